"""Benchmark: what the checkpoint manifest (size + checksum per file) costs at save and at load.

Writes one safetensors rank file of --mb megabytes (random fp32, like a model or Adam-moment shard) with the
same writer the trainer uses, then checksums it with CRC-32 (the default) and SHA-256 and reads it back as
`load_file` does on resume. Prints each as seconds and as a ratio to the write (save) or to the read (load),
best of --repeat, and the load average (the machine is shared).

    python benchmarks/checkpoint_hash.py [--mb 512] [--repeat 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from dapo_mcore.weights.checkpoint import file_digest, save_safetensors


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    tensors = {f"t{i}": torch.randn(args.mb * (1 << 20) // 16 // 4) for i in range(16)}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        path = Path(tmp) / "model.safetensors"
        write = best(lambda: save_safetensors(tensors, path), args.repeat)
        # load_file maps the file lazily; resume copies every tensor into the model, so touch every byte.
        read = best(lambda: [t.clone() for t in load_file(os.fspath(path)).values()], args.repeat)
        crc = best(lambda: file_digest(path, "crc32"), args.repeat)
        sha = best(lambda: file_digest(path, "sha256"), args.repeat)
        size = path.stat().st_size
    gb = size / 1e9
    print(f"file {gb:.2f} GB (page cache warm), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"write {write:.2f} s ({gb / write:.2f} GB/s)  read {read:.2f} s ({gb / read:.2f} GB/s)")
    for name, t in (("crc32", crc), ("sha256", sha)):
        print(f"{name:7s} {t:.2f} s ({gb / t:.2f} GB/s): +{100 * t / write:.0f}% on save, +{100 * t / read:.0f}% on load")


if __name__ == "__main__":
    main()

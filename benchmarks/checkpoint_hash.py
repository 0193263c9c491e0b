"""Benchmark: what the checkpoint checksums (size + XXH3-64 per file in the manifest) cost at save and at load.

One rank file of --mb megabytes (random fp32, like a model or Adam-moment shard), page cache warm, best of --repeat:

- save without checksums: the trainer's writer (tensor by tensor from their memory) with its checksum turned off
  (the baseline); and safetensors' ``save_file`` (what a save with no manifest does: the file built in memory first);
- save with checksums: the trainer's save (``save_safetensors`` under ``record_digests``: written from the tensors'
  memory, the XXH3-64 of the same bytes on a second thread as they are written); and, for comparison, the former way:
  ``save_file`` then a second read to checksum;
- load without checksums: ``load_file`` and a copy of every tensor (as a resume copies them into the model);
- load with checksums: the trainer's checked read (``read_megatron_rank`` under ``checking_reads``: the tensors are
  views of one mapping of the file, XXH3-64 and NaN/inf check on a second thread while they are copied) and the same copy; and the former way: a checksum pass, then ``load_file``;
- the same save and checked load with CRC-32 (what manifests held before XXH3-64, and what the checked read still
  accepts), interleaved with the others, so that the two hashes are compared under the same machine load.

Prints each time and each ratio to its baseline; the last line is ``checkpoint_checksum_overhead: X`` (the larger
of the save and load ratios of the trainer's way). --smoke: a 16 MB file, one repeat (seconds; run in CI).

    python benchmarks/checkpoint_hash.py [--mb 512] [--repeat 3] [--workdir DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dapo_mcore.weights import checkpoint as wckpt

RANK = "model/mp_rank_00_000/model.safetensors"


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _save_checked(tensors, path: Path, root: Path) -> dict:
    with wckpt.record_digests() as log:
        wckpt.save_safetensors(tensors, path, {"format": "pt"})
    return log.under(root)


def _load_checked(root: Path, files: dict) -> None:
    with wckpt.checking_reads(root, files) as check:
        [t.clone() for t in wckpt.read_megatron_rank(root / "model", 0, 0).values()]
        check.finish()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workdir", default=None)
    p.add_argument("--smoke", action="store_true", help="a 16 MB file, one repeat (a seconds-long check)")
    args = p.parse_args(argv)
    if args.smoke:
        args.mb, args.repeat = 16, 1
    tensors = {f"t{i}": torch.randn(args.mb * (1 << 20) // 16 // 4) for i in range(16)}
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        path = root / RANK
        path.parent.mkdir(parents=True)
        (root / "model" / wckpt.METADATA_FILE).write_text("{}")
        t = {}
        for _ in range(args.repeat):  # interleaved, so that a change of machine load hits every variant alike
            t.setdefault("save_st", []).append(best(lambda: save_file(tensors, os.fspath(path), {"format": "pt"}), 1))
            t.setdefault("save", []).append(best(lambda: wckpt._write_safetensors_digested(
                tensors, path, {"format": "pt"}, algo=None), 1))
            t.setdefault("save_old", []).append(best(lambda: (save_file(tensors, os.fspath(path), {"format": "pt"}),
                                                              wckpt.file_digest(path)), 1))
            t.setdefault("save_new", []).append(best(lambda: _save_checked(tensors, path, root), 1))
            files = _save_checked(tensors, path, root)
            t.setdefault("load", []).append(best(lambda: [x.clone() for x in load_file(os.fspath(path)).values()], 1))
            t.setdefault("load_old", []).append(best(lambda f=files: (wckpt.verify_files(root, f), [
                x.clone() for x in load_file(os.fspath(path)).values()]), 1))
            t.setdefault("load_new", []).append(best(lambda f=files: _load_checked(root, f), 1))
            t.setdefault("save_crc", []).append(best(lambda: wckpt._write_safetensors_digested(
                tensors, path, {"format": "pt"}, algo="crc32"), 1))
            crc = {RANK: wckpt.file_digest(path, "crc32")}
            t.setdefault("load_crc", []).append(best(lambda f=crc: _load_checked(root, f), 1))
        size = path.stat().st_size
    t = {k: min(v) for k, v in t.items()}
    gb = size / 1e9
    print(f"file {gb:.2f} GB (page cache warm), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs, "
          f"best of {args.repeat}")
    print(f"save: the same writer without checksums {t['save']:.2f} s; checksums as written {t['save_new']:.2f} s "
          f"({t['save_new'] / t['save']:.2f}x); safetensors' save_file {t['save_st']:.2f} s "
          f"({t['save_st'] / t['save']:.2f}x); save_file then re-read {t['save_old']:.2f} s ({t['save_old'] / t['save']:.2f}x)")
    print(f"load: no checksums {t['load']:.2f} s; checked as read {t['load_new']:.2f} s "
          f"({t['load_new'] / t['load']:.2f}x); checksum pass then read {t['load_old']:.2f} s "
          f"({t['load_old'] / t['load']:.2f}x)")
    print(f"crc32 instead of {wckpt.DEFAULT_HASH}: save as written {t['save_crc']:.2f} s "
          f"({t['save_crc'] / t['save']:.2f}x); load checked as read {t['load_crc']:.2f} s ({t['load_crc'] / t['load']:.2f}x)")
    print(f"checkpoint_checksum_overhead: {max(t['save_new'] / t['save'], t['load_new'] / t['load']):.2f}")


if __name__ == "__main__":
    main()

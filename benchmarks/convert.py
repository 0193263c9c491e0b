"""Benchmark: HF -> Megatron conversion of a Qwen2.5-32B-shaped checkpoint vs reading the same files once.

Writes a synthetic bf16 checkpoint with the 32B shapes (hidden 5120, FFN 27648, 40 heads / 8 KV heads,
vocab 152064) and a few layers into a temp dir, then, each in a fresh subprocess: (1) reads every tensor
fully once into fresh tensors (`SafetensorsDirSource.read`, positioned reads: the baseline), (2) converts to
TP=2 PP=2 with the default writer (O_DIRECT where the filesystem allows it), (3) converts again through the
page cache (`direct=False`: the same converter without O_DIRECT, to show where the time went), (4) writes
the same number of bytes with plain buffered writes, (5) reads again, (6) converts into --also-out (a tmpfs).
Prints conversion time over the faster of the two reads and the conversion's peak RSS over the largest tensor,
the time the conversions spent in fsync (files + directories, before the rename; included in their times),
and the load average. Deletes everything after.

    python benchmarks/convert.py [--layers 2] [--tp 2] [--pp 2] [--workdir DIR] [--also-out /dev/shm] [--smoke]

``--smoke`` (CI, seconds): the tiny preset's shape instead of the 32B's, and only the first read and the default
conversion; the same last line.

With --against-bridge: dapo-mcore against NVIDIA Megatron-Bridge (AutoBridge, what cluster users of Megatron convert
with) on one Qwen2 model built from a config (bf16, untied, Qwen2.5's vocabulary 151,936; --hidden 512 and --layers 2:
~161M parameters), TP1. Each round, in a fresh subprocess each and in this order: dapo-mcore HF -> Megatron (its
default dapo format; also --format bridge once the converter has it), Bridge's import_ckpt, dapo-mcore Megatron -> HF
(of its own output), Bridge's export_ckpt (of its own output). Bridge runs in its own virtualenv (--bridge-python,
default .venv-bridge/bin/python; see .ci/tiers/50-bridge.sh) through tests/bridge/bridge_cpu.py. Prints, per step, the
median over --rounds of the conversion call and of the whole process (imports included), the load average, and last
`convert_over_bridge: X`: dapo-mcore's HF -> Megatron call time over Bridge's.

    python benchmarks/convert.py --against-bridge [--bridge-python PATH] [--hidden 512] [--layers 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

READ = """
import json, sys, time
from dapo_mcore.weights.safetensors_io import SafetensorsDirSource
src = SafetensorsDirSource(sys.argv[1])
t0 = time.perf_counter(); total = 0
for name in src.file_of:
    t = src.read(name)   # every tensor fully, by the same reader the conversion uses
    total += t.numel() * t.element_size(); del t
print(json.dumps({"seconds": time.perf_counter() - t0, "bytes": total}))
"""

WRITE = """
import json, os, sys, time, torch
buf = torch.empty(64 << 20, dtype=torch.uint8).fill_(1).numpy()
left = int(sys.argv[2]); t0 = time.perf_counter()
with open(sys.argv[1], "wb") as f:
    while left > 0:
        n = min(left, len(buf)); f.write(memoryview(buf)[:n]); left -= n
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""

CONVERT = """
import json, sys, time
from conversion.hf_to_mcore import convert_hf_to_mcore
from dapo_mcore.weights import ParallelLayout
direct = {"auto": None, "off": False}[sys.argv[5]]
t0 = time.perf_counter()
convert_hf_to_mcore(sys.argv[1], sys.argv[2], ParallelLayout(tp=int(sys.argv[3]), pp=int(sys.argv[4])),
                    direct=direct)
from dapo_mcore.weights import atomic
print(json.dumps({"seconds": time.perf_counter() - t0, "fsync_seconds": atomic.last_fsync_seconds}))
"""


def run_measured(code: str, *args: str) -> tuple[dict, int]:
    """Run `code` in a subprocess; return its json line and its peak RSS (bytes, sampled every 20 ms)."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, cwd=REPO)
    peak = 0
    ps = psutil.Process(proc.pid)
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            try:
                peak = max(peak, ps.memory_info().rss)
            except psutil.NoSuchProcess:
                return
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out, _ = proc.communicate()
    done.set()
    thread.join()
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark subprocess failed with code {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1]), peak


DAPO_TIMED = """
import json, sys, time
from conversion import hf_to_mcore, mcore_to_hf
main = {"hf-to-mcore": hf_to_mcore.main, "mcore-to-hf": mcore_to_hf.main}[sys.argv[1]]
t0 = time.perf_counter()
rc = main(sys.argv[2:])
print(json.dumps({"seconds": time.perf_counter() - t0, "rc": rc}))
"""

BRIDGE_TIMED = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import bridge_cpu
bridge_cpu.apply_cpu_workarounds()
t0 = time.perf_counter()
if sys.argv[2] == "import":
    bridge_cpu.import_ckpt(sys.argv[3], sys.argv[4], tp=1, dtype=None)
else:
    bridge_cpu.export_ckpt(sys.argv[3], sys.argv[4], sys.argv[5])
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


def _timed(cmd: list[str]) -> tuple[float, float]:
    """Run `cmd` (which prints a json line with "seconds" last); return (call seconds, whole-process seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out.get("rc", 0) != 0:
        raise RuntimeError(f"{cmd[:4]} returned {out['rc']}: {proc.stderr[-2000:]}")
    return out["seconds"], wall


def _dapo_has_bridge_format() -> bool:
    from conversion.hf_to_mcore import build_parser

    return "bridge" in build_parser().format_help()


def against_bridge(args: argparse.Namespace) -> int:
    """dapo-mcore vs Megatron-Bridge, HF -> Megatron and back, interleaved rounds (see the module docstring)."""
    import statistics

    from transformers import Qwen2Config, Qwen2ForCausalLM

    bridge_python = Path(args.bridge_python)
    if not bridge_python.exists():
        raise SystemExit(f"convert.py --against-bridge: no Megatron-Bridge python at {bridge_python}; pass "
                         "--bridge-python (.ci/tiers/50-bridge.sh's install() builds .venv-bridge)")
    harness = str(REPO / "tests" / "bridge")
    work = Path(tempfile.mkdtemp(prefix="dapo_convert_vs_bridge_", dir=args.workdir))
    load0 = os.getloadavg()
    try:
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=151_936, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                             num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                             max_position_embeddings=4096, tie_word_embeddings=False, dtype=torch.bfloat16)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        n_params = sum(t.numel() for t in model.parameters())
        model.save_pretrained(work / "hf")
        del model
        hf = str(work / "hf")
        steps = {"dapo-mcore HF->Megatron (dapo)": lambda r: _timed(
            [sys.executable, "-c", DAPO_TIMED, "hf-to-mcore", "--hf", hf, "--out", str(work / f"dapo{r}"),
             "--no-progress"])}
        if _dapo_has_bridge_format():
            steps["dapo-mcore HF->Megatron (--format bridge)"] = lambda r: _timed(
                [sys.executable, "-c", DAPO_TIMED, "hf-to-mcore", "--hf", hf, "--out", str(work / f"dapob{r}"),
                 "--format", "bridge", "--no-progress"])
        steps["Bridge import_ckpt"] = lambda r: _timed(
            [str(bridge_python), "-c", BRIDGE_TIMED, harness, "import", hf, str(work / f"bridge{r}")])
        steps["dapo-mcore Megatron->HF"] = lambda r: _timed(
            [sys.executable, "-c", DAPO_TIMED, "mcore-to-hf", "--mcore", str(work / f"dapo{r}"), "--out",
             str(work / f"dapo_back{r}"), "--no-progress"])
        steps["Bridge export_ckpt"] = lambda r: _timed(
            [str(bridge_python), "-c", BRIDGE_TIMED, harness, "export", str(work / f"bridge{r}"),
             str(work / f"bridge_back{r}"), hf])
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
        print(f"Qwen2 from config: hidden {args.hidden}, {args.layers} layers, vocab 151,936, untied, bf16, "
              f"{n_params / 1e6:.1f}M parameters; TP1; {args.rounds} interleaved rounds")
        for r in range(args.rounds):
            for name, step in steps.items():
                times[name].append(step(r))
            for d in work.iterdir():
                if d.name != "hf":
                    shutil.rmtree(d)
        print(f"{'step':44s} {'call s (median)':>16s} {'process s (median)':>19s}   all calls")
        med = {}
        for name, vals in times.items():
            med[name] = statistics.median(v[0] for v in vals)
            print(f"{name:44s} {med[name]:16.2f} {statistics.median(v[1] for v in vals):19.2f}   "
                  + " ".join(f"{v[0]:.2f}" for v in vals))
        print("load average (1/5/15 min) at start: {:.1f} {:.1f} {:.1f}, at end: {:.1f} {:.1f} {:.1f} ({} CPUs)".format(
            *load0, *os.getloadavg(), os.cpu_count()))
        proc_med = {name: statistics.median(v[1] for v in vals) for name, vals in times.items()}
        print(f"whole processes, dapo-mcore over Bridge: HF->Megatron "
              f"{proc_med['dapo-mcore HF->Megatron (dapo)'] / proc_med['Bridge import_ckpt']:.2f}, Megatron->HF "
              f"{proc_med['dapo-mcore Megatron->HF'] / proc_med['Bridge export_ckpt']:.2f}; calls, Megatron->HF "
              f"{med['dapo-mcore Megatron->HF'] / med['Bridge export_ckpt']:.2f}")
        like = "dapo-mcore HF->Megatron (--format bridge)"
        if like in med:  # the same output as Bridge's (a torch_dist checkpoint in Bridge's layout), like for like
            print(f"same format as Bridge (--format bridge) over Bridge: call {med[like] / med['Bridge import_ckpt']:.2f}, "
                  f"whole process {proc_med[like] / proc_med['Bridge import_ckpt']:.2f}")
        print(f"convert_over_bridge: {med['dapo-mcore HF->Megatron (dapo)'] / med['Bridge import_ckpt']:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--workdir", default=None, help="parent dir for the temp checkpoint (default: system temp)")
    p.add_argument("--also-out", default="/dev/shm",
                   help="also convert into this dir (e.g. a tmpfs, to separate converter cost from disk writes); "
                        "'' to skip")
    p.add_argument("--against-bridge", action="store_true",
                   help="compare with Megatron-Bridge's import_ckpt/export_ckpt instead (see the module docstring)")
    p.add_argument("--bridge-python", default=str(REPO / ".venv-bridge" / "bin" / "python"),
                   help="the Megatron-Bridge virtualenv's python (with --against-bridge)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size of the --against-bridge model")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (with --against-bridge)")
    p.add_argument("--smoke", action="store_true",
                   help="seconds: the tiny preset's shape (2 layers), one read and one conversion at --tp/--pp, no "
                        "page-cache, plain-write or --also-out passes (the same reader and converter)")
    args = p.parse_args(argv)
    if args.against_bridge:
        return against_bridge(args)

    from conversion.synthetic import write_synthetic_hf_checkpoint
    from dapo_mcore.model.presets import preset_config
    from dapo_mcore.weights.registry import get_mapping

    hf_config = preset_config("tiny" if args.smoke else "qwen2.5-32b", num_hidden_layers=args.layers)
    shapes = get_mapping(hf_config).hf_shapes()
    largest = max(torch.Size(s).numel() * 2 for s in shapes.values())
    load0 = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="dapo_convert_bench_", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        total = write_synthetic_hf_checkpoint(work / "hf", hf_config, dtype=torch.bfloat16)
        print(f"synthetic {'tiny' if args.smoke else 'Qwen2.5-32B'}-shaped checkpoint: {args.layers} layers, "
              f"{total / 1e9:.2f} GB bf16, largest tensor {largest / 1e9:.2f} GB (written in "
              f"{time.perf_counter() - t0:.1f} s)")
        os.sync()  # flush the generator's dirty pages so they do not throttle the measured writes
        read1, read_rss = run_measured(READ, str(work / "hf"))
        os.sync()
        layout = (str(args.tp), str(args.pp))
        conv, conv_rss = run_measured(CONVERT, str(work / "hf"), str(work / "mcore"), *layout, "auto")
        out_bytes = sum(f.stat().st_size for f in (work / "mcore").rglob("*.safetensors"))
        if args.smoke:
            print(f"read once: {read1['seconds']:.3f} s; convert tp={args.tp} pp={args.pp}: {conv['seconds']:.3f} s, "
                  f"wrote {out_bytes / 1e6:.1f} MB, peak RSS {conv_rss / 1e9:.2f} GB (smoke: nothing else measured)")
            print(f"convert_time_over_read: {conv['seconds'] / read1['seconds']:.2f}")
            return 0
        shutil.rmtree(work / "mcore")
        os.sync()
        paged, paged_rss = run_measured(CONVERT, str(work / "hf"), str(work / "mcore"), *layout, "off")
        shutil.rmtree(work / "mcore")
        os.sync()
        write, _ = run_measured(WRITE, str(work / "write_baseline"), str(out_bytes))
        (work / "write_baseline").unlink()
        os.sync()
        read2, _ = run_measured(READ, str(work / "hf"))
        read_s = min(read1["seconds"], read2["seconds"])
        bound = 4 * largest + (1 << 30)
        fast = None
        if args.also_out and Path(args.also_out).is_dir() and shutil.disk_usage(args.also_out).free > 2 * out_bytes:
            fast_dir = Path(tempfile.mkdtemp(prefix="dapo_convert_bench_", dir=args.also_out))
            try:
                fast, fast_rss = run_measured(CONVERT, str(work / "hf"), str(fast_dir / "mcore"), *layout, "auto")
            finally:
                shutil.rmtree(fast_dir, ignore_errors=True)
        print(f"read once:            {read1['seconds']:.2f} s / {read2['seconds']:.2f} s "
              f"({read1['bytes'] / 1e9 / read_s:.2f} GB/s), peak RSS {read_rss / 1e9:.2f} GB")
        print(f"convert tp={args.tp} pp={args.pp} (default, O_DIRECT where allowed): {conv['seconds']:.2f} s, "
              f"wrote {out_bytes / 1e9:.2f} GB, peak RSS {conv_rss / 1e9:.2f} GB, over read: "
              f"{conv['seconds'] / read_s:.2f}")
        print(f"convert through the page cache (direct=False): {paged['seconds']:.2f} s, peak RSS "
              f"{paged_rss / 1e9:.2f} GB, over read: {paged['seconds'] / read_s:.2f}")
        print(f"fsync before the rename (included above): default {conv['fsync_seconds']:.2f} s "
              f"({100 * conv['fsync_seconds'] / conv['seconds']:.1f}%), page cache {paged['fsync_seconds']:.2f} s "
              f"({100 * paged['fsync_seconds'] / paged['seconds']:.1f}%)")
        print(f"plain buffered write of {out_bytes / 1e9:.2f} GB to the same disk: {write['seconds']:.2f} s "
              f"({out_bytes / 1e9 / write['seconds']:.2f} GB/s); convert / (read + plain write): "
              f"{conv['seconds'] / (read_s + write['seconds']):.2f}")
        if fast is not None:
            print(f"convert into {args.also_out} (no disk writes): {fast['seconds']:.2f} s, peak RSS "
                  f"{fast_rss / 1e9:.2f} GB, over read: {fast['seconds'] / read_s:.2f}, fsync "
                  f"{fast['fsync_seconds']:.2f} s")
        print(f"peak_rss_over_largest_tensor: {conv_rss / largest:.2f} (target <= 4x + 1 GB: "
              f"{conv_rss / 1e9:.2f} GB <= {bound / 1e9:.2f} GB {'OK' if conv_rss <= bound else 'OVER'})")
        print("load average (1/5/15 min) at start: {:.1f} {:.1f} {:.1f}, at end: {:.1f} {:.1f} {:.1f} ({} CPUs)".format(
            *load0, *os.getloadavg(), os.cpu_count()))
        print(f"convert_time_over_read: {conv['seconds'] / read_s:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: export throughput of a TP=2 Megatron model (2 gloo processes) vs plain transfers of the same bytes.

Builds a Qwen2-shaped Megatron model (default hidden 1024, 4 layers, 16 heads / 4 KV heads, FFN 2816, vocab
32000, untied head, fp32: about 0.45 GB) at TP=2 on two gloo processes launched by torchrun, fills it with
random values, and times, interleaved over several repeats, on every rank:

* ``export``: ``iter_hf_weights`` run to the end (every rank receives every full HF tensor);
* three plain transfers of the same local shards, in the same order, into fresh buffers, nothing else (no
  merge, no names): ``gather`` (``dist.all_gather`` into a list), ``gather_flat``
  (``dist.all_gather_into_tensor``) and ``bcast`` (one ``dist.broadcast`` per rank into its slice of one buffer);
* ``export_serial``: the export without overlap (each tensor's transfers waited on before the next are issued);
* ``bcast_full``: ``bcast`` with each rank's own shard also copied into its slice (full tensors on every rank, as
  the export delivers; reported as ``export_over_full_copy``, not the headline);
* ``bcast_async``: the same broadcasts all issued before any is waited on (overlap a plain copy could have;
  reported as ``export_over_bcast_async``, not the headline);
* ``memcpy``: ``torch.cat`` of ``tp`` copies of each local shard (the same bytes written, no communication): the
  machine's copy bandwidth, which no TP export can reach (it must also communicate), for scale;
* ``sync``: ``iter_hf_weights`` into ``HFEngine.update_weights`` (export + checks + copy into an HF model).

Throughput = bytes of the full tensors each rank ends up with / seconds (slowest rank, best repeat). The
headline ``export_over_copy`` divides the export's throughput by the FASTEST of the three plain transfers, each
issued one tensor at a time (the baseline kept since the first measurement). Each phase's CPU time (both processes,
all threads, user + system) is reported too, with the same ratios on it (``cpu_export_over_copy``): on a shared
machine the wall-clock figures swing with the load, the work does not.

On CPU most of every phase's time is first-touch page faults of fresh tensors (glibc maps large blocks afresh
and returns freed heap to the OS); ``--reuse-freed-memory`` keeps freed memory in the process for every phase, the
way CUDA's caching allocator does on a GPU, to show the transfer and copy costs without them.

    python benchmarks/weight_sync.py [--hidden 1024] [--layers 4] [--vocab 32000] [--repeats 5] [--no-engine]
                                     [--reuse-freed-memory] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _config(args) -> dict:
    from dapo_mcore.model.presets import preset_config

    return preset_config("tiny", hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                         tie_word_embeddings=False, max_position_embeddings=4096)


def _build(hf: dict, tp: int):
    from dapo_mcore.model.qwen import build_gpt_model, transformer_config

    tconfig = transformer_config(hf, tensor_parallel=tp)
    tconfig.perform_initialization = False  # filled below: cheaper than Megatron's full-matrix CPU init
    chunks = build_gpt_model(hf, tconfig, make_vocab_size_divisible_by=128)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return chunks


def _time(fn) -> tuple[float, float]:
    """(wall seconds of the slowest rank, CPU seconds of all ranks' processes, every thread, user + system)."""
    import torch.distributed as dist

    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank bounds a collective sync
    dist.all_reduce(cpu)
    return float(seconds), float(cpu)


def _engine(hf: dict):
    import transformers
    from transformers.initialization import no_init_weights

    from dapo_mcore.rollout import HFEngine

    with no_init_weights():
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**hf)).float()
    return HFEngine(model, eos_token_ids=hf["eos_token_id"], pad_token_id=0)


def worker(args) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from dapo_mcore.actor.parallel import init_distributed, init_model_parallel, read_launch_env, shutdown
    from dapo_mcore.weights.export import iter_hf_weights

    torch.set_num_threads(1)
    env = read_launch_env()
    init_distributed(env, "gloo")
    init_model_parallel(args.tp, 1, seed=1)
    hf = _config(args)
    chunks = _build(hf, args.tp)
    group = ps.get_tensor_model_parallel_group()
    shards = [p.detach() for p in chunks[0].parameters()]
    bucket_bytes = args.bucket_mb << 20
    hf_bytes = sum(t.numel() * t.element_size() for b in iter_hf_weights(chunks, hf, bucket_bytes=bucket_bytes)
                   for _, t in b)
    engine = None if args.no_engine else _engine(hf)

    def export():
        for _bucket in iter_hf_weights(chunks, hf, bucket_bytes=bucket_bytes):
            pass

    def export_serial():  # the export without overlap: each placement's transfers waited on at once (same helpers)
        from dapo_mcore.collectives.device import collective_device
        from dapo_mcore.weights.export import _Exporter
        from dapo_mcore.weights.live import live_layout, live_tensors
        from dapo_mcore.weights.registry import get_mapping

        mapping = get_mapping(hf)
        layout, _, _ = live_layout(chunks, "local", make_vocab_size_divisible_by=1)
        exporter = _Exporter(mapping, layout, live_tensors(chunks, layout), group, collective_device(group))
        for pl in mapping.placements(layout):
            if pl.exported:
                exporter.finish(exporter.start(pl))

    def gather():
        for s in shards:
            dist.all_gather([torch.empty_like(s) for _ in range(args.tp)], s, group=group)

    def gather_flat():
        for s in shards:
            dist.all_gather_into_tensor(torch.empty((args.tp * s.shape[0], *s.shape[1:])), s, group=group)

    def bcast():
        ranks = dist.get_process_group_ranks(group)
        for s in shards:
            flat = torch.empty((args.tp * s.shape[0], *s.shape[1:]))
            for r, src in enumerate(ranks):
                dist.broadcast(s if src == env.rank else flat[r * s.shape[0]:(r + 1) * s.shape[0]], src, group=group)

    def bcast_full():  # bcast, and each rank's own shard copied into its slice: full tensors, as the export ends with
        ranks = dist.get_process_group_ranks(group)
        for s in shards:
            flat = torch.empty((args.tp * s.shape[0], *s.shape[1:]))
            for r, src in enumerate(ranks):
                part = flat[r * s.shape[0]:(r + 1) * s.shape[0]]
                if src == env.rank:
                    part.copy_(s)
                dist.broadcast(part, src, group=group)

    def bcast_async():  # the same broadcasts, all issued before any is waited on: what overlap gives a plain copy
        ranks = dist.get_process_group_ranks(group)
        works = []
        for s in shards:
            flat = torch.empty((args.tp * s.shape[0], *s.shape[1:]))
            for r, src in enumerate(ranks):
                part = s if src == env.rank else flat[r * s.shape[0]:(r + 1) * s.shape[0]]
                works.append(dist.broadcast(part, src, group=group, async_op=True))
        for w in works:
            w.wait()

    def memcpy():
        for s in shards:
            torch.cat([s] * args.tp)

    def sync():
        engine.update_weights(iter_hf_weights(chunks, hf, bucket_bytes=bucket_bytes))

    phases = {"export": export, "export_serial": export_serial, "gather": gather, "gather_flat": gather_flat, "bcast": bcast,
              "bcast_full": bcast_full, "bcast_async": bcast_async, "memcpy": memcpy}
    if engine is not None:
        phases["sync"] = sync
    times: dict[str, list[float]] = {k: [] for k in phases}
    cpu: dict[str, list[float]] = {k: [] for k in phases}
    for _ in range(args.repeats):
        for name, fn in phases.items():
            wall, cpu_s = _time(fn)
            times[name].append(wall)
            cpu[name].append(cpu_s)
    if env.rank == 0:
        gathered_bytes = sum(s.numel() * s.element_size() for s in shards) * args.tp
        Path(args.out).write_text(json.dumps({"times": times, "cpu": cpu, "hf_bytes": hf_bytes, "gathered_bytes": gathered_bytes,
                                              "tp": args.tp, "config": hf}))
    shutdown()


def _report(res: dict) -> float:
    hf_gb = res["hf_bytes"] / 1e9
    print(f"model: hidden {res['config']['hidden_size']}, {res['config']['num_hidden_layers']} layers, vocab "
          f"{res['config']['vocab_size']}, fp32, {hf_gb:.3f} GB of HF tensors; TP={res['tp']} on gloo, 2 processes")
    rates, cpu_rates = {}, {}
    for name, ts in res["times"].items():
        nbytes = res["hf_bytes"] if name in ("export", "export_serial", "sync") else res["gathered_bytes"]
        rates[name] = nbytes / 1e9 / min(ts)
        cpu_rates[name] = nbytes / 1e9 / min(res["cpu"][name])
        print(f"{name:>13}: best {min(ts):.3f} s, median {statistics.median(ts):.3f} s -> {rates[name]:.2f} GB/s; "
              f"CPU (both ranks, all threads) best {min(res['cpu'][name]):.3f} s")
    best = max(("gather", "gather_flat", "bcast"), key=rates.get)
    print(f"export / memcpy: {rates['export'] / rates['memcpy']:.3f}")
    if "sync" in rates:
        print(f"sync (export + HFEngine.update_weights) / {best}: {rates['sync'] / rates[best]:.3f}")
    ratio = rates["export"] / rates[best]
    print(f"baseline: {best} (the fastest plain transfer of the same shards)")
    print(f"export_over_copy: {ratio:.3f}")
    # Not the headline (kept on the same serial baseline as before): the export issues the next tensor's gather
    # before merging this one, so a plain copy with every broadcast in flight at once bounds what overlap can give.
    print(f"export_over_bcast_async: {rates['export'] / rates['bcast_async']:.3f}")
    print(f"export_over_serial_export: {rates['export'] / rates['export_serial']:.3f} (the overlap's own gain)")
    # Like for like: a plain broadcast that also writes each rank's own shard into its fresh buffer, as the export
    # must (the headline baseline leaves that half of each buffer untouched: never written, never page-faulted).
    print(f"export_over_full_copy: {rates['export'] / rates['bcast_full']:.3f} (baseline bcast_full)")
    # CPU time counts the work, not the wait: stable on a loaded machine, where the wall-clock figures swing.
    print(f"cpu_export_over_copy: {cpu_rates['export'] / cpu_rates[best]:.3f}; cpu_export_over_full_copy: "
          f"{cpu_rates['export'] / cpu_rates['bcast_full']:.3f}")
    return ratio


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-engine", action="store_true", help="skip the export + HFEngine.update_weights timing")
    p.add_argument("--reuse-freed-memory", action="store_true",
                   help="run the workers with glibc's mmap and trim thresholds raised (MALLOC_MMAP_THRESHOLD_, "
                        "MALLOC_TRIM_THRESHOLD_), so freed tensors' pages are reused instead of page-faulted afresh, "
                        "as a caching allocator (CUDA's) does; every phase runs under the same setting")
    p.add_argument("--port", type=int, default=29571)
    p.add_argument("--smoke", action="store_true", help="a tiny model, one repeat: seconds (run in CI)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.ffn, args.layers, args.heads, args.kv_heads, args.vocab, args.repeats = 64, 128, 2, 4, 2, 512, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.tp), "--master_port",
               str(args.port), __file__, *forwarded, "--worker", "--out", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        if args.reuse_freed_memory:
            env.update(MALLOC_MMAP_THRESHOLD_=str(2**31 - 1), MALLOC_TRIM_THRESHOLD_=str(2**32))
        proc = subprocess.run(cmd, env=env, cwd=REPO)
        if proc.returncode != 0:
            print(f"torchrun failed with exit code {proc.returncode}", file=sys.stderr)
            return proc.returncode
        _report(json.loads(out.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

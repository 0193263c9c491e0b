"""What streaming over several engine groups costs and saves, on 2 gloo ranks, side by side.

Two ranks, each its own transformers engine on the same tiny random Qwen2 (``--stop-ids`` of its 32 tokens end a response,
so lengths vary), collect ``--steps`` steps of ``--target`` usable groups of ``--n`` responses with the rollout scheduler, no
training (the weights stay put, so every variant sees the same policy):
- ``chunks``: today's fallback with several engine groups: streaming off, rounds of ``--chunk`` prompts split over
  the groups (``gather.plan_shares``), every round generated in full;
- ``stream/K``: streaming over both groups in lockstep, exchanging ended groups every K decode steps and aborting
  once the step is full;
- ``done/4``, ``done/4+p``: the same at K=4 with ``rollout.schedule.order=completion`` (groups taken as they end;
  ``+p``: with partial rollouts, whose prompt-order twin is ``stream/4+p``; no training, so a carried group is
  continued by the same weights).
Per variant: wall seconds per step, seconds in exchanges (their collectives, waits for the slower group included),
exchanges per step, and generated tokens per kept group (aborted tokens included: what the step paid).
Run from the repository root: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine_groups.py``.
Last line: ``exchange_share_of_step: X`` (exchange seconds / wall seconds at the default exchange_every=4). ``--smoke``: 1 step, K=4 only (CI).
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))



def _variant(rank: int, args: argparse.Namespace, every: int | None, order: str = "prompt",
             partial: bool = False) -> dict[str, float]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dapo_mcore.config import Config
    from dapo_mcore.data.records import PromptRecord
    from dapo_mcore.data.sampler import PromptSampler
    from dapo_mcore.model.presets import preset_config
    from dapo_mcore.reward.result import RewardResult
    from dapo_mcore.rollout import HFEngine
    from dapo_mcore.rollout.pipeline.colocated import ColocatedRollouts, EngineGroups
    from dapo_mcore.rollout.scheduling.scheduler import RolloutScheduler
    from dapo_mcore.telemetry.timers import PhaseTimer

    torch.manual_seed(0)
    engine = HFEngine(Qwen2ForCausalLM(Qwen2Config(**preset_config("tiny"))).float().eval(), eos_token_ids=list(range(2, 2 + args.stop_ids)),
                      pad_token_id=0)
    cfg = Config()
    cfg.rollout.n, cfg.rollout.max_new_tokens, cfg.train.prompts_per_step = args.n, args.max_new_tokens, args.target
    cfg.algo.overlong_shaping = False
    s = cfg.rollout.schedule
    s.streaming, s.stream_chunk_prompts, s.exchange_every = every is not None, args.chunk, every or 1
    s.order, s.partial = order, partial
    records = [PromptRecord(prompt=f"q{i}", ground_truth="", data_source="t", index=i) for i in range(512)]
    sampler = PromptSampler(records, seed=1)
    scheduler = RolloutScheduler(s, sampler, n=args.n, target=args.target, gen_batch_prompts=args.chunk,
                                 max_rounds=0, seed=1)

    def score(texts, truths):  # about one response in three "right": most groups mixed, some not
        return [RewardResult(1.0, True, t) if sum(map(int, t.split())) % 3 == 0 else RewardResult(-1.0, False, t)
                for t in texts]

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    rollouts = ColocatedRollouts(cfg, engine=engine, scheduler=scheduler, tokenizer=Tok(), score=score,
                                 encode_prompt=lambda rec: [1, 6 + rec.index % 25, 7 + rec.index // 25 % 25],
                                 timer=PhaseTimer(), groups=EngineGroups(2, rank, True), streams=every is not None)
    dist.barrier()
    start, tokens, kept = time.perf_counter(), 0, 0
    for step in range(args.steps):
        batch = rollouts.step_batch(step, stop=lambda: False)
        tokens += batch.stats.tokens_generated + batch.stats.tokens_aborted
        kept += len(batch.kept)
    wall = time.perf_counter() - start
    return dict(wall_per_step=wall / args.steps, exchange_s_per_step=rollouts.exchanges.seconds / args.steps,
                exchanges_per_step=rollouts.exchanges.count / args.steps, tokens_per_kept=tokens / kept)


def _worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {"chunks": _variant(rank, args, None)}
    for every in args.every:
        out[f"stream/{every}"] = _variant(rank, args, every)
    out["done/4"] = _variant(rank, args, 4, order="completion")
    out["done/4+p"] = _variant(rank, args, 4, order="completion", partial=True)
    out["stream/4+p"] = _variant(rank, args, 4, partial=True)
    queue.put((rank, out))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--target", type=int, default=8)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--every", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--stop-ids", type=int, default=6, help="token ids 2.. that end a response (of 32): lengths vary")
    p.add_argument("--smoke", action="store_true",
                   help="1 step of 2 groups of 2, 8 tokens, K=4 only (both ranks, every variant; run in CI)")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.n, args.target, args.chunk, args.max_new_tokens, args.every = 1, 2, 2, 4, 8, [4]
    if 4 not in args.every:
        args.every.append(4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=3600) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    got = results[0]
    base = got["chunks"]
    print(f"{'variant':<10} {'s/step':>8} {'vs chunks':>9} {'exch s/step':>11} {'exch/step':>9} {'tok/kept':>9} "
          f"{'vs chunks':>9}")
    for name, r in got.items():
        print(f"{name:<10} {r['wall_per_step']:8.3f} {base['wall_per_step'] / r['wall_per_step']:9.3f} "
              f"{r['exchange_s_per_step']:11.3f} {r['exchanges_per_step']:9.1f} {r['tokens_per_kept']:9.1f} "
              f"{base['tokens_per_kept'] / r['tokens_per_kept']:9.3f}")
    d = got["stream/4"]
    print(f"completion_over_prompt_wall: {got['stream/4']['wall_per_step'] / got['done/4']['wall_per_step']:.3f} "
          f"(partial: {got['stream/4+p']['wall_per_step'] / got['done/4+p']['wall_per_step']:.3f})")
    print(f"exchange_share_of_step: {d['exchange_s_per_step'] / d['wall_per_step']:.3f}")


if __name__ == "__main__":
    main()

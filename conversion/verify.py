"""Logit parity: Hugging Face's own model vs the Megatron model on the same weights and prompts.

Builds the Megatron model at the requested TP/PP/VPP, loads either the HF dir directly (`load_hf_into_model`)
or a canonical Megatron checkpoint (`--mcore`), runs the prompts through both, and prints the max / mean
absolute logit difference and the top-1 agreement. The pass threshold depends on the dtype (`default_atol`):
both models compute in it, and bf16/fp16 arithmetic differs between the two implementations by far more than
fp32's 1e-4. Single process (TP=PP=1) or under torchrun:

    torchrun --nproc_per_node 2 -m conversion.verify --hf DIR --tp 2 [--mcore DIR] [--prompt "..."]
    dapo-mcore convert verify --nproc-per-node 2 --hf DIR --tp 2 ...   (the same, started for you, as `train` does)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from conversion.entry import add_debug_flag, parse_and_run

log = logging.getLogger(__name__)


def causal_mask(seq_len: int) -> torch.Tensor:
    """Megatron's boolean attention mask: True where attention is NOT allowed."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1).view(1, 1, seq_len, seq_len)


@torch.no_grad()
def megatron_logits(model_chunks: list, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full logits [batch, seq, vocab] on every rank: a plain stage-by-stage forward (no schedule).

    Hidden states go from each (chunk, stage) to the next by broadcast within the pipeline group;
    vocab-parallel logits are all-gathered within the TP group and the padding is stripped. What the collectives
    carry goes through the collective device (the model's GPU under NCCL, where the model's outputs already are).
    """
    from megatron.core import parallel_state as ps

    from dapo_mcore.collectives.device import collective_device
    from dapo_mcore.weights.live import unwrap

    pp, pp_rank, vpp = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(), len(model_chunks)
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    cdev = collective_device(pp_group)
    device = next(unwrap(model_chunks[0]).parameters()).device
    ids = input_ids.to(device)
    b, s = ids.shape
    pos = torch.arange(s, device=device).unsqueeze(0).expand(b, -1)
    mask = causal_mask(s).to(device)
    hidden = None
    for v in range(vpp):
        for p in range(pp):
            is_first, is_last = (v, p) == (0, 0), (v, p) == (vpp - 1, pp - 1)
            out = None
            if p == pp_rank:
                chunk = unwrap(model_chunks[v])
                if not is_first:
                    chunk.set_input_tensor(hidden)
                out = chunk(ids, pos, mask)
            if is_last:
                hidden = out
                break
            if pp > 1:
                config = unwrap(model_chunks[0]).config
                buf = cdev.to(out) if p == pp_rank else cdev.empty((s, b, config.hidden_size), config.params_dtype)
                dist.broadcast(buf, src=pp_ranks[p], group=pp_group)
                hidden = buf
            else:
                hidden = out
    return _gather_logits(hidden, vocab_size, b, s, cdev, pp, pp_rank, pp_ranks, pp_group)


def _gather_logits(local, vocab_size, b, s, cdev, pp, pp_rank, pp_ranks, pp_group) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if pp_rank == pp - 1:
        local = cdev.to(local.contiguous().float())
        if tp > 1:
            parts = [cdev.empty(tuple(local.shape), local.dtype) for _ in range(tp)]
            dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
            local = torch.cat(parts, dim=-1)
        logits = cdev.to(local[..., :vocab_size].contiguous())
    else:
        logits = cdev.empty((b, s, vocab_size), torch.float32)
    if pp > 1:
        dist.broadcast(logits, src=pp_ranks[pp - 1], group=pp_group)
    return logits


DEFAULT_ATOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
"""Max |logit diff| allowed per unit of logit scale (max |reference logit|, at least 1). Measured on the tiny
model (docs/conversion.md): fp32 ~1e-7; bf16 ~4e-3 to 2e-2 with top-1 agreement 1.0."""


def default_atol(dtype_name: str, ref: torch.Tensor) -> float:
    """The pass threshold for a dtype, scaled by the size of the reference logits (rounding is relative)."""
    return DEFAULT_ATOL[dtype_name] * max(1.0, ref.abs().max().item())


def compare_logits(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    diff = (ref.float() - got.float()).abs()
    return {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
            "top1_agreement": (ref.argmax(-1) == got.argmax(-1)).float().mean().item()}


def _prompt_ids(args, hf_dir: Path, vocab_size: int) -> torch.Tensor:
    if args.prompt:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(hf_dir)
        rows = [tok(p)["input_ids"] for p in args.prompt]
        width = min(len(r) for r in rows)
        return torch.tensor([r[:width] for r in rows])
    gen = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, vocab_size, (args.batch, args.seq_len), generator=gen)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dapo-mcore convert verify", description=__doc__.split("\n")[0])
    p.add_argument("--hf", required=True, help="HF dir: the reference model (and the weights unless --mcore)")
    p.add_argument("--mcore", default=None, help="Megatron checkpoint to load instead of the HF weights: this "
                   "project's, or a megatron-core dist checkpoint (Megatron-LM's or Megatron-Bridge's save dir)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models; inside data parallel)")
    p.add_argument("--layer-spec", default="local", choices=("local", "transformer_engine"))
    p.add_argument("--vocab-divisible-by", type=int, default=128)
    p.add_argument("--vocab-padding", choices=("tp", "megatron"), default="tp",
                   help="how the model's vocabulary is padded for the HF weights (a --mcore checkpoint brings its own)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="compute dtype of both models (default: the checkpoint's own: --mcore's, else --hf's weights)")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable; needs tokenizer files in --hf)")
    p.add_argument("--batch", type=int, default=2, help="random prompts when no --prompt is given")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--atol", type=float, default=None,
                   help="exit 1 when max abs diff exceeds this (default: by dtype, "
                        f"{', '.join(f'{k} {v:g}' for k, v in DEFAULT_ATOL.items())}, times max(1, max |logit|))")
    p.add_argument("--json", default=None, help="also write the numbers to this file (rank 0)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="start N processes on this machine (torch.distributed.run) instead of running under torchrun")
    return add_debug_flag(p)


def check_world(world_size: int, tp: int, pp: int, ep: int = 1) -> None:
    """Refuse, before any process group exists, a launch that cannot hold --tp x --pp (x --ep inside data
    parallel), naming the torchrun line."""
    from dapo_mcore.actor.parallel import expert_layout_error
    from dapo_mcore.weights.errors import WeightsError

    if tp < 1 or pp < 1:
        raise WeightsError(f"--tp {tp} --pp {pp}: both must be >= 1.")
    if world_size % (tp * pp):
        raise WeightsError(f"--tp {tp} --pp {pp} needs a multiple of {tp * pp} processes, this launch has {world_size}: "
                           f"run under torchrun --nproc_per_node {tp * pp} -m conversion.verify ...")
    problem = expert_layout_error(world_size, tp, pp, ep)
    if problem:
        raise WeightsError(problem.replace("parallel.expert_parallel", "--ep") +
                           f" (torchrun --nproc_per_node {tp * pp * ep} -m conversion.verify ...)")


def checkpoint_dtype(hf_dir: Path, mcore: str | None) -> str:
    """The dtype the checkpoint under test holds: the Megatron checkpoint's (``--mcore``), else the HF weights'
    (their common floating dtype; float32 when they mix dtypes)."""
    if mcore:
        from dapo_mcore.weights import checkpoint as ckpt
        from dapo_mcore.weights import dist_checkpoint

        if dist_checkpoint.is_dist_checkpoint(mcore):
            _, dtype = dist_checkpoint.embedding_rows(dist_checkpoint.find(mcore))
            return str(dtype).removeprefix("torch.")
        return ckpt.read_meta(ckpt.resolve_checkpoint_dir(mcore)).dtype
    from dapo_mcore.weights.safetensors_io import SafetensorsDirSource

    dtypes = {d for d, _ in SafetensorsDirSource(hf_dir).meta.values() if d.is_floating_point}
    if len(dtypes) == 1 and str(next(iter(dtypes))).removeprefix("torch.") in DEFAULT_ATOL:
        return str(next(iter(dtypes))).removeprefix("torch.")
    return "float32"


def _vocab_rule(args) -> tuple[int, str]:
    """(divisible_by, padding) that build the model with exactly the vocabulary rows of what is loaded: a dist
    checkpoint's rows, this project's checkpoint's recorded rule, else --vocab-divisible-by / --vocab-padding."""
    from dapo_mcore.weights import checkpoint as ckpt
    from dapo_mcore.weights import dist_checkpoint
    from dapo_mcore.weights.errors import WeightsError

    if not args.mcore:
        return args.vocab_divisible_by, args.vocab_padding
    if not dist_checkpoint.is_dist_checkpoint(args.mcore):
        layout = ckpt.read_meta(ckpt.resolve_checkpoint_dir(args.mcore)).layout
        return layout.make_vocab_size_divisible_by, layout.vocab_padding
    rows, _ = dist_checkpoint.embedding_rows(dist_checkpoint.find(args.mcore))
    if rows % args.tp:
        raise WeightsError(f"{args.mcore}: its vocabulary of {rows} rows does not split over --tp {args.tp}; use a "
                           "--tp that divides it.")
    return rows // args.tp, "megatron"  # a multiple of (rows / tp) x tp: exactly `rows`


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return parse_and_run(build_parser(), lambda args: _main(args, argv), argv)


def without_nproc(argv: list[str]) -> list[str]:
    """`argv` less ``--nproc-per-node N`` / ``--nproc-per-node=N`` (what the started processes get)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif not a.startswith("--nproc-per-node="):
            out.append(a)
    return out


def _relaunch(argv: list[str], n: int) -> int:
    """Run this command on `n` processes of this machine (torch.distributed.run, standalone); their exit code."""
    import os
    import subprocess

    from dapo_mcore.weights.errors import WeightsError

    if n < 1 or "RANK" in os.environ:
        raise WeightsError(f"--nproc-per-node {n}: give N >= 1, and not under torchrun/srun (they start the "
                           "processes themselves)")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           "-m", "conversion.verify", *without_nproc(argv)]
    return subprocess.run(cmd, env=env, check=False).returncode


def _main(args, argv: list[str]) -> int:
    if args.nproc_per_node is not None:
        return _relaunch(argv, args.nproc_per_node)
    from dapo_mcore.actor.parallel import init_distributed, init_model_parallel, read_launch_env, shutdown
    from dapo_mcore.model.qwen import build_gpt_model, transformer_config
    from dapo_mcore.weights import dist_checkpoint
    from dapo_mcore.weights.hf_checkpoint import read_hf_config
    from dapo_mcore.weights.live import load_hf_into_model, load_megatron_checkpoint_into_model
    from dapo_mcore.weights.registry import get_mapping
    from dapo_mcore.weights.safetensors_io import parse_dtype

    hf_dir = Path(args.hf)
    hf_config = read_hf_config(hf_dir)
    get_mapping(hf_config)  # an unsupported model type or feature: one line, before any process group
    launch = read_launch_env()
    check_world(launch.world_size, args.tp, args.pp, args.ep)
    args.dtype = args.dtype or checkpoint_dtype(hf_dir, args.mcore)
    dtype = parse_dtype(args.dtype)
    logging.getLogger(__name__).info("comparing logits in %s", args.dtype)
    init_distributed(launch, "auto")
    try:
        init_model_parallel(args.tp, args.pp, args.vpp if args.vpp > 1 else None, seed=1, expert_parallel=args.ep)
        tconfig = transformer_config(hf_config, tensor_parallel=args.tp, pipeline_parallel=args.pp,
                                     virtual_pipeline=args.vpp if args.vpp > 1 else None, params_dtype=dtype,
                                     expert_parallel=args.ep)
        divisible_by, padding = _vocab_rule(args)
        chunks = build_gpt_model(hf_config, tconfig, spec=args.layer_spec, make_vocab_size_divisible_by=divisible_by,
                                 vocab_padding=padding)
        for chunk in chunks:  # as the actor does: Megatron's torch norms ignore params_dtype
            chunk.to(dtype=dtype)
        if args.mcore and dist_checkpoint.is_dist_checkpoint(args.mcore):
            dist_checkpoint.load_into_model(chunks, args.mcore)
        elif args.mcore:  # at any layout, resharded as train's resume does (weights.reshard: exact)
            load_megatron_checkpoint_into_model(chunks, args.mcore, reshard=True,
                                                make_vocab_size_divisible_by=divisible_by, vocab_padding=padding)
        else:
            load_hf_into_model(chunks, hf_dir, args.layer_spec, args.vocab_divisible_by, vocab_padding=padding)
        ids = _prompt_ids(args, hf_dir, hf_config["vocab_size"])
        got = megatron_logits(chunks, ids, hf_config["vocab_size"]).cpu()
        if dist.get_rank() != 0:
            return 0
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
        with torch.no_grad():
            ref = hf_model(ids).logits
        stats = compare_logits(ref, got)
        stats["atol"] = args.atol if args.atol is not None else default_atol(args.dtype, ref)
        print(" ".join(f"{k}={v:.3g}" for k, v in stats.items()))
        if args.json:
            Path(args.json).write_text(json.dumps(stats) + "\n")
        return 0 if stats["max_abs_diff"] <= stats["atol"] else 1
    finally:
        shutdown()


if __name__ == "__main__":
    raise SystemExit(main())

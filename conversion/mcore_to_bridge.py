"""This project's checkpoint (a trainer checkpoint or `hf_to_mcore`'s) -> a Megatron-Bridge checkpoint.

So that a DAPO-trained model goes back into NeMo / Megatron-Bridge pipelines: the checkpoint is written out as
Hugging Face safetensors into a staging dir beside the output (`mcore_to_hf`, exact), then as a torch_dist checkpoint
in Megatron-Bridge's layout (`torch_dist.hf_to_torch_dist`, layout "bridge"); the staging dir is removed at the end,
also when the command fails or is stopped. It needs free space for one HF copy of the weights beside the output.

    dapo-mcore convert mcore-to-bridge --mcore RUN/checkpoints/step_N --out DIR [--tp 1 --pp 1]
        (under `torchrun --nproc-per-node TPxPP` when tp x pp > 1; the result loads at any TP/PP)
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch.distributed as dist

from conversion.entry import EXIT_USAGE, add_debug_flag, parse_and_run, report_written

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dapo-mcore convert mcore-to-bridge", description=__doc__.split("\n")[0])
    p.add_argument("--mcore", required=True, help="this project's checkpoint dir, or a trainer checkpoint dir "
                   "(RUN/checkpoints/step_N)")
    p.add_argument("--out", required=True, help="output dir (must not exist): a Megatron-Bridge save dir")
    p.add_argument("--tp", type=int, default=1, help="the TP the checkpoint is saved at (it loads at any TP)")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--tokenizer", default=None, help="dir whose tokenizer files go into the checkpoint (default: "
                   "the run's or the checkpoint's own, as mcore-to-hf finds them)")
    return add_debug_flag(p)


def main(argv: list[str] | None = None) -> int:
    return parse_and_run(build_parser(), _main, argv)


def _main(args) -> int:
    from conversion.mcore_to_hf import _run_tokenizer, convert_mcore_to_hf
    from conversion.torch_dist import _setup, hf_to_torch_dist
    from dapo_mcore.actor.parallel import shutdown
    from dapo_mcore.weights import checkpoint as ckpt

    out = Path(args.out)
    ckpt.read_meta(ckpt.resolve_checkpoint_dir(args.mcore))  # not ours: one line, before any process group
    ckpt.check_target_free(out)
    _setup(args.tp, args.pp)
    staging: list[str | None] = [None, None]  # [staging dir, rank 0's error]
    try:
        if dist.get_rank() == 0:
            try:
                staging[0] = tempfile.mkdtemp(prefix=f".{out.name}.hf-staging-", dir=out.parent)
                tokenizer = args.tokenizer or _run_tokenizer(Path(args.mcore))
                convert_mcore_to_hf(args.mcore, Path(staging[0]) / "hf", tokenizer_dir=tokenizer)
            except BaseException as err:  # the other ranks wait in the broadcast: tell them, then raise here
                staging[1] = str(err) or type(err).__name__
                dist.broadcast_object_list(staging, src=0)
                raise
        dist.broadcast_object_list(staging, src=0)
        if staging[1] is not None:
            return EXIT_USAGE  # rank 0 says why, in one line
        hf_to_torch_dist(Path(staging[0]) / "hf", out, layout="bridge")
    finally:
        if dist.get_rank() == 0 and staging[0] is not None:
            shutil.rmtree(staging[0], ignore_errors=True)
        shutdown()
    if os.environ.get("RANK", "0") == "0":
        report_written(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

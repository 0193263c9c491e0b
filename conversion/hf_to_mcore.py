"""Hugging Face checkpoint dir -> the canonical Megatron checkpoint at a chosen TP/PP/VPP, in one process.

No process groups: each (tp, pp) rank file is computed directly from the HF safetensors and streamed into
its file (the file's header is known from the config up front). Without a dtype cast no tensor is built:
each rank tensor is a list of byte ranges of the HF tensors (q/k/v groups, gate/up halves, column slices),
read straight into reused staging buffers that a thread writes out with O_DIRECT (`staged_io`). Peak memory
is the staging buffers plus one memory-mapped tensor; every HF byte is read once (norms once per TP rank).

    python -m conversion.hf_to_mcore --hf DIR --out DIR --tp 2 --pp 2 [--vpp 1] [--ep 1] [--layer-spec local]
        [--vocab-padding tp|megatron] [--vocab-divisible-by 128] [--dtype bfloat16] [--io auto|direct|buffered]
        [--format dapo|torch_dist] [--debug]

The HF directory's tokenizer, generation config and chat template are copied into ``<out>/tokenizer/`` so that
`mcore_to_hf` can put them back. User errors print one line and exit 2 (`--debug` for the traceback).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch

from conversion.entry import add_debug_flag, parse_and_run, report_written
from dapo_mcore.model.vocab import VOCAB_PADDINGS
from dapo_mcore.weights import checkpoint as ckpt
from dapo_mcore.weights.errors import WeightsError
from dapo_mcore.weights.hf_checkpoint import (
    TOKENIZER_DIR,
    check_hf_tensors,
    copy_tokenizer_files,
    read_hf_config,
)
from dapo_mcore.weights.layout import LAYER_SPECS, ParallelLayout
from dapo_mcore.weights.registry import get_mapping
from dapo_mcore.weights.safetensors_io import (
    DTYPE_NAMES,
    SafetensorsDirSource,
    StreamingSafetensorsWriter,
    dtype_name,
    parse_dtype,
)
from dapo_mcore.weights.staged_io import IO_MODES, io_mode

log = logging.getLogger(__name__)


def _progress(enabled: bool):
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                    disable=not enabled)


class CastOverflowError(WeightsError):
    """A cast (e.g. to float16) that turns finite values into inf."""


def cast_checked(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor.to(dtype)`, refusing a cast that overflows finite values to +-inf (naming the tensor)."""
    out = tensor.to(dtype)
    if dtype.is_floating_point and not torch.isinf(tensor).any() and torch.isinf(out).any():
        big = tensor.abs().max().item()
        raise CastOverflowError(f"{name}: casting to {dtype_name(dtype)} overflows (|max| {big:.4g} > "
                                f"{torch.finfo(dtype).max:.4g}); convert to bfloat16 or float32 instead.")
    return out


def convert_hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, layout: ParallelLayout, *,
                        dtype: torch.dtype | None = None, progress: bool = False,
                        direct: bool | None = None) -> ckpt.CheckpointMeta:
    """Convert; all checks (config, layout, tensors, target path) run before anything is written.

    `direct`: write the rank files with O_DIRECT (True), through the page cache (False), or O_DIRECT where
    the output filesystem allows it (None, logged when it does not).
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    hf_config = read_hf_config(hf_dir)
    mapping = get_mapping(hf_config)
    mapping.check_layout(layout)
    source = SafetensorsDirSource(hf_dir)
    out_dtype = check_hf_tensors(mapping, source, dtype=dtype)
    ckpt.check_target_free(out_dir)
    meta = ckpt.CheckpointMeta(hf_config, layout, mapping.padded_vocab_size(layout), dtype_name(out_dtype))
    eps = [None] if layout.ep == 1 else list(range(layout.ep))  # MoE: one rank file per expert-parallel rank
    plans = {(t, p, e): [(key, pl, mapping.rank_shape(pl, layout))
                         for key, pl in mapping.rank_placements(layout, p, e or 0)]
             for p in range(layout.pp) for t in range(layout.tp) for e in eps}
    itemsize = torch.empty((), dtype=out_dtype).element_size()
    total = sum(torch.Size(s).numel() * itemsize for plan in plans.values() for _, _, s in plan)
    with ckpt.atomic_directory(out_dir) as tmp, _progress(progress) as bar:
        task = bar.add_task(f"hf -> mcore tp={layout.tp} pp={layout.pp} vpp={layout.vpp}", total=total)
        for (tp_rank, pp_rank, ep_rank), plan in plans.items():
            path = ckpt.rank_file(tmp, tp_rank, pp_rank, ep_rank)
            path.parent.mkdir()
            entries = [(key, out_dtype, shape) for key, _, shape in plan]
            with StreamingSafetensorsWriter(path, entries, direct=direct) as writer:
                for key, pl, shape in plan:
                    if all(source.dtype(n) == out_dtype for n in pl.hf_names):  # bytes move file to file
                        writer.write_extents(key, source, pl.hf_names,
                                             mapping.shard_extents(pl, layout, tp_rank, itemsize))
                    else:  # a cast: build the tensor
                        writer.write(key, cast_checked(f"{key} ({', '.join(pl.hf_names)})",
                                                       mapping.shard(pl, source, layout, tp_rank), out_dtype))
                    bar.advance(task, torch.Size(shape).numel() * itemsize)
        ckpt.write_meta(tmp, meta)
        copied = copy_tokenizer_files(hf_dir, tmp / TOKENIZER_DIR)
    if not copied:
        log.warning("%s has no tokenizer files; mcore-to-hf will need --tokenizer to write a usable HF dir", hf_dir)
    log.info("wrote %s: tp=%d pp=%d vpp=%d ep=%d, %s, %.2f GB", out_dir, layout.tp, layout.pp, layout.vpp,
             layout.ep, meta.dtype, total / 1e9)
    return meta


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dapo-mcore convert hf-to-mcore", description=__doc__.split("\n")[0])
    p.add_argument("--hf", required=True, help="HF checkpoint dir (config.json + safetensors)")
    p.add_argument("--out", required=True, help="output dir (must not exist)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=1, help="virtual pipeline chunks per pipeline rank")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models): one rank file per "
                   "(tp, pp, ep) rank holding its experts, Megatron's mp_rank_TT_PPP_EEE")
    p.add_argument("--layer-spec", choices=LAYER_SPECS, default="local")
    p.add_argument("--vocab-padding", choices=VOCAB_PADDINGS, default="tp",
                   help="tp: keep the vocabulary unless tensor parallelism needs padding (what Megatron-Bridge and "
                        "the trainer's default model.vocab_padding=tp load); megatron: pad to a multiple of "
                        "--vocab-divisible-by x tp (Megatron-LM's rule, dapo-mcore's in older versions)")
    p.add_argument("--vocab-divisible-by", type=int, default=128,
                   help="divisor of the padding rule (megatron: rows are a multiple of it x tp; tp: caps the power "
                        "of two used when tp does not divide the vocabulary)")
    p.add_argument("--dtype", choices=tuple(DTYPE_NAMES), default=None,
                   help="cast to this dtype (default: keep the checkpoint's dtype)")
    p.add_argument("--format", choices=("dapo", "torch_dist", "bridge"), default="dapo",
                   help="dapo: this project's per-rank safetensors (what the trainer loads); torch_dist: "
                        "megatron-core dist checkpoint in Megatron-LM's layout (release/, args in common.pt); bridge: "
                        "the same tensors in Megatron-Bridge's layout (iter_0000000/, run_config.yaml), which "
                        "AutoBridge.export_ckpt and Bridge's training loader read. torch_dist and bridge need torchrun "
                        "with tp*pp processes when tp or pp > 1 and load at any layout")
    p.add_argument("--io", choices=tuple(IO_MODES), default="auto",
                   help="rank file writes: O_DIRECT (direct), page cache (buffered), or O_DIRECT where the "
                        "filesystem allows it, falling back when it refuses (auto)")
    p.add_argument("--no-progress", action="store_true")
    return add_debug_flag(p)


def main(argv: list[str] | None = None) -> int:
    return parse_and_run(build_parser(), _main, argv)


def _main(args) -> int:
    if args.format in ("torch_dist", "bridge"):
        from conversion.torch_dist import run_collective

        dtype = parse_dtype(args.dtype) if args.dtype else None
        run_collective(args.tp, args.pp, "hf_to_torch_dist", args.hf, args.out, dtype=dtype,
                       divisible_by=args.vocab_divisible_by, vocab_padding=args.vocab_padding,
                       layout="megatron-lm" if args.format == "torch_dist" else "bridge")
        if os.environ.get("RANK", "0") == "0":
            report_written(args.out)
        return 0
    layout = ParallelLayout(tp=args.tp, pp=args.pp, vpp=args.vpp, layer_spec=args.layer_spec,
                            make_vocab_size_divisible_by=args.vocab_divisible_by, ep=args.ep,
                            vocab_padding=args.vocab_padding)
    dtype = parse_dtype(args.dtype) if args.dtype else None
    convert_hf_to_mcore(args.hf, args.out, layout, dtype=dtype, progress=not args.no_progress,
                        direct=io_mode(args.io))
    report_written(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

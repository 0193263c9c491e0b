"""Canonical Megatron checkpoint (any TP/PP/VPP) -> Hugging Face safetensors shards + index + config.json.

Accepts the canonical directory itself or a trainer checkpoint directory that holds it as ``model/``.
Streams tensor by tensor: each Megatron tensor is read from its TP rank files (memory-mapped), merged,
split into HF tensors and appended to a shard planned up front. The result loads with
``transformers.AutoModelForCausalLM.from_pretrained``.

    python -m conversion.mcore_to_hf --mcore DIR --out DIR [--max-shard-size 5GB] [--tokenizer DIR]
        [--io auto|direct|buffered] [--debug]

A LoRA run's checkpoint (with ``lora/``) gives the merged model, or with ``--adapter-only`` a peft adapter
directory (conversion.lora_export).

Tokenizer, generation config and chat template come from `--tokenizer`, else from a training run's
``RUN/tokenizer``, else from the checkpoint's own copy (``<ckpt>/tokenizer``, written by `hf_to_mcore`); with
none of these the output has no tokenizer and a warning says so.
"""

from __future__ import annotations

import argparse
import itertools
import logging
from pathlib import Path

import torch

from conversion.entry import add_debug_flag, parse_and_run, report_written
from conversion.hf_to_mcore import _progress
from dapo_mcore.weights import checkpoint as ckpt
from dapo_mcore.weights.errors import WeightsError
from dapo_mcore.weights.hf_checkpoint import TOKENIZER_DIR, HFShardedWriter, copy_tokenizer, write_hf_config
from dapo_mcore.weights.live import check_tensors_match
from dapo_mcore.weights.registry import get_mapping
from dapo_mcore.weights.safetensors_io import parse_dtype, read_header
from dapo_mcore.weights.staged_io import IO_MODES, io_mode

log = logging.getLogger(__name__)


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '1024' -> bytes (decimal units, like Hugging Face)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    text = text.strip().upper()
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    if not text.isdigit():
        raise WeightsError(f"cannot read size {text!r}; write e.g. 5GB, 500MB or a byte count.")
    return int(text)


def _check_rank_files(directory: Path, meta: ckpt.CheckpointMeta, mapping) -> None:
    """Every rank file exists and holds exactly the expected keys and shapes (before writing anything)."""
    layout = meta.layout
    dtype = parse_dtype(meta.dtype)
    ep_ranks = [None] if layout.ep == 1 else list(range(layout.ep))
    for pp_rank, ep_rank in itertools.product(range(layout.pp), ep_ranks):
        expected = {key: mapping.rank_shape(pl, layout)
                    for key, pl in mapping.rank_placements(layout, pp_rank, ep_rank or 0)}
        for tp_rank in range(layout.tp):
            path = ckpt.rank_file(directory, tp_rank, pp_rank, ep_rank)
            if not path.exists():
                raise ckpt.CheckpointError(f"{path} is missing (checkpoint says tp={layout.tp} pp={layout.pp} "
                                           f"ep={layout.ep}).")
            header = read_header(path)
            check_tensors_match({k: s for k, (_, s) in header.items()}, expected, str(path), "the metadata")
            bad = [k for k, (d, _) in header.items() if d != dtype]
            if bad:
                raise ckpt.CheckpointError(f"{path}: {bad[:3]} are {header[bad[0]][0]}, metadata says {meta.dtype}.")


def convert_mcore_to_hf(mcore_dir: str | Path, out_dir: str | Path, *, max_shard_bytes: int = 5 * 10**9,
                        tokenizer_dir: str | Path | None = None, progress: bool = False,
                        direct: bool | None = None) -> Path:
    """Convert a canonical (or trainer) checkpoint to an HF directory; checks run before writing.

    `tokenizer_dir` None: use the checkpoint's own tokenizer copy when it has one (else warn).
    `direct`: O_DIRECT for the shards (True), page cache (False), or where the filesystem allows (None).
    """
    from conversion.lora_export import Merger, lora_dir

    directory = ckpt.resolve_checkpoint_dir(mcore_dir)
    adapters = lora_dir(mcore_dir)
    merge_lora = Merger(adapters) if adapters is not None else None  # a LoRA run's: the merged model
    if tokenizer_dir is None and (directory / TOKENIZER_DIR).is_dir():
        tokenizer_dir = directory / TOKENIZER_DIR
    meta = ckpt.read_meta(directory)
    mapping = get_mapping(meta.hf_config)
    layout = meta.layout
    mapping.check_layout(layout)
    _check_rank_files(directory, meta, mapping)
    out_dir = ckpt.check_target_free(out_dir)
    dtype = parse_dtype(meta.dtype)
    placements = [pl for pl in mapping.placements(layout) if pl.exported]
    plan = [(name, dtype, shape) for pl in placements for name, shape in mapping.hf_output_shapes(pl)]
    with ckpt.atomic_directory(out_dir) as tmp, _progress(progress) as bar:
        writer = HFShardedWriter(tmp, plan, max_shard_bytes, direct=direct)
        task = bar.add_task("mcore -> hf", total=writer.total)
        for pl in placements:
            ep = None if layout.ep == 1 else pl.ep_rank or 0  # dense tensors: every EP file has them; read EP 0's
            parts = [ckpt.read_rank_tensor(directory, t, pl.pp_rank, layout.chunk_prefix(pl.vchunk) + pl.key, ep)
                     for t in range(layout.tp)]
            for name, tensor in mapping.merge(pl, parts, layout):
                if merge_lora is not None:
                    tensor = merge_lora(name, tensor)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise ckpt.CheckpointError(f"{directory}: {name} holds NaN or inf values (a checkpoint of a run "
                                               "whose update went non-finite); convert an earlier checkpoint.")
                writer.write(name, tensor)
                bar.advance(task, tensor.numel() * tensor.element_size())
            del parts
        writer.close()
        if merge_lora is not None:
            merge_lora.check_all_used()
        write_hf_config(tmp, meta.hf_config, dtype)
        if tokenizer_dir is not None:
            copy_tokenizer(tokenizer_dir, tmp)
    if tokenizer_dir is None:
        log.warning("%s has no tokenizer files (nor does its checkpoint): transformers will not load a tokenizer "
                    "from %s; pass --tokenizer DIR (e.g. the original HF dir)", directory, out_dir)
    log.info("wrote HF checkpoint %s (%d shard(s), %.2f GB)", out_dir, len(writer.files), writer.total / 1e9)
    return out_dir


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dapo-mcore convert mcore-to-hf", description=__doc__.split("\n")[0])
    p.add_argument("--mcore", required=True, help="canonical checkpoint dir, or a trainer checkpoint dir with model/")
    p.add_argument("--out", required=True, help="output HF dir (must not exist)")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--tokenizer", default=None, help="dir whose tokenizer files are copied into the output "
                   "(default: RUN/tokenizer for a trainer checkpoint RUN/checkpoints/step_N, else the checkpoint's "
                   "tokenizer/ copy, if present)")
    p.add_argument("--format", choices=("auto", "dapo", "torch_dist"), default="auto",
                   help="the input: dapo (this project's checkpoint), torch_dist (a megatron-core dist checkpoint: "
                        "a Megatron-LM or Megatron-Bridge save dir, one of its iter_* dirs, or a bare one; any "
                        "TP/PP, any vocab padding), or auto (told apart by their files; the default)")
    p.add_argument("--hf-config", default=None,
                   help="for torch_dist: the HF dir whose config.json (and tokenizer files) describe the model; "
                        "optional for a Megatron-Bridge checkpoint (its run_config.yaml and tokenizer/ are used)")
    p.add_argument("--io", choices=tuple(IO_MODES), default="auto",
                   help="shard writes: O_DIRECT (direct), page cache (buffered), or O_DIRECT where allowed (auto)")
    p.add_argument("--adapter-only", action="store_true",
                   help="a LoRA run's checkpoint: write its adapter as a peft adapter directory (adapter_config.json, "
                        "adapter_model.safetensors) instead of the merged model")
    p.add_argument("--no-progress", action="store_true")
    return add_debug_flag(p)


def _run_tokenizer(src: Path) -> Path | None:
    """The tokenizer a training run saved beside its checkpoints (RUN/checkpoints/step_N -> RUN/tokenizer)."""
    candidate = src.resolve().parent.parent / "tokenizer"
    if src.resolve().parent.name == "checkpoints" and (candidate / "tokenizer_config.json").is_file():
        logging.getLogger(__name__).info("copying the run's tokenizer from %s", candidate)
        return candidate
    return None


def main(argv: list[str] | None = None) -> int:
    return parse_and_run(build_parser(), _main, argv)


def input_format(path: str | Path) -> str:
    """'dapo' for this project's checkpoints (trainer or converted), else 'torch_dist'."""
    path = Path(path)
    return "dapo" if any((c / ckpt.METADATA_FILE).is_file() for c in (path, path / "model")) else "torch_dist"


def _main(args) -> int:
    if args.adapter_only:
        from conversion.lora_export import export_adapter

        export_adapter(args.mcore, args.out)
        report_written(args.out)
        return 0
    fmt = input_format(args.mcore) if args.format == "auto" else args.format
    if fmt == "torch_dist":
        from conversion.torch_dist import run_collective

        run_collective(1, 1, "torch_dist_to_hf", args.mcore, args.hf_config, args.out,
                       max_shard_bytes=parse_size(args.max_shard_size))
        report_written(args.out)
        return 0
    tokenizer = args.tokenizer or _run_tokenizer(Path(args.mcore))
    convert_mcore_to_hf(args.mcore, args.out, max_shard_bytes=parse_size(args.max_shard_size),
                        tokenizer_dir=tokenizer, progress=not args.no_progress, direct=io_mode(args.io))
    report_written(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


"""Weights in and out of a LIVE Megatron model: load HF, save / load the canonical checkpoint.

All functions take this rank's model chunks (as built by `dapo_mcore.model.qwen.build_gpt_model`, optionally
wrapped in DDP / Float16Module) and read TP/PP ranks from Megatron's parallel state. Every check runs before
any parameter is changed.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.weights import checkpoint as ckpt
from dapo_mcore.weights.hf_checkpoint import check_hf_tensors
from dapo_mcore.weights.layout import ParallelLayout
from dapo_mcore.weights.mapping import ModelMapping, Placement
from dapo_mcore.weights.registry import get_mapping
from dapo_mcore.weights.safetensors_io import SafetensorsDirSource, dtype_name

log = logging.getLogger(__name__)


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def plain_tensor(param: torch.Tensor) -> torch.Tensor:
    """``param`` as a plain tensor of its nominal dtype, dequantizing a quantized parameter (FP8 params).

    With ``model.fp8.fp8_params`` Transformer Engine keeps weights as ``QuantizedTensor`` subclasses (Float8Tensor,
    ...) whose ``dequantize(dtype=...)`` gives the values; they have no plain storage to gather, save or send. Plain
    tensors (and ``nn.Parameter``) come back as they are (``torch.Tensor.dequantize`` is for torch's own int8 types).
    """
    if type(param).dequantize is not torch.Tensor.dequantize:
        return param.dequantize(dtype=param.dtype)
    return param


def detect_layer_spec(model_chunks: list[torch.nn.Module]) -> str:
    names = (n for c in model_chunks for n, _ in unwrap(c).named_parameters())
    return "transformer_engine" if any(n.endswith("linear_qkv.layer_norm_weight") for n in names) else "local"


def live_layout(model_chunks: list, layer_spec: str, make_vocab_size_divisible_by: int,
                vocab_padding: str = "megatron") -> tuple[ParallelLayout, int, int]:
    """(layout, tp rank, pp rank) of this process, from Megatron's parallel state; the vocabulary padding (divisor
    and rule) is the one the chunks were built with (``build_gpt_model``), which parallel state does not know."""
    from megatron.core import parallel_state as ps

    layout = ParallelLayout(tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
                            vpp=len(model_chunks), layer_spec=layer_spec,
                            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                            ep=ps.get_expert_model_parallel_world_size(), vocab_padding=vocab_padding)
    found = detect_layer_spec(model_chunks)
    if found != layer_spec:
        raise ckpt.CheckpointError(f"layer_spec={layer_spec!r} but the live model uses the {found!r} spec names.")
    return layout, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()


def live_ep_rank(layout: ParallelLayout) -> int | None:
    """This process's expert-parallel rank in an EP > 1 layout (None without expert parallelism)."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank() if layout.ep > 1 else None


def live_tensors(model_chunks: list, layout: ParallelLayout) -> dict[str, torch.Tensor]:
    """This rank's base parameters under their checkpoint keys (chunk prefix when VPP > 1); LoRA adapters are not
    among them (``weights.lora`` handles those)."""
    from dapo_mcore.model.lora.attach import is_adapter_param

    out: dict[str, torch.Tensor] = {}
    for v, chunk in enumerate(model_chunks):
        for name, param in unwrap(chunk).named_parameters():
            if not is_adapter_param(name):
                out[layout.chunk_prefix(v) + name] = param
    return out


def expected_rank(mapping: ModelMapping, layout: ParallelLayout, pp_rank: int,
                  ep_rank: int | None = None) -> dict[str, tuple[Placement, tuple]]:
    return {key: (pl, mapping.rank_shape(pl, layout))
            for key, pl in mapping.rank_placements(layout, pp_rank, ep_rank or 0)}


def check_tensors_match(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], what: str,
                        against: str) -> None:
    """Raise CheckpointError naming missing / unexpected keys and the first shape mismatches."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise ckpt.CheckpointError(f"{what} does not match {against}: missing {missing[:5]}"
                                   f"{'...' if len(missing) > 5 else ''} ({len(missing)}), unexpected "
                                   f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''} ({len(unexpected)}).")
    bad = [f"{k}: {tuple(found[k])} vs {tuple(expected[k])}" for k in expected if tuple(found[k]) != tuple(expected[k])]
    if bad:
        raise ckpt.CheckpointError(f"{what} shapes do not match {against}: {'; '.join(bad[:5])}")


def _copy_in(params: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, value in values.items():
            params[key].copy_(value)


def load_hf_into_model(model_chunks: list, hf_dir: str | Path, layer_spec: str = "local",
                       make_vocab_size_divisible_by: int = 128, vocab_padding: str = "megatron") -> None:
    """Stream this rank's slices of an HF checkpoint dir (memory-mapped safetensors) into the live model."""
    hf_dir = Path(hf_dir)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    mapping = get_mapping(hf_config)
    layout, tp_rank, pp_rank = live_layout(model_chunks, layer_spec, make_vocab_size_divisible_by, vocab_padding)
    mapping.check_layout(layout)
    source = SafetensorsDirSource(hf_dir)
    check_hf_tensors(mapping, source, dtype=None, allow_mixed_dtypes=True)
    params = live_tensors(model_chunks, layout)
    expected = expected_rank(mapping, layout, pp_rank, live_ep_rank(layout))
    check_tensors_match({k: tuple(p.shape) for k, p in params.items()}, {k: s for k, (_, s) in expected.items()},
                        "the live model", f"the mapping of {hf_dir} (tp={layout.tp} pp={layout.pp} vpp={layout.vpp})")
    with torch.no_grad():
        for key, (pl, _) in expected.items():
            params[key].copy_(mapping.shard(pl, source, layout, tp_rank))
    log.info("loaded %d tensors from %s into tp rank %d, pp rank %d", len(expected), hf_dir, tp_rank, pp_rank)


def _meta_mismatches(meta: ckpt.CheckpointMeta, layout: ParallelLayout, padded_vocab: int, dtype: str) -> list[str]:
    out = [f"{name}: checkpoint {getattr(meta.layout, name)!r}, live model {getattr(layout, name)!r}"
           for name in ("tp", "pp", "vpp", "layer_spec", "ep") if getattr(meta.layout, name) != getattr(layout, name)]
    if meta.padded_vocab_size != padded_vocab:
        out.append(f"padded vocab: checkpoint {meta.padded_vocab_size}, live model {padded_vocab}")
    if meta.dtype != dtype:
        out.append(f"dtype: checkpoint {meta.dtype}, live model {dtype}")
    return out


def load_megatron_checkpoint_into_model(model_chunks: list, directory: str | Path, *, reshard: bool = False,
                                        make_vocab_size_divisible_by: int | None = None,
                                        vocab_padding: str | None = None, cast: bool = False) -> ckpt.CheckpointMeta:
    """Load this rank's tensors of a canonical checkpoint; raises CheckpointError on any mismatch before writing.

    With `reshard`, a checkpoint of another TP/PP/VPP layout (or layer spec, or vocabulary padding) is resharded
    to the live model's (`weights.reshard`: padding rows are stripped and re-added, real rows bit-identical);
    `make_vocab_size_divisible_by` and `vocab_padding` are then the live model's (default: the checkpoint's). Without it, only a checkpoint of the live layout loads. With `cast`, a checkpoint of another
    dtype is cast to the live model's (the trainer's rule: model.params_dtype decides, as for an HF checkpoint).
    """
    directory = ckpt.resolve_checkpoint_dir(directory)
    meta = ckpt.read_meta(directory)
    mapping = get_mapping(meta.hf_config)
    divisible = make_vocab_size_divisible_by or meta.layout.make_vocab_size_divisible_by
    padding = vocab_padding or meta.layout.vocab_padding
    layout, tp_rank, pp_rank = live_layout(model_chunks, detect_layer_spec(model_chunks),
                                           divisible if reshard else meta.layout.make_vocab_size_divisible_by,
                                           padding if reshard else meta.layout.vocab_padding)
    params = live_tensors(model_chunks, layout)
    dtype = dtype_name(next(iter(params.values())).dtype)
    problems = _meta_mismatches(meta, layout, _live_padded_vocab(model_chunks, layout, mapping), dtype)
    if reshard:
        problems = [p for p in problems if p.startswith("dtype")]
    if cast:
        problems = [p for p in problems if not p.startswith("dtype")]
    if problems:
        fixes = []
        if any(not p.startswith("dtype") for p in problems):
            fixes.append("convert it to this layout with `dapo-mcore convert` (mcore-to-hf, then hf-to-mcore)")
        if meta.dtype != dtype:
            fixes.append(f"build the model in {meta.dtype} (e.g. verify --dtype {meta.dtype}) or convert with "
                         f"hf-to-mcore --dtype {dtype}")
        raise ckpt.CheckpointError(f"checkpoint {directory} does not fit the live model: {'; '.join(problems)}. "
                                   f"Fix: {'; '.join(fixes)}.")
    ep_rank = live_ep_rank(layout)
    if reshard:
        from dapo_mcore.weights.reshard import read_rank_resharded

        state = read_rank_resharded(directory, layout, tp_rank, pp_rank, ep_rank)
    else:
        state = ckpt.read_megatron_rank(directory, tp_rank, pp_rank, ep_rank)
    check_tensors_match({k: tuple(t.shape) for k, t in state.items()}, {k: tuple(p.shape) for k, p in params.items()},
                        f"checkpoint rank file {ckpt.rank_dir_name(tp_rank, pp_rank, ep_rank)}", "the live model")
    if cast:
        state = {k: t.to(params[k].dtype) if k in params else t for k, t in state.items()}
    bad = [k for k, t in state.items() if t.dtype != params[k].dtype]
    if bad:
        raise ckpt.CheckpointError(f"dtype mismatch for {bad[:5]}: checkpoint {state[bad[0]].dtype}, "
                                   f"live {params[bad[0]].dtype}; cast the model chunks to one dtype before "
                                   "loading (chunk.to(dtype), as the actor does: Megatron's norms stay float32).")
    _copy_in(params, state)
    how = describe_load(meta.layout, layout, meta.padded_vocab_size, _live_padded_vocab(model_chunks, layout, mapping))
    log.info("loaded %s rank (tp %d, pp %d): %d tensors%s", directory, tp_rank, pp_rank, len(state), how)
    return meta


def describe_load(saved: ParallelLayout, live: ParallelLayout, saved_rows: int, live_rows: int) -> str:
    """What a load did beyond reading the rank's own file: " (resharded from tp=.. pp=.. vpp=..)" only when the
    split moved, the layer spec's renaming, the vocabulary's re-padding; "" for a load at the saved layout."""
    out = ""
    if (saved.tp, saved.pp, saved.vpp, saved.ep) != (live.tp, live.pp, live.vpp, live.ep):
        out += f" (resharded from tp={saved.tp} pp={saved.pp} vpp={saved.vpp}" + (
            f" ep={saved.ep})" if saved.ep > 1 or live.ep > 1 else ")")
    if saved.layer_spec != live.layer_spec:
        out += f" (names of the {saved.layer_spec} layer spec mapped to {live.layer_spec})"
    if saved_rows != live_rows:
        out += (f" (vocabulary re-padded: {saved_rows} rows, {saved.vocab_padding} padding -> {live_rows} rows, "
                f"{live.vocab_padding} padding)")
    return out


def _live_padded_vocab(model_chunks: list, layout: ParallelLayout, mapping: ModelMapping) -> int:
    """Padded vocab of the live model, read off its embedding/output weight (or the mapping if neither is here)."""
    for chunk in model_chunks:
        for name, p in unwrap(chunk).named_parameters():
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                return p.shape[0] * layout.tp
    return mapping.padded_vocab_size(layout)


def save_megatron_checkpoint(model_chunks: list, directory: str | Path, hf_config: dict[str, Any], *,
                             make_vocab_size_divisible_by: int = 128, vocab_padding: str = "megatron") -> None:
    """Collective: write the live model as a canonical checkpoint (DP rank 0 of each TP/PP rank writes)."""
    from megatron.core import parallel_state as ps

    mapping = get_mapping(hf_config)
    layout, tp_rank, pp_rank = live_layout(model_chunks, detect_layer_spec(model_chunks), make_vocab_size_divisible_by,
                                           vocab_padding)
    params = live_tensors(model_chunks, layout)
    ep_rank = live_ep_rank(layout)
    expected = expected_rank(mapping, layout, pp_rank, ep_rank)
    check_tensors_match({k: tuple(p.shape) for k, p in params.items()}, {k: s for k, (_, s) in expected.items()},
                        "the live model", "the mapping of its HF config")
    target = Path(directory)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            ckpt.check_target_free(target)
            tmp = ckpt.temp_dir_for(target)
            tmp.mkdir()
            box[0] = os.fspath(tmp)
        except (FileExistsError, FileNotFoundError) as err:
            box[0] = err
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    tmp = Path(box[0])
    writer = ps.get_data_parallel_rank() == 0 if ep_rank is None else ps.get_expert_data_parallel_rank() == 0
    if writer:  # with EP, one replica of each expert-parallel rank writes its experts (and the dense tensors)
        rank_path = ckpt.rank_file(tmp, tp_rank, pp_rank, ep_rank)
        rank_path.parent.mkdir()
        ckpt.save_safetensors({k: plain_tensor(p).detach().contiguous() for k, p in params.items()}, rank_path,
                              {"format": "pt"})
    if dist.get_rank() == 0:
        meta = ckpt.CheckpointMeta(hf_config, layout, _live_padded_vocab(model_chunks, layout, mapping),
                                   dtype_name(next(iter(params.values())).dtype))
        ckpt.write_meta(tmp, meta)
    dist.barrier()
    if dist.get_rank() == 0:
        os.replace(tmp, target)
    dist.barrier()
    ckpt.note_moved(tmp, target)
    # DEBUG: the trainer writes into a step_*.partial directory and logs the final name itself.
    log.debug("wrote model files to %s (tp=%d pp=%d vpp=%d)", target, layout.tp, layout.pp, layout.vpp)

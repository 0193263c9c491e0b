"""Megatron-Core distributed checkpoints (``torch_dist``): what Megatron-LM, Megatron-Bridge and NeMo load.

`hf_to_torch_dist` builds this rank's GPTModel (local layer spec, the names Megatron-LM's
``--transformer-impl local`` uses), loads the HF weights into it, and saves ``{"model": sharded_state_dict}``
with `dist_checkpointing.save` in Megatron-LM's layout::

    <out>/latest_checkpointed_iteration.txt     "release"
    <out>/release/{metadata.json, common.pt, .metadata, __*_*.distcp}

or in Megatron-Bridge's (``layout="bridge"``: what AutoBridge.export_ckpt and Bridge's training loader read)::

    <out>/latest_checkpointed_iteration.txt     "0"
    <out>/latest_train_state.pt
    <out>/iter_0000000/{metadata.json, .metadata, __*_*.distcp, run_config.yaml, train_state.pt, tokenizer/}

``common.pt`` holds what Megatron-LM's ``load_checkpoint`` reads besides tensors: ``checkpoint_version`` 3.0,
``iteration`` 0 and ``args`` (an ``argparse.Namespace`` with the model and parallel sizes). The format is
layout-free: a checkpoint saved at TP2/PP2 loads at TP1 (dist_checkpointing reshards on load).

`torch_dist_to_hf` reads such a checkpoint (ours, a Megatron-LM or Megatron-Bridge save dir, one iter_* dir, or a
bare dist-checkpoint dir: `dapo_mcore.weights.dist_checkpoint`, on any megatron-core), builds a TP1 model whose
vocabulary has the checkpoint's padded size (any padding rule: Megatron-LM's multiple of 128·TP, Megatron-Bridge's,
none), loads, strips the padding and writes HF safetensors. The HF config comes from `--hf-config` (the original HF
dir) or, for a Megatron-Bridge checkpoint, from its run_config.yaml. Runs as one process or under torchrun.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.weights import dist_checkpoint
from dapo_mcore.weights.errors import InputFileError, WeightsError

log = logging.getLogger(__name__)

TRACKER = dist_checkpoint.TRACKER
EMBEDDING_KEY = dist_checkpoint.EMBEDDING_KEY


def megatron_lm_args(hf_config: dict[str, Any], *, tp: int, pp: int, padded_vocab: int, divisible_by: int,
                     dtype: torch.dtype) -> argparse.Namespace:
    """The ``args`` Megatron-LM stores in a checkpoint (the fields its loader and check_checkpoint_args read)."""
    from dapo_mcore.model.hf_config import megatron_rope_scaling_factor
    from dapo_mcore.model.qwen import QwenShape

    s = QwenShape.from_hf(hf_config)
    rope_factor = megatron_rope_scaling_factor(hf_config, "a Megatron-LM torch_dist checkpoint")
    return argparse.Namespace(
        use_rope_scaling=rope_factor is not None, rope_scaling_factor=rope_factor or 8.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, num_layers=s.num_layers,
        hidden_size=s.hidden_size, ffn_hidden_size=s.ffn_hidden_size, num_attention_heads=s.num_heads,
        group_query_attention=s.num_kv_heads != s.num_heads, num_query_groups=s.num_kv_heads, kv_channels=s.head_dim,
        max_position_embeddings=s.max_position_embeddings, position_embedding_type="rope", rotary_base=s.rope_theta,
        add_position_embedding=False, normalization="RMSNorm", norm_epsilon=s.rms_norm_eps, swiglu=True,
        disable_bias_linear=True, add_qkv_bias=s.qkv_bias, qk_layernorm=s.qk_norm,
        untie_embeddings_and_output_weights=not s.tie_embeddings,
        make_vocab_size_divisible_by=divisible_by, padded_vocab_size=padded_vocab, vocab_size=s.vocab_size,
        tokenizer_type="HuggingFaceTokenizer", bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        params_dtype=dtype, no_save_optim=True, no_save_rng=True, ckpt_format="torch_dist",
        transformer_impl="local")


def run_collective(tp: int, pp: int, name: str, *args, **kwargs):
    """Start gloo (torchrun's world or one process), set TP/PP, run `name` of this module, shut down."""
    from dapo_mcore.actor.parallel import shutdown

    _setup(tp, pp)
    try:
        return globals()[name](*args, **kwargs)
    finally:
        shutdown()


def _setup(tp: int, pp: int) -> None:
    from dapo_mcore.actor.parallel import init_distributed, init_model_parallel, read_launch_env

    launch = read_launch_env()
    if launch.world_size != tp * pp:
        raise WeightsError(f"torch_dist with tp={tp} pp={pp} needs {tp * pp} processes, found {launch.world_size}; "
                           f"run it under `torchrun --nproc_per_node {tp * pp}` (the result loads at any TP/PP).")
    if not dist.is_initialized():
        init_distributed(launch, "gloo")
    init_model_parallel(tp, pp, None, seed=1)


def _build(hf_config: dict[str, Any], tp: int, pp: int, dtype: torch.dtype, divisible_by: int):
    from dapo_mcore.model.qwen import build_gpt_model, transformer_config

    tconfig = transformer_config(hf_config, tensor_parallel=tp, pipeline_parallel=pp, params_dtype=dtype)
    tconfig.perform_initialization = False  # every weight is overwritten by the load: random init is wasted time
    (chunk,) = build_gpt_model(hf_config, tconfig, spec="local", make_vocab_size_divisible_by=divisible_by)
    return chunk.to(dtype=dtype)  # Megatron's torch norms ignore params_dtype


LAYOUTS = ("megatron-lm", "bridge")
"""Save-dir layouts: Megatron-LM's (``release/`` + ``common.pt`` args) or Megatron-Bridge's (``iter_0000000/`` +
``run_config.yaml``, the vocabulary padded only where TP needs it)."""


def hf_to_torch_dist(hf_dir: str | Path, out_dir: str | Path, *, dtype: torch.dtype | None = None,
                     divisible_by: int = 128, layout: str = "megatron-lm", vocab_padding: str = "tp") -> Path:
    """Collective over the job (world size = TP x PP): write `hf_dir` as a torch_dist checkpoint in `layout`.

    `vocab_padding`: "tp" (pad only where TP needs it: what Megatron-Bridge loads) or "megatron" (multiples of
    `divisible_by` x TP). Megatron-LM's args then carry a ``make_vocab_size_divisible_by`` that reproduces the rows.
    """
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from dapo_mcore.model.vocab import _power_of_two_divisor, padded_vocab_size
    from dapo_mcore.weights.atomic import atomic_directory, check_target_free
    from dapo_mcore.weights.hf_checkpoint import TOKENIZER_DIR, copy_tokenizer_files, read_hf_config
    from dapo_mcore.weights.live import load_hf_into_model
    from dapo_mcore.weights.safetensors_io import SafetensorsDirSource

    if layout not in LAYOUTS:
        raise WeightsError(f"unknown torch_dist layout {layout!r}; choose one of {', '.join(LAYOUTS)}.")
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    hf_config = read_hf_config(hf_dir)
    if dtype is None:
        source = SafetensorsDirSource(hf_dir)
        dtype = source.dtype(next(iter(source.meta)))
    check_target_free(out_dir)
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    rows = padded_vocab_size(hf_config["vocab_size"], divisible_by, tp, padding=vocab_padding)
    model = _build(hf_config, tp, pp, dtype, rows // tp)
    load_hf_into_model([model], hf_dir, "local", rows // tp)  # casts to `dtype` on copy, as .to(dtype) would
    # MARK: this checkpoint carries dist_checkpoint.CHECKSUMS, so a copy without it is refused as damaged
    common: dict[str, Any] = {"checkpoint_version": 3.0, "iteration": 0,
                              dist_checkpoint.MARK: dist_checkpoint.CHECKSUMS}
    if layout == "megatron-lm":  # its divisor: the largest power of two whose multiple x TP is exactly `rows`
        common["args"] = megatron_lm_args(hf_config, tp=tp, pp=pp, padded_vocab=rows,
                                          divisible_by=_power_of_two_divisor(rows // tp, divisible_by), dtype=dtype)
    sub = "release" if layout == "megatron-lm" else "iter_0000000"
    tmp_box: list[Any] = [None]
    with _on_rank0(atomic_directory(out_dir)) as tmp:
        tmp_box[0] = os.fspath(tmp) if tmp is not None else None
        dist.broadcast_object_list(tmp_box, src=0)
        ckpt_dir = Path(tmp_box[0]) / sub
        if dist.get_rank() == 0:
            ckpt_dir.mkdir()
        dist.barrier()
        _save_or_name_the_disk(dist_checkpointing, {"model": model.sharded_state_dict(), **common}, ckpt_dir,
                               out_dir)
        dist.barrier()
        if dist.get_rank() == 0:
            if layout == "bridge":
                from conversion.bridge_config import write_bridge_files

                copied = copy_tokenizer_files(hf_dir, ckpt_dir / TOKENIZER_DIR)
                # the tokenizer bundled beside the weights, where it will be once the output is in place
                bundled = out_dir.resolve() / sub / TOKENIZER_DIR
                write_bridge_files(ckpt_dir, hf_config, tp=tp, pp=pp, dtype=dtype, padded_rows=rows,
                                   vocab_padding=vocab_padding, divisible_by=divisible_by,
                                   tokenizer_model=os.fspath(bundled) if "tokenizer_config.json" in copied else None)
            dist_checkpoint.write_checksums(ckpt_dir)
            (Path(tmp_box[0]) / TRACKER).write_text("release\n" if layout == "megatron-lm" else "0")
    log.info("wrote torch_dist checkpoint %s in %s's layout (saved at tp=%d pp=%d, vocabulary %d rows for %d)",
             out_dir, layout, tp, pp, rows, hf_config["vocab_size"])
    return out_dir


def _save_or_name_the_disk(dist_checkpointing, state: dict, ckpt_dir: Path, out_dir: Path) -> None:
    """`dist_checkpointing.save`; when it fails, a write there is tried: a full disk, a quota or a file-size limit
    (which the save's writer threads report only as ``unexpected pos``) becomes one OutputPathError."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    from dapo_mcore.weights.errors import output_os_error

    try:
        dist_checkpointing.save(state, os.fspath(ckpt_dir))
    except (Exception, CheckpointException) as err:
        disk = _write_probe(ckpt_dir)
        if disk is not None:
            raise output_os_error(disk, out_dir) from err
        raise


def _write_probe(directory: Path) -> OSError | None:
    """The OSError a user fixes (full, quota, read-only, file-size limit) that a 4 MiB write in `directory` meets."""
    from dapo_mcore.weights.errors import is_output_os_error

    probe = directory / f".write-probe-{dist.get_rank()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * (4 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        return err if is_output_os_error(err) else None
    finally:
        probe.unlink(missing_ok=True)
    return None


class _on_rank0:  # noqa: N801  (used like a contextlib helper)
    """Enter `cm` on global rank 0 only (other ranks get None); exceptions propagate on every rank."""

    def __init__(self, cm):
        self.cm = cm if dist.get_rank() == 0 else None

    def __enter__(self):
        return self.cm.__enter__() if self.cm is not None else None

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc) if self.cm is not None else False


def torch_dist_to_hf(ckpt: str | Path, hf_config_dir: str | Path | None, out_dir: str | Path, *,
                     max_shard_bytes: int = 5 * 10**9) -> Path:
    """Collective (run it in one process): a torch_dist checkpoint -> an HF dir, padding stripped.

    `hf_config_dir` None: the model's shape comes from a Megatron-Bridge checkpoint's run_config.yaml and the
    tokenizer from its ``tokenizer/`` dir (when it has one).
    """
    from dapo_mcore.weights.atomic import atomic_directory, check_target_free
    from dapo_mcore.weights.hf_checkpoint import (
        HFShardedWriter,
        copy_tokenizer_files,
        write_hf_config,
    )
    from dapo_mcore.weights.layout import ParallelLayout
    from dapo_mcore.weights.live import live_tensors
    from dapo_mcore.weights.registry import get_mapping

    found = dist_checkpoint.find(ckpt)
    src = found.path
    hf_config = _hf_config_for(found, hf_config_dir)
    check_target_free(out_dir)
    padded, dtype = dist_checkpoint.embedding_rows(found)
    if padded < hf_config["vocab_size"]:
        raise InputFileError(f"{src}: the embedding has {padded} rows, fewer than vocab_size="
                             f"{hf_config['vocab_size']} in the model's config; is it the same model?")
    model = _build(hf_config, 1, 1, dtype, padded)  # divisible_by = padded: exactly the checkpoint's padding
    loaded = dist_checkpoint.load({"model": model.sharded_state_dict()}, found)
    model.load_state_dict(loaded["model"])
    mapping = get_mapping(hf_config)
    layout = ParallelLayout(make_vocab_size_divisible_by=padded)
    params = live_tensors([model], layout)
    placements = [pl for pl in mapping.placements(layout) if pl.exported]
    plan = [(n, dtype, s) for pl in placements for n, s in mapping.hf_output_shapes(pl)]
    with atomic_directory(out_dir) as tmp:
        writer = HFShardedWriter(tmp, plan, max_shard_bytes)
        for pl in placements:
            for name, tensor in mapping.merge(pl, [params[pl.key].detach()], layout):
                writer.write(name, tensor)
        writer.close()
        write_hf_config(tmp, hf_config, dtype)
        tokenizer_dir = hf_config_dir if hf_config_dir is not None else _bridge_tokenizer(src)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
    log.info("wrote HF checkpoint %s from %s (padded vocab %d -> %d)", out_dir, src, padded, hf_config["vocab_size"])
    return Path(out_dir)


def _hf_config_for(found: dist_checkpoint.DistCheckpoint, hf_config_dir: str | Path | None) -> dict[str, Any]:
    """The HF config: `hf_config_dir`'s config.json, else the HF config in a Bridge checkpoint's run_config.yaml."""
    from dapo_mcore.weights.hf_checkpoint import read_hf_config

    if hf_config_dir is not None:
        return read_hf_config(hf_config_dir)
    if found.run_config is None:
        raise WeightsError(f"{found.path} carries no run_config.yaml (it is not a Megatron-Bridge checkpoint); pass "
                           "--hf-config DIR, the Hugging Face dir whose config.json describes the model.")
    return dist_checkpoint.hf_config_from_run_config(found.run_config, found.path)


def _bridge_tokenizer(ckpt_dir: Path) -> Path | None:
    """The tokenizer files a Megatron-Bridge import saves in its iteration dir (``tokenizer/``), if any."""
    candidate = ckpt_dir / "tokenizer"
    return candidate if candidate.is_dir() and any(candidate.iterdir()) else None

"""Checkpoints of the full training state: atomic, keep-last-N, and safe to resume after a kill -9.

Layout of one checkpoint (``<run>/checkpoints/step_000010/``):
  model/mp_rank_TT_PPP/model.safetensors   this (tp, pp) rank's GPTModel chunk(s), Megatron names
  model/dapo_mcore_checkpoint.json          layout metadata (HF config, TP/PP/VPP, layer spec, vocab padding)
  optim/mp_rank_TT_PPP.pt                   optimizer state of that model shard (replicated over DP: DP rank 0 writes)
  optim/mp_rank_TT_PPP_dist.pt              distributed-optimizer parameter state (GPU, gathered to DP rank 0)
  trainer_state.json                        step, data cursor, cost ledger, anything the trainer adds
  rng/rank_NNNNN.pt                         every rank's RNG states
  COMPLETE                                  written last, after every rank has finished

A checkpoint is written into ``step_000010.partial`` and renamed after all ranks finish; then ``latest`` is
replaced atomically. Resume takes ``latest`` if it is complete, else the newest complete checkpoint, warning
about any partial or corrupt one it skips. Old checkpoints beyond ``keep_last`` are deleted only after a newer one
is complete. The model directory is the same format as ``dapo-mcore convert hf-to-mcore`` writes, so
``convert mcore-to-hf`` works on any trainer checkpoint.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d{6,})$")


class CheckpointMismatch(ValueError):
    """A checkpoint does not fit the live model (shape or layout); nothing was changed."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _ranks() -> tuple[int, int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()


def shard_name(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def model_state_for_save(chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's chunk state dicts flattened (``chunk{v}.`` prefix when there are several), tensors only."""
    out: dict[str, torch.Tensor] = {}
    for v, chunk in enumerate(chunks):
        prefix = f"chunk{v}." if len(chunks) > 1 else ""
        for key, value in chunk.state_dict().items():
            if isinstance(value, torch.Tensor) and not key.endswith("_extra_state"):
                out[prefix + key] = value.detach().to("cpu").contiguous()
    return out


def layout_metadata(hf_config: dict[str, Any], tp: int, pp: int, vpp: int | None, layer_spec: str,
                    divisible_by: int, padded_vocab: int, dtype: torch.dtype) -> dict[str, Any]:
    return {"format": "dapo_mcore", "format_version": FORMAT_VERSION, "hf_config": hf_config,
            "tensor_parallel": tp, "pipeline_parallel": pp, "virtual_pipeline": vpp, "layer_spec": layer_spec,
            "make_vocab_size_divisible_by": divisible_by, "padded_vocab_size": padded_vocab,
            "dtype": str(dtype).replace("torch.", "")}


def _check_shapes(chunks: list[torch.nn.Module], state: dict[str, torch.Tensor], where: Path) -> None:
    expected = model_state_for_save(chunks)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointMismatch(f"{where}: tensors do not match the model (missing {missing[:5]}, unexpected "
                                 f"{unexpected[:5]}); was it saved with a different model or layout?")
    for key, tensor in expected.items():
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise CheckpointMismatch(f"{where}: {key} has shape {tuple(state[key].shape)} in the checkpoint but "
                                     f"{tuple(tensor.shape)} in the model; the model shape or TP layout differs.")


def load_model_shard(chunks: list[torch.nn.Module], model_dir: Path, expect: dict[str, Any]) -> None:
    """Load this rank's shard into the live chunks after checking layout and shapes (nothing changes on error)."""
    meta_path = model_dir / "dapo_mcore_checkpoint.json"
    if not meta_path.is_file():
        raise CheckpointMismatch(f"{model_dir} has no dapo_mcore_checkpoint.json; it is not a dapo-mcore model checkpoint.")
    meta = json.loads(meta_path.read_text())
    for key in ("tensor_parallel", "pipeline_parallel", "virtual_pipeline", "layer_spec", "padded_vocab_size"):
        if meta.get(key) != expect.get(key):
            raise CheckpointMismatch(f"{model_dir}: saved with {key}={meta.get(key)!r} but this run has "
                                     f"{key}={expect.get(key)!r}; convert it (dapo-mcore convert) or change the layout.")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        if meta["hf_config"].get(key) != expect["hf_config"].get(key):
            raise CheckpointMismatch(f"{model_dir}: model {key}={meta['hf_config'].get(key)} differs from this run's "
                                     f"{expect['hf_config'].get(key)}.")
    tp_rank, pp_rank, _ = _ranks()
    path = model_dir / shard_name(tp_rank, pp_rank) / "model.safetensors"
    if not path.is_file():
        raise CheckpointMismatch(f"{path} is missing: the checkpoint is incomplete.")
    state = load_file(str(path))
    _check_shapes(chunks, state, path)
    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            prefix = f"chunk{v}." if len(chunks) > 1 else ""
            own = {k[len(prefix):]: t for k, t in state.items() if k.startswith(prefix)}
            chunk.load_state_dict(own, strict=False)


def _rng_state() -> dict[str, Any]:
    from dapo_mcore.model import cpu_compat

    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    elif cpu_compat.is_active():
        state["fake_cuda"] = cpu_compat.fake_cuda_rng_state()
    from megatron.core import tensor_parallel

    state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "fake_cuda" in state and not torch.cuda.is_available():
        torch.cuda.set_rng_state(state["fake_cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(root: Path, step: int, actor, trainer_state: dict[str, Any], keep_last: int) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory."""
    root = Path(root)
    final = root / f"step_{step:06d}"
    partial = root / f"step_{step:06d}.partial"
    if _rank() == 0:
        if partial.exists():
            shutil.rmtree(partial)
        (partial / "model").mkdir(parents=True)
        (partial / "optim").mkdir()
        (partial / "rng").mkdir()
    _barrier()
    tp_rank, pp_rank, dp_rank = _ranks()
    if actor.s.distributed_optimizer:
        # Gathers over DP to DP rank 0, which writes: every DP rank must take part.
        actor.optimizer.save_parameter_state(str(partial / "optim" / f"{shard_name(tp_rank, pp_rank)}_dist.pt"))
    if dp_rank == 0:
        save_file(model_state_for_save(actor.chunks), str(_mkdir(partial / "model" / shard_name(tp_rank, pp_rank)) / "model.safetensors"))
        torch.save(actor.optimizer.state_dict(), partial / "optim" / f"{shard_name(tp_rank, pp_rank)}.pt")
    torch.save(_rng_state(), partial / "rng" / f"rank_{_rank():05d}.pt")
    if _rank() == 0:
        (partial / "model" / "dapo_mcore_checkpoint.json").write_text(json.dumps(actor.layout_metadata(), indent=1))
        (partial / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1, default=_json_default))
    _barrier()
    if _rank() == 0:
        (partial / "COMPLETE").write_text(str(step))
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        tmp = root / "latest.tmp"
        tmp.write_text(final.name)
        tmp.replace(root / "latest")
        _prune(root, keep_last)
        log.info("checkpoint saved: %s", final)
    _barrier()
    return final


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"trainer state value of type {type(value).__name__} is not JSON-serializable")


def _complete_steps(root: Path) -> list[Path]:
    found = []
    for child in root.iterdir() if root.is_dir() else []:
        m = _STEP_RE.match(child.name)
        if m and child.is_dir():
            if (child / "COMPLETE").is_file() and (child / "trainer_state.json").is_file():
                found.append(child)
            else:
                log.warning("skipping incomplete checkpoint %s", child)
    return sorted(found, key=lambda p: int(_STEP_RE.match(p.name).group(1)))


def _prune(root: Path, keep_last: int) -> None:
    for old in _complete_steps(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=False)
    for stale in root.glob("step_*.partial"):
        shutil.rmtree(stale)


def find_latest(root: Path) -> Path | None:
    """The checkpoint to resume from: ``latest`` if complete and readable, else the newest complete one."""
    root = Path(root)
    marker = root / "latest"
    candidates = _complete_steps(root)
    if marker.is_file():
        named = root / marker.read_text().strip()
        if named in candidates and _readable(named):
            return named
        log.warning("latest checkpoint marker points at %s, which is missing or corrupt; using an older one", named)
    for ckpt in reversed(candidates):
        if _readable(ckpt):
            return ckpt
        log.warning("skipping corrupt checkpoint %s", ckpt)
    return None


def _readable(ckpt: Path) -> bool:
    try:
        json.loads((ckpt / "trainer_state.json").read_text())
        json.loads((ckpt / "model" / "dapo_mcore_checkpoint.json").read_text())
    except (OSError, ValueError):
        return False
    return True


def load_checkpoint(ckpt: Path, actor) -> dict[str, Any]:
    """Collective. Restores model, optimizer and RNG states; returns the trainer state dict."""
    ckpt = Path(ckpt)
    load_model_shard(actor.chunks, ckpt / "model", actor.layout_metadata())
    tp_rank, pp_rank, _ = _ranks()
    opt_state = torch.load(ckpt / "optim" / f"{shard_name(tp_rank, pp_rank)}.pt", weights_only=False)
    actor.optimizer.load_state_dict(opt_state)
    if actor.s.distributed_optimizer:
        actor.optimizer.load_parameter_state(str(ckpt / "optim" / f"{shard_name(tp_rank, pp_rank)}_dist.pt"))
    rng_path = ckpt / "rng" / f"rank_{_rank():05d}.pt"
    if rng_path.is_file():
        _set_rng_state(torch.load(rng_path, weights_only=False))
    else:
        log.warning("no RNG state for rank %d in %s (different world size?); RNG continues unseeded from it", _rank(), ckpt)
    _barrier()
    return json.loads((ckpt / "trainer_state.json").read_text())

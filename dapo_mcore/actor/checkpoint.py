"""Checkpoints of the full training state: atomic, keep-last-N, and safe to resume after a kill -9.

Layout of one checkpoint (``<run>/checkpoints/step_000010/``):
  model/mp_rank_TT_PPP/model.safetensors   this (tp, pp) rank's GPTModel chunk(s), Megatron names
  model/dapo_mcore_checkpoint.json          layout metadata (weights.checkpoint format: HF config, TP/PP/VPP, vocab padding)
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

from dapo_mcore.weights.live import load_megatron_checkpoint_into_model, save_megatron_checkpoint

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d{6,})$")


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
        (partial / "optim").mkdir(parents=True)
        (partial / "rng").mkdir()
    _barrier()
    tp_rank, pp_rank, dp_rank = _ranks()
    if actor.s.distributed_optimizer:
        # Gathers over DP to DP rank 0, which writes: every DP rank must take part.
        actor.optimizer.save_parameter_state(str(partial / "optim" / f"{shard_name(tp_rank, pp_rank)}_dist.pt"))
    save_megatron_checkpoint(actor.chunks, partial / "model", actor.s.hf_config,
                             make_vocab_size_divisible_by=actor.s.make_vocab_size_divisible_by)
    if dp_rank == 0:
        torch.save(actor.optimizer.state_dict(), partial / "optim" / f"{shard_name(tp_rank, pp_rank)}.pt")
    torch.save(_rng_state(), partial / "rng" / f"rank_{_rank():05d}.pt")
    if _rank() == 0:
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
        # A marker torn by a crash may hold any bytes: undecodable ones must not stop the fallback below.
        named = root / marker.read_bytes().decode("utf-8", errors="replace").strip()
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


def check_same_model(ckpt: Path, actor) -> None:
    """Raise CheckpointError naming every architecture field where the checkpoint's model differs from the actor's.

    Tensor shapes alone miss some differences (a vocabulary of 37 or 45 pads to the same 48 rows; rope_theta or
    rms_norm_eps have no shape), so the HF configs are compared field by field before anything is loaded.
    """
    import dataclasses

    from dapo_mcore.model.qwen import QwenShape
    from dapo_mcore.weights.checkpoint import CheckpointError, read_meta

    saved = QwenShape.from_hf(read_meta(Path(ckpt) / "model").hf_config)
    diffs = [f"{f.name}: checkpoint {getattr(saved, f.name)!r}, live model {getattr(actor.shape, f.name)!r}"
             for f in dataclasses.fields(saved) if getattr(saved, f.name) != getattr(actor.shape, f.name)]
    if diffs:
        raise CheckpointError(f"checkpoint {ckpt} holds a different model than the one being trained: "
                              f"{'; '.join(diffs)}. Resume with the model config it was saved with, or start a new run.")


def load_checkpoint(ckpt: Path, actor) -> dict[str, Any]:
    """Collective. Restores model, optimizer and RNG states; returns the trainer state dict.

    Every check (model architecture, parallel layout, tensor shapes) runs before any parameter changes.
    """
    ckpt = Path(ckpt)
    check_same_model(ckpt, actor)
    load_megatron_checkpoint_into_model(actor.chunks, ckpt / "model")
    tp_rank, pp_rank, _ = _ranks()
    # On the CPU first: the optimizer moves its state to each parameter's device when it loads it.
    opt_state = torch.load(ckpt / "optim" / f"{shard_name(tp_rank, pp_rank)}.pt", weights_only=False,
                           map_location="cpu")
    actor.optimizer.load_state_dict(opt_state)
    if actor.s.distributed_optimizer:
        actor.optimizer.load_parameter_state(str(ckpt / "optim" / f"{shard_name(tp_rank, pp_rank)}_dist.pt"))
    rng_path = ckpt / "rng" / f"rank_{_rank():05d}.pt"
    if rng_path.is_file():
        _set_rng_state(torch.load(rng_path, weights_only=False, map_location="cpu"))
    else:
        log.warning("no RNG state for rank %d in %s (different world size?); RNG continues unseeded from it", _rank(), ckpt)
    _barrier()
    return json.loads((ckpt / "trainer_state.json").read_text())

"""Checkpoints of the full training state: atomic, verified, keep-last-N, resumable at any layout after a kill -9.

Layout of one checkpoint (``<run>/checkpoints/step_000010/``):
  model/mp_rank_TT_PPP/model.safetensors   this (tp, pp) rank's GPTModel chunk(s), Megatron names
  model/dapo_mcore_checkpoint.json          layout metadata (weights.checkpoint format: HF config, TP/PP/VPP, vocab padding)
  optim/exp_avg/ optim/exp_avg_sq/ ...      Adam's state in the same canonical format (actor.optim_state)
  optim/mp_rank_TT_PPP[_dist].pt            instead, with the distributed optimizer (GPU): Megatron's own format
  trainer_state.json                        step, data cursor, cost ledger, anything the trainer adds
  rng/rank_NNNNN.pt                         every rank's RNG states
  manifest.json                             size + CRC-32 of every file above, the world size
  COMPLETE                                  written last, after every rank has finished

A checkpoint is written into ``step_000010.partial`` and renamed after all ranks finish; then ``latest`` is
replaced atomically. Resume takes ``latest`` if it is complete and its files match the manifest, else the newest
one that does, logging one line per checkpoint it skips (naming the bad file); if checkpoints exist but none is
intact, it stops with a CheckpointError rather than start over. "Intact" includes finite values: a checkpoint
whose tensors hold NaN/inf (a manifest cannot tell) is skipped like a bad CRC, and none is ever written
(``check_finite_state`` refuses to save one). ``*.partial`` directories left by a killed save
are removed when a run starts (`remove_partials`) and at the next save. Old checkpoints beyond ``keep_last`` are
deleted only after a newer one is complete.

Elastic resume: the model and Adam's state are canonical checkpoints, so they load at any valid TP/PP/VPP/DP
layout (``weights.reshard``, exact). RNG states are per rank: at another world size or layout every rank takes
rank 0's torch RNG state and keeps Megatron's freshly seeded model-parallel tracker (the trainer's sampling seeds
are explicit per step, so its trajectory does not depend on them). The model directory is the same format as
``dapo-mcore convert hf-to-mcore`` writes, so ``convert mcore-to-hf`` works on any trainer checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.actor import optim_state
from dapo_mcore.weights import checkpoint as wckpt
from dapo_mcore.weights.checkpoint import CheckpointError
from dapo_mcore.weights.live import load_megatron_checkpoint_into_model, save_megatron_checkpoint

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d{6,})$")
_UNLISTED = (wckpt.MANIFEST_FILE, "COMPLETE")
"""The files of a checkpoint its manifest does not list: the manifest, and the marker written after it."""


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


def save_checkpoint(root: Path, step: int, actor, trainer_state: dict[str, Any], keep_last: int,
                    extra_files: dict[str, bytes] | None = None) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory. ``extra_files``: name -> bytes that
    rank 0 writes into it too (covered by its manifest, like every other file)."""
    root = Path(root)
    final = root / f"step_{step:06d}"
    partial = root / f"step_{step:06d}.partial"
    check_finite_state(actor, step)
    if _rank() == 0:
        if partial.exists():
            shutil.rmtree(partial)
        (partial / "optim").mkdir(parents=True)
        (partial / "rng").mkdir()
    _barrier()
    with wckpt.record_digests() as written:
        tp_rank, pp_rank, dp_rank = _ranks()
        if actor.s.distributed_optimizer:
            # Gathers over DP to DP rank 0, which writes: every DP rank must take part.
            actor.optimizer.save_parameter_state(str(partial / "optim" / f"{shard_name(tp_rank, pp_rank)}_dist.pt"))
        save_megatron_checkpoint(actor.chunks, partial / "model", actor.s.hf_config,
                                 make_vocab_size_divisible_by=actor.s.make_vocab_size_divisible_by,
                                 vocab_padding=actor.s.vocab_padding)
        if actor.lora is not None:  # the adapters and their optimizer state (the base has none)
            from dapo_mcore.actor import lora_state

            lora_state.save_lora(actor, partial, lora_state.optimizer_step(actor))
        elif actor.s.distributed_optimizer:
            if dp_rank == 0:
                wckpt.torch_save(actor.optimizer.state_dict(), partial / "optim" / f"{shard_name(tp_rank, pp_rank)}.pt")
        else:
            optim_state.save_optimizer(actor, partial / "optim", write=dp_rank == 0, write_meta=_rank() == 0)
        wckpt.torch_save(_rng_state(), partial / "rng" / f"rank_{_rank():05d}.pt")
        if _rank() == 0:
            state = json.dumps(trainer_state, indent=1, default=_json_default)
            wckpt.write_bytes(partial / "trainer_state.json", state.encode())
            for name, data in (extra_files or {}).items():
                wckpt.write_bytes(partial / name, data)
    _barrier()
    _write_manifest(partial, written.under(partial))
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
    from dapo_mcore.signals import faults

    faults.point("saved", step)
    return final


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _share(names: list[str]) -> list[str]:
    """This rank's share of a file list: checksums of a checkpoint are computed and checked by all ranks."""
    return names[_rank()::_world()]


def _gather(obj: Any) -> list[Any]:
    if _world() == 1:
        return [obj]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def _write_manifest(partial: Path, mine: dict[str, dict[str, Any]]) -> None:
    """Collective, after every file is written: rank 0 writes manifest.json from the digests each rank computed as
    it wrote its files (`mine`, no second read). A file no rank recorded (Megatron's distributed-optimizer files,
    written by Megatron) is checksummed after the fact, the ranks sharing that work."""
    recorded = {k: v for part in _gather(mine) for k, v in part.items()}
    box: list[Any] = [[n for n in wckpt.list_files(partial) if n not in recorded] if _rank() == 0 else None]
    if _world() > 1:
        dist.broadcast_object_list(box, src=0)
    late = {name: wckpt.file_digest(partial / name) for name in _share(box[0])}
    digests = {**recorded, **{k: v for part in _gather(late) for k, v in part.items()}}
    if _rank() == 0:
        wckpt.write_manifest(partial, digests, world_size=_world())


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


def remove_partials(root: Path) -> list[Path]:
    """Delete what interrupted saves left in `root` (``step_*.partial``, ``latest.tmp``); rank 0 calls it at start."""
    root = Path(root)
    removed = sorted(root.glob("step_*.partial")) + sorted(root.glob("latest.tmp"))
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
        log.info("removed %s, left by an interrupted checkpoint save", path)
    return removed


def latest_complete(root: Path) -> Path | None:
    """The checkpoint a resume would try first (``latest`` if complete, else the newest complete one), without
    reading its files: for a message when the process group is gone and ``find_latest`` cannot run."""
    root = Path(root)
    candidates = _complete_steps(root)
    marker = root / "latest"
    if marker.is_file():
        named = root / marker.read_bytes().decode("utf-8", errors="replace").strip()
        if named in candidates:
            return named
    return candidates[-1] if candidates else None


def find_latest(root: Path, *, contents: bool = True, skip: tuple[Path, ...] = ()) -> Path | None:
    """The checkpoint to resume from: ``latest`` if intact, else the newest intact one; None if there is none.

    Collective when a process group exists (the ranks share the checksum work and agree on the result). Without
    `contents`, "intact" is judged without reading the files (metadata, manifest, sizes): `load_checkpoint` checks
    the bytes each rank reads as it reads them, and a resume that finds damage there asks again, with `skip`.
    Raises CheckpointError naming each bad file if checkpoints exist but none is intact.
    """
    root = Path(root)
    marker = root / "latest"
    candidates = [c for c in reversed(_complete_steps(root)) if c not in skip]
    if marker.is_file():
        # A marker torn by a crash may hold any bytes: undecodable ones must not stop the fallback below.
        named = root / marker.read_bytes().decode("utf-8", errors="replace").strip()
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
        elif _rank() == 0:
            log.warning("the latest marker names %r, which is not a complete checkpoint; using an older one",
                        named.name)
    bad = []
    for i, ckpt in enumerate(candidates):
        problems = check_intact(ckpt, contents=contents)
        if not problems:
            return ckpt
        bad.append(f"{ckpt.name}: {problems[0]}")
        if _rank() == 0:
            nxt = candidates[i + 1].name if i + 1 < len(candidates) else "none left"
            log.warning("checkpoint %s is corrupt, skipping it (%s); next: %s", ckpt, problems[0], nxt)
    if bad:
        raise CheckpointError(f"no intact checkpoint in {root} ({'; '.join(bad)}). Restore the files, or move "
                              "the checkpoints away (or use a new run.dir) to start over.")
    return None


def check_intact(ckpt: Path, *, contents: bool = True) -> list[str]:
    """Problems of one checkpoint directory (unreadable metadata, files that differ from its manifest); [] if none.

    Collective when a process group exists: each rank checks a share of the files and all ranks get every problem.
    Without `contents`: no file is read (sizes, names, metadata only; `load_checkpoint` checks the bytes).
    """
    ckpt = Path(ckpt)
    problems: list[str] = []
    for name in ("trainer_state.json", "model/" + wckpt.METADATA_FILE):
        try:
            json.loads((ckpt / name).read_text())
        except (OSError, ValueError) as err:
            problems.append(f"{ckpt / name}: unreadable ({type(err).__name__})")
    try:
        manifest = wckpt.read_manifest(ckpt)
    except CheckpointError as err:
        manifest, problems = None, problems + [str(err)]
    if manifest is None and not problems:
        if _rank() == 0:
            log.warning("checkpoint %s has no %s (saved by an older dapo-mcore): its files are not verified",
                        ckpt, wckpt.MANIFEST_FILE)
        return []
    if manifest is not None:
        files = manifest["files"]
        mine = _share(sorted(files))
        if _rank() == 0:  # a flipped bit in a name leaves a file the manifest does not cover
            problems += [f"{ckpt / n}: not in the manifest" for n in wckpt.list_files(ckpt, exclude=_UNLISTED)
                         if n not in files]
        problems += wckpt.verify_files(ckpt, files, mine, contents=contents)
        if contents and not problems:  # bytes as saved: now the values (a NaN checkpoint has a valid manifest)
            problems += _nonfinite_files(ckpt, [n for n in mine if n.endswith(".safetensors")])
    return sorted({p for part in _gather(problems) for p in part})


def _nonfinite_files(ckpt: Path, names: list[str]) -> list[str]:
    problems = []
    for name in names:
        bad = wckpt.nonfinite_tensors(ckpt / name)
        if bad:
            problems.append(wckpt.describe_nonfinite(ckpt / name, bad))
    return problems


def check_finite_state(actor, step: int) -> None:
    """Collective, before a save: refuse to checkpoint weights or Adam state holding NaN/inf (on any rank)."""
    from dapo_mcore.actor.nonfinite import nonfinite_tensors
    from dapo_mcore.errors import NonFiniteError

    named = [(f"chunk{i}.{n}", p) for i, c in enumerate(actor.chunks) for n, p in c.named_parameters()]
    bad = nonfinite_tensors(named) + nonfinite_tensors(_optimizer_tensors(actor.optimizer))
    everywhere = [name for part in _gather(bad) for name in part]
    if everywhere:
        shown = ", ".join(everywhere[:3]) + (f" and {len(everywhere) - 3} more" if len(everywhere) > 3 else "")
        raise NonFiniteError(f"not saving the checkpoint of step {step}: {shown} hold NaN or inf values; the "
                             "run's earlier checkpoints are kept and it resumes from the latest of them. Lower "
                             "optim.lr or turn on optim.grad_clip")


def _optimizer_tensors(optimizer) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the optimizer's fp32 main parameters and Adam state (every inner torch optimizer)."""
    out = []
    for i, part in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = getattr(part, "optimizer", None)
        if inner is None:
            continue
        for g, group in enumerate(inner.param_groups):
            for j, param in enumerate(group["params"]):
                out.append((f"optimizer{i}.group{g}.param{j}", param))
                for key, value in inner.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor) and value.numel() > 1:
                        out.append((f"optimizer{i}.group{g}.param{j}.{key}", value))
    return out


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


def load_checkpoint(ckpt: Path, actor, *, weights_only: bool = False) -> dict[str, Any]:
    """Collective. Restores model, optimizer and RNG states (at any layout); returns the trainer state dict.

    `weights_only`: the model only; the optimizer starts fresh (for state that cannot be resharded). Every check
    (model architecture, tensor shapes, optimizer state) runs before any parameter changes.
    """
    ckpt = Path(ckpt)
    check_same_model(ckpt, actor)
    saved = wckpt.read_meta(ckpt / "model").layout
    manifest = wckpt.read_manifest(ckpt)
    world = manifest.get("world_size") if manifest else None  # absent from older manifests
    world = world or len(list((ckpt / "rng").glob("rank_*.pt")))
    live = (actor.s.tensor_parallel, actor.s.pipeline_parallel, len(actor.chunks))
    same_layout = (saved.tp, saved.pp, saved.vpp) == live and world == _world()
    optim_dir = ckpt / "optim"
    saved_dist = any(optim_dir.glob("*_dist.pt"))
    if actor.lora is not None:
        return _load_lora_checkpoint(ckpt, actor, manifest, weights_only, same_layout)
    if not weights_only and not optim_state.has_canonical_state(optim_dir) and not same_layout:
        raise CheckpointError(
            f"checkpoint {ckpt} was saved at tp={saved.tp} pp={saved.pp} vpp={saved.vpp} on {world} ranks with "
            f"{'the distributed optimizer' if saved_dist else 'an older dapo-mcore'}, whose "
            f"optimizer state cannot be resharded to tp={live[0]} pp={live[1]} vpp={live[2]} on {_world()} ranks. "
            "Resume at the saved layout, or set run.resume_weights_only=true to resume the weights with a fresh "
            "optimizer.")
    if not weights_only and saved_dist != actor.s.distributed_optimizer:
        raise CheckpointError(f"checkpoint {ckpt}: its optimizer state was saved with parallel.distributed_optimizer="
                              f"{str(saved_dist).lower()}; resume with that setting, or set "
                              "run.resume_weights_only=true to start the optimizer fresh.")
    apply_optimizer = _read_checked(ckpt, manifest, actor, weights_only)
    if weights_only:
        log.info("run.resume_weights_only=true: the optimizer starts fresh")
        actor.refresh_main_params()  # the fresh optimizer's fp32 main copies must take the loaded weights
    elif apply_optimizer is not None:
        apply_optimizer()
    else:
        _load_megatron_optimizer(optim_dir, actor)
    _restore_rng(ckpt, same_layout)
    if _rank() == 0 and not same_layout:
        log.info("resumed %s (saved at tp=%d pp=%d vpp=%d on %d ranks) at tp=%d pp=%d vpp=%d on %d ranks",
                 ckpt.name, saved.tp, saved.pp, saved.vpp, world, *live, _world())
    _barrier()
    return json.loads((ckpt / "trainer_state.json").read_text())


def _read_checked(ckpt: Path, manifest: dict[str, Any] | None, actor, weights_only: bool,
                  also: tuple[str, ...] = ()):
    """Read the optimizer state (first: a failure must leave the model untouched) and load the model, checking each
    file this rank reads against the manifest as it is read (and the files `also` names, relative to `ckpt`: what a
    caller reads after); the ranks then agree: if any found damage, all raise DamagedFileError naming it (a resume
    then falls back to an older checkpoint). Returns the optimizer's setter."""
    optim_dir = ckpt / "optim"
    scope = wckpt.checking_reads(ckpt, manifest["files"]) if manifest else contextlib.nullcontext()
    damage, apply_optimizer = [], None
    with scope as check:
        try:
            tp_rank, pp_rank, _ = _ranks()
            for small in ("trainer_state.json", f"model/{wckpt.METADATA_FILE}", f"optim/{optim_state.STEP_FILE}",
                          f"rng/rank_{_rank():05d}.pt", "rng/rank_00000.pt",  # the one _restore_rng reads
                          f"optim/{shard_name(tp_rank, pp_rank)}.pt", f"optim/{shard_name(tp_rank, pp_rank)}_dist.pt",
                          *also):
                if check is not None and (ckpt / small).is_file():
                    check.verify(ckpt / small)
            if not weights_only and optim_state.has_canonical_state(optim_dir):
                apply_optimizer = optim_state.read_optimizer(actor, optim_dir)
            load_megatron_checkpoint_into_model(actor.chunks, ckpt / "model", reshard=True,
                                                make_vocab_size_divisible_by=actor.s.make_vocab_size_divisible_by,
                                                vocab_padding=actor.s.vocab_padding)
            if check is not None:
                check.finish()
        except wckpt.DamagedFileError as err:
            damage.append(str(err))
    everywhere = sorted({p for part in _gather(damage) for p in part})
    if everywhere:
        raise wckpt.DamagedFileError(f"checkpoint {ckpt} is corrupt: {'; '.join(everywhere)}")
    return apply_optimizer


def _load_lora_checkpoint(ckpt: Path, actor, manifest: dict[str, Any] | None, weights_only: bool,
                          same_layout: bool) -> dict[str, Any]:
    """A LoRA run's resume: the base identity and the adapters are checked first, then the base (its files checked
    against the manifest as they are read, the adapters' files too: damage falls back like any checkpoint's), the
    adapters and their optimizer state are set (any layout: everything is canonical)."""
    from dapo_mcore.actor import lora_state

    lora_state.check_lora(ckpt, actor)
    adapters = tuple(sorted(str(f.relative_to(ckpt)) for f in (ckpt / "lora").rglob("*") if f.is_file()))
    _read_checked(ckpt, manifest, actor, weights_only=True, also=adapters)
    lora_state.load_lora(ckpt, actor, weights_only=weights_only)
    _restore_rng(ckpt, same_layout)
    _barrier()
    return json.loads((ckpt / "trainer_state.json").read_text())


def _load_megatron_optimizer(optim_dir: Path, actor) -> None:
    """Megatron's own optimizer format (distributed optimizer, or checkpoints of older versions): same layout only."""
    tp_rank, pp_rank, _ = _ranks()
    # On the CPU first: the optimizer moves its state to each parameter's device when it loads it.
    opt_state = torch.load(optim_dir / f"{shard_name(tp_rank, pp_rank)}.pt", weights_only=False, map_location="cpu")
    actor.optimizer.load_state_dict(opt_state)
    if actor.s.distributed_optimizer:
        actor.optimizer.load_parameter_state(str(optim_dir / f"{shard_name(tp_rank, pp_rank)}_dist.pt"))


def _restore_rng(ckpt: Path, same_layout: bool) -> None:
    """Each rank's own RNG states at the saved layout; elsewhere rank 0's torch RNG state (see module docstring)."""
    if same_layout:
        _set_rng_state(torch.load(ckpt / "rng" / f"rank_{_rank():05d}.pt", weights_only=False, map_location="cpu"))
        return
    state = torch.load(ckpt / "rng" / "rank_00000.pt", weights_only=False, map_location="cpu")
    torch.set_rng_state(state["torch"])

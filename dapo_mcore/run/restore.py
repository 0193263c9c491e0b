"""Restoring a run: the checkpoint it starts from (the latest intact one, or ``--checkpoint``), the rollout side's
state after it, and the telemetry files cut back to that step."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from dapo_mcore.config import Config, ConfigError
from dapo_mcore.config.tree import to_dict
from dapo_mcore.run.components import Components

log = logging.getLogger(__name__)


def find_start_checkpoint(cfg: Config, *, resume: bool, checkpoint: str | None, is_main: bool) -> Path | None:
    """The checkpoint the run starts from: `checkpoint` (``--checkpoint``), else the run's latest intact one, or None
    (``--checkpoint base``, or no checkpoint yet). Collective (``find_latest`` shares its checksum work).

    Training (`resume`) first removes what interrupted saves left behind. Called before the actor is built: the
    model's vocabulary padding follows the checkpoint's (``adopt_checkpoint_padding``).
    """
    from dapo_mcore.actor import checkpoint as ckpt

    root = Path(cfg.run.dir) / "checkpoints"
    if checkpoint == "base":
        return None
    if resume and is_main:
        ckpt.remove_partials(root)
    if dist.is_initialized():
        dist.barrier()
    if checkpoint:
        target = check_checkpoint_arg(checkpoint)
        problems = ckpt.check_intact(target, contents=False)  # the bytes are checked as the load reads them
        if problems:
            raise ckpt.CheckpointError(f"--checkpoint {checkpoint} is corrupt: {'; '.join(problems)}. Choose "
                                       "another checkpoint of the run.")
        return target
    return ckpt.find_latest(root, contents=False)  # the bytes are checked as the load reads them (restore)


def adopt_checkpoint_padding(cfg: Config, target: Path | None, *, is_main: bool) -> Config:
    """`cfg` with model.vocab_padding set to the rule the checkpoint `target` was written with (metadata without the
    key: ``megatron``, the only rule of older versions), so a run continues exactly as it trained (the padded rows
    change the output layer's GEMM and softmax shapes) whatever its config says; logged once when it differs."""
    from dapo_mcore.weights import checkpoint as wckpt

    if target is None:
        return cfg
    saved = wckpt.read_meta(target / "model").layout.vocab_padding
    if saved == cfg.model.vocab_padding:
        return cfg
    if is_main:
        log.info("checkpoint %s pads the vocabulary by the %r rule: model.vocab_padding=%s is used instead of %s "
                 "(on resume the checkpoint's padding wins)", target.name, saved, saved, cfg.model.vocab_padding)
    return replace(cfg, model=replace(cfg.model, vocab_padding=saved))


def restore(parts: Components, target: Path | None, *, fall_back: bool = True) -> int:
    """Load `target` (``find_start_checkpoint``); the step to continue after (0 without a checkpoint).

    A run may resume at another layout (the checkpoint reshards); run.resume_weights_only=true starts the optimizer
    fresh. A checkpoint whose files turn out damaged as they are read is skipped for the next older intact one
    (`fall_back`: the run's own latest; not a ``--checkpoint`` the user named).
    """

    if target is None:
        return 0
    state, target = _load_or_fall_back(parts, target, fall_back)
    from dapo_mcore.rollout.scheduling.partial import join_partials

    join_partials(state, target)  # the partial groups from their binary file (older checkpoints: inline)
    if parts.scheduler is not None:  # built exactly when there is a sampler (training data)
        parts.scheduler.load_checkpoint_state(state)
        buffered = parts.scheduler.partials
        if (buffered.items and parts.rollouts.colocated  # async: the engine ranks stream
                and not (parts.engine_streams and parts.cfg.rollout.schedule.partial)):
            log.warning("the checkpoint holds %d partial groups (%d tokens) for the next step, but this run does not "
                        "stream (rollout.schedule.streaming/partial off, or an engine that cannot stream here): they are dropped",
                        len(buffered.items), buffered.num_tokens())
            buffered.take()
    if not parts.rollouts.colocated:
        from dapo_mcore.rollout.pipeline.async_source import PENDING_FILE

        pending = target / PENDING_FILE
        parts.rollouts.resume_from(int(state["step"]), state, pending.read_bytes() if pending.is_file() else None)
    parts._resume_state = state
    log.info("loaded checkpoint %s (step %d)", target, state["step"])
    return int(state["step"])


def _load_or_fall_back(parts: Components, target: Path, fall_back: bool) -> tuple[dict, Path]:
    from dapo_mcore.actor import checkpoint as ckpt
    from dapo_mcore.weights import checkpoint as wckpt

    skipped: list[Path] = []
    while True:
        try:
            return ckpt.load_checkpoint(target, parts.actor, weights_only=parts.cfg.run.resume_weights_only), target
        except wckpt.DamagedFileError as err:
            if not fall_back:
                raise
            skipped.append(target)
            nxt = ckpt.find_latest(target.parent, contents=False, skip=tuple(skipped))
            if parts.is_main:
                log.warning("%s; skipping it, next: %s", err, nxt.name if nxt is not None else "none left")
            if nxt is None:
                raise ckpt.CheckpointError(f"no intact checkpoint in {target.parent} ({err}). Restore the files, "
                                           "or move the checkpoints away (or use a new run.dir) to start over.") from err
            if wckpt.read_meta(nxt / "model").layout.vocab_padding != parts.cfg.model.vocab_padding:
                raise ckpt.CheckpointError(f"{err}; the next checkpoint, {nxt}, pads the vocabulary by another rule: "
                                           f"resume with --checkpoint {nxt}.") from err
            target = nxt


def check_checkpoint_arg(checkpoint: str) -> Path:
    """``--checkpoint DIR`` must be a complete trainer checkpoint (checked before anything starts)."""
    target = Path(checkpoint)
    if not (target / "COMPLETE").is_file():
        raise ConfigError(f"--checkpoint {checkpoint} is not a complete dapo-mcore checkpoint directory "
                          "(RUN_DIR/checkpoints/step_NNNNNN, or 'base' for the base model).")
    return target


def open_telemetry(parts: Components, start: int) -> None:
    from dapo_mcore.telemetry.ledger import CostLedger
    from dapo_mcore.telemetry.metrics import METRICS_FILE, MetricsWriter
    from dapo_mcore.telemetry.rollout_store import ROLLOUTS_DIR, RolloutStore

    run_dir = Path(parts.cfg.run.dir)
    resume_step = start + 1 if start else 0
    sinks = []
    if parts.is_main and parts.cfg.telemetry.wandb.project is not None:
        from dapo_mcore.telemetry.wandb_sink import WandbSink

        sinks.append(WandbSink(run_dir, parts.cfg.telemetry.wandb, to_dict(parts.cfg)))
    parts.writer = MetricsWriter(run_dir, enabled=parts.is_main, resume_step=resume_step, sinks=sinks)
    for sink in sinks:  # the jsonl is cut back to the resume step now: W&B gets the rows a kill -9 took from it
        sink.backfill(run_dir / METRICS_FILE)
    parts.ledger = CostLedger(run_dir, enabled=parts.is_main)
    state = getattr(parts, "_resume_state", None)
    # A fresh start restores an empty ledger: lines left by a run that died before its first checkpoint go.
    parts.ledger.load_state_dict(state["ledger"] if state is not None and "ledger" in state
                                 else CostLedger(None, enabled=False).state_dict())
    # A store left by the interrupted run is cut back too, even when this run stores no rollouts.
    if parts.is_main and (parts.cfg.run.rollout_store or (run_dir / ROLLOUTS_DIR).exists()):
        store = RolloutStore(run_dir / ROLLOUTS_DIR, resume_step=resume_step)
        parts.store = store if parts.cfg.run.rollout_store else None
    if parts.is_main:
        from dapo_mcore.weights.hf_checkpoint import keep_model_files

        keep_model_files(run_dir / "tokenizer", *parts.model_files, parts.tokenizer)
    parts._closers.append(parts.writer.close)
    parts._closers.append(parts.ledger.close)

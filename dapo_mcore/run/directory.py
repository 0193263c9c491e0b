"""The run directory: whether it holds this run or another (identity), its lock, run.overwrite, and writability.

Checked before anything is written: ``prepare_run_dir`` refuses another run (rank 0) and an unwritable directory;
``claim_run_dir`` (collective) takes the lock and then applies run.overwrite.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from dapo_mcore.config import Config, ConfigError
from dapo_mcore.config.tree import to_dict

if TYPE_CHECKING:  # torch stays unimported on the config side (config_cli reads the run directory's identity)
    from dapo_mcore.actor.parallel import LaunchEnv

log = logging.getLogger(__name__)

# Config sections that define what a run *is*; a run directory holding a different one is another run.
_IDENTITY_SECTIONS = ("model", "algo", "data", "rollout", "train", "optim", "tiny_base")
# ...except these keys (and everything under them): how a run is laid out or how long it runs, not what it learns.
# The parallel section is not identity at all: checkpoints reshard to any layout (actor.checkpoint).
_NOT_IDENTITY = ("train.steps", "train.micro_batch_tokens", "model.layer_spec", "model.make_vocab_size_divisible_by",
                 "model.vocab_padding", "model.recompute", "rollout.vllm", "optim.skip_nonfinite_updates", "rollout.pipeline.engine_ranks",
                 "rollout.pipeline.bucket_mb",
                 # how many rounds a step may take before it gives up: raising it continues the same trajectory
                 # (the fix dynamic sampling's exhaustion names)
                 "algo.max_gen_batches",
                 # a name only: the switches it sets are recorded beside it, and those are compared
                 "rollout.schedule.preset", "algo.preset")

# What a run writes at the top of its directory: run.overwrite deletes these and nothing else.
RUN_ENTRIES = ("config.yaml", "config.yaml.tmp", "metrics.jsonl", "ledger.jsonl", "tensorboard", "rollouts.zarr",
               "checkpoints", "tokenizer", "figures", "profile", "wandb", "wandb_run_id")


def prepare_run_dir(cfg: Config, launch: LaunchEnv) -> None:
    """Refuse a run directory that holds another run (unless told to overwrite). Writes and deletes nothing: the
    run lock comes first (``claim_run_dir``, in ``build_components``), then run.overwrite's deletion, and
    ``write_resolved`` runs once every input has been checked."""
    run_dir = Path(cfg.run.dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir={str(run_dir)!r} exists and is not a directory; choose another run.dir.")
    check_writable(run_dir, "run.dir")
    if launch.rank == 0:
        refuse_non_run_overwrite(cfg)
        refuse_other_run(cfg)


def refuse_non_run_overwrite(cfg: Config) -> None:
    """run.overwrite=true on a directory that holds files but no run (a checkout, HOME, a data dir) is refused:
    an unset variable in a launch script must not empty it."""
    from dapo_mcore.run.lock import LOCK_NAME

    run_dir = Path(cfg.run.dir)
    if not cfg.run.overwrite or not run_dir.is_dir():
        return
    names = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_NAME)
    if names and not any(name in RUN_ENTRIES for name in names):
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise ConfigError(f"run.overwrite=true: run.dir={str(run_dir)!r} holds no run ({shown}; no config.yaml, "
                          "metrics or checkpoints), so nothing is deleted; choose a new run.dir for this run.")


def refuse_other_run(cfg: Config) -> None:
    """Raise ConfigError if run.dir holds another run, or this run with run.resume=never (unless run.overwrite)."""
    run_dir = Path(cfg.run.dir)
    existing = run_dir / "config.yaml"
    if cfg.run.overwrite or not existing.is_file():
        return
    stored = yaml.safe_load(existing.read_text()) or {}
    changed = identity_diff(stored, to_dict(cfg), defaults=to_dict(Config()))
    if changed:
        shown = "; ".join(changed[:8]) + (f"; and {len(changed) - 8} more" if len(changed) > 8 else "")
        raise ConfigError(f"run directory {run_dir} holds another run ({shown}). Use a new run.dir, "
                          "or run.overwrite=true to delete it.")
    if cfg.run.resume == "never":
        raise ConfigError(f"run directory {run_dir} already holds this run and run.resume=never; use "
                          "run.resume=auto to continue it or run.overwrite=true to start over.")
    _warn_wandb_change(stored, cfg)


def _warn_wandb_change(stored: dict[str, Any], cfg: Config) -> None:
    """W&B is not part of a run's identity, but a resume that drops or moves it should say so once."""
    telemetry = stored.get("telemetry") if isinstance(stored.get("telemetry"), dict) else {}
    was = (telemetry.get("wandb") if isinstance(telemetry.get("wandb"), dict) else {}).get("project")
    now = cfg.telemetry.wandb.project
    if was is None or was == now:
        return
    if now is None:
        log.warning("this run logged to W&B project %r and telemetry.wandb.project is unset now: the steps from here "
                    "go to metrics.jsonl and TensorBoard only; set telemetry.wandb.project=%s to keep logging them "
                    "there", was, was)
    else:
        log.warning("this run logged to W&B project %r and telemetry.wandb.project=%s now: the steps from here go to "
                    "a run of that other project; set telemetry.wandb.project=%s to keep one W&B run", was, now, was)


def claim_run_dir(cfg: Config, launch: LaunchEnv) -> Any:
    """Collective: lock the run directory for this run (rank 0 holds it; see ``dapo_mcore.run.lock``), then apply
    run.overwrite (delete everything in it but the lock). Returns the lock on rank 0, else None."""
    import torch.distributed as dist

    from dapo_mcore.run import lock as run_lock

    run_dir = Path(cfg.run.dir)
    lock = run_lock.claim(run_dir, launch.rank, enabled=cfg.run.lock)
    if launch.rank == 0 and cfg.run.overwrite:
        try:
            _empty_run_dir(run_dir)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
    if dist.is_initialized():
        dist.barrier()  # nobody reads the directory before the overwrite has emptied it
    return lock


def _empty_run_dir(run_dir: Path) -> None:
    from dapo_mcore.run.lock import LOCK_NAME

    present = [p for p in run_dir.iterdir() if p.name != LOCK_NAME] if run_dir.is_dir() else []
    entries = [p for p in present if p.name in RUN_ENTRIES]
    kept = sorted(p.name for p in present if p.name not in RUN_ENTRIES)
    if entries:
        log.warning("run.overwrite=true: deleting the run in %s (%s)", run_dir, ", ".join(p.name for p in entries))
    if kept:
        log.warning("run.overwrite=true: keeping %s in %s (not written by a run)", ", ".join(kept), run_dir)
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def check_writable(path: Path, key: str) -> None:
    """Raise ConfigError (before anything is written) if directory `path` cannot be created or written to.

    Checks the nearest existing ancestor when `path` does not exist yet (it is created with its parents later).
    """
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{key}={str(path)!r}: {probe} is a file, not a directory; choose another {key}.")
    if not os.access(probe, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if _read_only(probe) else "is not writable by this user"
        raise ConfigError(f"{key}={str(path)!r}: {probe} {why}; choose a writable {key} (or fix its permissions).")


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def identity_diff(old: dict[str, Any], new: dict[str, Any], defaults: dict[str, Any] | None = None) -> list[str]:
    """The keys that define a run and differ: ``"algo.clip_high: 0.28 -> 0.3"`` (run dir's value first).

    With ``defaults`` (the default config), a key the run directory's config does not have, because the setting was
    added after that run started, is no change while the new config leaves it at its default: new settings default
    to the behaviour from before they existed, so a run started by an older version resumes."""
    old, new = _one_correction_spelling(old, new)
    a, b = _flatten({k: old.get(k) for k in _IDENTITY_SECTIONS}), _flatten({k: new.get(k) for k in _IDENTITY_SECTIONS})
    if defaults is not None:
        d = _flatten({k: defaults.get(k) for k in _IDENTITY_SECTIONS})
        for k in [k for k in b if k not in a and k in d and d[k] == b[k]]:
            a[k] = b[k]
    keys = sorted(k for k in set(a) | set(b) if not any(k == x or k.startswith(x + ".") for x in _NOT_IDENTITY))

    def show(tree: dict[str, Any], key: str) -> str:
        return repr(tree[key]) if key in tree else "(unset)"

    return [f"{k}: {show(a, k)} -> {show(b, k)}" for k in keys if k not in a or k not in b or a[k] != b[k]]


def _one_correction_spelling(old: dict[str, Any], new: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both trees with ``algo.tis_cap`` and ``algo.rollout_correction`` replaced by the correction they apply
    (``algo.correction``): ``tis_cap=2``, ``preset=token_tis`` and its fields spelled out are one run. A run
    directory written before presets were resolved on load is read that older way when that is what matches."""
    from dapo_mcore.algo.rollout_correction_config import effective_settings

    def swap(tree: dict[str, Any], correction: dict[str, Any]) -> dict[str, Any]:
        algo = {k: v for k, v in (tree.get("algo") or {}).items() if k not in ("tis_cap", "rollout_correction")}
        return {**tree, "algo": {**algo, "correction": correction}}

    if not isinstance(old.get("algo", {}), dict) or not isinstance(new.get("algo", {}), dict):
        return old, new
    mine = effective_settings(new.get("algo") or {})
    theirs = effective_settings(old.get("algo") or {})
    if theirs != mine and effective_settings(old.get("algo") or {}, legacy=True) == mine:
        theirs = mine
    return swap(old, theirs), swap(new, mine)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, tuple):
        tree = list(tree)
    return {prefix.rstrip("."): tree}

"""Which checkpoint of a run directory counts, read without torch: ``eval --checkpoint`` resolved to a checkpoint
directory, and whether ``train`` finds its run already finished (then no rank needs to start)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from dapo_mcore.config import Config
from dapo_mcore.config.tree import ConfigError, to_dict

_STEP_DIR = re.compile(r"step_(\d+)")


def resolve_eval_checkpoint(checkpoint: str | None) -> str | None:
    """``eval --checkpoint``: ``base``, a checkpoint directory, or a run directory (its latest complete checkpoint).

    The run directory's ``checkpoints/latest`` marker is followed when it names a complete checkpoint, else the
    newest complete ``step_*`` is used (the trainer's resume rule, minus reading the tensors).
    """
    if checkpoint is None or checkpoint == "base":
        return checkpoint
    path = Path(checkpoint)
    if not path.is_dir():
        raise ConfigError(f"--checkpoint {checkpoint}: no such directory; give a run directory (its latest "
                          "checkpoint is used), a checkpoint directory (RUN/checkpoints/step_N) or 'base'.")
    if (path / "COMPLETE").is_file():
        return str(path)
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    complete = sorted((int(m.group(1)), p) for p in root.iterdir()
                      if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name)) and (p / "COMPLETE").is_file())
    marker = root / "latest"
    if marker.is_file():
        named = root / marker.read_bytes().decode("utf-8", errors="replace").strip()
        if (named / "COMPLETE").is_file():
            return str(named)
    if not complete:
        raise ConfigError(f"--checkpoint {checkpoint}: holds no complete checkpoint (looked for "
                          f"{root}/step_N/COMPLETE); train first, or pass --checkpoint base.")
    return str(complete[-1][1])



def finished_step(cfg) -> int | None:
    """The step of run.dir's latest complete checkpoint when it has done cfg.train.steps and holds this very config
    (config.yaml equal to it), else None: then the trainer decides (a resume, a changed config refused, ...).
    Read without torch, so ``train`` on a finished run answers in a second, not after building the model."""

    run_dir = Path(cfg.run.dir)
    if cfg.run.overwrite or cfg.run.resume != "auto" or not (run_dir / "config.yaml").is_file():
        return None
    def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(tree, dict):
            return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
        return {prefix.rstrip("."): tree}

    stored = flat(yaml.safe_load((run_dir / "config.yaml").read_text()))
    asked, default = (flat(yaml.safe_load(yaml.safe_dump(to_dict(c)))) for c in (cfg, Config()))
    for tree in (stored, asked):  # a run directory moved or copied elsewhere is the same run
        tree.pop("run.dir", None)
    # a setting newer than the run's config.yaml, left at its default, is the same run (run_dir.identity_diff's rule)
    stored.update({k: v for k, v in asked.items() if k not in stored and k in default and default[k] == v})
    if stored != asked:
        return None
    try:
        latest = Path(resolve_eval_checkpoint(str(run_dir)) or "")
    except ConfigError:  # no complete checkpoint: nothing is finished
        return None
    step = int(latest.name.removeprefix("step_")) if latest.name.startswith("step_") else -1
    return step if step >= cfg.train.steps else None

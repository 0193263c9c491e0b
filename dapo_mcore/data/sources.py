"""Resolve a :class:`DataConfig` source to prompt records: a synthetic task split or a prompt file."""

from __future__ import annotations

from typing import Literal

from dapo_mcore.data.config import TASK_PREFIX, DataConfig
from dapo_mcore.data.datasets import load_prompt_dataset
from dapo_mcore.data.records import PromptRecord
from dapo_mcore.data.tasks import task_records


def load_records(cfg: DataConfig, which: Literal["train", "eval"]) -> list[PromptRecord]:
    """The prompts of ``cfg.train`` or ``cfg.eval``; a task gives its train or held-out split."""
    spec = cfg.train if which == "train" else cfg.eval
    if not spec:
        return []
    if spec.startswith(TASK_PREFIX):
        split = "train" if which == "train" else "heldout"
        return task_records(spec[len(TASK_PREFIX):], split, cfg.task_split_seed, cfg.heldout_fraction)
    return load_prompt_dataset(spec, wrap_raw=cfg.wrap_raw_problems).records

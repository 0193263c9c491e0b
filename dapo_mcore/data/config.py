"""Configuration of the prompt data: where prompts come from and how they are shaped and drawn."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dapo_mcore.data.datasets import SUFFIXES
from dapo_mcore.data.prompts import TRUNCATION_MODES
from dapo_mcore.data.tasks import task_names

TASK_PREFIX = "task:"


@dataclass
class DataConfig:
    """Prompt sources, prompt length handling and the sampler's seed."""

    train: str = "task:max4"
    """Training prompts: a .parquet/.jsonl path (DAPO layout or {"prompt", "answer"}), or ``task:<name>``
    for a registered synthetic task (its training split)."""
    eval: str = "task:max4"
    """Held-out prompts, same forms as ``train``; a task gives its held-out split (disjoint from train).
    Empty string: no evaluation set."""
    task_split_seed: int = 0
    """Seed of the synthetic tasks' train/held-out permutation (the tiny base model must use the same)."""
    heldout_fraction: float = 0.2
    """Share of a synthetic task's problems that form its held-out split."""
    max_prompt_len: int = 64
    """Longest rendered prompt in tokens (DAPO: 2048)."""
    truncation: str = "drop"
    """Over-long prompts: "drop" (filtered out and counted, with the reason) or "left" (keep the last
    ``max_prompt_len`` tokens, as verl's DAPO recipe does)."""
    shuffle_seed: int = 0
    """Seed of the prompt sampler's per-epoch shuffles."""
    wrap_raw_problems: bool = True
    """Give raw problem strings (e.g. {"prompt": "...", "answer": "..."} jsonl) DAPO's math-prompt wording."""

    def validate(self, check_files: bool = True) -> None:
        """Raise ValueError naming the fix for the first bad field; ``check_files=False`` leaves out whether the
        dataset files exist here (a cluster config checked on a laptop)."""
        check_source("data.train", self.train, check_files)
        if self.eval:
            check_source("data.eval", self.eval, check_files)
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"data.heldout_fraction={self.heldout_fraction} must lie in (0, 1), e.g. 0.2")
        if self.max_prompt_len < 1:
            raise ValueError(f"data.max_prompt_len={self.max_prompt_len} must be >= 1 (DAPO uses 2048)")
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={self.truncation!r}; use one of {', '.join(TRUNCATION_MODES)}")


def check_source(field_name: str, spec: str, check_files: bool = True) -> None:
    """Validate a ``task:<name>`` or file-path source spec (``check_files``: also that the file exists here)."""
    if spec.startswith(TASK_PREFIX):
        name = spec[len(TASK_PREFIX):]
        if name not in task_names():
            raise ValueError(f"{field_name}={spec!r}: unknown task {name!r}; registered tasks: "
                             f"{', '.join(TASK_PREFIX + n for n in task_names())}")
        return
    path = Path(spec)
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{field_name}={spec!r}: expected task:<name> or a path ending in "
                         f"{' or '.join(SUFFIXES)}")
    if not check_files:
        return
    if path.is_dir():
        raise ValueError(f"{field_name}={spec!r} is a directory; give the .parquet/.jsonl file inside it (e.g. "
                         f"{field_name}={str(path / 'train.parquet')!r}) or task:<name>")
    if not path.is_file():
        raise ValueError(f"{field_name}={spec!r}: no such file; give an existing path or task:<name>")

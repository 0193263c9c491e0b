"""Resolve a :class:`DataConfig` to prompts: load a task split or a file, filter by length, encode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from transformers import PreTrainedTokenizerBase

from dapo_mcore.data.config import TASK_PREFIX, DataConfig
from dapo_mcore.data.datasets import load_prompt_dataset
from dapo_mcore.data.prompts import encode_prompts, render_prompt_ids
from dapo_mcore.data.records import PromptRecord
from dapo_mcore.data.tasks import task_records


def load_prompt_records(cfg: DataConfig, which: Literal["train", "eval"]) -> list[PromptRecord]:
    """The prompts of ``cfg.train`` or ``cfg.eval``; a task gives its train or held-out split."""
    spec = cfg.train if which == "train" else cfg.eval
    if not spec:
        return []
    if spec.startswith(TASK_PREFIX):
        split = "train" if which == "train" else "heldout"
        return task_records(spec[len(TASK_PREFIX):], split, cfg.task_split_seed, cfg.heldout_fraction)
    return load_prompt_dataset(spec, wrap_raw=cfg.wrap_raw_problems).records


def filter_by_length(records: list[PromptRecord], tokenizer: PreTrainedTokenizerBase,
                     cfg: DataConfig) -> tuple[list[PromptRecord], list[tuple[int, str]]]:
    """With ``truncation="drop"``, the records whose rendered prompt fits ``max_prompt_len``, and
    ``(index, reason)`` for each dropped one; with ``"left"`` every record is kept."""
    kept, dropped = encode_prompts(records, tokenizer, cfg.max_prompt_len, cfg.truncation)  # type: ignore[arg-type]
    return [p.record for p in kept], dropped


def prompt_encoder(tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> Callable[[PromptRecord], list[int]]:
    """A function from a record to its chat-rendered prompt ids, left-truncated when configured.

    In ``drop`` mode an over-long prompt is an error here: drop them at load time with
    :func:`filter_by_length`.
    """
    cache: dict[tuple[str | None, str], list[int]] = {}

    def encode(record: PromptRecord) -> list[int]:
        ids = cache.get((record.system, record.prompt))
        if ids is None:
            ids = render_prompt_ids(tokenizer, record.prompt, record.system)
            if len(ids) > cfg.max_prompt_len:
                if cfg.truncation != "left":
                    raise ValueError(f"prompt {record.index} of {record.data_source} has {len(ids)} tokens > "
                                     f"data.max_prompt_len={cfg.max_prompt_len}; filter with filter_by_length() "
                                     "at load time or set data.truncation=left")
                ids = ids[-cfg.max_prompt_len:]
            cache[(record.system, record.prompt)] = ids
        return ids

    return encode

"""The one record type every prompt source yields: synthetic tasks, parquet and jsonl datasets."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptRecord:
    """One prompt with its verifiable answer.

    ``prompt`` is the user-turn content before chat-template rendering, ``system`` the system turn before it (None:
    none, the chat template's default applies); ``index`` is the row's position in its source (after deduplication
    for files, in the split for synthetic tasks).
    """

    prompt: str
    ground_truth: str
    data_source: str
    index: int
    system: str | None = None

"""Prompt datasets from local files: DAPO-Math-17k / AIME-2024 parquet, and jsonl.

Accepted layouts, per row:
- DAPO layout (parquet or jsonl): ``prompt`` = list with one ``{role: "user", content}`` (already in
  DAPO wording, used as is), or verl's ``[{role: "system", ...}, {role: "user", ...}]``; ``reward_model`` =
  ``{ground_truth, style}``, plus ``data_source``, ``ability``, ``extra_info`` (optional here).
- Simple jsonl: ``{"prompt": "<raw problem>", "answer": "<answer>"}``; a string prompt is a raw
  problem and gets the DAPO wording unless ``wrap_raw=False``.

Loading deduplicates on the whole conversation (system and user turn; the released DAPO-Math-17k file holds each
prompt about 100 times; AIME-2024 each problem 32 times) and rejects rows whose ground truth is missing or empty,
reporting each with its row index and reason; rejected rows never reach training. A number as ground truth (int or
float, not bool) is taken as its string form (``42`` -> ``"42"``) and counted in the report. A missing path or a file
that is not one of these formats (not UTF-8, not parquet, no prompt column) raises :class:`DatasetFormatError`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dapo_mcore.data.prompts import dapo_math_prompt
from dapo_mcore.data.records import PromptRecord

logger = logging.getLogger(__name__)

SUFFIXES: tuple[str, ...] = (".parquet", ".jsonl")
_EXPECTED = ("a UTF-8 .jsonl or a .parquet file whose rows hold 'prompt' (a list of [user] or [system, user] "
             "{role, content} messages, or a raw problem string) and 'reward_model': {'ground_truth': str or number} "
             "or 'answer': str or number")


class DatasetFormatError(ValueError):
    """A prompt file that does not exist or is not in an accepted format."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}; expected {_EXPECTED}")
        self.path = Path(path)


@dataclass
class LoadReport:
    """What loading a prompt file kept and dropped."""

    path: Path
    n_rows: int = 0
    n_duplicates: int = 0
    n_numeric_truths: int = 0
    """Rows whose ground truth was a number, taken as its string form."""
    rejected: list[tuple[int, str]] = field(default_factory=list)
    """``(row index in the file, reason)`` per rejected row."""


@dataclass
class PromptDataset:
    """Deduplicated, validated prompts of one file, and the report of how they were obtained."""

    records: list[PromptRecord]
    report: LoadReport


def _prompt_turns(prompt: Any, wrap_raw: bool) -> tuple[str | None, str] | None:
    """``(system content or None, user content)`` of a row's ``prompt`` field, or None when it has no usable shape:
    a string, ``[user]`` or ``[system, user]`` messages."""
    if isinstance(prompt, str):
        return None, dapo_math_prompt(prompt) if wrap_raw else prompt
    if not isinstance(prompt, list | tuple) or not 1 <= len(prompt) <= 2 or not all(isinstance(m, dict) for m in prompt):
        return None
    system = None
    if len(prompt) == 2:
        first = prompt[0]
        if first.get("role") != "system" or not isinstance(first.get("content"), str):
            return None
        system = first["content"]
    user = prompt[-1]
    if user.get("role", "user") == "user" and isinstance(user.get("content"), str):
        return system, user["content"]
    return None


def _ground_truth(row: dict[str, Any]) -> tuple[str | None, str, bool]:
    """The row's ground truth, or None and the reason it is unusable; and whether it was a number."""
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict):
        truth, where = reward_model.get("ground_truth"), "reward_model.ground_truth"
    elif "answer" in row:
        truth, where = row["answer"], "answer"
    else:
        return None, "no ground truth: neither reward_model.ground_truth nor answer is present", False
    if truth is None:
        return None, f"{where} is missing (null)", False
    numeric = isinstance(truth, int | float) and not isinstance(truth, bool)
    if numeric:
        if truth != truth or truth in (float("inf"), float("-inf")):
            return None, f"{where} is {truth!r}, not a finite number", False
        truth = str(truth)
    if not isinstance(truth, str):
        return None, f"{where} is {type(truth).__name__} {truth!r}, not a string or number", False
    if not truth.strip():
        return None, f"{where} is empty", False
    return truth, "", numeric


def _records_from_rows(rows: Iterator[tuple[int, dict[str, Any]]], report: LoadReport, default_source: str,
                       wrap_raw: bool) -> list[PromptRecord]:
    records: list[PromptRecord] = []
    seen: set[tuple[str | None, str]] = set()
    for index, row in rows:
        report.n_rows += 1
        turns = _prompt_turns(row.get("prompt"), wrap_raw)
        if turns is None:
            report.rejected.append((index, "prompt is neither a string nor a list of [user] or [system, user] "
                                           "messages with string content"))
            continue
        if turns in seen:
            report.n_duplicates += 1
            continue
        truth, reason, numeric = _ground_truth(row)
        if truth is None:
            report.rejected.append((index, reason))
            continue
        report.n_numeric_truths += numeric
        seen.add(turns)
        source = row.get("data_source")
        records.append(PromptRecord(prompt=turns[1], system=turns[0], ground_truth=truth, index=len(records),
                                    data_source=source if isinstance(source, str) else default_source))
    return records


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open("rb") as f:
        index = 0
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DatasetFormatError(path, f"line {lineno} is not UTF-8 ({err.reason} at byte {err.start}); "
                                               "re-encode the file as UTF-8") from err
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetFormatError(path, f"line {lineno} is not JSON ({err.msg})") from err
            if not isinstance(row, dict):
                raise DatasetFormatError(path, f"line {lineno} is a JSON {type(row).__name__}, not an object")
            yield index, row
            index += 1


def _dedup_keys(prompts: pa.ChunkedArray) -> list[Any]:
    """One hashable key per row for the whole conversation in ``prompt``: column-wise for the common one-message
    layout (fast on DAPO-Math-17k's 1.79M rows), row by row otherwise (several turns, empty lists, structs without
    ``role``/``content``, strings)."""
    kind = prompts.type
    if (pa.types.is_list(kind) and pa.types.is_struct(kind.value_type)
            and {kind.value_type.field(i).name for i in range(kind.value_type.num_fields)} >= {"role", "content"}
            and pc.all(pc.equal(pc.list_value_length(prompts), 1)).as_py()):
        first = pc.list_element(prompts, 0)
        return list(zip(pc.struct_field(first, "role").to_pylist(), pc.struct_field(first, "content").to_pylist(),
                        strict=True))
    return [json.dumps(p, sort_keys=True, default=str) for p in prompts.to_pylist()]


def _parquet_rows(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """Rows of a parquet file, deduplicated column-wise first, and the number of duplicates skipped.

    The released DAPO-Math-17k file has ~1.79M rows for ~17k prompts: materialising only first
    occurrences keeps loading fast. Duplicates are counted on the whole conversation, like the jsonl path.
    """
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise DatasetFormatError(path, f"not a readable parquet file ({err})") from err
    if "prompt" not in table.column_names:
        raise DatasetFormatError(path, f"no 'prompt' column (columns: {table.column_names})")
    keys = _dedup_keys(table.column("prompt"))
    first: dict[Any, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    unique_rows = sorted(first.values())
    rows = table.take(pa.array(unique_rows, type=pa.int64())).to_pylist()
    return list(zip(unique_rows, rows, strict=True)), len(keys) - len(unique_rows)


def load_prompt_dataset(path: Path | str, wrap_raw: bool = True) -> PromptDataset:
    """Load, validate and deduplicate a parquet or jsonl prompt file (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetFormatError(path, "no such file" if not path.exists() else
                                 "a directory, not a file (name the .parquet/.jsonl inside it)" if path.is_dir()
                                 else "not a regular file")
    if path.suffix not in SUFFIXES:
        raise DatasetFormatError(path, f"unsupported suffix {path.suffix!r}")
    report = LoadReport(path=path)
    if path.suffix == ".parquet":
        rows, n_skipped = _parquet_rows(path)
        report.n_rows = report.n_duplicates = n_skipped
        records = _records_from_rows(iter(rows), report, path.stem, wrap_raw)
    else:
        records = _records_from_rows(_jsonl_rows(path), report, path.stem, wrap_raw)
    if report.n_rows == 0:
        raise DatasetFormatError(path, "the file holds no rows")
    logger.info("loaded %s: %d rows, %d duplicate prompts dropped, %d rows rejected, %d prompts kept",
                path, report.n_rows, report.n_duplicates, len(report.rejected), len(records))
    if report.n_numeric_truths:
        logger.info("%s: %d ground truths were numbers; they are compared as their string form (42 -> '42', "
                    "2.5 -> '2.5')", path, report.n_numeric_truths)
    for index, reason in report.rejected[:10]:
        logger.warning("%s row %d rejected: %s", path, index, reason)
    if len(report.rejected) > 10:
        logger.warning("%s: %d more rejected rows not shown", path, len(report.rejected) - 10)
    if not records:
        raise DatasetFormatError(path, f"no usable rows ({len(report.rejected)} rejected)")
    return PromptDataset(records=records, report=report)

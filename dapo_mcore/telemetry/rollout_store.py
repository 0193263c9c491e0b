"""The rollout store: every generated rollout of every step, in an appendable zarr v3 group.

Layout (``run_dir/rollouts.zarr``), all arrays 1-D and chunked along their only axis:

- one row per rollout: ``step`` (int64), ``group_id`` (int64), ``gen_batch`` (int32), ``reward``
  (float32), ``acc`` (bool), ``kept`` (bool: kept by dynamic sampling and trained on),
  ``finish`` (uint8 code into the ``finish_reasons`` attribute: stop, length), ``stale_tokens`` (int32: leading
  response tokens an older policy sampled, partial rollouts; stores written before it read as 0), ``stop_token``
  (int64: the stop/EOS id that ended the response, -1 when it reached the length limit; stores written before it read
  as -1), ``tool_calls`` / ``tool_errors`` (int32: tool calls of a multi-turn response and how many of them
  errored; 0 in stores written before them),
  ``prompt_start``/``prompt_len`` and ``response_start``/``response_len`` (offsets into the token arrays);
- ragged tokens, concatenated: ``prompt_ids`` (int32), ``response_ids`` (int32), ``logprobs``
  (float32, the engine's log-prob of each response token, NaN when the engine gave none: a tool-output token has
  none) and ``loss_mask`` (bool per response token: False on tool output, which no loss counts; True in stores
  written before it).

Commit protocol: a step's arrays are grown and written first; only then is the root attribute
``committed`` (the list of steps and the row/token end offset after each) rewritten. zarr's
LocalStore replaces files atomically, so a reader in another process that reads ``committed``
first sees only complete steps, even while the writer appends. After a crash, uncommitted tail
data is cut off when the store is reopened; ``resume_step`` also drops committed steps >= it, so
the resumed run rewrites them instead of duplicating them.

Integrity: the commit record also holds each step's CRC-32 over all its columns as written (``step_crc32``), so a
deleted chunk (zarr reads it as zeros), a changed or truncated one is caught: reading a step verifies it
(``StoreDamagedError``, one line naming the step; ``dapo-mcore rollouts RUN --check`` verifies every step). The
writer, opening a store to continue it, checks the metadata and the step it continues after (the chunks it will
append into); a damaged store is renamed aside (``rollouts.zarr.damaged-N``, nothing deleted) with one warning and
a new store is started, so it never blocks training. Damage the open did not look at (an older step) stays where
it is: appends never read it, and reading that step says so.
"""

from __future__ import annotations

import logging
import os
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from dapo_mcore.errors import UserError, naming

logger = logging.getLogger(__name__)

_DAMAGE = (ValueError, KeyError, TypeError, RuntimeError, IndexError)
"""What zarr raises on a damaged store: bad JSON or metadata (ValueError, zarr's errors included), a chunk its codec
cannot decode (RuntimeError: "Zstd decompression error"), a commit record missing keys. OSErrors (a full disk, a
permission) are not damage and propagate."""


class StoreDamagedError(UserError):
    """A rollout store (or one of its steps) does not hold what was written to it."""

ROLLOUTS_DIR = "rollouts.zarr"
FORMAT = "dapo-mcore-rollouts"
VERSION = 1
FINISH_REASONS: tuple[str, ...] = ("stop", "length")

ROW_COLUMNS: dict[str, str] = {
    "step": "int64", "group_id": "int64", "gen_batch": "int32", "reward": "float32", "acc": "bool",
    "kept": "bool", "finish": "uint8", "prompt_start": "int64", "prompt_len": "int32",
    "response_start": "int64", "response_len": "int32", "stale_tokens": "int32", "stop_token": "int64",
    "tool_calls": "int32", "tool_errors": "int32",
}
ADDED_ROW_COLUMNS: dict[str, int] = {"stale_tokens": 0, "stop_token": -1, "tool_calls": 0, "tool_errors": 0}
"""Columns newer than the format's first stores, with the value they read as where absent (and are created with
when such a store is appended to)."""
TOKEN_COLUMNS: dict[str, tuple[str, str]] = {
    # name: (dtype, which token stream it follows)
    "prompt_ids": ("int32", "prompt"), "response_ids": ("int32", "response"), "logprobs": ("float32", "response"),
    "loss_mask": ("bool", "response"),
}
ADDED_TOKEN_COLUMNS: dict[str, bool] = {"loss_mask": True}
"""Token columns newer than the format's first stores, with the value they read as where absent."""
UNCHECKED_AT_DEFAULT = ("tool_calls", "tool_errors", "loss_mask")
"""Columns a step's checksum covers only where they differ from their default somewhere: a single-turn step (and every
step stored before them) has the checksum it always had."""


@dataclass
class Rollout:
    """One generated response to one prompt, as stored.

    ``prompt_ids``/``response_ids`` are token ids; ``logprobs`` holds one engine log-prob per
    response token (None when the engine returned none; stored as NaN). ``group_id`` identifies the
    prompt group within the step, ``gen_batch`` the generation batch that produced it; ``step`` is
    set by the reader.
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray | None
    reward: float
    acc: bool
    finish_reason: str
    kept: bool
    group_id: int
    gen_batch: int
    step: int = -1
    stale_tokens: int = 0
    """Leading response tokens an older policy sampled (partial rollouts; their log-probs are that policy's)."""
    stop_token: int = -1
    """The stop/EOS id that ended the response (finish_reason "stop"); -1 when it reached the length limit."""
    loss_mask: np.ndarray | None = None
    """Multi-turn tool use: False on tool-output tokens (not trained on); None = every token the model's."""
    tool_calls: int = 0
    tool_errors: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def response_len(self) -> int:
        return len(self.response_ids)


@dataclass
class _Committed:
    """The ``committed`` root attribute: end offsets after each committed step."""

    steps: list[int]
    rows: list[int]
    prompt_tokens: list[int]
    response_tokens: list[int]
    crc32: list[int | None] = field(default_factory=list)
    """CRC-32 of each step's data as written (``step_crc32``); None for steps stored before checksums existed."""

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> _Committed:
        c = attrs["committed"]
        steps = list(c["steps"])
        crc = list(c.get("crc32", []))
        crc = [None] * (len(steps) - len(crc)) + crc  # checksums start with the first step written with them
        return cls(steps, list(c["rows"]), list(c["prompt_tokens"]), list(c["response_tokens"]), crc)

    def to_attrs(self) -> dict[str, Any]:
        return {"committed": {"steps": self.steps, "rows": self.rows, "prompt_tokens": self.prompt_tokens,
                              "response_tokens": self.response_tokens,
                              "crc32": [c for c in self.crc32 if c is not None]}}

    def ends(self) -> tuple[int, int, int]:
        """(rows, prompt tokens, response tokens) committed so far."""
        if not self.steps:
            return 0, 0, 0
        return self.rows[-1], self.prompt_tokens[-1], self.response_tokens[-1]

    def keep_before(self, step: int) -> _Committed:
        n = sum(1 for s in self.steps if s < step)
        return _Committed(self.steps[:n], self.rows[:n], self.prompt_tokens[:n], self.response_tokens[:n],
                          self.crc32[:n])

    def ranges(self, step: int) -> tuple[slice, slice, slice]:
        """Row, prompt-token and response-token slices of committed ``step``."""
        if step not in self.steps:
            raise KeyError(f"step {step} is not in the store (committed steps: {_summarize(self.steps)})")
        i = self.steps.index(step)
        lo = (0, 0, 0) if i == 0 else (self.rows[i - 1], self.prompt_tokens[i - 1], self.response_tokens[i - 1])
        return (slice(lo[0], self.rows[i]), slice(lo[1], self.prompt_tokens[i]),
                slice(lo[2], self.response_tokens[i]))


def _summarize(steps: Sequence[int]) -> str:
    if not steps:
        return "none"
    return f"{len(steps)} steps, {steps[0]}..{steps[-1]}" if len(steps) > 4 else str(list(steps))


def _check_format(group: zarr.Group, path: Path) -> None:
    attrs = dict(group.attrs)
    if attrs.get("format") != FORMAT or attrs.get("version") != VERSION:
        raise ValueError(
            f"{path} is not a {FORMAT} v{VERSION} store (format={attrs.get('format')!r}, "
            f"version={attrs.get('version')!r}); point at a run's {ROLLOUTS_DIR} or move the directory away"
        )


class RolloutStore:
    """Append rollouts step by step (one writer: rank 0).

    Args:
        path: the store directory (usually ``run_dir/rollouts.zarr``); created if missing.
        resume_step: first step the resumed run will write again; committed steps >= it are dropped.
        row_chunk: rollouts per chunk of the per-rollout arrays (new stores only).
        token_chunk: tokens per chunk of the token arrays (new stores only).
    """

    def __init__(self, path: Path, resume_step: int | None = None,
                 row_chunk: int = 16384, token_chunk: int = 1 << 20) -> None:
        if row_chunk < 1 or token_chunk < 1:
            raise ValueError(f"row_chunk={row_chunk}, token_chunk={token_chunk}: chunk sizes must be >= 1")
        self.path = Path(path)
        self._chunks = (row_chunk, token_chunk)
        self.set_aside: Path | None = None
        """Where a damaged store found at open was moved (None if there was none)."""
        if self.path.is_dir() and any(self.path.iterdir()):
            try:
                self._open_existing(resume_step)
                return
            except StoreDamagedError as exc:
                self._set_aside(str(exc), resume_step)
        with naming(self.path):
            self._create(row_chunk, token_chunk)

    def _open_existing(self, resume_step: int | None) -> None:
        """Open to continue: metadata readable, the step to continue after intact; else StoreDamagedError."""
        if not (self.path / "zarr.json").is_file():
            raise StoreDamagedError(f"{self.path / 'zarr.json'} is missing")
        try:
            self._group = zarr.open_group(str(self.path), mode="r+")
            _check_format(self._group, self.path)
            self._committed = _Committed.from_attrs(dict(self._group.attrs))
            kept = self._committed if resume_step is None else self._committed.keep_before(resume_step)
            if kept.steps:
                problem = verify_step(self._group, kept, kept.steps[-1])
                if problem:
                    raise StoreDamagedError(problem)
            self._add_missing_columns()
            if resume_step is not None:
                self._truncate(kept)
            self._shrink_to_committed()
        except _DAMAGE as exc:
            raise StoreDamagedError(f"{type(exc).__name__}: {exc}") from exc

    def _set_aside(self, problem: str, resume_step: int | None) -> None:
        n = 1
        while (aside := self.path.with_name(f"{self.path.name}.damaged-{n}")).exists():
            n += 1
        os.rename(self.path, aside)
        self.set_aside = aside
        since = f" from step {resume_step}" if resume_step else ""
        logger.warning("rollout store %s is damaged (%s); moved aside to %s (nothing deleted) and a new store starts"
                       "%s", self.path, problem.replace("\n", " ")[:300], aside, since)

    def _create(self, row_chunk: int, token_chunk: int) -> None:
        """Build the empty store beside ``path`` and rename it into place: readers never see half of it."""
        if self.path.exists() and any(self.path.iterdir()):
            raise ValueError(f"{self.path} exists and is not a rollout store; pick another path or remove it")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_name(f"{self.path.name}.creating-{uuid.uuid4().hex}")
        group = zarr.open_group(str(staging), mode="w")
        for name, dtype in ROW_COLUMNS.items():
            group.create_array(name, shape=(0,), dtype=dtype, chunks=(row_chunk,))
        for name, (dtype, _) in TOKEN_COLUMNS.items():
            fill = np.nan if dtype.startswith("float") else ADDED_TOKEN_COLUMNS.get(name, 0)
            group.create_array(name, shape=(0,), dtype=dtype, chunks=(token_chunk,), fill_value=fill)
        self._committed = _Committed([], [], [], [])
        group.update_attributes(
            {"format": FORMAT, "version": VERSION, "finish_reasons": list(FINISH_REASONS), **self._committed.to_attrs()}
        )
        os.rename(staging, self.path)
        self._group = zarr.open_group(str(self.path), mode="r+")

    @property
    def steps(self) -> list[int]:
        return list(self._committed.steps)

    def _truncate(self, kept: _Committed) -> None:
        dropped = [s for s in self._committed.steps if s not in kept.steps]
        if dropped:
            logger.info("%s: dropping committed steps %s (resume)", self.path, _summarize(dropped))
        # Un-commit first, so readers never see a step whose data is being cut.
        self._committed = kept
        self._group.update_attributes(kept.to_attrs())

    def _add_missing_columns(self) -> None:
        """A store written before a column existed gets it, zeros for the rows it already holds."""
        length, chunk = self._group["step"].shape[0], self._group["step"].chunks[0]
        for name in ADDED_ROW_COLUMNS:
            if name not in self._group:
                fill = ADDED_ROW_COLUMNS[name]
                array = self._group.create_array(name, shape=(length,), dtype=ROW_COLUMNS[name], chunks=(chunk,),
                                                 fill_value=fill)
                if length:
                    array[:] = np.full(length, fill, dtype=ROW_COLUMNS[name])
        tokens = self._group["response_ids"].shape[0]
        for name, fill in ADDED_TOKEN_COLUMNS.items():
            if name not in self._group:
                dtype, chunks = TOKEN_COLUMNS[name][0], self._group["response_ids"].chunks
                array = self._group.create_array(name, shape=(tokens,), dtype=dtype, chunks=chunks, fill_value=fill)
                if tokens:
                    array[:] = np.full(tokens, fill, dtype=dtype)

    def _shrink_to_committed(self) -> None:
        """Cut array tails past the committed ends (a step that crashed mid-write, or dropped steps)."""
        rows, ptok, rtok = self._committed.ends()
        for name in ROW_COLUMNS:
            self._resize(name, rows)
        for name, (_, stream) in TOKEN_COLUMNS.items():
            self._resize(name, ptok if stream == "prompt" else rtok)

    def _resize(self, name: str, length: int) -> None:
        array = self._group[name]
        if array.shape[0] != length:
            array.resize((length,))

    def append_step(self, step: int, records: Sequence[Rollout]) -> None:
        """Write all rollouts of ``step`` and commit it (steps must increase)."""
        if self._committed.steps and step <= self._committed.steps[-1]:
            raise ValueError(
                f"step {step} is not after the last stored step {self._committed.steps[-1]}; "
                f"when resuming, open RolloutStore(path, resume_step={step})"
            )
        columns = _columns(step, records)
        with naming(self.path):  # a full disk inside zarr's writes names the store
            self._append(step, columns)

    def _append(self, step: int, columns: dict[str, np.ndarray]) -> None:
        columns = dict(columns)
        rows0, ptok0, rtok0 = self._committed.ends()
        columns["prompt_start"] = columns["prompt_start"] + ptok0
        columns["response_start"] = columns["response_start"] + rtok0
        starts = {"row": rows0, "prompt": ptok0, "response": rtok0}
        for name in ROW_COLUMNS:
            self._write(name, starts["row"], columns[name])
        for name, (_, stream) in TOKEN_COLUMNS.items():
            self._write(name, starts[stream], columns[name])
        c = self._committed
        self._committed = _Committed(
            c.steps + [step], c.rows + [rows0 + len(columns["step"])],
            c.prompt_tokens + [ptok0 + len(columns["prompt_ids"])],
            c.response_tokens + [rtok0 + len(columns["response_ids"])], c.crc32 + [step_crc32(columns)],
        )
        self._group.update_attributes(self._committed.to_attrs())

    def _write(self, name: str, start: int, data: np.ndarray) -> None:
        array = self._group[name]
        end = start + len(data)
        array.resize((end,))
        if len(data):
            array[start:end] = data


def step_crc32(columns: dict[str, np.ndarray]) -> int:
    """CRC-32 of one step's columns as stored (absolute offsets), in a fixed column order."""
    crc = 0
    for name, dtype in (*ROW_COLUMNS.items(), *((n, d) for n, (d, _) in TOKEN_COLUMNS.items())):
        if name in UNCHECKED_AT_DEFAULT and bool(np.all(columns[name] == _default(name))):
            continue
        crc = zlib.crc32(np.ascontiguousarray(columns[name], dtype=dtype).tobytes(), crc)
    return crc


def _default(name: str) -> Any:
    return ADDED_TOKEN_COLUMNS[name] if name in ADDED_TOKEN_COLUMNS else ADDED_ROW_COLUMNS[name]


def _raw_step(group: zarr.Group, committed: _Committed, step: int) -> dict[str, np.ndarray]:
    rows, ptok, rtok = committed.ranges(step)
    out = {name: _row_column(group, name, rows) for name in ROW_COLUMNS}
    for name, (dtype, stream) in TOKEN_COLUMNS.items():
        span = ptok if stream == "prompt" else rtok
        out[name] = (group[name][span] if name in group
                     else np.full(len(range(*span.indices(span.stop))), ADDED_TOKEN_COLUMNS[name], dtype=dtype))
    return out


def verify_step(group: zarr.Group, committed: _Committed, step: int) -> str | None:
    """What is wrong with committed ``step`` (a chunk that cannot be decoded, data that differs from its checksum),
    or None when it is intact (or was stored before checksums existed)."""
    want = committed.crc32[committed.steps.index(step)]
    try:
        raw = _raw_step(group, committed, step)
    except _DAMAGE as exc:
        return f"step {step}: unreadable ({type(exc).__name__}: {exc})"
    if want is not None and step_crc32(raw) != want:
        return f"step {step}: its data differs from the checksum written with it (a chunk deleted or changed)"
    return None


def _columns(step: int, records: Sequence[Rollout]) -> dict[str, np.ndarray]:
    """Validate ``records`` and lay them out as the store's columns (offsets relative to 0)."""
    prompts = [np.asarray(r.prompt_ids, dtype=np.int64).reshape(-1) for r in records]
    responses = [np.asarray(r.response_ids, dtype=np.int64).reshape(-1) for r in records]
    logprobs, masks = [], []
    for i, (r, resp) in enumerate(zip(records, responses, strict=True)):
        mask = np.ones(len(resp), dtype=bool) if r.loss_mask is None else np.asarray(r.loss_mask, dtype=bool).reshape(-1)
        if len(mask) != len(resp):
            raise ValueError(f"rollout {i}: {len(mask)} loss_mask values for {len(resp)} response tokens")
        masks.append(mask)
        if r.finish_reason not in FINISH_REASONS:
            raise ValueError(f"rollout {i}: finish_reason={r.finish_reason!r}; use one of {FINISH_REASONS}")
        if r.logprobs is None:
            logprobs.append(np.full(len(resp), np.nan, dtype=np.float32))
            continue
        lp = np.asarray(r.logprobs, dtype=np.float32).reshape(-1)
        if len(lp) != len(resp):
            raise ValueError(f"rollout {i}: {len(lp)} logprobs for {len(resp)} response tokens; pass one per token")
        logprobs.append(lp)
    for ids in (*prompts, *responses):
        if len(ids) and (ids.min() < 0 or ids.max() >= 2**31):
            raise ValueError(f"token ids must lie in [0, 2**31), got range [{ids.min()}, {ids.max()}]")
    prompt_len = np.array([len(p) for p in prompts], dtype=np.int64)
    response_len = np.array([len(r) for r in responses], dtype=np.int64)

    def cat(parts: list[np.ndarray], dtype: str) -> np.ndarray:
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

    return {
        "step": np.full(len(records), step, dtype=np.int64),
        "group_id": np.array([r.group_id for r in records], dtype=np.int64),
        "gen_batch": np.array([r.gen_batch for r in records], dtype=np.int32),
        "reward": np.array([r.reward for r in records], dtype=np.float32),
        "acc": np.array([bool(r.acc) for r in records], dtype=bool),
        "kept": np.array([bool(r.kept) for r in records], dtype=bool),
        "finish": np.array([FINISH_REASONS.index(r.finish_reason) for r in records], dtype=np.uint8),
        "prompt_start": np.cumsum(prompt_len) - prompt_len,
        "prompt_len": prompt_len.astype(np.int32),
        "response_start": np.cumsum(response_len) - response_len,
        "response_len": response_len.astype(np.int32),
        "stale_tokens": np.array([r.stale_tokens for r in records], dtype=np.int32),
        "stop_token": np.array([r.stop_token for r in records], dtype=np.int64),
        "tool_calls": np.array([r.tool_calls for r in records], dtype=np.int32),
        "tool_errors": np.array([r.tool_errors for r in records], dtype=np.int32),
        "prompt_ids": cat(prompts, "int32"),
        "response_ids": cat(responses, "int32"),
        "logprobs": cat(logprobs, "float32"),
        "loss_mask": cat(masks, "bool"),
    }


class RolloutReader:
    """Read committed steps of a store, safely while a writer appends to it (any process)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not (self.path / "zarr.json").exists():
            raise FileNotFoundError(f"no rollout store at {self.path}; a run writes it to RUN_DIR/{ROLLOUTS_DIR}")

    def _open(self) -> tuple[zarr.Group, _Committed]:
        def damaged(exc: BaseException) -> StoreDamagedError:
            return StoreDamagedError(f"rollout store {self.path} is damaged ({type(exc).__name__}: {exc}); move it "
                                     "aside (a resumed run sets it aside itself and starts a new one)")

        try:
            group = zarr.open_group(str(self.path), mode="r")
        except _DAMAGE as exc:
            raise damaged(exc) from exc
        _check_format(group, self.path)  # another kind of directory: not damage, a wrong path
        try:  # the commit record before any array: arrays are at least that long
            return group, _Committed.from_attrs(dict(group.attrs))
        except _DAMAGE as exc:
            raise damaged(exc) from exc

    def check(self) -> list[str]:
        """Every committed step verified: one problem per damaged step ([] when all are intact)."""
        group, committed = self._open()
        return [p for step in committed.steps if (p := verify_step(group, committed, step))]

    def steps(self) -> list[int]:
        """Committed steps, ascending (re-read on every call)."""
        return self._open()[1].steps

    def read_step_columns(self, step: int) -> dict[str, np.ndarray]:
        """The step's columns (see module docstring); starts are relative to the step's token arrays."""
        group, committed = self._open()
        rows, ptok, rtok = committed.ranges(step)
        problem = verify_step(group, committed, step)
        if problem:
            raise StoreDamagedError(f"rollout store {self.path}: {problem}; other steps may still be read (dapo-mcore "
                                    "rollouts RUN --check lists every damaged step)")
        out = _raw_step(group, committed, step)
        out["prompt_start"] = out["prompt_start"] - ptok.start
        out["response_start"] = out["response_start"] - rtok.start
        return out

    def read_step(self, step: int) -> list[Rollout]:
        """All rollouts of committed ``step``, in the order they were appended."""
        finish_reasons = self._open()[0].attrs["finish_reasons"]
        c = self.read_step_columns(step)
        out = []
        for i in range(len(c["step"])):
            p0, p1 = c["prompt_start"][i], c["prompt_start"][i] + c["prompt_len"][i]
            r0, r1 = c["response_start"][i], c["response_start"][i] + c["response_len"][i]
            out.append(Rollout(
                prompt_ids=c["prompt_ids"][p0:p1], response_ids=c["response_ids"][r0:r1],
                logprobs=c["logprobs"][r0:r1], reward=float(c["reward"][i]), acc=bool(c["acc"][i]),
                finish_reason=finish_reasons[int(c["finish"][i])], kept=bool(c["kept"][i]),
                group_id=int(c["group_id"][i]), gen_batch=int(c["gen_batch"][i]), step=int(c["step"][i]),
                stale_tokens=int(c["stale_tokens"][i]), stop_token=int(c["stop_token"][i]),
                loss_mask=c["loss_mask"][r0:r1], tool_calls=int(c["tool_calls"][i]), tool_errors=int(c["tool_errors"][i]),
            ))
        return out

    def column(self, name: str) -> np.ndarray:
        """One per-rollout column over every committed step (e.g. ``reward``, ``kept``, ``step``)."""
        if name not in ROW_COLUMNS:
            raise ValueError(f"unknown column {name!r}; per-rollout columns are {sorted(ROW_COLUMNS)}")
        group, committed = self._open()
        return _row_column(group, name, slice(0, committed.ends()[0]))


def store_problem(run_dir: Path) -> str | None:
    """One line on a run's rollout store if its metadata or last step is damaged (cheap: what ``report`` and
    ``diagnose`` show); None when it is absent or looks intact (``--check`` verifies every step)."""
    path = Path(run_dir) / ROLLOUTS_DIR
    if not path.exists():
        return None
    if not (path / "zarr.json").is_file():
        return f"rollout store {path} is damaged ({path / 'zarr.json'} is missing)"
    try:
        reader = RolloutReader(path)
        group, committed = reader._open()
    except (StoreDamagedError, ValueError) as exc:
        return str(exc)
    problem = verify_step(group, committed, committed.steps[-1]) if committed.steps else None
    if problem:
        return f"rollout store {path}: {problem} (dapo-mcore rollouts {run_dir} --check verifies every step)"
    return None


def _row_column(group: zarr.Group, name: str, rows: slice) -> np.ndarray:
    if name in group:
        return group[name][rows]
    length = len(range(*rows.indices(group["step"].shape[0])))  # a column the store predates
    return np.full(length, ADDED_ROW_COLUMNS[name], dtype=ROW_COLUMNS[name])


def fates(rollouts: list[Rollout], filtering: bool = True) -> list[str]:
    """What became of each rollout: ``kept`` (trained on), ``rejected`` (its group had no mixed outcome: refused
    by dynamic sampling) or ``surplus`` (a usable group the step did not need: generated past the target).
    ``filtering=False`` (``algo.dynamic_sampling=false``, GRPO) refuses no group: every unkept one is surplus."""
    outcomes: dict[tuple[int, int], set[bool]] = {}
    for r in rollouts:
        outcomes.setdefault((r.step, r.group_id), set()).add(bool(r.acc))
    return ["kept" if r.kept else "rejected" if filtering and len(outcomes[(r.step, r.group_id)]) == 1 else "surplus"
            for r in rollouts]


def _filtering(run_dir: Path) -> bool:
    """The run's ``algo.dynamic_sampling`` (from RUN_DIR/config.yaml; True when that is absent)."""
    import yaml

    path = run_dir / "config.yaml"
    algo = (yaml.safe_load(path.read_text()) or {}).get("algo", {}) if path.is_file() else {}
    return bool(algo.get("dynamic_sampling", True))


def spread_groups(items: list[tuple[Rollout, str]], limit: int) -> list[tuple[Rollout, str]]:
    """Up to `limit` of `items`, one per group in turn (first responses of each group first, groups in stored order):
    ``--limit 4`` shows four groups, not four samples of one."""
    by_group: dict[int, list[tuple[Rollout, str]]] = {}
    for item in items:
        by_group.setdefault(item[0].group_id, []).append(item)
    out: list[tuple[Rollout, str]] = []
    depth = 0
    while len(out) < min(limit, len(items)):
        out += [g[depth] for g in by_group.values() if depth < len(g)][:limit - len(out)]
        depth += 1
    return out


def _print_step(reader: RolloutReader, step: int, limit: int, which: str, decode: Any, filtering: bool = True) -> None:
    rollouts = reader.read_step(step)
    fate = fates(rollouts, filtering)
    if rollouts:
        print(f"step {step}: {len(rollouts)} rollouts, {fate.count('kept')} kept, {fate.count('rejected')} rejected by "
              f"dynamic sampling (no mixed outcome), {fate.count('surplus')} surplus (usable, past the step's target), "
              f"acc {np.mean([r.acc for r in rollouts]):.3f}, reward {np.mean([r.reward for r in rollouts]):+.3f}, "
              f"truncated {np.mean([r.finish_reason == 'length' for r in rollouts]):.3f}")
    else:
        print(f"step {step}: no rollouts")
    shown = spread_groups([(r, f) for r, f in zip(rollouts, fate, strict=True) if which in ("all", f)], limit)
    for i, (r, what) in enumerate(shown):
        print(f"\n--- [{i}] group {r.group_id}  gen_batch {r.gen_batch}  reward {r.reward:+.3f}  acc {r.acc}  "
              f"{what}  finish {r.finish_reason}{_stop_text(r, decode)}  prompt {r.prompt_len} tok  "
              f"response {r.response_len} tok" + (f" ({r.stale_tokens} from an older policy)" if r.stale_tokens else ""))
        print(f"prompt:   {decode(r.prompt_ids)!r}")
        if r.tool_calls or (r.loss_mask is not None and not bool(np.all(r.loss_mask))):
            _print_turns(r, decode)
        else:
            print(f"response: {decode(r.response_ids)!r}")


def turns(r: Rollout) -> list[tuple[bool, np.ndarray]]:
    """A response's runs of model tokens (True) and tool-output tokens (False), in order."""
    mask = np.ones(r.response_len, dtype=bool) if r.loss_mask is None else np.asarray(r.loss_mask, dtype=bool)
    out: list[tuple[bool, np.ndarray]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((bool(mask[start]), np.asarray(r.response_ids[start:i])))
            start = i
    return out


def _print_turns(r: Rollout, decode: Any) -> None:
    """A multi-turn response turn by turn, the tool's output set apart (it is not trained on)."""
    print(f"response: {r.tool_calls} tool call(s), {r.tool_errors} errored")
    for model, ids in turns(r):
        print(f"  {'model' if model else 'TOOL '} | {decode(ids)!r}")


def _stop_text(r: Rollout, decode: Any) -> str:
    """`` (151645 '<|im_end|>')``: which stop id ended a "stop" response."""
    if r.stop_token < 0:
        return ""
    return f" ({r.stop_token} {decode(np.asarray([r.stop_token]))!r})"


def main(argv: list[str] | None = None) -> int:
    """``dapo-mcore rollouts RUN_DIR [--step N] [--limit K] [--tokenizer DIR]``: print decoded samples."""
    import argparse

    parser = argparse.ArgumentParser(prog="dapo-mcore rollouts", description="Print stored rollouts of a run.")
    parser.add_argument("run_dir", type=Path, help="the run directory (holding rollouts.zarr)")
    parser.add_argument("--step", type=int, default=None, help="step to show (default: the last stored step)")
    parser.add_argument("--limit", type=int, default=8, help="rollouts to print (default 8)")
    parser.add_argument("--which", choices=("all", "kept", "rejected", "surplus"), default="all",
                        help="kept (trained on), rejected (dynamic sampling refused the group: no mixed outcome) or "
                             "surplus (a usable group past the step's target)")
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory (default RUN_DIR/tokenizer)")
    parser.add_argument("--raw", action="store_true", help="print token ids instead of decoding")
    parser.add_argument("--check", action="store_true", help="verify every stored step against its checksum")
    args = parser.parse_args(argv)
    try:
        reader = RolloutReader(args.run_dir / ROLLOUTS_DIR)
    except ValueError as err:  # a missing store is an OSError: the CLI reports it on stderr and exits 2
        raise UserError(str(err)) from err
    steps = reader.steps()
    if args.check:
        problems = reader.check()
        if problems:
            raise StoreDamagedError(f"rollout store {reader.path}: {len(problems)} of {len(steps)} steps damaged: "
                                    f"{'; '.join(problems[:5])}{' ...' if len(problems) > 5 else ''}")
        print(f"rollout store {reader.path}: {_summarize(steps)}, all intact")
        return 0
    step = args.step if args.step is not None else (steps[-1] if steps else None)
    if step is None or step not in steps:
        raise UserError(f"step {step} is not stored in {args.run_dir / ROLLOUTS_DIR}; stored: {_summarize(steps)}")
    if args.raw:
        def decode(ids: np.ndarray) -> str:
            return " ".join(str(int(t)) for t in ids)
    else:
        tok_dir = args.tokenizer if args.tokenizer is not None else args.run_dir / "tokenizer"
        if not tok_dir.is_dir():
            raise UserError(f"no tokenizer at {tok_dir}; pass --tokenizer DIR or --raw")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))

        def decode(ids: np.ndarray) -> str:
            return tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    _print_step(reader, step, args.limit, args.which, decode, _filtering(args.run_dir))
    return 0

"""The async mode's step as two lanes, every second counted once (``profile``, the run summary and ``pipeline.png``).

Trainer lane of step n (its wall time, ``time/step``, in the order it happens): the checkpoint after step n - 1
(accounted to step n), the wait for batch n, old log-probs, train, the wait inside the publish until the engines
join it (they finished batch n + 1), the weight transfer (``time/sync_weights``), the wait for the engines'
evaluation when one is due (``time/eval``), and what no phase timed. ``time/wait_rollouts`` is both waits for
rollouts (``async/trainer_wait_batch_s`` + ``async/trainer_wait_publish_s``).

Engine lane during step n: generate and score batch n + 1, wait for version n + 1, receive it (the transfer ends when
the trainer's publish ends), evaluate it when due (an evaluation behind the trainer, ``eval/policy_version`` < n:
first, before generating; the trainer's wait for it, ``async/trainer_wait_eval_s``, is drawn before its publish). Those seconds travel with batch n + 1, so they are in step n + 1's
record. No clock is shared between the ranks: the lanes are laid out from per-step seconds (shares and order, not
exact instants).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dapo_mcore.telemetry import keys

TRAINER_LABELS: dict[str, str] = {
    "wait_rollouts": "wait for rollouts (engines)",
    "old_logprobs": "old log-probs",
    "train": "train",
    "sync_weights": "publish weights (transfer)",
    "eval": "wait for eval (engines)",
    "checkpoint": "checkpoint",
}
"""How ``profile`` and the summary name the trainer's phases in an async run."""
SYNC_LABELS: dict[str, str] = {
    "generate": "generate", "reward": "score (reward)", "old_logprobs": "old log-probs", "train": "train",
    "sync_weights": "weight sync", "eval": "eval", "checkpoint": "checkpoint", "wait_rollouts": "wait for rollouts",
}
"""The phases of a synchronous step in words (``cost.png``'s legend)."""


def phase_label(phase: str, async_run: bool) -> str:
    """A phase in words (the raw name when it has none)."""
    return (TRAINER_LABELS if async_run else SYNC_LABELS).get(phase, phase.replace("_", " "))

ENGINE_SECONDS: tuple[tuple[str, str], ...] = (
    ("async/engine_generate_s", "generate"), ("async/engine_reward_s", "score"),
    ("async/engine_wait_weights_s", "wait for weights"), ("async/weights_transfer_s", "receive weights"),
    ("async/engine_eval_s", "eval"),
)
"""The engine lane's seconds per batch (eval: when the engines report it; else the trainer's wait for it)."""


def is_async(records: Sequence[dict[str, Any]]) -> bool:
    return any("async/trainer_wait_s" in r for r in records)


@dataclass(frozen=True)
class Segment:
    lane: str
    """``trainer`` or ``engines``."""
    what: str
    start: float
    width: float
    step: int


def _f(record: dict[str, Any], key: str) -> float:
    value = record.get(key)
    return float(value) if value is not None else 0.0


def trainer_segments(r: dict[str, Any], t: float) -> list[Segment]:
    """Step ``r`` on the trainer lane from ``t``; the widths sum to its ``time/step``."""
    step, wall = r[keys.STEP], _f(r, keys.TIME_STEP)
    wait = _f(r, keys.time_key("wait_rollouts"))
    at_publish = _f(r, "async/trainer_wait_publish_s")
    behind = _f(r, "async/trainer_wait_eval_s")  # an evaluation behind the trainer, taken in this publish
    parts = [("checkpoint", _f(r, keys.TIME_CHECKPOINT)), ("wait for rollouts", wait - at_publish - behind),
             ("old log-probs", _f(r, keys.TIME_OLD_LOGPROBS)), ("train", _f(r, keys.TIME_TRAIN)),
             ("wait for eval", behind), ("wait for rollouts", at_publish), ("publish", _f(r, keys.TIME_SYNC_WEIGHTS)),
             ("wait for eval", _f(r, keys.TIME_EVAL))]
    parts.append(("other", max(wall - sum(w for _, w in parts), 0.0)))
    out = []
    for what, width in parts:
        if width > 0:
            out.append(Segment("trainer", what, t, width, step))
            t += width
    return out


def engine_segments(r: dict[str, Any], nxt: dict[str, Any] | None, publish_end: float,
                    after: dict[str, Any] | None = None) -> list[Segment]:
    """The engines during step ``r`` (one-step-off): batch n + 1 (``nxt``'s seconds) is generated, then the engines
    wait for and receive the next version, which ends at ``publish_end``; then eval if due. A batch's line carries the
    wait and transfer of the version taken before it, so that wait and copy are ``after``'s (the batch after
    ``nxt``). An evaluation behind the trainer (of version n - 1, labelled so in ``r``) comes first."""
    step, out = r[keys.STEP], []
    evaluation = _f(r, "async/engine_eval_s") if "async/engine_eval_s" in r else _f(r, keys.TIME_EVAL)
    behind = "eval/policy_version" in r and _f(r, "eval/policy_version") < step
    if nxt is not None:
        gen = _f(nxt, "async/engine_generate_s") + _f(nxt, "async/engine_reward_s")
        idle, copy = (0.0, 0.0) if after is None else (_f(after, "async/engine_wait_weights_s"),
                                                       _f(after, "async/weights_transfer_s"))
        t = publish_end - copy - idle - gen - (evaluation if behind else 0.0)
        for what, width in (("eval", evaluation if behind else 0.0), ("generate + score", gen),
                            ("wait for weights", idle), ("receive weights", copy)):
            if width > 0:
                out.append(Segment("engines", what, t, width, step))
            t += width
    if evaluation > 0 and not behind:
        out.append(Segment("engines", "eval", publish_end, evaluation, step))
    return out


def layout(records: Sequence[dict[str, Any]], steps: Sequence[int]) -> list[Segment]:
    """Both lanes over ``steps`` (of the async records), one step after the other on the trainer's clock."""
    rows = [r for r in records if "async/trainer_wait_s" in r]
    by_step = {r[keys.STEP]: r for r in rows}
    t, out = 0.0, []
    for step in steps:
        r = by_step[step]
        trainer = trainer_segments(r, t)
        publish_end = max((s.start + s.width for s in trainer if s.what == "publish"),
                          default=trainer[-1].start + trainer[-1].width if trainer else t)
        out += trainer + engine_segments(r, by_step.get(step + 1), publish_end, by_step.get(step + 2))
        t += _f(r, keys.TIME_STEP)
    return out


def select_steps(records: Sequence[dict[str, Any]], spec: str | None, default_last: int = 6) -> list[int]:
    """The async steps ``spec`` names: ``N`` (the last N), ``A-B`` (steps A to B), or None (the last ``default_last``).
    Raises ValueError with the steps there are."""
    steps = [r[keys.STEP] for r in records if "async/trainer_wait_s" in r]
    if spec is None:
        return steps[-default_last:]
    try:
        if "-" in spec:
            first, last = (int(x) for x in spec.split("-", 1))
            chosen = [s for s in steps if first <= s <= last]
        else:
            chosen = steps[-int(spec):] if int(spec) > 0 else []
    except ValueError:
        chosen = None
    if not chosen:
        have = f"{steps[0]}-{steps[-1]}" if steps else "none"
        raise ValueError(f"--pipeline-steps {spec}: give N (the last N steps) or A-B (steps A to B) among the "
                         f"run's async steps ({have})")
    return chosen

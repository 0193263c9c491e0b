"""Settings of the rollout scheduler (``rollout.schedule``): how a step gathers its usable groups cheaply.

Every switch is off by default, and all off is DAPO's published batch-and-filter loop exactly (same prompts,
same seeds, same kept groups). ``preset`` names a set of switches: a recipe ships a faster one and
``rollout.schedule.preset=paper`` brings the published loop back in one key. Pure configuration: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SCHEDULE_PRESETS", "ScheduleConfig"]


class _Unset:
    """The default of a preset-driven switch: "not given", so the preset fills it (a value given beside a preset,
    even the plain default, is the user's and wins)."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()
_PLAIN: dict[str, Any] = {"streaming": False, "order": "prompt", "partial": False, "adaptive": False,
                          "stage_responses": 0, "history": False}
"""The switches a preset sets, at their values when neither the user nor a preset sets them (all off)."""

SCHEDULE_PRESETS: dict[str, dict[str, Any]] = {
    "paper": {},
    "partial_completion": {"streaming": True, "partial": True, "order": "completion"},
}
"""Named sets of switches (the others stay off). ``paper``: DAPO's published batch-and-filter loop, every switch off.
``partial_completion``: streaming with partial rollouts in completion order (off-policy tokens one step old: needs a
correction such as algo.tis_cap), what the step model ranks fastest for the 32B recipes (docs/rollout.md)."""


@dataclass
class ScheduleConfig:
    """Rollout scheduling switches (see docs/rollout.md, "Rollout cost")."""

    streaming: bool = UNSET
    """Generate each round in chunks of ``stream_chunk_prompts`` prompts, decide the groups of each chunk in prompt
    order, and stop as soon as the step holds train.prompts_per_step usable groups: prompts after that point are
    never drawn (they stay for the next step)."""

    stream_chunk_prompts: int = 8
    """Prompts per streamed chunk (streaming only). Smaller stops closer to the need; larger batches the engine
    better (on GPUs, a few hundred)."""

    order: str = UNSET
    """Streaming: the order the step decides its groups in. ``prompt`` (default): each chunk of
    ``stream_chunk_prompts`` prompts is decided in prompt order and the engines drain between chunks. ``completion``:
    a whole round goes to every engine group at once and the step takes each group as it ends (the engine groups'
    exchanges set the order: a pure function of the seed, the data, the world size and ``exchange_every``), so no
    engine waits for another's slowest response until the step is full. Prompts of the round that had not started
    when the step filled are continued at the next step with ``partial`` (as empty prefixes), else dropped."""

    exchange_every: int = 4
    """Streaming over several engine groups: decode steps every group takes between two exchanges of the groups that
    ended (each exchange is a few collectives over all ranks). Smaller stops closer to the need and costs more
    exchanges; the step is a pure function of the seed, the data, the world size and this value."""

    partial: bool = UNSET
    """Partial rollouts (off-policy, streaming only): the groups still in flight when a streamed step fills are kept
    as far as they got (tokens and the engine's log-probs) and continued first thing at the next step, by the new
    policy, instead of being thrown away. Their earlier tokens are one batch older than the batch that continues them
    (everything kept is continued at the very next step; one policy version in sync mode, up to
    rollout.pipeline.max_staleness in async mode) and are corrected by an off-policy
    correction: needs algo.tis_cap or algo.rollout_correction. Counted in sampling/groups_resumed, sampling/tokens_stale_kept
    (trained tokens an older policy sampled) and sampling/tokens_partial_buffered."""

    adaptive: bool = UNSET
    """Size each generation round from the usable-group fraction observed so far instead of a fixed
    rollout.gen_batch_prompts: need / estimated fraction x adaptive_margin, capped at adaptive_max_prompts."""

    adaptive_margin: float = 1.2
    """Over-sampling factor on top of the expected need (>= 1)."""

    adaptive_max_prompts: int = 0
    """Most prompts in one round; 0 = 4 x rollout.gen_batch_prompts."""

    adaptive_ema: float = 0.5
    """Weight of the latest step in the running usable-fraction estimate (in (0, 1]; 1 = last step only)."""

    adaptive_min_fraction: float = 0.05
    """Floor of the usable-fraction estimate, so a run of bad steps cannot ask for unbounded rounds."""

    stage_responses: int = UNSET
    """Staged groups: generate this many responses (k < rollout.n) of each prompt first and complete only the groups
    whose first k are mixed (they are sure to be usable); groups whose first k agree are skipped and counted
    (sampling/groups_stage_skipped; a bias towards prompts of middling difficulty). 0 = off."""

    stage_audit_fraction: float = 0.0
    """Fraction of stage-skipped groups completed anyway, only to measure the bias: how many of them would have been
    usable (sampling/groups_stage_audit_usable of sampling/groups_stage_audited). They are never trained on."""

    history: bool = UNSET
    """Prompt history (GRESO-like): skip prompts whose recent visits were all right or all wrong, with a probability
    that grows with the streak, is capped by history_max_skip_prob and decays with each skip. Saved in checkpoints."""

    history_skip_prob: float = 0.5
    """Skip probability after one uniform visit; after s uniform visits in a row: 1 - (1 - p)^s."""

    history_max_skip_prob: float = 0.9
    """Cap of the skip probability (every prompt keeps at least 1 - cap chance to be generated: exploration)."""

    history_decay: float = 0.5
    """Each skip multiplies a prompt's skip probability by this (in [0, 1]), until its next visit."""

    preset: str | None = None
    """A named set of the switches above (SCHEDULE_PRESETS): ``paper`` (DAPO's published loop, all off) or
    ``partial_completion`` (streaming + partial + order=completion). A switch given beside it overrides it; the
    switches hold the effective values (what config.yaml records). null: each switch as given, else off."""

    def __post_init__(self) -> None:
        chosen = SCHEDULE_PRESETS.get(self.preset, {}) if self.preset is not None else {}  # unknown: validate() names it
        for name, plain in _PLAIN.items():
            if getattr(self, name) is UNSET:
                setattr(self, name, chosen.get(name, plain))

    @property
    def enabled(self) -> bool:
        """Any switch on (else the trainer runs the published batch-and-filter loop)."""
        return self.streaming or self.adaptive or self.stage_responses > 0 or self.history

    def validate(self, n: int, dynamic_sampling: bool) -> None:
        """Raise ValueError naming the key and the fix."""
        if self.preset is not None and self.preset not in SCHEDULE_PRESETS:
            raise ValueError(f"rollout.schedule.preset={self.preset!r} is unknown; use one of "
                             f"{', '.join(SCHEDULE_PRESETS)} (or null)")
        if self.enabled and not dynamic_sampling:
            raise ValueError("rollout.schedule switches (streaming, adaptive, stage_responses, history) select usable "
                             "groups for dynamic sampling; set algo.dynamic_sampling=true or turn them off")
        if self.partial and (not self.streaming or self.stage_responses):
            raise ValueError("rollout.schedule.partial continues the groups a streamed step aborted: it needs "
                             "rollout.schedule.streaming=true and stage_responses=0")
        if self.order not in ("prompt", "completion"):
            raise ValueError(f"rollout.schedule.order={self.order!r}; use prompt or completion")
        if self.order == "completion" and (not self.streaming or self.stage_responses):
            raise ValueError("rollout.schedule.order=completion decides streamed groups as they end: it needs "
                             "rollout.schedule.streaming=true and stage_responses=0")
        if self.stream_chunk_prompts < 1:
            raise ValueError(f"rollout.schedule.stream_chunk_prompts={self.stream_chunk_prompts} must be >= 1 (e.g. 8)")
        if self.exchange_every < 1:
            raise ValueError(f"rollout.schedule.exchange_every={self.exchange_every} must be >= 1 (e.g. 4)")
        if self.adaptive_margin < 1.0:
            raise ValueError(f"rollout.schedule.adaptive_margin={self.adaptive_margin} must be >= 1 (e.g. 1.2)")
        if self.adaptive_max_prompts < 0:
            raise ValueError(f"rollout.schedule.adaptive_max_prompts={self.adaptive_max_prompts} must be >= 0 "
                             "(0 = 4 x rollout.gen_batch_prompts)")
        if not 0.0 < self.adaptive_ema <= 1.0:
            raise ValueError(f"rollout.schedule.adaptive_ema={self.adaptive_ema} must be in (0, 1] (e.g. 0.5)")
        if not 0.0 < self.adaptive_min_fraction <= 1.0:
            raise ValueError(f"rollout.schedule.adaptive_min_fraction={self.adaptive_min_fraction} must be in (0, 1] "
                             "(e.g. 0.05)")
        if self.stage_responses < 0 or (self.stage_responses and not 2 <= self.stage_responses < n):
            raise ValueError(f"rollout.schedule.stage_responses={self.stage_responses} must be 0 (off) or in "
                             f"[2, rollout.n={n}): a first stage of one response is never mixed")
        if not 0.0 <= self.stage_audit_fraction <= 1.0:
            raise ValueError(f"rollout.schedule.stage_audit_fraction={self.stage_audit_fraction} must be in [0, 1]")
        if not 0.0 < self.history_skip_prob <= 1.0:
            raise ValueError(f"rollout.schedule.history_skip_prob={self.history_skip_prob} must be in (0, 1] "
                             "(e.g. 0.5)")
        if not 0.0 <= self.history_max_skip_prob < 1.0:
            raise ValueError(f"rollout.schedule.history_max_skip_prob={self.history_max_skip_prob} must be in [0, 1): "
                             "1 would drop prompts forever; e.g. 0.9")
        if not 0.0 <= self.history_decay <= 1.0:
            raise ValueError(f"rollout.schedule.history_decay={self.history_decay} must be in [0, 1] (e.g. 0.5)")

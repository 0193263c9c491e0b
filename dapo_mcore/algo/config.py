"""Algorithm settings of DAPO (and the GRPO, GSPO, CISPO and RLOO variants): objective, clipping, loss aggregation,
advantages, sampling, shaping.

Pure configuration: no torch, no process groups. ``AlgoConfig.from_preset("dapo")`` gives the paper's
recipe; ``validate()`` refuses settings DAPO does not have (KL and entropy terms) with the fix in the message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dapo_mcore.algo.rollout_correction_config import RolloutCorrectionConfig
from dapo_mcore.algo.schedule_config import UNSET

BUILTIN_LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""The aggregation modes ``algo.loss`` registers (a test keeps the two equal): a config naming one of them is
checked without importing torch; any other name is looked up in the registry (a mode registered by the user)."""

OBJECTIVES = ("ppo_clip", "gspo", "cispo")
"""``algo.loss.OBJECTIVES`` (a test keeps the two equal), here so a config is checked without importing torch."""

ADVANTAGE_ESTIMATORS = ("grpo", "rloo")
"""``algo.advantages.ESTIMATORS`` (a test keeps the two equal)."""


@dataclass
class AlgoConfig:
    """DAPO algorithm configuration (defaults: the paper's 32B recipe)."""

    objective: str = UNSET
    """Policy objective: ppo_clip (DAPO/GRPO: the clipped token ratio), gspo (GSPO: the clipped sequence ratio, the
    length-normalized mean of the token log-ratios; preset gspo), cispo (CISPO: the clipped importance weight times
    the log-prob, no token's gradient dropped; preset cispo). clip_low/clip_high bound each objective's ratio."""

    advantage_estimator: str = "grpo"
    """Outcome advantages per group: grpo (reward minus the group mean, divided by the group std when
    norm_adv_by_std) or rloo (reward minus the mean of the other responses' rewards; needs rollout.n >= 2 and
    norm_adv_by_std=false)."""

    clip_low: float = UNSET
    """epsilon_low: the ratio is clipped below at 1 - clip_low (DAPO and GRPO: 0.2)."""

    clip_high: float = UNSET
    """epsilon_high: the ratio is clipped above at 1 + clip_high (DAPO "Clip-Higher": 0.28; GRPO: 0.2)."""

    dual_clip_c: float | None = None
    """Dual clip for negative advantages: token loss capped at -A*c; None disables, else c > 1 (verl 32B: 10)."""

    loss_agg: str = UNSET
    """Loss aggregation: token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum,
    seq-mean-token-sum-norm (Dr. GRPO, divides by overlong_max_len)."""

    norm_adv_by_std: bool = True
    """Divide group-centred rewards by the group's (unbiased) standard deviation."""

    adv_eps: float = 1e-6
    """Added to the group std before dividing (DAPO: 1e-6)."""

    dynamic_sampling: bool = UNSET
    """Keep only groups with mixed accuracy (0 < #correct < G), generating more batches until full."""

    max_gen_batches: int = 10
    """Most generation batches per training step with dynamic sampling (verl: 10); 0 = no limit."""

    overlong_shaping: bool = UNSET
    """Add the soft overlong punishment R_length in [-overlong_penalty_factor, 0] to the reward."""

    overlong_max_len: int = 20480
    """L_max: the maximum response length in tokens (must equal the rollout's max new tokens)."""

    overlong_cache_len: int = 4096
    """L_cache: the penalty ramps linearly from 0 at L_max - L_cache to -1 at L_max."""

    overlong_penalty_factor: float = 1.0
    """Scale of the soft overlong punishment (verl: 1.0)."""

    overlong_filter: bool = UNSET
    """Mask the loss of truncated responses (the paper's "overlong filtering" ablation)."""

    kl_coef: float = 0.0
    """KL penalty coefficient. DAPO has no KL term and no reference model: must stay 0."""

    entropy_coef: float = 0.0
    """Entropy bonus coefficient. DAPO logs entropy but does not optimize it: must stay 0."""

    tis_cap: float | None = None
    """Truncated importance sampling cap for engine-vs-trainer log-prob mismatch (e.g. 2.0); None disables. The short
    form of rollout_correction preset token_tis with is_threshold=tis_cap (set one or the other)."""

    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Off-policy correction beyond token TIS: sequence IS, IcePop, rejection (Geo-RS, K3-RS) and the bypass mode
    that skips the old-log-prob pass; `preset:` names a recipe (see docs/rollout.md)."""

    router_replay: str = "none"
    """MoE models: "rollout" = rollout routing replay (R3): the trainer's routers use the experts the rollout engine
    routed each token to (transformers engine), in the old-log-prob and training passes; gates stay the trainer's
    (so the router keeps its gradient). "none" = the trainer routes itself; moe/routing_mismatch_frac shows how often
    that differs from the engine where the engine records its routes anyway (the transformers engine does; vLLM
    captures them only with replay on, so with vLLM and "none" the metric is not logged)."""

    preset: str | None = None
    """A named objective recipe (PRESETS: dapo, grpo, gspo, cispo) setting objective, clip_low, clip_high,
    loss_agg, dynamic_sampling, overlong_shaping and overlong_filter; a key given beside it overrides it, and the
    keys hold the effective values (what config.yaml records). null: each key as given, else DAPO's."""

    def __post_init__(self) -> None:
        chosen = PRESETS.get(self.preset, {}) if self.preset is not None else {}  # unknown: validate() names it
        for name, plain in _PLAIN.items():
            if getattr(self, name) is UNSET:
                setattr(self, name, chosen.get(name, plain))

    @property
    def correction(self) -> RolloutCorrectionConfig:
        """The effective correction: ``tis_cap`` as token TIS, else ``rollout_correction`` with its preset resolved."""
        if self.tis_cap is not None:
            return RolloutCorrectionConfig(is_level="token", is_threshold=self.tis_cap)
        return self.rollout_correction.resolved()

    def validate(self) -> None:
        """Raise ValueError naming the fix for any inconsistent setting."""
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"algo.preset={self.preset!r} is unknown; use one of {', '.join(PRESETS)} (or null)")
        self._validate_objective()
        if not (0.0 < self.clip_low < 1.0 or (self.objective == "cispo" and self.clip_low == 1.0)):
            raise ValueError(f"algo.clip_low={self.clip_low} must be in (0, 1) (cispo: (0, 1], 1 = no lower bound); "
                             "DAPO uses 0.2")
        if self.clip_high <= 0.0:
            raise ValueError(f"algo.clip_high={self.clip_high} must be > 0; DAPO uses 0.28, GRPO 0.2")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"algo.dual_clip_c={self.dual_clip_c} must be > 1 (e.g. 10) or None to disable")
        if self.loss_agg not in BUILTIN_LOSS_AGGS:
            from dapo_mcore.algo.loss import loss_agg_names

            if self.loss_agg not in loss_agg_names():
                raise ValueError(f"algo.loss_agg={self.loss_agg!r} is unknown; valid: {', '.join(loss_agg_names())}")
        if self.adv_eps <= 0.0:
            raise ValueError(f"algo.adv_eps={self.adv_eps} must be > 0 (DAPO: 1e-6)")
        if self.max_gen_batches < 0:
            raise ValueError(f"algo.max_gen_batches={self.max_gen_batches} must be >= 0 (0 = no limit)")
        if self.overlong_max_len <= 0:
            raise ValueError(f"algo.overlong_max_len={self.overlong_max_len} must be > 0 (the max response length)")
        if not 0 < self.overlong_cache_len < self.overlong_max_len:
            raise ValueError(
                f"algo.overlong_cache_len={self.overlong_cache_len} must be in (0, overlong_max_len="
                f"{self.overlong_max_len}); the paper uses 4096 of 20480"
            )
        if self.overlong_penalty_factor < 0.0:
            raise ValueError(f"algo.overlong_penalty_factor={self.overlong_penalty_factor} must be >= 0")
        if self.kl_coef != 0.0:
            raise ValueError(
                f"algo.kl_coef={self.kl_coef}: DAPO has no KL term and no reference model; set algo.kl_coef=0"
            )
        if self.entropy_coef != 0.0:
            raise ValueError(
                f"algo.entropy_coef={self.entropy_coef}: DAPO logs entropy but does not optimize it; "
                "set algo.entropy_coef=0"
            )
        if self.router_replay not in ("none", "rollout"):
            raise ValueError(f"algo.router_replay={self.router_replay!r}; choose 'none' or 'rollout' (replay the "
                             "engine's experts in the trainer, MoE models)")
        if self.tis_cap is not None and self.tis_cap < 1.0:
            raise ValueError(
                f"algo.tis_cap={self.tis_cap} must be >= 1 (a cap below 1 down-weights every token); "
                "typical 2.0, or None to disable"
            )
        self.rollout_correction.validate()
        if self.tis_cap is not None and self.rollout_correction.active:
            raise ValueError(f"algo.tis_cap={self.tis_cap} and algo.rollout_correction both set a correction; keep one "
                             f"(algo.tis_cap=C is algo.rollout_correction.preset=token_tis with is_threshold=C)")

    def _validate_objective(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"algo.objective={self.objective!r} is unknown; valid: {', '.join(OBJECTIVES)}")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"algo.advantage_estimator={self.advantage_estimator!r} is unknown; valid: "
                             f"{', '.join(ADVANTAGE_ESTIMATORS)}")
        if self.advantage_estimator == "rloo" and self.norm_adv_by_std:
            raise ValueError("algo.advantage_estimator=rloo takes no std normalization: set algo.norm_adv_by_std=false")
        if self.dual_clip_c is not None and self.objective != "ppo_clip":
            raise ValueError(f"algo.dual_clip_c={self.dual_clip_c} belongs to the ppo_clip objective; set "
                             f"algo.dual_clip_c=null with algo.objective={self.objective}")

    def advisories(self) -> list[str]:
        """Settings that are valid but almost surely not meant (logged once at start by ``config``/``train``)."""
        out = []
        if self.objective == "gspo" and max(self.clip_low, self.clip_high) >= 0.01:
            out.append(f"algo.objective=gspo with clip_low={self.clip_low:g} clip_high={self.clip_high:g}: GSPO clips a "
                       "sequence ratio (the exp of a mean of token log-ratios), which stays close to 1, so a PPO-sized "
                       "range almost never clips; GSPO's paper clips at 3e-4 / 4e-4 (algo.preset=gspo sets them)")
        return out

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> AlgoConfig:
        """Build a validated config from a named preset (``PRESETS``) with field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown algo preset {name!r}; valid: {', '.join(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown AlgoConfig field(s) {unknown}; valid: {', '.join(sorted(fields))}")
        cfg = cls(**{**PRESETS[name], **overrides})
        cfg.validate()
        return cfg


PRESETS: dict[str, dict[str, Any]] = {
    "dapo": {
        "clip_low": 0.2,
        "clip_high": 0.28,
        "loss_agg": "token-mean",
        "dynamic_sampling": True,
        "overlong_shaping": True,
        "overlong_filter": False,
    },
    "grpo": {
        "clip_low": 0.2,
        "clip_high": 0.2,
        "loss_agg": "seq-mean-token-mean",
        "dynamic_sampling": False,
        "overlong_shaping": False,
        "overlong_filter": False,
    },
    "gspo": {
        "objective": "gspo",
        "clip_low": 3e-4,
        "clip_high": 4e-4,
        "loss_agg": "seq-mean-token-mean",
    },
    "cispo": {
        "objective": "cispo",
        "clip_low": 1.0,
        "clip_high": 4.0,
        "loss_agg": "token-mean",
    },
}
"""Named recipes: "dapo" (the paper) and "grpo" (the naive baseline of its ablation table); "gspo" (GSPO, Zheng et
al. 2025, arXiv:2507.18071: sequence ratio clipped to [1 - 3e-4, 1 + 4e-4], sequence-mean loss) and "cispo" (CISPO,
MiniMax-M1, arXiv:2506.13585: token-level normalization, no lower bound on the weight; the upper bound 1 + 4 that
MiniMax-M1 does not publish is ScaleRL's, arXiv:2510.13786). The rest of each recipe is DAPO's (dynamic sampling,
overlong shaping); docs/algorithms.md gives the sources. ``algo.preset=NAME`` selects one in a config."""

_PLAIN: dict[str, Any] = {"objective": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28, "loss_agg": "token-mean",
                          "dynamic_sampling": True, "overlong_shaping": True, "overlong_filter": False}
"""The preset-driven keys at their values when neither the user nor a preset sets them: DAPO's (PRESETS["dapo"])."""

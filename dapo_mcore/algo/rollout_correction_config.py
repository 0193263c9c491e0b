"""The settings of the rollout correction (``algo.rollout_correction``): fields, validation and the named presets.

Pure configuration, no torch (reading a config imports none: tests/test_fast_paths.py); the correction itself is
``dapo_mcore.algo.rollout_correction``, which re-exports everything here.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields
from typing import Any

LOG_CLAMP = 20.0
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_mean_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
"""Rejection options; ``*_k1`` take a ratio band (lo, hi), the others an upper bound u."""

Threshold = float | list[float]


class _Unset:
    """The default of a correction field: "not given", so a preset fills it (a value equal to the plain default,
    given beside a preset, is the user's and wins)."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()
_PLAIN = {"is_level": None, "is_threshold": None, "is_batch_normalize": False, "rs": [], "rs_thresholds": [],
          "bypass": False}
"""Each field's value when neither the user nor a preset sets it."""


@dataclass
class RolloutCorrectionConfig:
    """Off-policy correction between the rollout engine's and the trainer's log-probs (verl's rollout correction).

    Set ``preset`` for a named recipe; a field given beside it overrides the preset's value (even when it equals the
    field's plain default, e.g. ``preset=bypass_ppo_clip bypass=false``). The preset is resolved on construction: the
    fields hold the effective values (what ``config.yaml`` records), ``preset`` stays as the recipe's name.
    """

    is_level: str | None = UNSET
    """Importance weights: token (w_t = r_t), sequence (w = prod_t r_t for every token), or null (none)."""
    is_threshold: float | list[float] | None = UNSET
    """A number C truncates w to min(w, C) (TIS, typical 2.0); a pair [lo, hi] zeroes w outside it (IcePop)."""
    is_batch_normalize: bool = UNSET
    """Divide the truncated weights by their mean over the global batch (tokens or responses, by is_level)."""
    rs: list[str] = UNSET
    """Rejection options, all must pass: token_k1/k2/k3, seq_sum_k1, seq_mean_k1 (Geo-RS), seq_{sum,mean,max}_k{2,3}."""
    rs_thresholds: list[float | list[float]] = UNSET
    """One per rs option: a ratio band [lo, hi] for *_k1, an upper bound u for k2/k3."""
    bypass: bool = UNSET
    """Skip the old-log-prob pass: the PPO ratio is pi_theta / pi_rollout; weights and rejection use pi_theta."""
    preset: str | None = None
    """A named recipe (PRESETS): token_tis, seq_tis, seq_mis, icepop, geo_rs, geo_rs_token_tis, k3_rs,
    bypass_ppo_clip, bypass_ppo_clip_geo_rs, disabled."""

    def __post_init__(self) -> None:
        base = PRESETS.get(self.preset) if self.preset is not None else None  # unknown: validate() names it
        for name, plain in _PLAIN.items():
            if getattr(self, name) is UNSET:
                setattr(self, name, copy.deepcopy(getattr(base, name) if base is not None else plain))
        if isinstance(self.rs, str):
            self.rs = [self.rs]
        self.rs = list(self.rs or [])
        t = self.rs_thresholds if self.rs_thresholds is not None else []
        if isinstance(t, (int, float)):
            t = [t]
        elif (len(self.rs) == 1 and isinstance(t, (list, tuple)) and len(t) == 2
              and all(isinstance(v, (int, float)) for v in t) and self.rs[0].endswith("k1")):
            t = [list(t)]  # one k1 option given its band directly
        self.rs_thresholds = [list(v) if isinstance(v, (list, tuple)) else v for v in t]
        if isinstance(self.is_threshold, tuple):
            self.is_threshold = list(self.is_threshold)

    def resolved(self) -> RolloutCorrectionConfig:
        """The effective correction: these fields (the preset was applied on construction), without the name."""
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"algo.rollout_correction.preset={self.preset!r} is unknown; valid: {', '.join(PRESETS)}")
        return self if self.preset is None else RolloutCorrectionConfig(**self.settings())

    def settings(self) -> dict[str, Any]:
        """The effective fields as plain values (no ``preset``): what two spellings of one correction share."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "preset"}

    @property
    def active(self) -> bool:
        """Whether it changes the loss at all (weights, rejection or bypass)."""
        r = self.resolved()
        return r.is_level is not None or bool(r.rs) or r.bypass

    def validate(self, key: str = "algo.rollout_correction") -> None:
        """Raise ValueError naming the key and the fix for a bad setting."""
        r = self.resolved()
        if r.is_level not in (None, "token", "sequence"):
            raise ValueError(f"{key}.is_level={r.is_level!r} is unknown; use token, sequence or null")
        if r.is_threshold is not None:
            _check_threshold(f"{key}.is_threshold", r.is_threshold, pair_ok=True, number_ok=True)
            if not isinstance(r.is_threshold, list) and r.is_threshold < 1.0:
                raise ValueError(f"{key}.is_threshold={r.is_threshold} must be >= 1 (a cap below 1 down-weights every "
                                 "token); typical 2.0, or a band [lo, hi] (IcePop) to zero weights outside it")
        elif r.is_level is not None:
            raise ValueError(f"{key}.is_threshold is needed with is_level={r.is_level!r}: a cap (e.g. 2.0) or an "
                             "IcePop band [lo, hi] (e.g. [0.5, 5.0])")
        unknown = [o for o in r.rs if o not in RS_OPTIONS]
        if unknown:
            raise ValueError(f"{key}.rs: unknown option(s) {unknown}; valid: {', '.join(RS_OPTIONS)}")
        if len(set(r.rs)) != len(r.rs):
            raise ValueError(f"{key}.rs={r.rs} names an option twice; give each once")
        if len(r.rs_thresholds) != len(r.rs):
            raise ValueError(f"{key}.rs_thresholds has {len(r.rs_thresholds)} value(s) for {len(r.rs)} rs option(s); "
                             "give one per option ([lo, hi] for *_k1, a number for k2/k3)")
        for i, (opt, thr) in enumerate(zip(r.rs, r.rs_thresholds, strict=True)):
            k1 = opt.endswith("k1")
            _check_threshold(f"{key}.rs_thresholds[{i}] ({opt})", thr, pair_ok=k1, number_ok=not k1)


def _check_threshold(key: str, value: Threshold, *, pair_ok: bool, number_ok: bool) -> None:
    if isinstance(value, list):
        if not pair_ok:
            raise ValueError(f"{key}={value}: a pair where a number is required; give one upper bound (e.g. 0.01)")
        if len(value) != 2:
            raise ValueError(f"{key}={value}: a band is two numbers [lo, hi] (e.g. [0.5, 2.0])")
        lo, hi = value
        if not (lo > 0 and hi > 0 and math.isfinite(lo) and math.isfinite(hi)):
            raise ValueError(f"{key}={value}: both bounds must be positive finite numbers (e.g. [0.5, 2.0])")
        if lo > hi:
            raise ValueError(f"{key}={value}: lo > hi; give [lo, hi] with lo <= hi (e.g. [0.5, 2.0])")
        return
    if not number_ok:
        raise ValueError(f"{key}={value}: a number where a band [lo, hi] is required (e.g. [0.999, 1.001])")
    if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
        raise ValueError(f"{key}={value!r}: must be a positive finite number (e.g. 2.0)")


PRESETS: dict[str, RolloutCorrectionConfig] = {
    "disabled": RolloutCorrectionConfig(),
    "token_tis": RolloutCorrectionConfig(is_level="token", is_threshold=2.0),
    "seq_tis": RolloutCorrectionConfig(is_level="sequence", is_threshold=2.0),
    "seq_mis": RolloutCorrectionConfig(is_level="sequence", is_threshold=2.0, rs=["seq_sum_k1"],
                                       rs_thresholds=[[0.5, 2.0]]),
    "icepop": RolloutCorrectionConfig(is_level="token", is_threshold=[0.5, 5.0]),
    "geo_rs": RolloutCorrectionConfig(rs=["seq_mean_k1"], rs_thresholds=[[0.999, 1.001]]),
    "geo_rs_token_tis": RolloutCorrectionConfig(is_level="token", is_threshold=2.0, rs=["seq_mean_k1"],
                                                rs_thresholds=[[0.999, 1.001]]),
    "k3_rs": RolloutCorrectionConfig(rs=["seq_mean_k3"], rs_thresholds=[0.01]),
    "bypass_ppo_clip": RolloutCorrectionConfig(bypass=True),
    "bypass_ppo_clip_geo_rs": RolloutCorrectionConfig(rs=["seq_mean_k1"], rs_thresholds=[[0.999, 1.001]],
                                                      bypass=True),
}
"""Named recipes, thresholds as verl's RolloutCorrectionConfig factories (IcePop's band [0.5, 5] from its paper)."""


def effective_settings(algo: dict[str, Any], *, legacy: bool = False) -> dict[str, Any]:
    """The correction an ``algo`` section of a written config.yaml applies, as plain field values: ``tis_cap: C``
    and ``rollout_correction: {preset: token_tis, is_threshold: C}`` give the same. ``legacy`` reads it as versions
    that applied a preset only to the fields left at their plain defaults wrote it."""
    if algo.get("tis_cap") is not None:
        return RolloutCorrectionConfig(is_level="token", is_threshold=algo["tis_cap"]).settings()
    given = algo.get("rollout_correction") or {}
    names = {f.name for f in fields(RolloutCorrectionConfig)}
    values = {k: v for k, v in given.items() if k in names}
    if legacy:
        values = {k: v for k, v in values.items() if k == "preset" or v != _PLAIN.get(k)}
    try:
        return RolloutCorrectionConfig(**values).settings()
    except (TypeError, ValueError) as exc:  # a hand-edited file: compare it as written
        return {"unreadable": f"{given!r} ({exc})"}

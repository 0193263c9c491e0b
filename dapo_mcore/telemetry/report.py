"""Run reports: PNG figures from ``metrics.jsonl`` and ``ledger.jsonl`` (``dapo-mcore report``).

One figure per observable (accuracy, reward, entropy, response length, usable groups, clip
fractions, update health) plus a cost figure (seconds per phase, tokens generated kept vs rejected,
cumulative totals). A figure whose quantities live on different scales (update health: grad norm ~1,
engine/trainer KL ~1e-7) gets one panel per quantity, on a log axis where a series spans decades.
``--compare`` draws several runs on one figure (a grid of labelled panels, one legend below them), against
step, generated tokens (default: the cost of an experiment) or wall seconds. Metrics a run did not log are
skipped with a warning.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# The object-oriented Figure renders with the Agg canvas without pyplot, so importing this module
# never switches the process-wide matplotlib backend (report runs on login nodes and in CI).
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from dapo_mcore.errors import naming
from dapo_mcore.telemetry import keys
from dapo_mcore.telemetry.diagnose import load_run

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Panel:
    """One line figure: a title, a y label and the (key, label) series it draws."""

    name: str
    title: str
    ylabel: str
    series: tuple[tuple[str, str], ...]
    split: bool = False
    """One subplot per series (quantities on different scales) instead of all on one axis."""
    optional: bool = False
    """Drawn only for runs that log it (e.g. ``algo.tis_cap``), without a warning for the others."""


PANELS: tuple[Panel, ...] = (
    Panel("accuracy", "Accuracy", "accuracy", (
        (keys.ROLLOUT_ACC_MEAN, "train acc (rollouts)"), (keys.EVAL_AVG_AT_K, "held-out avg@k"),
        (keys.EVAL_PASS_AT_K, "held-out pass@k"), (keys.EVAL_MAJ_AT_K, "held-out maj@k"))),
    Panel("reward", "Reward", "mean reward", ((keys.ROLLOUT_REWARD_MEAN, "reward"),)),
    Panel("entropy", "Policy entropy", "nats / token", ((keys.TRAIN_ENTROPY, "entropy"),)),
    Panel("response_length", "Response length", "tokens", (
        (keys.ROLLOUT_RESP_LEN_MEAN, "mean"), (keys.ROLLOUT_RESP_LEN_MAX, "max"),
        (keys.ROLLOUT_RESP_LEN_MIN, "min"))),
    Panel("usable_groups", "Dynamic sampling", "fraction", (
        (keys.ROLLOUT_USABLE_GROUP_FRAC, "usable-group fraction"), (keys.ROLLOUT_TRUNCATED_FRAC, "truncated fraction"))),
    Panel("clipfrac", "Clip fractions", "fraction of tokens", (
        (keys.TRAIN_CLIPFRAC, "all"), (keys.TRAIN_CLIPFRAC_LOW, "low (1-eps_low)"),
        (keys.TRAIN_CLIPFRAC_HIGH, "high (1+eps_high)"), (keys.TRAIN_DUAL_CLIPFRAC, "dual clip"))),
    Panel("update", "Update health", "value", (
        (keys.TRAIN_GRAD_NORM, "grad norm (before clipping)"), (keys.TRAIN_PPO_KL, "ppo_kl (old - new logp)"),
        (keys.MISMATCH_KL, "engine/trainer KL (k1)"), (keys.MISMATCH_LOGP_ABS_DIFF_MEAN, "engine/trainer |dlogp| mean")),
        split=True),
    Panel("tis", "Truncated importance sampling (algo.tis_cap)", "value", (
        ("mismatch/tis_mean", "mean TIS weight"), ("mismatch/tis_clip_frac", "fraction of tokens at the cap"),
        ("train/tis_weight", "TIS weight in the loss")), split=True, optional=True),
    Panel("tools", "Tool use (rollout.tools)", "value", (
        (keys.TOOLS_CALLS_PER_RESPONSE, "tool calls per response"), (keys.TOOLS_ERROR_RATE, "tool error rate"),
        (keys.TOOLS_ACC_WITH, "accuracy, responses with a call"),
        (keys.TOOLS_ACC_WITHOUT, "accuracy, responses without one")), split=True, optional=True),
    Panel("lora", "LoRA adapters", "L2 norm", (
        ("lora/update_norm", "update per optimizer step"), ("lora/adapter_norm", "adapters")), split=True,
        optional=True),
)
LINE_STYLES: tuple[tuple[str, float, str | None], ...] = (("-", 3.0, None), ("--", 2.2, "o"), (":", 2.0, "s"),
                                                         ("-.", 1.4, "^"))
"""(linestyle, width, marker) per series of a shared axis, thick to thin: a series equal to another (``all`` and
``low`` when nothing clips high; ``high`` and ``dual clip``) still shows under it."""

COMPARE_PANELS: tuple[tuple[str, str, str], ...] = (
    (keys.EVAL_AVG_AT_K, "Held-out avg@k", "accuracy"), (keys.ROLLOUT_ACC_MEAN, "Train accuracy (rollouts)", "accuracy"),
    (keys.ROLLOUT_USABLE_GROUP_FRAC, "Usable-group fraction", "fraction of groups"),
    (keys.TRAIN_ENTROPY, "Policy entropy", "nats / token"),
    (keys.ROLLOUT_RESP_LEN_MEAN, "Mean response length", "tokens"),
    (keys.ROLLOUT_GEN_BATCHES, "Generation batches per step (dynamic sampling)", "batches"),
)
"""(key, title, y label); ``avg@k`` is spelled with the run's k."""

X_AXES: dict[str, tuple[str | None, str]] = {
    "step": (None, "step"),
    "generated_tokens": (keys.cost_key("tokens_generated", cumulative=True), "generated tokens (cumulative)"),
    "wall_seconds": (keys.cost_seconds_key("step", cumulative=True), "wall seconds (cumulative)"),
    "device_hours": (keys.COST_TOTAL_DEVICE_HOURS, "device-hours (cumulative; fair across rank counts)"),
}
"""``--x`` choices: the key holding each step's x value (None: the step itself) and the axis label."""


def series(records: Sequence[dict[str, Any]], key: str, smooth: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records holding ``key``; ``smooth`` > 1 applies a trailing moving average."""
    pairs = [(r[keys.STEP], r[key]) for r in records if key in r and r[key] is not None]
    steps = np.array([p[0] for p in pairs], dtype=float)
    values = np.array([p[1] for p in pairs], dtype=float)
    if smooth > 1 and len(values) > 1:
        cums = np.cumsum(np.insert(values, 0, 0.0))
        idx = np.arange(1, len(values) + 1)
        lo = np.maximum(idx - smooth, 0)
        values = (cums[idx] - cums[lo]) / (idx - lo)
    return steps, values


def _figure(ncols: int, width: float, height: float) -> tuple[Figure, Any]:
    fig = Figure(figsize=(width, height))
    return fig, fig.subplots(1, ncols)


def _save(fig: Figure, path: Path, layout: bool = True) -> Path:
    """Integer step ticks (a 3-step run shows 1, 2, 3, not 1.0, 1.5, ...), then an atomic write: the PNG goes to a
    temporary name and is renamed into place, so a kill mid-savefig never leaves a 0-byte or half figure."""
    for ax in fig.axes:
        if ax.get_xlabel() == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if layout:
        fig.tight_layout()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with naming(path):  # matplotlib's write errors name no file
        try:
            fig.savefig(tmp, dpi=110, format="png")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def _k_label(records: Sequence[dict[str, Any]], text: str) -> str:
    """``avg@k`` -> ``avg@4`` when the run logged its k."""
    ks = [r[keys.EVAL_K] for r in records if keys.EVAL_K in r]
    return text.replace("@k", f"@{int(ks[-1])}") if ks else text


def _use_log(values: np.ndarray) -> bool:
    """A log axis for a positive series spanning more than two decades."""
    finite = values[np.isfinite(values)]
    return len(finite) > 1 and bool(np.all(finite > 0)) and finite.max() / finite.min() > 100


def _draw(ax: Any, records: Sequence[dict[str, Any]], key: str, label: str, smooth: int,
          style: int | None = None) -> np.ndarray:
    x, y = series(records, key, smooth)
    sparse = len(x) < 0.5 * len(records)  # e.g. eval every N steps: show the points
    if style is None:
        ax.plot(x, y, marker="o" if sparse else None, markersize=3, label=label)
        return y
    linestyle, width, marker = LINE_STYLES[style % len(LINE_STYLES)]
    ax.plot(x, y, linestyle=linestyle, linewidth=width, marker=marker or ("o" if sparse else None), markersize=4,
            markevery=max(1, len(x) // 12), label=label)
    return y


def _line_figure(records: Sequence[dict[str, Any]], panel: Panel, out: Path, smooth: int,
                 max_len: int | None = None) -> Path | None:
    present = [(k, _k_label(records, lbl)) for k, lbl in panel.series if any(k in r for r in records)]
    missing = [k for k, _ in panel.series if not any(k in r for r in records)]
    if not present:
        if not panel.optional:
            logger.warning("skipping figure %r: none of %s were logged", panel.name, [k for k, _ in panel.series])
        return None
    if missing and not panel.optional:
        logger.warning("figure %r: not logged, skipped: %s", panel.name, missing)
    if panel.split:
        fig, axes = _figure(len(present), 3.6 * len(present), 3.4)
        axes = np.atleast_1d(axes)
        for ax, (key, label) in zip(axes, present, strict=True):
            y = _draw(ax, records, key, label, smooth)
            if _use_log(y):
                ax.set_yscale("log")
            ax.set(title=label, xlabel="step", ylabel=key)
            ax.grid(alpha=0.3)
        fig.suptitle(panel.title)
        return _save(fig, out / f"{panel.name}.png")
    fig, ax = _figure(1, 7, 4)
    for i, (key, label) in enumerate(present):
        _draw(ax, records, key, label, smooth, style=i)
    if panel.name == "response_length" and max_len is not None:
        ax.axhline(max_len, color="gray", linestyle="--", linewidth=1, label=f"rollout.max_new_tokens={max_len}")
    ax.set(title=panel.title, xlabel="step", ylabel=panel.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    return _save(fig, out / f"{panel.name}.png")


def phase_seconds(records: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Seconds per phase per step (0 where a phase did not run), from ``time/*`` or the ledger."""
    out: dict[str, np.ndarray] = {}
    for phase in keys.PHASES:
        for key in (keys.time_key(phase), keys.cost_seconds_key(phase, cumulative=False)):
            if any(key in r for r in records):
                out[phase] = np.array([float(r.get(key, 0.0)) for r in records])
                break
    return out


def phase_labels(records: Sequence[dict[str, Any]], phases: Sequence[str]) -> list[str]:
    """The legend of the phases in words, as ``profile`` names them."""
    from dapo_mcore.telemetry import lanes

    return [lanes.phase_label(p, lanes.is_async(records)) for p in phases]


def cost_figure(records: Sequence[dict[str, Any]], out: Path) -> Path | None:
    """Seconds per phase (stacked), tokens generated kept vs rejected, and cumulative totals."""
    steps = np.array([r[keys.STEP] for r in records], dtype=float)
    phases = phase_seconds(records)
    kept_key = keys.cost_key("tokens_generated_kept", cumulative=False)
    rej_key = keys.cost_key("tokens_generated_rejected", cumulative=False)
    has_tokens = any(kept_key in r for r in records)
    if not phases and not has_tokens:
        logger.warning("skipping figure 'cost': no time/* or cost/* metrics were logged")
        return None
    fig, axes = _figure(3, 16, 4.2)
    inner = {p: s for p, s in phases.items() if p != keys.STEP_PHASE}
    if inner:
        axes[0].stackplot(steps, *inner.values(), labels=phase_labels(records, list(inner)), alpha=0.8)
    if keys.STEP_PHASE in phases:
        axes[0].plot(steps, phases[keys.STEP_PHASE], color="black", linewidth=1, label="step (wall)")
    axes[0].set(title="Seconds per phase", xlabel="step", ylabel="seconds")
    if phases:
        axes[0].legend(fontsize=7)
    if has_tokens:
        kept = np.array([float(r.get(kept_key, 0)) for r in records])
        rejected = np.array([float(r.get(rej_key, 0)) for r in records])
        surplus = np.array([float(r.get(keys.cost_key("tokens_generated_surplus", cumulative=False), 0))
                            for r in records])
        aborted = np.array([float(r.get(keys.cost_key("tokens_generated_aborted", cumulative=False), 0))
                            for r in records])
        filtered = rejected - surplus  # kept + filtered + surplus + aborted = generated
        bottom = np.zeros_like(kept)
        for part, label, color in ((kept, "kept (trained on)", "tab:green"),
                                   (filtered, "rejected by dynamic sampling", "tab:red"),
                                   (surplus, "surplus groups", "tab:orange"), (aborted, "aborted", "tab:gray")):
            if part.any() or label.startswith("kept"):
                axes[1].bar(steps, part, bottom=bottom, label=label, color=color)
                bottom = bottom + part
        axes[1].legend(fontsize=7)
        axes[2].plot(steps, np.cumsum(kept), label="generated, kept", color="tab:green")
        axes[2].plot(steps, np.cumsum(filtered), label="generated, rejected by dynamic sampling", color="tab:red")
        if surplus.any():
            axes[2].plot(steps, np.cumsum(surplus), label="generated, surplus groups", color="tab:orange")
        _, trained = series(records, keys.cost_key("tokens_trained", cumulative=True))
        if len(trained) == len(steps):
            axes[2].plot(steps, trained, label="trained (prompt + response)", color="tab:blue")
        axes[2].legend(fontsize=7, loc="upper left")
        _, hours = series(records, keys.COST_TOTAL_DEVICE_HOURS)
        if len(hours) == len(steps):
            twin = axes[2].twinx()
            twin.plot(steps, hours, color="gray", linestyle="--")
            twin.set_ylabel("device-hours (dashed)")
    else:
        logger.warning("figure 'cost': no cost/* token counters logged; token panels left empty")
    axes[1].set(title="Tokens generated per step", xlabel="step", ylabel="tokens")
    axes[2].set(title="Cumulative tokens", xlabel="step", ylabel="tokens")
    for ax in axes:
        ax.grid(alpha=0.3)
    return _save(fig, out / "cost.png")


PIPELINE_STEPS = 6
"""Steps the async timeline shows by default (the last ones; ``report --pipeline-steps`` chooses others)."""
PIPELINE_COLOURS = {"wait for rollouts": "tab:red", "wait for eval": "mistyrose", "old log-probs": "lightsteelblue",
                    "train": "tab:blue", "publish": "tab:cyan", "checkpoint": "tab:brown", "other": "lightgray",
                    "generate + score": "tab:green", "wait for weights": "tab:orange",
                    "receive weights": "tab:purple", "eval": "tab:gray"}


def pipeline_figure(records: Sequence[dict[str, Any]], out: Path, steps: Sequence[int] | None = None) -> Path | None:
    """Async mode: the trainer's and the engines' lanes over ``steps`` (default: the last ``PIPELINE_STEPS``), every
    second drawn once (``telemetry.lanes``: the trainer's bars of a step sum to its wall time; eval is on the
    engines' lane, the trainer's lane shows its wait for it)."""
    from dapo_mcore.telemetry import lanes

    if not lanes.is_async(records):
        return None
    steps = list(steps) if steps is not None else lanes.select_steps(records, None, PIPELINE_STEPS)
    fig, ax = _figure(1, 14, 3.4)
    used: set[str] = set()
    for seg in lanes.layout(records, steps):
        ax.broken_barh([(seg.start, seg.width)], (1 if seg.lane == "trainer" else 0, 0.8),
                       color=PIPELINE_COLOURS[seg.what], label=None if seg.what in used else seg.what)
        used.add(seg.what)
    t = 0.0
    for r in (r for r in records if r[keys.STEP] in set(steps) and "async/trainer_wait_s" in r):
        ax.text(t, 1.85, f"step {r[keys.STEP]}", fontsize=7)
        ax.axvline(t, color="black", linewidth=0.5, alpha=0.3)
        t += float(r.get(keys.TIME_STEP) or 0.0)
    ax.set(yticks=[0.4, 1.4], yticklabels=["engines", "trainer"], xlabel="seconds (laid out from per-step times)",
           title=f"Async pipeline, steps {steps[0]}-{steps[-1]}")
    ax.legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.28), frameon=False)
    ax.set_ylim(-0.2, 2.3)
    return _save(fig, out / "pipeline.png")


def correction_active(run_dir: Path) -> bool:
    """Whether the run's config.yaml applies a rollout correction (any spelling); True when it cannot be read."""
    import yaml

    from dapo_mcore.algo.rollout_correction_config import effective_settings

    path = Path(run_dir) / "config.yaml"
    try:
        algo = (yaml.safe_load(path.read_text()) or {}).get("algo") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return True
    eff = effective_settings(algo) if isinstance(algo, dict) else {}
    return "unreadable" in eff or bool(eff.get("is_level") or eff.get("rs") or eff.get("bypass"))


def correction_label(run_dir: Path) -> str:
    """The correction as diagnose names it (``preset geo_rs``, ``algo.tis_cap=2.0``), '' when none or unreadable."""
    import yaml

    from dapo_mcore.telemetry.diagnose import Run, _correction_name

    try:
        config = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return ""
    return _correction_name(Run([], config if isinstance(config, dict) else {}))


def correction_figure(records: Sequence[dict[str, Any]], out: Path, smooth: int = 1,
                      active: bool = True, label: str = "") -> Path | None:
    """Rollout correction (algo.rollout_correction): the gap between the engine's and the trainer's policy and what
    the correction did with it, per step: IS weights, effective sample size, rejected fractions, off-policy KL."""
    if not any(keys.CORR_KL_K3 in r for r in records):
        return None
    if not active:
        return None  # a run without correction logs the gap only: flat weights and rejection panels say nothing
    panels = [
        ("IS weights", [(keys.CORR_IS_WEIGHT_MEAN, "mean"), (keys.CORR_IS_WEIGHT_MIN, "min"),
                        (keys.CORR_IS_WEIGHT_MAX, "max")]),
        ("effective sample size (fraction)", [(keys.CORR_ESS, "ESS")]),
        ("rejected fraction", [(keys.CORR_REJECTED_TOKEN_FRAC, "tokens"), (keys.CORR_REJECTED_SEQ_FRAC, "responses")]),
        ("off-policy gap", [(keys.CORR_KL_K1, "KL k1"), (keys.CORR_KL_K3, "KL k3"), (keys.CORR_CHI2, "chi-squared"),
                            (keys.CORR_LOG_PPL_DIFF, "log-PPL diff")]),
    ]
    fig, axes = _figure(len(panels), 4.2 * len(panels), 3.4)
    for ax, (title, lines) in zip(axes, panels, strict=True):
        for key, label in lines:
            steps, values = series(records, key, smooth)
            if len(steps):
                ax.plot(steps, values, label=label)
        ax.set(title=title, xlabel="step")
        ax.legend(fontsize=7)
    bypass = any(keys.CORR_BYPASS in r for r in records)
    fig.suptitle("Rollout correction" + (f": {label}" if label else "") + (" (bypass: pi_theta vs the engine, measured in training)" if bypass
                                         else " (pi_old vs the engine)"))
    return _save(fig, out / "rollout_correction.png")


def staleness_figure(records: Sequence[dict[str, Any]], out: Path) -> Path | None:
    """Trained tokens per step, stacked by how many policy versions they lag (``telemetry.staleness``)."""
    from dapo_mcore.telemetry import staleness

    lags = sorted(staleness.totals(records))
    if not lags:
        return None
    rows = [r for r in records if any(k.startswith(staleness.PREFIX) for k in r)]
    steps = np.array([r[keys.STEP] for r in rows])
    fig, ax = _figure(1, 6.0, 3.6)
    bottom = np.zeros(len(rows))
    for lag in lags:
        values = np.array([float(r.get(f"{staleness.PREFIX}{lag}", 0.0)) for r in rows])
        ax.bar(steps, values, bottom=bottom, label=f"lag {lag}")
        bottom += values
    ax.set(title="Trained tokens by policy-version lag", xlabel="step", ylabel="tokens")
    ax.legend(fontsize=7)
    return _save(fig, out / "staleness.png")


def write_report(run_dir: Path, out: Path | None = None, smooth: int = 1,
                 pipeline_steps: Sequence[int] | None = None) -> list[Path]:
    """Write every figure of one run; returns the files written."""
    records = load_run(run_dir)
    out = Path(out) if out is not None else Path(run_dir) / "figures"
    out.mkdir(parents=True, exist_ok=True)
    cfg = _run_config(Path(run_dir))
    value = cfg.get("rollout", {}).get("max_new_tokens")
    max_len = value if isinstance(value, int) else None
    objective = cfg.get("algo", {}).get("objective", "ppo_clip")
    panels = [clip_panel(objective) if p.name == "clipfrac" else p for p in PANELS]
    written = [_line_figure(records, panel, out, smooth, max_len) for panel in panels]
    written.append(cost_figure(records, out))
    written.append(pipeline_figure(records, out, pipeline_steps))
    written.append(correction_figure(records, out, smooth, active=correction_active(Path(run_dir)),
                                     label=correction_label(Path(run_dir))))
    written.append(staleness_figure(records, out))
    written.append(moe_figure(records, out, smooth))
    return [p for p in written if p is not None]


MOE_PANEL = Panel("moe", "MoE routing", "value", (
    ("moe/routing_mismatch_frac", "routing mismatch (engine vs trainer top-k, token-layer pairs)"),
    ("moe/load_max_over_mean", "load balance: tokens per expert max/mean"), ("moe/aux_loss", "aux loss (unscaled)")),
    split=True)


def moe_figure(records: Sequence[dict[str, Any]], out: Path, smooth: int) -> Path | None:
    """MoE runs only (no warning for a dense run): routing mismatch between engine and trainer (0 with
    algo.router_replay=rollout), load balance and the router's aux loss per step."""
    if not any(k.startswith("moe/") for r in records for k in r):
        return None
    return _line_figure(records, MOE_PANEL, out, smooth)


def _run_config(run_dir: Path) -> dict[str, dict[str, Any]]:
    """The run's resolved config (config.yaml) as nested dicts; {} where it is missing or unreadable (the figures
    then go without the response-length line and with the ppo_clip clip labels)."""
    import yaml

    path = run_dir / "config.yaml"
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        logger.warning("%s is unreadable (%s): response_length.png has no max-length line", path, err)
        return {}
    return {k: v for k, v in cfg.items() if isinstance(v, dict)} if isinstance(cfg, dict) else {}


def clip_panel(objective: str) -> Panel:
    """The clip-fraction figure in the objective's terms: GSPO clips whole sequences (its fraction counts their
    tokens, on a sequence scale), CISPO truncates importance weights (the tokens keep their gradient)."""
    base = next(p for p in PANELS if p.name == "clipfrac")
    if objective == "gspo":
        return Panel("clipfrac", "Clip fractions (GSPO: whole sequences, sequence ratio s_i)",
                     "fraction of tokens in clipped sequences", (
                         (keys.TRAIN_CLIPFRAC, "all"), (keys.TRAIN_CLIPFRAC_LOW, "low (s_i < 1-eps_low)"),
                         (keys.TRAIN_CLIPFRAC_HIGH, "high (s_i > 1+eps_high)")))
    if objective == "cispo":
        return Panel("clipfrac", "Truncated importance weights (CISPO: the tokens keep their gradient)",
                     "fraction of tokens", (
                         (keys.TRAIN_CLIPFRAC, "all"), (keys.TRAIN_CLIPFRAC_LOW, "low (r < 1-eps_low)"),
                         (keys.TRAIN_CLIPFRAC_HIGH, "high (r > 1+eps_high)")))
    return base


def run_labels(run_dirs: Sequence[Path]) -> list[str]:
    """Run names for legends: directory names, with the parent added where names collide."""
    names = [Path(d).resolve().name for d in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{Path(d).resolve().parent.name}/{Path(d).resolve().name}" for d in run_dirs]


def x_values(records: Sequence[dict[str, Any]], x: str) -> dict[int, float]:
    """Each step's x coordinate for ``--x``: the step, or a cumulative cost counter (0 before the first step)."""
    key, _ = X_AXES[x]
    if key is None:
        return {r[keys.STEP]: float(r[keys.STEP]) for r in records}
    out = {r[keys.STEP]: float(r[key]) for r in records if key in r}
    for r in records:  # the base model's eval (step 0) and steps before any ledger line cost nothing yet
        if r[keys.STEP] not in out and all(r[keys.STEP] < s for s in out):
            out[r[keys.STEP]] = 0.0
    return out


def compare_figure(run_dirs: Sequence[Path], out_path: Path, smooth: int = 1, x: str = "generated_tokens",
                   log_x: bool = False) -> Path:
    """A grid with a panel per key of ``COMPARE_PANELS``, one line per run, one legend below the grid; ``log_x``:
    a log x axis (runs whose costs differ by a large factor; the first point at 0 is left out there)."""
    runs = [load_run(d) for d in run_dirs]
    labels = run_labels(run_dirs)
    xlabel = X_AXES[x][1]
    ncols = 3
    nrows = -(-len(COMPARE_PANELS) // ncols)
    fig = Figure(figsize=(5.0 * ncols, 3.6 * nrows + 0.8))
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    colors = [f"C{i}" for i in range(len(runs))]
    for ax, (key, title, ylabel) in zip(axes, COMPARE_PANELS, strict=False):
        for records, label, color in zip(runs, labels, colors, strict=True):
            steps, y = series(records, key, smooth)
            xs = x_values(records, x)
            keep = [i for i, s in enumerate(steps) if int(s) in xs]
            if not keep:
                logger.warning("compare: run %s did not log %s; skipped in that panel", label, key)
                continue
            px = np.array([xs[int(steps[i])] for i in keep])
            sparse = len(keep) < 0.5 * len(records)
            ax.plot(px, y[keep], color=color, marker="o" if sparse else None, markersize=3, label=label)
        ax.set(title=_k_label(runs[0], title), xlabel=xlabel, ylabel=ylabel)
        if log_x:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
    for ax in axes[len(COMPARE_PANELS):]:
        ax.set_visible(False)
    handles = [Line2D([], [], color=c, label=label) for c, label in zip(colors, labels, strict=True)]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(labels), 4), frameon=False)
    fig.tight_layout(rect=(0, 0.05 + 0.03 * ((len(labels) - 1) // 4), 1, 1))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, out_path, layout=False)


def main(argv: list[str] | None = None) -> int:
    """``dapo-mcore report RUN_DIR [--compare OTHER_RUN ...] [--out DIR] [--smooth N]``."""
    parser = argparse.ArgumentParser(prog="dapo-mcore report", description="Write PNG figures of a run.")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--compare", type=Path, nargs="+", default=[], help="other runs to draw with this one")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default RUN_DIR/figures)")
    parser.add_argument("--smooth", type=int, default=1, help="trailing moving-average window (default 1: raw)")
    parser.add_argument("--x", choices=sorted(X_AXES), default="generated_tokens",
                        help="x axis of --compare: step, generated_tokens (default: what an experiment costs), "
                             "wall_seconds, or device_hours (devices x wall time: fair across rank counts)")
    parser.add_argument("--log-x", action="store_true", help="log x axis of --compare (runs of very different cost)")
    parser.add_argument("--pipeline-steps", default=None, metavar="N|A-B",
                        help=f"async runs: the steps pipeline.png draws, the last N or steps A to B (default: the "
                             f"last {PIPELINE_STEPS})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.smooth < 1:
        parser.error(f"--smooth {args.smooth}: use a window of 1 (raw) or more")
    pipeline_steps = None
    if args.pipeline_steps is not None:
        from dapo_mcore.telemetry.lanes import select_steps

        try:  # a missing run is an OSError: the CLI reports it on stderr and exits 2
            pipeline_steps = select_steps(load_run(args.run_dir), args.pipeline_steps)
        except ValueError as exc:
            parser.error(str(exc))
    # Missing runs and unwritable outputs are OSErrors: the CLI reports them on stderr and exits 2.
    written = write_report(args.run_dir, args.out, args.smooth, pipeline_steps)
    from dapo_mcore.telemetry.rollout_store import store_problem

    damaged = store_problem(args.run_dir)  # the figures do not read it; the run's user should still know
    if damaged:
        logging.getLogger(__name__).warning("%s", damaged)
    if args.compare:
        out = args.out if args.out is not None else args.run_dir / "figures"
        written.append(compare_figure([args.run_dir, *args.compare], out / "compare.png", args.smooth, args.x,
                                      args.log_x))
    for path in written:
        print(path)
    return 0

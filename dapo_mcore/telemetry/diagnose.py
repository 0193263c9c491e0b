"""``dapo-mcore diagnose RUN``: why did a run stall? Rules over ``metrics.jsonl`` + ``ledger.jsonl``.

Each rule reads a few series and returns findings in plain words, with the steps and the numbers that support
them and what to try next. ``warn`` marks something that is likely holding the run back; ``info`` marks
something worth knowing that is not a fault (e.g. the policy solved its training data and groups stopped being
mixed). A rule whose metrics were not logged is listed as skipped; a rule that found nothing as ok. Rules on levels
(cannot-learn, usable-groups, length-limit, non-finite values, warm-up) judge runs of any length; trend rules need
MIN_STEPS logged training steps and are listed as not judged before that.

Windows: "start" and "end" are the first and last ``max(3, n // 5)`` steps of the ``n`` logged training steps.
No Megatron, torch or matplotlib import: diagnosing a run is instant on a login node.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dapo_mcore.telemetry import keys
from dapo_mcore.telemetry.diagnose_modes import (
    rule_mismatch,
    rule_off_policy,
    rule_pipeline,
    rule_routing_mismatch,
    rule_tools,
)
from dapo_mcore.telemetry.run_series import (  # noqa: F401  (load_run, Run: names its callers import from here)
    LEDGER_FILE,
    METRICS_FILE,
    MIN_STEPS,
    Finding,
    Run,
    _first_below,
    _heldout,
    _k,
    _mean,
    _median,
    load_run,
)

USABLE_LOW = 0.2
ENTROPY_COLLAPSE = 0.2
SOLVED_ACC = 0.9
CLIP_HIGH_ALWAYS = 0.05
GSPO_CLIP_ALWAYS = 0.5
"""GSPO clips whole sequences, so its clip fraction (tokens of clipped sequences) reads on a sequence scale: the GSPO
paper reports two orders of magnitude more clipped tokens than GRPO. Only a majority of clipped tokens every step
warns."""
TRUNCATED_HIGH = 0.1
REWARD_RISE = 0.2
HELDOUT_FLAT = 0.02
SPIKE_Z = 10.0
"""Robust z-score (|x - median| / (1.4826 MAD)) above which a grad-norm value is a spike (if also > 4x the median)."""
GRAD_SPIKE_RATIO = 4.0
LOSS_SPIKE_Z = 20.0
"""The DAPO loss is noise around zero (the tiny default has |z| up to 11 in a healthy run): a spike must stand out more."""


def _dynamic_sampling_cost(run: Run) -> str:
    steps, batches = run.series(keys.ROLLOUT_GEN_BATCHES)
    w = run.window(len(steps)) if steps else 0
    parts = []
    if batches:
        parts.append(f"{_mean(batches[-w:]):.1f} generation batches per step (start {_mean(batches[:w]):.1f})")
    _, gen = run.series(keys.cost_key("tokens_generated", cumulative=False))
    _, rej = run.series(keys.cost_key("tokens_generated_rejected", cumulative=False))
    if gen and rej and sum(gen[-w:]) > 0:
        parts.append(f"{sum(rej[-w:]) / sum(gen[-w:]):.0%} of generated tokens rejected")
    return "; last steps: " + ", ".join(parts) if parts else ""


# ---- the rules ------------------------------------------------------------------------------------------
def rule_usable_groups(run: Run) -> list[Finding]:
    """Usable-group fraction low or collapsing: saturated (all-correct groups) or hopeless (all-wrong)."""
    se = run.start_end(keys.ROLLOUT_USABLE_GROUP_FRAC)
    if se is None:  # a short run: no trend, but a level
        steps_all, values = run.series(keys.ROLLOUT_USABLE_GROUP_FRAC)
        if not values:
            return []
        rng = f"{steps_all[0]}-{steps_all[-1]}"
        se = (_mean(values), _mean(values), rng, rng)
    start, end, s_rng, e_rng = se
    if end >= USABLE_LOW:
        return []
    acc = run.end_mean(keys.ROLLOUT_ACC_MEAN)
    saturated = acc is not None and acc >= 0.5
    cause = (f"saturated: rollout accuracy {acc:.2f}, nearly every group is all-correct" if saturated else
             f"hopeless: rollout accuracy {acc if acc is not None else float('nan'):.2f}, nearly every group is all-wrong")
    cost = _dynamic_sampling_cost(run)
    ev_steps, ev = _heldout(run)
    learned = len(ev) >= 2 and ev[-1] - ev[0] >= 0.1
    if start < USABLE_LOW:
        msg = f"usable-group fraction low from the start ({cause})"
        evidence = f"usable-group fraction {start:.2f} (steps {s_rng}) -> {end:.2f} (steps {e_rng}){cost}"
        steps = f"{s_rng.split('-')[0]}-{e_rng.split('-')[1]}"
    else:
        steps_all, values = run.series(keys.ROLLOUT_USABLE_GROUP_FRAC)
        below = _first_below(steps_all, values, USABLE_LOW, run.window(len(values)))
        msg = f"usable-group fraction collapsed ({cause})"
        evidence = (f"usable-group fraction {start:.2f} (steps {s_rng}) -> {end:.2f} (steps {e_rng}), "
                    f"below {USABLE_LOW} from step {below}{cost}")
        steps = f"{below}-{e_rng.split('-')[1]}"
    if saturated:
        advice = ("the policy solves its training prompts: further steps buy little; stop, or train on harder "
                  "prompts (filter out prompts the base model always solves)")
    else:
        advice = "the prompts are too hard for this model: easier data, a stronger base model, or a larger rollout.n"
    level = "info" if saturated and learned else "warn"
    if learned:
        evidence += f"; held-out {_k(run)} {ev[0]:.3f} (step {ev_steps[0]}) -> {ev[-1]:.3f} (step {ev_steps[-1]})"
    return [Finding("usable-groups", level, steps, msg, evidence, advice)]


def rule_entropy(run: Run) -> list[Finding]:
    """Policy entropy collapsing; a fault only if the task is not solved by then."""
    se = run.start_end(keys.TRAIN_ENTROPY)
    if se is None or se[0] <= 0:
        return []
    start, end, s_rng, e_rng = se
    if end >= ENTROPY_COLLAPSE * start:
        return []
    steps, values = run.series(keys.TRAIN_ENTROPY)
    at = _first_below(steps, values, ENTROPY_COLLAPSE * start, run.window(len(values)))
    acc = run.end_mean(keys.ROLLOUT_ACC_MEAN)
    evidence = (f"entropy {start:.3g} (steps {s_rng}) -> {end:.3g} (steps {e_rng}), below {ENTROPY_COLLAPSE:.0%} "
                f"of the start from step {at}; rollout accuracy at the end {acc if acc is not None else float('nan'):.2f}")
    if acc is not None and acc >= SOLVED_ACC:
        return [Finding("entropy", "info", f"{at}-{e_rng.split('-')[1]}", "entropy fell as the policy converged",
                        evidence, "expected once the task is solved; nothing to do")]
    return [Finding("entropy", "warn", f"{at}-{e_rng.split('-')[1]}",
                    "entropy collapsed before the task was solved (the policy stopped exploring)", evidence,
                    "raise algo.clip_high (Clip-Higher keeps low-probability tokens rising), lower optim.lr, "
                    "or check rollout.temperature=1.0")]


def rule_clip_high(run: Run) -> list[Finding]:
    """Clip-Higher never binding (it changes nothing) or binding on many tokens every step (steps too large).
    GSPO (algo.objective=gspo) is judged on its own, sequence scale (:func:`_gspo_clip`)."""
    if run.cfg("algo", "objective") == "gspo":
        return _gspo_clip(run)
    steps, values = run.series(keys.TRAIN_CLIPFRAC_HIGH)
    if len(values) < MIN_STEPS:
        return []
    if run.cfg("algo", "objective") == "cispo":
        return _cispo_clip(run, steps, values)
    eps = run.cfg("algo", "clip_high")
    bound = f"1+clip_high={1 + eps:g}" if isinstance(eps, int | float) else "1+clip_high"
    rng = f"{steps[0]}-{steps[-1]}"
    if max(values) == 0.0:
        return [Finding("clip-high", "info", rng, "clip-high was never active",
                        f"train/clipfrac_high = 0 in all {len(values)} steps: no positive-advantage token's ratio "
                        f"passed {bound}", _clip_high_fix(run))]
    active = sum(v > 0 for v in values) / len(values)
    med = _median(values)
    if active >= 0.9 and med >= CLIP_HIGH_ALWAYS:
        return [Finding("clip-high", "warn", rng, "clip-high is active on many tokens in nearly every step",
                        f"train/clipfrac_high > 0 in {active:.0%} of steps, median {med:.1%} of tokens clipped at {bound}",
                        "each update moves the policy past the trust region: lower optim.lr"
                        + ("" if _updates(run) == 1 else " or use fewer mini-batches per step "
                           "(train.mini_batch_prompts closer to train.prompts_per_step)"))]
    return []


def _gspo_clip(run: Run) -> list[Finding]:
    """GSPO: train/clipfrac counts the tokens of the sequences whose ratio left [1-clip_low, 1+clip_high]."""
    steps, values = run.series(keys.TRAIN_CLIPFRAC)
    if len(values) < MIN_STEPS:
        return []
    rng, med = f"{steps[0]}-{steps[-1]}", _median(values)
    evidence = (f"train/clipfrac (tokens of clipped sequences) median {med:.1%} over {len(values)} steps; GSPO clips "
                f"whole sequences, so this reads on a sequence scale (the GSPO paper: two orders of magnitude above "
                f"GRPO's token clip fraction)")
    if sum(v >= GSPO_CLIP_ALWAYS for v in values) >= 0.9 * len(values):
        return [Finding("clip-high", "warn", rng, "GSPO clips most sequences in nearly every step", evidence,
                        f"most sequences train with no gradient: lower optim.lr, or widen algo.clip_low/clip_high "
                        f"(now {run.cfg('algo', 'clip_low')} / {run.cfg('algo', 'clip_high')}; the GSPO paper's "
                        f"are 3e-4 / 4e-4)")]
    return [Finding("clip-high", "info", rng, "GSPO sequence clip fraction", evidence,
                    "nothing to do: token thresholds do not apply to a sequence clip")]


def _cispo_clip(run: Run, steps: list[int], values: list[float]) -> list[Finding]:
    """CISPO: clipfrac_high counts tokens whose importance weight was truncated; they keep their gradient."""
    eps = run.cfg("algo", "clip_high")
    bound = f"1+clip_high={1 + eps:g}" if isinstance(eps, int | float) else "1+clip_high"
    med, rng = _median(values), f"{steps[0]}-{steps[-1]}"
    if sum(v > 0 for v in values) >= 0.9 * len(values) and med >= CLIP_HIGH_ALWAYS:
        return [Finding("clip-high", "warn", rng, "CISPO truncates the importance weight of many tokens every step",
                        f"train/clipfrac_high median {med:.1%} of tokens with weights truncated at {bound}",
                        "the policy moves far from the one that sampled within a step: lower optim.lr")]
    return []


def _updates(run: Run) -> int | None:
    """Optimizer updates per step from the run's config (None when it is not readable)."""
    prompts, mini, epochs = (run.cfg("train", "prompts_per_step"), run.cfg("train", "mini_batch_prompts"),
                             run.cfg("train", "epochs"))
    if not all(isinstance(v, int) and v > 0 for v in (prompts, mini, epochs)):
        return None
    return prompts // mini * epochs


def _clip_high_fix(run: Run) -> str:
    """What to change when Clip-Higher never binds, from the run's own settings: more mini-batches per step only
    where the run takes one (the ratio is exactly 1 on the first update of a step), else a larger lr."""
    prompts, mini, epochs = (run.cfg("train", "prompts_per_step"), run.cfg("train", "mini_batch_prompts"),
                             run.cfg("train", "epochs"))
    lr = run.cfg("optim", "lr")
    lr_text = f"optim.lr (now {lr:g})" if isinstance(lr, int | float) else "optim.lr"
    updates = _updates(run)
    if updates is None:
        return ("Clip-Higher changes nothing at this step size; fine if learning progresses, otherwise more "
                f"mini-batches per step (train.mini_batch_prompts < train.prompts_per_step) or a larger {lr_text}")
    if updates <= 1:
        return (f"Clip-Higher changes nothing with one on-policy update per step (train.prompts_per_step={prompts}, "
                f"mini_batch_prompts={mini}, epochs={epochs}): the ratio is 1 there. Fine if learning progresses; "
                f"otherwise several mini-batches per step (e.g. train.mini_batch_prompts={max(1, prompts // 4)}) or "
                f"a larger {lr_text}")
    return (f"the {updates} updates per step (train.prompts_per_step={prompts} / mini_batch_prompts={mini} x "
            f"epochs={epochs}) never moved a token's ratio past {1 + (run.cfg('algo', 'clip_high') or 0):g}: the "
            f"step size is small. Fine if learning progresses; otherwise a larger {lr_text}")


def rule_length_limit(run: Run) -> list[Finding]:
    """Responses hitting the generation length limit."""
    steps, values = run.series(keys.ROLLOUT_TRUNCATED_FRAC)
    if not values:
        return []
    end = run.end_mean(keys.ROLLOUT_TRUNCATED_FRAC)
    assert end is not None
    if end < TRUNCATED_HIGH:
        return []
    over = [s for s, v in zip(steps, values, strict=True) if v >= TRUNCATED_HIGH]
    limit = run.cfg("rollout", "max_new_tokens")
    lim = f" of rollout.max_new_tokens={limit}" if limit is not None else ""
    _, lens = run.series(keys.ROLLOUT_RESP_LEN_MEAN)
    mean_len = f"; mean response length {lens[-1]:.0f} tokens{lim}" if lens else ""
    return [Finding("length-limit", "warn", f"{over[0]}-{steps[-1]}", "responses are hitting the length limit",
                    f"truncated fraction {end:.0%} over the last steps, >= {TRUNCATED_HIGH:.0%} in {len(over)} of "
                    f"{len(values)} steps (first: step {over[0]}){mean_len}",
                    "truncated answers are scored wrong: raise rollout.max_new_tokens (and algo.overlong_max_len), "
                    "or keep algo.overlong_shaping on so length is penalized before the cut")]


def rule_reward_vs_heldout(run: Run) -> list[Finding]:
    """Training reward rising while held-out accuracy does not: a verifier shortcut or memorized prompts."""
    se = run.start_end(keys.ROLLOUT_REWARD_MEAN)
    ev_steps, ev = _heldout(run)
    if se is None or len(ev) < 2:
        return []
    start, end, s_rng, e_rng = se
    rise, moved = end - start, ev[-1] - ev[0]
    if rise < REWARD_RISE or moved >= HELDOUT_FLAT:
        return []
    reward = run.cfg("reward", "name") or "REWARD"
    return [Finding("reward-vs-heldout", "warn", f"{s_rng.split('-')[0]}-{e_rng.split('-')[1]}",
                    "training reward rose while held-out accuracy did not",
                    f"reward {start:+.3f} (steps {s_rng}) -> {end:+.3f} (steps {e_rng}); held-out {_k(run)} "
                    f"{ev[0]:.3f} (step {ev_steps[0]}) -> {ev[-1]:.3f} (step {ev_steps[-1]})",
                    f"a verifier shortcut or memorized prompts: run `dapo-mcore audit-reward --reward {reward}` and read "
                    f"`dapo-mcore rollouts RUN --step {e_rng.split('-')[1]}` for answers paid without being right")]


def _spikes(steps: list[int], values: list[float], z_max: float, ratio: float | None) -> list[tuple[int, float, float]]:
    med = _median(values)
    mad = _median([abs(v - med) for v in values]) * 1.4826
    out = []
    for s, v in zip(steps, values, strict=True):
        z = abs(v - med) / mad if mad > 0 else (math.inf if v != med else 0.0)
        if z > z_max and (ratio is None or abs(v) > ratio * abs(med)):
            out.append((s, v, med))
    return out


def rule_spikes(run: Run) -> list[Finding]:
    """Loss or grad-norm spikes (robust z-score over the run), and non-finite values."""
    found = []
    for key, z_max, ratio in ((keys.TRAIN_LOSS, LOSS_SPIKE_Z, None), (keys.TRAIN_GRAD_NORM, SPIKE_Z, GRAD_SPIKE_RATIO)):
        bad = [r[keys.STEP] for r in run.records if isinstance(r.get(key), float) and not math.isfinite(r[key])
               and not _no_update(r)]  # a step that trained nothing (older versions logged its loss as nan)
        if bad:
            found.append(Finding("spikes", "warn", f"{bad[0]}-{bad[-1]}", f"{key} is not finite",
                                 f"{key} is nan/inf at steps {_fmt_steps(bad)}",
                                 "lower optim.lr, keep optim.grad_clip on, check the data of those steps"))
        steps, values = run.series(key)
        if len(values) < MIN_STEPS:
            continue
        spikes = _spikes(steps, values, z_max, ratio)
        if spikes:
            med = spikes[0][2]
            pts = ", ".join(f"step {s}: {v:.3g}" for s, v, _ in spikes[:5])
            clip = _grad_clip(run)
            # one gradient-norm spike in a run that clips gradients moved the weights no further than the clip: by
            # the rule's own advice ("if it repeats") that is a note, not a warning
            once_clipped = key == keys.TRAIN_GRAD_NORM and len(spikes) == 1 and clip is not None
            found.append(Finding("spikes", "info" if once_clipped else "warn", f"{spikes[0][0]}-{spikes[-1][0]}",
                                 f"{key} spiked" + (f" once (clipped to optim.grad_clip={clip:g})" if once_clipped
                                                    else ""),
                                 f"{len(spikes)} step(s) more than {z_max:g} robust deviations from the median "
                                 f"{med:.3g}: {pts}",
                                 "read those steps' rollouts (`dapo-mcore rollouts RUN --step N`); lower optim.lr or "
                                 "optim.grad_clip if it repeats"))
    return found


def _grad_clip(run: Run) -> float | None:
    """optim.grad_clip as the run set it (None: off, or not recorded)."""
    optim = run.config.get("optim") if isinstance(run.config.get("optim"), dict) else {}
    clip = optim.get("grad_clip")
    return float(clip) if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0 else None


def _no_update(record: dict[str, Any]) -> bool:
    return record.get("train/updates") == 0 and bool(record.get("train/skipped_updates"))


def rule_no_update(run: Run) -> list[Finding]:
    """Steps whose mini-batches were all skipped: the correction rejected every token, or every token was masked."""
    idle = [r for r in run.records if _no_update(r)]
    if not idle:
        return []
    steps = [r[keys.STEP] for r in idle]
    rejected = [r[keys.STEP] for r in idle if float(r.get(keys.CORR_REJECTED_TOKEN_FRAC, 0.0)) >= 1.0]
    if rejected:
        preset = _correction_name(run)
        return [Finding("no-update", "warn", f"{rejected[0]}-{rejected[-1]}",
                        "the rollout correction rejected every token: those steps trained nothing",
                        f"{keys.CORR_REJECTED_TOKEN_FRAC} = 1 at steps {_fmt_steps(rejected)}"
                        + (f" (correction: {preset})" if preset else ""),
                        "widen algo.rollout_correction.rs_thresholds (Geo-RS's +-0.1% band suits only a tiny "
                        "engine mismatch), or use a preset without rejection (token_tis, icepop); not a learning-rate "
                        "problem")]
    return [Finding("no-update", "warn", f"{steps[0]}-{steps[-1]}", "every token of those steps was masked: they "
                    "trained nothing", f"train/updates = 0 at steps {_fmt_steps(steps)}",
                    "check algo.overlong_filter against the response length (rollout.max_response_len)")]


def _correction_name(run: Run) -> str:
    """The active rollout correction as config.yaml names it: ``preset geo_rs``, ``algo.tis_cap=2``, or ''."""
    algo = run.config.get("algo") if isinstance(run.config.get("algo"), dict) else {}
    if algo.get("tis_cap") is not None:
        return f"algo.tis_cap={algo['tis_cap']}"
    rc = algo.get("rollout_correction") if isinstance(algo.get("rollout_correction"), dict) else {}
    if rc.get("preset"):
        return f"preset {rc['preset']}"
    parts = [f"{k}={rc[k]}" for k in ("is_level", "is_threshold", "rs", "bypass") if rc.get(k)]
    return ", ".join(parts)


def _fmt_steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:8])) + (f" (+{len(steps) - 8} more)" if len(steps) > 8 else "")


def rule_warmup(run: Run) -> list[Finding]:
    """The learning rate still rising at the last step: the run ended inside its warm-up."""
    steps, lrs = run.series(keys.TRAIN_LR)
    if not lrs:
        return []
    peak, warmup = run.cfg("optim", "lr"), run.cfg("optim", "warmup_steps")
    if isinstance(peak, int | float) and peak > 0:
        still = lrs[-1] < 0.999 * peak
    else:
        still = len(lrs) >= 3 and lrs[-3] < lrs[-2] < lrs[-1]
    if not still:
        return []
    peak_txt = f" of peak optim.lr={peak:g}" if isinstance(peak, int | float) else ""
    warm_txt = f" (optim.warmup_steps={warmup}, run at step {steps[-1]})" if warmup is not None else ""
    return [Finding("warmup", "warn", f"{steps[0]}-{steps[-1]}", "the learning rate is still in warm-up",
                    f"train/lr {lrs[0]:.3g} (step {steps[0]}) -> {lrs[-1]:.3g} (step {steps[-1]}){peak_txt}{warm_txt}",
                    "the run never trained at full lr: lower optim.warmup_steps below train.steps, or train longer")]


def rule_cannot_learn(run: Run) -> list[Finding]:
    """A run that cannot learn whatever its length: no step had a usable group (every group all-right or all-wrong,
    so every advantage is 0), or the loss and gradient were exactly 0 in every step. Says which cause fits."""
    steps, usable = run.series(keys.ROLLOUT_USABLE_GROUP_FRAC)
    _, loss = run.series(keys.TRAIN_LOSS)
    _, grad = run.series(keys.TRAIN_GRAD_NORM)
    no_groups = bool(usable) and max(usable) == 0.0
    no_signal = bool(loss) and all(v == 0.0 for v in loss) and (not grad or all(v == 0.0 for v in grad))
    if not (no_groups or no_signal):
        return []
    rng = f"{(steps or run.train_steps)[0]}-{(steps or run.train_steps)[-1]}"
    trunc, acc = run.end_mean(keys.ROLLOUT_TRUNCATED_FRAC), run.end_mean(keys.ROLLOUT_ACC_MEAN)
    parts = [f"usable-group fraction {max(usable):.2f} at best" if usable else "",
             f"loss {'exactly 0' if no_signal else f'{loss[-1]:.3g}'} in every step" if loss else "",
             f"truncated fraction {trunc:.3f}" if trunc is not None else "",
             f"rollout accuracy {acc:.3f}" if acc is not None else ""]
    limit = run.cfg("rollout", "max_new_tokens")
    if trunc is not None and trunc >= 0.99:
        why = "every response ran to the length limit, so every answer scores the same"
        advice = (f"check how responses end (`dapo-mcore rollouts RUN` shows finish and the stop id): a model whose "
                  f"EOS is not among the stop tokens never stops (add it to rollout.stop_token_ids); else raise "
                  f"rollout.max_new_tokens{f'={limit}' if limit is not None else ''}")
    elif acc is not None and acc == 0.0:
        why = "every answer was wrong, so every group is all-wrong"
        advice = ("the data is too hard for the model or the answers are in a format the reward cannot read: run "
                  "`dapo-mcore audit-reward` and read `dapo-mcore rollouts RUN`; easier data or a larger rollout.n")
    elif acc is not None and acc == 1.0:
        why = "every answer was right, so every group is all-correct"
        advice = "the model already solves this data: train on harder prompts"
    else:
        why = "every advantage was 0"
        advice = "a larger rollout.n gives mixed groups more often; check the reward gives different scores"
    return [Finding("cannot-learn", "warn", rng, f"this run cannot learn: {why}",
                    "; ".join(p for p in parts if p), advice)]


LORA_STILL = 1e-4
"""A LoRA update smaller than this share of the adapters' norm, in most steps, is an adapter that barely moves."""


def rule_lora_update(run: Run) -> list[Finding]:
    """LoRA runs: adapters that barely move. The data is not what stalls such a run (usable groups say whether it
    has a signal): the learning rate or the adapter's size is. Relative update = update norm / adapter norm."""
    steps, upd = run.series("lora/update_norm")
    _, par = run.series("lora/adapter_norm")
    rel = [u / p for u, p in zip(upd, par, strict=False) if p > 0]
    if not rel:
        return []
    ordered = sorted(rel)
    median = ordered[len(ordered) // 2]
    rng = f"{steps[0]}-{steps[-1]}"
    evidence = f"median relative update {median:.2g} per step (update norm / adapter norm; max {ordered[-1]:.2g})"
    if median >= LORA_STILL:
        return []
    lr = run.cfg("optim", "lr")
    lora = run.cfg("model", "lora")
    rank, alpha = (lora.get("rank"), lora.get("alpha")) if isinstance(lora, dict) else (None, None)
    return [Finding("lora-update", "warn", rng, "the LoRA adapters barely move", evidence,
                    f"a learning-rate or adapter-size problem, not a stall of the data: LoRA usually needs ~10x the "
                    f"full fine-tuning learning rate (optim.lr{f'={lr:g}' if lr is not None else ''}); or raise "
                    f"model.lora.alpha{f'={alpha:g}' if alpha is not None else ''} (the update's scale is alpha / "
                    f"rank) or model.lora.rank{f'={rank}' if rank is not None else ''}")]


RULES: tuple[tuple[str, tuple[str, ...], Callable[[Run], list[Finding]]], ...] = (
    ("cannot-learn", (keys.ROLLOUT_USABLE_GROUP_FRAC, keys.TRAIN_LOSS), rule_cannot_learn),
    ("usable-groups", (keys.ROLLOUT_USABLE_GROUP_FRAC,), rule_usable_groups),
    ("entropy", (keys.TRAIN_ENTROPY,), rule_entropy),
    ("clip-high", (keys.TRAIN_CLIPFRAC_HIGH,), rule_clip_high),
    ("length-limit", (keys.ROLLOUT_TRUNCATED_FRAC,), rule_length_limit),
    ("mismatch", (keys.MISMATCH_LOGP_ABS_DIFF_MEAN,), rule_mismatch),
    ("reward-vs-heldout", (keys.ROLLOUT_REWARD_MEAN, keys.EVAL_AVG_AT_K), rule_reward_vs_heldout),
    ("spikes", (keys.TRAIN_LOSS, keys.TRAIN_GRAD_NORM), rule_spikes),
    ("no-update", ("train/skipped_updates", keys.TRAIN_LOSS, keys.TRAIN_LR), rule_no_update),
    ("warmup", (keys.TRAIN_LR,), rule_warmup),
    ("pipeline", ("async/trainer_wait_s",), rule_pipeline),
    ("off-policy", (keys.CORR_KL_K3, "async/lag_mean"), rule_off_policy),
    ("routing-mismatch", ("moe/routing_mismatch_frac",), rule_routing_mismatch),
    ("tools", (keys.cost_key("tool_calls", cumulative=False),), rule_tools),
    ("lora-update", ("lora/update_norm",), rule_lora_update),
)
"""(name, metrics it needs, rule). A rule runs when at least one of its metrics was logged."""
LEVEL_RULES = frozenset({"cannot-learn", "usable-groups", "length-limit", "spikes", "warmup", "pipeline",
                         "routing-mismatch", "no-update", "tools", "lora-update"})
"""Rules that judge levels (or non-finite values), not trends: they run on a run of any length."""
MODE_RULES = frozenset({"pipeline", "off-policy", "routing-mismatch", "tools", "lora-update"})
"""Rules of one mode (async; runs that log rollout_corr/*; MoE): a run of the other is not told they were skipped."""


@dataclass(frozen=True)
class Diagnosis:
    findings: list[Finding]
    ok: list[str]
    skipped: list[str]
    """Rules none of whose metrics were logged."""
    summary: str
    too_short: list[str] = field(default_factory=list)
    """Trend rules not judged: fewer than MIN_STEPS logged training steps."""


def diagnose(run: Run) -> Diagnosis:
    """Apply every rule; rules with none of their metrics logged are skipped; trend rules need MIN_STEPS steps."""
    findings, ok, skipped, too_short = [], [], [], []
    for name, needs, rule in RULES:
        if not any(run.has(k) for k in needs):
            if name not in MODE_RULES:  # a rule of the other mode is not a metric that went missing
                skipped.append(name)
            continue
        if len(run.train_steps) < MIN_STEPS and name not in LEVEL_RULES:
            too_short.append(name)
            continue
        out = rule(run)
        findings.extend(out)
        if not out:
            ok.append(name)
    return Diagnosis(findings, ok, skipped, _summary(run), too_short)


def _summary(run: Run) -> str:
    ts = run.train_steps
    parts = [f"{len(ts)} training steps" + (f" ({ts[0]}-{ts[-1]})" if ts else "")]
    ev_steps, ev = _heldout(run)
    if ev:
        parts.append(f"held-out {_k(run)} {ev[0]:.3f} (step {ev_steps[0]}) -> {ev[-1]:.3f} (step {ev_steps[-1]})")
    _, acc = run.series(keys.ROLLOUT_ACC_MEAN)
    if acc:
        parts.append(f"rollout accuracy {acc[0]:.2f} -> {acc[-1]:.2f}")
    if _correction_name(run):
        parts.append(f"rollout correction: {_correction_name(run)}")
    return ", ".join(parts)


def render(run_dir: Path, d: Diagnosis) -> str:
    lines = [f"diagnose {run_dir}: {d.summary}"]

    for f in sorted(d.findings, key=lambda f: f.level != "warn"):
        lines.append(f"[{f.level}] {f.rule} (steps {f.steps}): {f.message}")
        lines.append(f"    evidence: {f.evidence}")
        lines.append(f"    next: {f.advice}")
    if d.ok:
        lines.append("ok: " + ", ".join(d.ok))
    if d.skipped:
        lines.append("skipped (metrics not logged): " + ", ".join(d.skipped))
    if d.too_short:
        lines.append(f"not judged (trends need >= {MIN_STEPS} logged training steps): " + ", ".join(d.too_short))
    warns = sum(f.level == "warn" for f in d.findings)
    lines.append(f"{warns} warning(s), {len(d.findings) - warns} note(s)")
    return "\n".join(lines)


def read_run(run_dir: Path) -> Run:
    """Records and the resolved ``config.yaml`` of a run directory (config optional)."""
    records = load_run(run_dir)
    cfg_path = Path(run_dir) / "config.yaml"
    config = yaml.safe_load(cfg_path.read_text()) if cfg_path.is_file() else {}
    return Run(records, config if isinstance(config, dict) else {})


def main(argv: list[str] | None = None) -> int:
    """Exit 0 (findings or not); 1 with ``--fail-on-warn`` when any warning; 2 for a missing run."""
    parser = argparse.ArgumentParser(prog="dapo-mcore diagnose", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--fail-on-warn", action="store_true", help="exit 1 if any rule warns")
    args = parser.parse_args(argv)
    try:
        run = read_run(args.run_dir)
    except FileNotFoundError as err:
        print(f"dapo-mcore diagnose: {err}", file=sys.stderr)
        return 2
    d = diagnose(run)
    if args.json:
        print(json.dumps({"summary": d.summary, "findings": [asdict(f) for f in d.findings], "ok": d.ok,
                          "skipped": d.skipped, "too_short": d.too_short}, indent=1))
    else:
        print(render(args.run_dir, d))
    return 1 if args.fail_on_warn and any(f.level == "warn" for f in d.findings) else 0


if __name__ == "__main__":
    raise SystemExit(main())

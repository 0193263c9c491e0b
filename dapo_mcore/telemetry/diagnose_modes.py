"""The rules of ``diagnose`` that belong to one mode of a run: engine/trainer mismatch and off-policy correction,
the async pipeline's balance and lag, and MoE routing replay. A run of another mode is not told they were skipped."""

from __future__ import annotations

from dapo_mcore.telemetry import keys
from dapo_mcore.telemetry.run_series import Finding, Run, _mean, _median

MISMATCH_FLOOR = 1e-3
MISMATCH_GROWTH = 4.0


def rule_mismatch(run: Run) -> list[Finding]:
    """Engine/trainer log-prob mismatch that grows (or is large): the policy gradient is computed off-policy."""
    key = keys.MISMATCH_LOGP_ABS_DIFF_MEAN
    se = run.start_end(key)
    if se is None:
        return []
    start, end, s_rng, e_rng = se
    growing = end > MISMATCH_FLOOR and end > MISMATCH_GROWTH * start
    large = end > 50 * MISMATCH_FLOOR
    if not (growing or large):
        return []
    _, kl = run.series(keys.MISMATCH_KL)
    kl_txt = f"; mismatch/kl at the end {kl[-1]:.3g}" if kl else ""
    corrected = correction_in_use(run)
    if is_async(run):  # the engines sample from an older policy by design: the gap is mostly that lag
        fix = ("in async mode this gap includes the engines' policy lag (up to rollout.pipeline.max_staleness "
               "versions): compare async/lag_mean and a sync run of the same config before suspecting the engine's "
               "precision or the weight sync")
    else:
        fix = "check the engine dtype vs model.params_dtype and that weight sync covers every tensor"
    fix += (f"; the run already corrects the gradient ({corrected})" if corrected else
            "; algo.tis_cap (or an algo.rollout_correction preset) corrects the gradient for a known mismatch")
    return [Finding("mismatch", "warn", f"{s_rng.split('-')[0]}-{e_rng.split('-')[1]}",
                    "the rollout engine and the trainer disagree on log-probs" + (", and it is growing" if growing else ""),
                    f"|logp_engine - logp_trainer| mean {start:.3g} (steps {s_rng}) -> {end:.3g} (steps {e_rng}){kl_txt}",
                    fix)]


def is_async(run: Run) -> bool:
    """The run's config says rollout.pipeline.mode=async, or its metrics carry the async pipeline's lag."""
    pipeline = (run.config.get("rollout") or {}).get("pipeline") if isinstance(run.config.get("rollout"), dict) else None
    return (isinstance(pipeline, dict) and pipeline.get("mode") == "async") or run.has("async/lag_mean")


def correction_in_use(run: Run) -> str:
    """The token-level TIS correction the run set, as config.yaml names it (``algo.tis_cap=2``, ``preset
    token_tis``), or '' (then "start token_tis" is advice, not a repetition of the run's own setting)."""
    algo = run.config.get("algo") if isinstance(run.config.get("algo"), dict) else {}
    if algo.get("tis_cap") is not None:
        return f"algo.tis_cap={algo['tis_cap']}"
    rc = algo.get("rollout_correction") if isinstance(algo.get("rollout_correction"), dict) else {}
    if rc.get("preset"):
        return f"algo.rollout_correction.preset={rc['preset']}"
    if rc.get("is_level"):
        return f"algo.rollout_correction.is_level={rc['is_level']}"
    return ""


def _next_correction(run: Run) -> str:
    """What to try for a gap the policy lag makes: token TIS if the run has none, else what token TIS leaves."""
    corrected = correction_in_use(run)
    if not corrected:
        return "algo.rollout_correction preset token_tis or icepop"
    return (f"the run already applies {corrected}: try preset icepop (it drops the tokens with huge weights) or "
            "seq_mis")


OFF_POLICY_KL_FLOOR = 1e-3
"""Off-policy k3 KL below this is numerical noise (fp32 engine vs trainer), whatever its trend."""
OFF_POLICY_KL_LARGE = 2e-2
OFF_POLICY_REJECT_MOST = 0.5


def rule_off_policy(run: Run) -> list[Finding]:
    """The rollout-vs-trainer gap (rollout_corr/*) grows or is large, or the correction rejects most tokens: which
    algo.rollout_correction preset to try next."""
    out = _async_gap(run)
    se = run.start_end(keys.CORR_KL_K3)
    if se is None:
        return out
    start, end, s_rng, e_rng = se
    steps = f"{s_rng.split('-')[0]}-{e_rng.split('-')[1]}"
    bypass = run.has(keys.CORR_BYPASS)
    rejected = run.end_mean(keys.CORR_REJECTED_TOKEN_FRAC) or 0.0
    if rejected > OFF_POLICY_REJECT_MOST:
        out.append(Finding("off-policy", "warn", steps, f"the rollout correction rejects {100 * rejected:.0f}% of "
                           "the tokens: most of the batch trains nothing",
                           f"{keys.CORR_REJECTED_TOKEN_FRAC} {rejected:.2f} at the end; off-policy KL (k3) {end:.3g}",
                           "widen algo.rollout_correction.rs_thresholds" + (
                               ", or leave bypass mode: with several mini-batches per step pi_theta drifts from "
                               "the engine's policy and Geo-RS's +-0.1% rejects it (preset geo_rs_token_tis)"
                               if bypass else "; Geo-RS's +-0.1% suits a small engine mismatch, not async staleness "
                               "(preset token_tis or icepop)")))
    growing = end > OFF_POLICY_KL_FLOOR and end > MISMATCH_GROWTH * max(start, 1e-12)
    if growing or end > OFF_POLICY_KL_LARGE:
        weighted = (run.end_mean(keys.CORR_IS_WEIGHT_MAX) or 1.0) != 1.0
        if bypass:
            advice = "leave bypass mode (preset token_tis: the old-log-prob pass returns and clips against pi_old)"
        elif weighted:
            advice = "reject the outlier responses too: preset geo_rs_token_tis, or seq_mis"
        elif correction_in_use(run):
            advice = (f"the run applies {correction_in_use(run)}: reject the outlier responses too (preset "
                      "geo_rs_token_tis or seq_mis), or icepop if a few tokens carry huge weights")
        else:
            advice = ("start a correction: preset token_tis (icepop if a few tokens carry huge weights, seq_mis for "
                      "long responses)")
        out.append(Finding("off-policy", "warn", steps, "the gap between the rollout policy and the trainer's"
                           + (" grows" if growing else " is large"),
                           f"off-policy KL (k3) {start:.3g} (steps {s_rng}) -> {end:.3g} (steps {e_rng})",
                           f"algo.rollout_correction: {advice}"))
    return out


PPO_KL_JUMP = 10.0
"""train/ppo_kl at a step this many times its median (and above OFF_POLICY_KL_LARGE): that step trained far from
the policy that sampled it."""


def _async_gap(run: Run) -> list[Finding]:
    """Async runs: the trainer's policy far from the one that sampled (train/ppo_kl jumps, or the engine/trainer KL
    mismatch/kl is large), whatever the rollout_corr metrics say."""
    if not run.has("async/lag_mean"):
        return []
    out = []
    steps, ppo = run.series(keys.TRAIN_PPO_KL)
    if ppo:
        med = _median([abs(v) for v in ppo])
        jumps = [(s, v) for s, v in zip(steps, ppo, strict=True)
                 if abs(v) > OFF_POLICY_KL_LARGE and abs(v) > PPO_KL_JUMP * max(med, 1e-9)]
        if jumps:
            top = max(jumps, key=lambda p: abs(p[1]))
            out.append(Finding("off-policy", "warn", f"{jumps[0][0]}-{jumps[-1][0]}",
                               "async: some steps train far from the policy that sampled them",
                               f"{keys.TRAIN_PPO_KL} reached {top[1]:.3g} at step {top[0]} (median {med:.3g}) at "
                               f"{len(jumps)} step(s)",
                               "lower optim.lr or train fewer mini-batches per step, and correct the lag: "
                               f"{_next_correction(run)} (rollout.pipeline.max_staleness bounds it)"))
    mk = run.end_mean(keys.MISMATCH_KL)
    if mk is not None and mk > OFF_POLICY_KL_LARGE:
        out.append(Finding("off-policy", "warn", f"{run.train_steps[0]}-{run.train_steps[-1]}" if run.train_steps
                           else "-", "async: the engines' and the trainer's policies are far apart",
                           f"{keys.MISMATCH_KL} {mk:.3g} at the end (engine vs trainer log-probs of the trained "
                           "tokens)", f"correct it: {_next_correction(run)}; or lower rollout.pipeline.max_staleness"))
    return out


ROUTING_MISMATCH_FLOOR = 1e-3
"""moe/routing_mismatch_frac above this: the trainer's MoE routers pick other experts than the engine's."""


def rule_routing_mismatch(run: Run) -> list[Finding]:
    """MoE: tokens routed to other experts in the trainer than in the engine, the usual driver of an MoE model's
    log-prob mismatch (a rerouted token runs through another expert's MLP); rollout routing replay removes it."""
    steps, frac = run.series("moe/routing_mismatch_frac")
    if not frac or _mean(frac) <= ROUTING_MISMATCH_FLOOR:
        return []
    _, diff = run.series(keys.MISMATCH_LOGP_ABS_DIFF_MEAN)
    drives = f"; log-prob mismatch |diff| mean {_mean(diff):.3g} over the same steps" if diff else ""
    return [Finding("routing-mismatch", "warn", f"{steps[0]}-{steps[-1]}",
                    "routing mismatch: the trainer's MoE routers send tokens to other experts than the rollout "
                    "engine did, which drives the engine/trainer log-prob mismatch",
                    f"moe/routing_mismatch_frac mean {_mean(frac):.3g} (token-layer pairs){drives}",
                    "set algo.router_replay=rollout (rollout routing replay: the trainer uses the engine's experts; "
                    "the metric drops to 0)")]


PIPELINE_WAIT_FRAC = 0.25
"""Async mode: a side that waits more than this share of its time for the other is the one to shrink."""


def rule_pipeline(run: Run) -> list[Finding]:
    """Async mode: the trainer starving (waiting for rollouts) or the engines idling (waiting for weights)."""
    rows = [r for r in run.records if isinstance(r.get("async/trainer_wait_s"), int | float)][1:]  # step 1: no overlap
    if not rows:
        return []
    steps = f"{rows[0][keys.STEP]}-{rows[-1][keys.STEP]}"
    step_s = sum(float(r.get("time/step", 0.0)) - float(r.get("time/eval", 0.0)) for r in rows)
    starve = sum(float(r["async/trainer_wait_s"]) for r in rows) / max(step_s, 1e-9)
    idle_s = sum(float(r.get("async/engine_wait_weights_s", 0.0)) for r in rows)
    busy_s = sum(float(r.get("async/engine_generate_s", 0.0)) + float(r.get("async/engine_reward_s", 0.0))
                 for r in rows)
    idle = idle_s / max(idle_s + busy_s, 1e-9)
    evidence = (f"the trainer waited {starve:.0%} of its step time for rollouts; the engines waited {idle:.0%} of "
                f"theirs for weights (overlap {_mean([float(r.get('async/overlap_frac', 0.0)) for r in rows]):.2f})")
    if starve > PIPELINE_WAIT_FRAC and starve >= idle:
        return [Finding("pipeline", "warn", steps, "the trainer starves: generation is the slower side", evidence,
                        "give the engines more ranks (raise rollout.pipeline.engine_ranks; `dapo-mcore plan "
                        "--disaggregated` prices the split) or generate less per step (rollout.schedule.streaming)")]
    if idle > PIPELINE_WAIT_FRAC:
        return [Finding("pipeline", "warn", steps, "the engines idle: training is the slower side", evidence,
                        "give the trainer more ranks (lower rollout.pipeline.engine_ranks), or run sync mode "
                        "(rollout.pipeline.mode=sync) if the engines would idle at any split")]
    return []


TOOL_ERRORS_HIGH = 0.5
"""A tool error rate at or above this over a run's last steps: the tool fails more often than it answers."""


def rule_tools(run: Run) -> list[Finding]:
    """Multi-turn tool use: a tool that fails (errors, timeouts, a sandbox that does not start). A tool outage looks
    like a stall from outside (every call errors, the model never gets an answer back), so it is named."""
    steps, calls = run.series(keys.cost_key("tool_calls", cumulative=False))
    if not calls or sum(calls) == 0:
        return []
    per = {name: dict(zip(*run.series(keys.cost_key(name, cumulative=False)), strict=True))
           for name in ("tool_errors", "tool_timeouts", "tool_sandbox_failures")}
    w = run.window(len(steps))
    last = list(zip(steps, calls, strict=True))[-w:]
    made = sum(c for _, c in last)
    if made == 0:
        return []

    def share(name: str) -> float:
        return sum(per[name].get(s, 0.0) for s, _ in last) / made

    errors, timeouts, boxless = share("tool_errors"), share("tool_timeouts"), share("tool_sandbox_failures")
    rng = f"{last[0][0]}-{last[-1][0]}"
    evidence = (f"tool error rate {errors:.0%} over steps {rng} ({made:.0f} calls: {timeouts:.0%} timed out, "
                f"{boxless:.0%} found no sandbox)")
    if boxless > 0:
        return [Finding("tools", "warn", rng, "the tool's sandbox does not start: the model gets errors back instead "
                        "of results (an outage, not the model's fault)", evidence,
                        "check that bubblewrap runs on the engine nodes (user namespaces on) and that "
                        "rollout.tools.python names a working interpreter; `dapo-mcore rehearse` shows the error")]
    if errors >= TOOL_ERRORS_HIGH:
        fix = ("raise rollout.tools.timeout_s (or rollout.tools.memory_mb)" if timeouts >= errors / 2 else
               "read the tool outputs (`dapo-mcore rollouts RUN`): the model's code may be failing, which RL can fix, "
               "or the tool environment lacks a package its code imports (rollout.tools.python)")
        return [Finding("tools", "warn", rng, "most tool calls fail", evidence, fix)]
    return [Finding("tools", "info", rng, "tool use", evidence,
                    "`dapo-mcore report RUN` draws calls per response and the error rate; `dapo-mcore rollouts RUN` "
                    "shows each call and its output")]

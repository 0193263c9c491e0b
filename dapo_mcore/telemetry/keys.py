"""The metric-name contract: every key the trainer logs, as flat string constants.

The trainer, the metrics writer, the report and the profile summary all spell metric names through
this module, so a rename happens in one place. Keys are ``<group>/<name>``; TensorBoard groups
its panels by the part before the first slash. ``docs/observability.md`` explains each key.
"""

from __future__ import annotations

# --- step -------------------------------------------------------------------------------------
STEP = "step"
"""The rollout step (one generate -> train -> sync cycle); the x axis of every series."""

# --- train: the policy update (averaged over the step's mini-batches) -------------------------
TRAIN_LOSS = "train/loss"
TRAIN_GRAD_NORM = "train/grad_norm"
TRAIN_LR = "train/lr"
TRAIN_CLIPFRAC = "train/clipfrac"
"""Fraction of response tokens whose ratio was clipped (either side) in the surrogate objective."""
TRAIN_CLIPFRAC_LOW = "train/clipfrac_low"
"""Clipped at 1 - eps_low (A < 0 and ratio below the lower bound)."""
TRAIN_CLIPFRAC_HIGH = "train/clipfrac_high"
"""Clipped at 1 + eps_high (A > 0 and ratio above the upper bound)."""
TRAIN_DUAL_CLIPFRAC = "train/dual_clipfrac"
"""Tokens where the dual clip (A < 0, loss capped at -A * c) was active."""
TRAIN_PPO_KL = "train/ppo_kl"
"""Mean of logp_old - logp_new over response tokens."""
TRAIN_ENTROPY = "train/entropy"
"""Mean per-token entropy of the policy over response tokens (logged, not optimized)."""

# --- rollout: what generation produced this step ----------------------------------------------
ROLLOUT_REWARD_MEAN = "rollout/reward_mean"
ROLLOUT_ACC_MEAN = "rollout/acc_mean"
ROLLOUT_USABLE_GROUP_FRAC = "rollout/usable_group_frac"
"""Fraction of generated groups with mixed outcomes (0 < #correct < G), i.e. kept by dynamic sampling."""
ROLLOUT_GEN_BATCHES = "rollout/gen_batches"
"""Generation batches needed to fill the training batch with usable groups."""
ROLLOUT_RESP_LEN_MEAN = "rollout/resp_len_mean"
ROLLOUT_RESP_LEN_MAX = "rollout/resp_len_max"
ROLLOUT_RESP_LEN_MIN = "rollout/resp_len_min"
ROLLOUT_TRUNCATED_FRAC = "rollout/truncated_frac"
"""Fraction of responses that stopped at the length limit (finish reason ``length``)."""
ROLLOUT_ADV_MEAN = "rollout/adv_mean"
ROLLOUT_ADV_STD = "rollout/adv_std"

# --- mismatch: rollout engine vs trainer log-probs of the same tokens -------------------------
MISMATCH_LOGP_ABS_DIFF_MEAN = "mismatch/logp_abs_diff_mean"
MISMATCH_LOGP_ABS_DIFF_MAX = "mismatch/logp_abs_diff_max"
MISMATCH_KL = "mismatch/kl"

# --- rollout correction (algo.rollout_correction): log r = logp_train - logp_rollout per valid token -----------
CORR_IS_WEIGHT_MEAN = "rollout_corr/is_weight_mean"
CORR_IS_WEIGHT_MIN = "rollout_corr/is_weight_min"
CORR_IS_WEIGHT_MAX = "rollout_corr/is_weight_max"
CORR_ESS = "rollout_corr/ess"
"""(sum w)^2 / (n sum w^2) over valid tokens: 1 with equal weights, small when a few weights dominate."""
CORR_REJECTED_TOKEN_FRAC = "rollout_corr/rejected_token_frac"
CORR_REJECTED_SEQ_FRAC = "rollout_corr/rejected_seq_frac"
CORR_KL_K1 = "rollout_corr/kl_k1"
CORR_KL_K3 = "rollout_corr/kl_k3"
"""Off-policy KL(rollout || train): mean of -log r (k1) and of r - 1 - log r (k3, never negative)."""
CORR_CHI2 = "rollout_corr/chi2"
CORR_LOG_PPL_DIFF = "rollout_corr/log_ppl_diff"
"""Per-response log-perplexity, trainer minus engine, averaged over responses."""
CORR_BYPASS = "rollout_corr/bypass"
"""1 in bypass mode: the old-log-prob phase was skipped (pi_old := the engine's log-probs)."""
"""Mean of logp_engine - logp_trainer over response tokens (k1 estimate of KL(engine || trainer))."""

# --- eval: held-out set, k samples per problem --------------------------------------------------
EVAL_AVG_AT_K = "eval/avg_at_k"
"""Mean accuracy over all k samples of all problems (the paper's avg@32)."""
EVAL_PASS_AT_K = "eval/pass_at_k"
"""Fraction of problems with at least one correct sample among k."""
EVAL_MAJ_AT_K = "eval/maj_at_k"
"""Fraction of problems whose majority-vote answer over k samples is correct."""
EVAL_K = "eval/k"

# --- time: wall seconds per phase of the step ---------------------------------------------------
PHASES: tuple[str, ...] = (
    "wait_rollouts", "generate", "reward", "old_logprobs", "train", "sync_weights", "eval", "checkpoint", "step",
)
"""Phase names the trainer times. ``step`` wraps the whole step, so the others nest inside it. ``wait_rollouts``:
async mode only, the trainer waiting for the engines' batch (its ``sync_weights`` is then the weight transfer alone)."""
STEP_PHASE = "step"


def time_key(phase: str) -> str:
    """``time/<phase>``: wall seconds spent in ``phase`` during the step."""
    return f"time/{phase}"


TIME_GENERATE = time_key("generate")
TIME_REWARD = time_key("reward")
TIME_OLD_LOGPROBS = time_key("old_logprobs")
TIME_TRAIN = time_key("train")
TIME_SYNC_WEIGHTS = time_key("sync_weights")
TIME_EVAL = time_key("eval")
TIME_CHECKPOINT = time_key("checkpoint")
TIME_STEP = time_key("step")

# --- tools: multi-turn tool use (rollout.tools), over the step's generated responses ---------------------
TOOLS_CALLS_PER_RESPONSE = "tools/calls_per_response"
TOOLS_ERROR_RATE = "tools/error_rate"
"""Tool calls whose output was an error (the code failed, timed out, flooded, or found no sandbox), of all calls."""
TOOLS_ACC_WITH = "tools/acc_with_calls"
"""Accuracy of the responses that made at least one tool call (absent when none did)."""
TOOLS_ACC_WITHOUT = "tools/acc_without_calls"
"""Accuracy of the responses that made none (absent when every response called)."""

# --- cost: the ledger (see telemetry/ledger.py), per step and cumulative ------------------------
COST_COUNTERS: tuple[str, ...] = (
    "prompts_generated", "prompts_kept", "prompts_rejected",
    "rollouts_generated", "rollouts_kept", "rollouts_rejected",
    "tokens_generated", "tokens_generated_kept", "tokens_generated_rejected",
    "tokens_trained", "device_seconds",
    "tokens_generated_surplus", "tokens_generated_aborted", "prompts_skipped",
    "tool_calls", "tool_errors", "tool_timeouts", "tool_sandbox_failures", "tool_seconds",
)
"""Counters the cost ledger keeps. ``*_rejected`` = generated in finished groups but not trained on (dynamic
sampling's rejected groups, surplus groups dropped, stage-skipped groups); ``tokens_generated_surplus`` = the
surplus part of it; ``tokens_generated_aborted`` = tokens of requests aborted once the step was full (part of
``tokens_generated``, not of ``*_rejected``); ``prompts_skipped`` = prompts the prompt history skipped before
generation; ``device_seconds`` = devices x step wall seconds. ``tool_*`` (multi-turn tool use): calls made,
those that errored (every output but a clean one), timed out, or found no sandbox, and the calls' wall seconds summed
(they overlap decoding and each other)."""
COST_COUNTERS_ADDED: tuple[str, ...] = ("tokens_generated_surplus", "tokens_generated_aborted", "prompts_skipped",
                                        "tool_calls", "tool_errors", "tool_timeouts", "tool_sandbox_failures",
                                        "tool_seconds")
"""Counters newer than some checkpoints: a ledger state without them resumes them from 0."""


def cost_key(name: str, cumulative: bool) -> str:
    """``cost/step/<name>`` (this step) or ``cost/total/<name>`` (since the run began)."""
    return f"cost/{'total' if cumulative else 'step'}/{name}"


def cost_seconds_key(phase: str, cumulative: bool) -> str:
    """``cost/step/seconds_<phase>`` or ``cost/total/seconds_<phase>``."""
    return cost_key(f"seconds_{phase}", cumulative)


COST_TOTAL_DEVICE_HOURS = "cost/total/device_hours"

# --- perf: throughput and utilization ------------------------------------------------------------
PERF_TOKENS_PER_S_PER_DEVICE = "perf/tokens_per_s_per_device"
"""Generated tokens per second of the step's wall time, per device."""
PERF_MFU_TRAIN = "perf/mfu_train"
"""Model FLOPs utilization of the train phase (achieved / peak FLOP/s), in [0, 1]."""
PERF_MFU_LOGPROB = "perf/mfu_logprob"
"""Model FLOPs utilization of the old-log-prob forward pass, in [0, 1]."""

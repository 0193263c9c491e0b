"""A bad reward function: time limits in every mode, a circuit breaker quoting its first error, numpy scalars
accepted, NaN refused naming the reward, and one rank's failure stopping every rank."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest

from dapo_mcore.config import ConfigError, RewardConfig
from dapo_mcore.errors import NonFiniteError, UserError
from dapo_mcore.reward.guard import FailureBreaker, InProcessScorer, RewardFailingError, as_result
from dapo_mcore.reward.math_verifier import compute_score
from dapo_mcore.reward.pool import RewardPool
from dapo_mcore.reward.result import RewardResult
from tests.gloo_workers import run_gloo_workers

PLUGIN = '''
import math, os, time
import numpy as np
from dapo_mcore.reward.result import RewardResult

def always_raises(response, gt):
    raise ValueError(f"cannot parse {gt!r}")

def exits(response, gt):
    os._exit(3)

def hangs(response, gt):
    time.sleep(3600)

def as_numpy(response, gt):
    ok = response.endswith(gt)
    return {"b": np.bool_(ok), "f": np.float64(1.0 if ok else -1.0), "i": np.int64(1 if ok else -1),
            "r": RewardResult(np.float64(0.5 if ok else -0.5), np.bool_(ok), None)}[response[0]]

def nan_for_long(response, gt):
    return math.nan if len(response) > 3 else 1.0

def returns_str(response, gt):
    return "yes"
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    yield "bad_rewards"
    sys.modules.pop("bad_rewards", None)


def hang(response, gt):
    time.sleep(3600)


def busy_loop_that_swallows_exceptions(response, gt):
    while True:
        try:
            sum(range(1000))
        except Exception:  # a careless reward: catches everything it can
            pass


@pytest.mark.unit
@pytest.mark.parametrize("fn", [hang, busy_loop_that_swallows_exceptions])
def test_in_process_answers_are_bounded_by_the_timeout(fn):
    calls = []

    def mixed(response, gt):
        calls.append(response)
        return fn(response, gt) if response == "BAD" else compute_score(response, gt)

    scorer = InProcessScorer(mixed, timeout_s=0.3)
    start = time.monotonic()
    got = scorer(["Answer: 1", "BAD", "Answer: 2"], ["1", "1", "2"])
    elapsed = time.monotonic() - start
    assert elapsed < 30, elapsed  # the hang is an hour (loaded machines only stretch the 0.3-0.6 s)
    assert [r.acc for r in got] == [True, False, True] and got[1].failed and not got[0].failed
    assert "timed out after 0.3s" in got[1].reason


@pytest.mark.unit
def test_the_breaker_trips_on_a_failing_share_and_quotes_the_first_error():
    breaker = FailureBreaker("my:reward", window=8, max_frac=0.5)
    for _ in range(6):
        breaker.record(RewardResult(1.0, True, "1"))
    breaker.record(RewardResult(-1.0, False, None, "reward function raised ValueError: first", failed=True))
    breaker.record(RewardResult(-1.0, False, None, "no answer line"))  # a wrong answer is not a failure
    for i in range(2):
        breaker.record(RewardResult(-1.0, False, None, f"reward timed out after 1s ({i})", failed=True))
    with pytest.raises(RewardFailingError) as err:
        breaker.record(RewardResult(-1.0, False, None, "reward function raised ValueError: later", failed=True))
    msg = str(err.value)
    assert "reward my:reward failed on 4 of the last 8 answers (2 raised or returned no verdict, 2 timed out)" in msg
    assert "its first error: reward function raised ValueError: first" in msg and "\n" not in msg


@pytest.mark.unit
def test_the_pool_stops_a_raising_or_exiting_reward_early_quoting_its_error(plugin):
    for fn, needle in (("always_raises", "ValueError: cannot parse '7'"), ("exits", "crashed (exit code 3)"),
                       ("returns_str", "returned str")):
        breaker = FailureBreaker(f"{plugin}:{fn}", window=8, max_frac=0.5)
        with RewardPool(f"{plugin}:{fn}", num_workers=1, timeout_s=20, chunk_size=2, breaker=breaker) as pool:
            with pytest.raises(RewardFailingError, match="failed on 4 of the last 4 answers") as err:
                pool.score(["Answer: 7"] * 200, ["7"] * 200)
            assert needle in str(err.value)
            assert pool.restarts <= 4  # crashes bounded: no endless respawning
            pool._breaker = None  # (a tripped breaker stays tripped: the run is over)
            assert pool.score(["x"], ["7"])[0].failed  # the pool itself still works after stopping a batch


@pytest.mark.unit
def test_a_hanging_reward_in_the_pool_trips_the_breaker_after_a_few_timeouts(plugin):
    breaker = FailureBreaker(f"{plugin}:hangs", window=4, max_frac=0.5)
    start = time.monotonic()
    with RewardPool(f"{plugin}:hangs", num_workers=2, timeout_s=0.5, chunk_size=4, breaker=breaker) as pool:
        with pytest.raises(RewardFailingError, match="timed out"):
            pool.score(["Answer: 1"] * 1000, ["1"] * 1000)
    assert time.monotonic() - start < 120  # 1000 answers x 0.5 s / 2 workers would be 250 s


@pytest.mark.unit
def test_numpy_and_torch_scalars_are_verdicts(plugin):
    import torch

    from dapo_mcore.reward.registry import get_reward

    fn = get_reward(f"{plugin}:as_numpy").fn
    assert fn("b 7", "7") == RewardResult(1.0, True, None) and fn("b 8", "7") == RewardResult(-1.0, False, None)
    assert fn("f 7", "7") == RewardResult(1.0, True, None) and fn("i 8", "7") == RewardResult(-1.0, False, None)
    got = fn("r 7", "7")
    assert got == RewardResult(0.5, True, None) and type(got.score) is float and type(got.acc) is bool
    assert as_result(torch.tensor(True)) == RewardResult(1.0, True, None)
    with RewardPool(f"{plugin}:as_numpy", num_workers=1) as pool:
        assert [r.acc for r in pool.score(["b 7", "f 8", "r 7"], ["7"] * 3)] == [True, False, True]
    with pytest.raises(TypeError, match="returned str"):
        get_reward(f"{plugin}:returns_str").fn("x", "1")


@pytest.mark.unit
def test_a_nan_reward_stops_naming_the_reward_and_the_answer(plugin):
    from dapo_mcore.run.runtime import make_scorer

    closers: list = []
    score = make_scorer(RewardConfig(name=f"{plugin}:nan_for_long", workers=1), closers)
    try:
        assert score(["ok"], ["1"])[0].score == 1.0
        with pytest.raises(NonFiniteError) as err:
            score(["ok", "a long answer"], ["1", "1"])
    finally:
        for close in closers:
            close()
    assert f"reward {plugin}:nan_for_long returned score nan for the answer ending 'a long answer'" in str(err.value)


@pytest.mark.unit
def test_custom_rewards_are_refused_in_process_and_the_breaker_settings_checked(plugin):
    with pytest.raises(ConfigError, match="reward.workers=2"):
        RewardConfig(name=f"{plugin}:hangs", workers=0).validate()
    RewardConfig(name=f"{plugin}:hangs", workers=1).validate()
    RewardConfig(name="math_dapo", workers=0).validate()  # the registered rule verifier may run in process
    with pytest.raises(ConfigError, match="max_failure_frac"):
        RewardConfig(max_failure_frac=0.0).validate()
    with pytest.raises(ConfigError, match="failure_window"):
        RewardConfig(failure_window=0).validate()


def _apply_once_worker(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    from dapo_mcore.rollout.scheduling.gather import apply_once

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")

    def fn(share):
        if rank == 1:
            raise RewardFailingError("reward x failed on 4 of the last 4 answers")
        return [v * 2 for v in share]

    try:
        apply_once(fn, list(range(6)))
        queue.put((rank, "returned"))
    except UserError as exc:
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_one_ranks_reward_failure_stops_every_rank_with_the_same_line():
    got = run_gloo_workers(_apply_once_worker, 2, timeout_s=300)
    assert got[0] == got[1] == "RewardFailingError: reward x failed on 4 of the last 4 answers"


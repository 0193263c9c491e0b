"""Small things a new user met: the dynamic-sampling hint is a whole override that validates, and ``convert`` does
not print Megatron's notices about its own internals."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from dapo_mcore.algo.dynamic_sampling import SamplingStats, exhausted_error
from dapo_mcore.config import ConfigError, load_config

pytestmark = pytest.mark.unit

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"


def test_the_dynamic_sampling_hint_is_an_override_that_validates():
    target = load_config(TINY).train.prompts_per_step
    message = str(exhausted_error(SamplingStats(), target, 3))
    overrides = re.search(r"override ((?:\S+=\S+ ?)+)", message).group(1).split()
    assert overrides[0] == "algo.dynamic_sampling=false"
    load_config(TINY, overrides).validate(1)  # the hint, as given, is accepted
    with pytest.raises(ConfigError):  # the first half alone is not (what the hint used to say)
        load_config(TINY, overrides[:1]).validate(1)


def test_convert_hides_megatrons_notices_about_its_internals():
    from conversion.entry import quiet_library_warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_library_warnings()
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=2)
        warnings.warn("`load_state_dict` is deprecated and will be removed", FutureWarning, stacklevel=2)
        warnings.warn("something a user should see", UserWarning, stacklevel=2)
    assert [str(w.message) for w in seen] == ["something a user should see"]


def test_rollouts_limit_spreads_over_groups():
    from types import SimpleNamespace

    from dapo_mcore.telemetry.rollout_store import spread_groups

    items = [(SimpleNamespace(group_id=g, i=i), "kept") for g in (7, 3, 9) for i in range(4)]
    shown = spread_groups(items, 4)
    assert [(r.group_id, r.i) for r, _ in shown] == [(7, 0), (3, 0), (9, 0), (7, 1)]
    assert len(spread_groups(items, 100)) == 12 and spread_groups(items, 0) == []


def test_cost_figure_names_phases_in_words():
    from dapo_mcore.telemetry.report import phase_labels

    sync = phase_labels([{"step": 1}], ["generate", "old_logprobs", "sync_weights"])
    assert sync == ["generate", "old log-probs", "weight sync"]
    assert phase_labels([{"step": 1, "async/trainer_wait_s": 1.0}], ["wait_rollouts"]) == ["wait for rollouts (engines)"]


def test_verify_takes_nproc_per_node_like_train(monkeypatch):
    from conversion import verify
    from dapo_mcore.weights.errors import WeightsError

    argv = ["--hf", "H", "--nproc-per-node", "2", "--tp", "2", "--nproc-per-node=4"]
    assert verify.without_nproc(argv) == ["--hf", "H", "--tp", "2"]
    assert verify.build_parser().parse_args(["--hf", "H", "--nproc-per-node", "2"]).nproc_per_node == 2
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(WeightsError, match="not under torchrun"):
        verify._relaunch(argv, 2)

"""Synthetic tasks: registry, determinism, disjoint splits, distractor design."""

import pytest

from dapo_mcore.data.tasks import (
    OrderStatTask,
    get_task,
    register_task,
    split_problems,
    task_names,
    task_records,
)

pytestmark = pytest.mark.unit


def test_registry_lists_names_and_guards_duplicates():
    assert {"max4", "min4", "add2"} <= set(task_names())
    with pytest.raises(ValueError, match="already registered"):
        register_task(OrderStatTask("max"))
    with pytest.raises(ValueError, match="max4"):
        get_task("nope")


@pytest.mark.parametrize("name", ["max4", "min4", "add2"])
def test_splits_are_deterministic_disjoint_and_cover_the_universe(name):
    train, held = task_records(name, "train", seed=3), task_records(name, "heldout", seed=3)
    assert train == task_records(name, "train", seed=3)
    assert {r.prompt for r in train}.isdisjoint({r.prompt for r in held})
    assert len(train) + len(held) == len(get_task(name).problems())
    assert abs(len(held) / (len(train) + len(held)) - 0.2) < 0.01
    assert task_records(name, "heldout", seed=4) != held


def test_max4_answers_and_render():
    task = get_task("max4")
    assert task.render((3, 9, 1, 4)) == "max(3,9,1,4)" and task.answer((3, 9, 1, 4)) == "9"
    assert get_task("min4").answer((3, 9, 1, 4)) == "1"
    assert get_task("add2").render((7, 45)) == "07+45" and get_task("add2").answer((7, 45)) == "52"


@pytest.mark.parametrize("name", ["max4", "min4"])
def test_order_stat_distractors_never_coincide(name):
    task = get_task(name)
    rules = [task.answer, *task.distractors().values()]
    for p in task.problems():
        assert len({rule(p) for rule in rules}) == len(rules)


def test_same_prompt_length_within_a_task():
    for name in ["max4", "add2"]:
        assert len({len(r.prompt) for r in task_records(name, "train")}) == 1


def test_bad_split_arguments():
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_problems(get_task("max4"), "train", heldout_fraction=1.0)
    with pytest.raises(ValueError, match="split"):
        split_problems(get_task("max4"), "test")

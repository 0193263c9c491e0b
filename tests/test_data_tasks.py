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
    assert {"max4", "min4", "add2", "sumchain"} <= set(task_names())
    with pytest.raises(ValueError, match="already registered"):
        register_task(OrderStatTask("max"))
    with pytest.raises(ValueError, match="max4"):
        get_task("nope")


@pytest.mark.parametrize("name", ["max4", "min4", "add2", "sumchain"])
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


def test_default_tasks_corpus_is_answer_lines():
    # The fixed-format tasks' pre-training text is "Answer: <rule output>", exactly as before corpus_rules existed.
    task = get_task("max4")
    rules = [task.answer, *task.distractors().values()]
    p = (3, 9, 1, 4)
    assert [r(p) for r in task.corpus_rules()] == [f"Answer: {r(p)}" for r in rules]


def test_sumchain_responses_verify_and_vary_in_length():
    from dapo_mcore.data.tokenizer import build_tiny_tokenizer
    from dapo_mcore.reward.math_verifier import compute_score

    task, tok = get_task("sumchain"), build_tiny_tokenizer()
    assert task.render((3, 5, 2, 7)) == "3+5+2+7" and task.answer((3, 5, 2, 7)) == "17"
    correct, stop_early, last_slip, ramble = task.corpus_rules()
    assert correct((3, 5, 2, 7)) == "3+5=8+2=10+7=17\nAnswer: 17"
    assert stop_early((3, 5, 2, 7)) == "3+5=8+2=10\nAnswer: 10"
    assert last_slip((3, 5, 2, 7)) == "3+5=8+2=10+7=18\nAnswer: 18"
    lengths = set()
    for p in [(1, 2), (9, 9, 9, 9, 9, 9), *split_problems(task, "heldout")[:200]]:
        texts = [rule(p) for rule in task.corpus_rules()]
        ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
        assert all(tok.unk_token_id not in i for i in ids)
        assert tok.decode(ids[0]) == texts[0]
        assert compute_score(texts[0], task.answer(p)).acc
        assert not any(compute_score(t, task.answer(p)).acc for t in texts[1:])
        assert compute_score(texts[3], task.answer(p)).pred is None and len(ids[3]) >= task.RAMBLE_TOKENS
        lengths.add(len(ids[0]))
    assert min(lengths) <= 10 and max(lengths) >= 28  # a few to tens of tokens (eos not counted)


def test_sumchain_universe_balances_lengths():
    task = get_task("sumchain")
    counts = {n: sum(len(p) == n for p in task.problems()) for n in range(2, 7)}
    assert counts == {2: 81, 3: 729, 4: 1000, 5: 1000, 6: 1000}
    assert len(set(task.problems())) == len(task.problems())

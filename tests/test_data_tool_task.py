"""The tiny tool task (mul2tool) and its vocabulary: the tool tokenizer extends the tiny one (same ids, the tiny
tokenizer and every existing cache key unchanged), spells every corpus response exactly with the markers as single
tokens, the verifier accepts the worked response and refuses the distractors, and the python tool really computes
what the worked response's interpreter text says."""

from __future__ import annotations

import pytest

from dapo_mcore.data.tasks import get_task, split_problems
from dapo_mcore.data.tiny_base_settings import TinyBaseSettings
from dapo_mcore.data.tokenizer import TINY_VOCAB, TOOL_TOKENS, build_tiny_tokenizer
from dapo_mcore.model.presets import preset_config
from dapo_mcore.reward.math_verifier import compute_score

pytestmark = pytest.mark.unit
TASK = get_task("mul2tool")


def test_tool_vocabulary_extends_the_tiny_one():
    plain, tools = build_tiny_tokenizer(), build_tiny_tokenizer(tools=True)
    assert [plain.convert_tokens_to_ids(t) for t in TINY_VOCAB] == [tools.convert_tokens_to_ids(t) for t in TINY_VOCAB]
    assert [tools.convert_tokens_to_ids(t) for t in TOOL_TOKENS] == list(range(30, 35))
    assert len(tools) <= preset_config("tiny-tools")["vocab_size"]
    assert TinyBaseSettings().cache_key() == "1941c59719fe"  # the default base is the one every trace was built on
    assert TinyBaseSettings(task="mul2tool", preset="tiny-tools").cache_key() != TinyBaseSettings(
        task="mul2tool").cache_key()


def test_every_corpus_response_is_spelled_exactly():
    tok = build_tiny_tokenizer(tools=True)
    for p in split_problems(TASK, "train")[:50]:
        for rule in TASK.corpus_rules():
            text = rule(p)
            ids = tok(text, add_special_tokens=False).input_ids
            assert tok.unk_token_id not in ids and tok.decode(ids) == text
    ids = tok(TASK.worked((37, 48)), add_special_tokens=False).input_ids
    assert tok.convert_ids_to_tokens(ids[:3]) == ["<code>", "print", "("]


def test_verifier_accepts_the_worked_response_only():
    for p in split_problems(TASK, "heldout")[:40]:
        truth = TASK.answer(p)
        assert compute_score(TASK.worked(p), truth).acc
        for name, rule in TASK.distractors().items():
            lucky = name == "no_tool" and p[0] % 10 == 0 and p[1] % 10 == 0
            assert compute_score(rule(p), truth).acc == lucky, (p, name)
    assert len(TASK.problems()) == 8100


def test_the_python_tool_prints_what_the_corpus_says():
    from dapo_mcore.tools.registry import get_tool
    from dapo_mcore.tools.sandbox import Sandbox

    tool = get_tool("python", Sandbox(timeout_s=10, memory_mb=256, backend="none"))
    out = tool("print(37*48)")
    assert out.kind == "ok" and out.text == "1776\n"
    assert TASK.worked((37, 48)).split("<interpreter>")[1].split("</interpreter>")[0] == out.text

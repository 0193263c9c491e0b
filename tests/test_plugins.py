"""``package.module:function`` names of a user's own code (dapo_mcore/plugins): the reward and the tool registries
import them through one helper and refuse a bad one in the same one line, naming their kind and an example."""

from __future__ import annotations

import sys
import textwrap

import pytest

from dapo_mcore.plugins import import_callable
from dapo_mcore.reward.registry import import_reward
from dapo_mcore.tools.registry import get_tool


@pytest.fixture
def own_module(tmp_path, monkeypatch):
    (tmp_path / "my_code.py").write_text(textwrap.dedent("""
        VALUE = 3
        def score(response, ground_truth):
            return response == ground_truth
        def lookup(text):
            return text.upper()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_code", raising=False)
    return "my_code"


NO_MODULE = ("cannot import 'no_such_module_xyz' (No module named 'no_such_module_xyz'); install it, or put its "
             "directory on PYTHONPATH (e.g. PYTHONPATH=$PWD for a file in the current directory)")
# The registries' whole messages, as each printed them before they shared the helper.
CASES = [
    ("my_code:", "write package.module:function, e.g. {example}"),
    (":score", "write package.module:function, e.g. {example}"),
    ("no_such_module_xyz:f", NO_MODULE),
    ("my_code:nope", "my_code has no function 'nope'; callables there: lookup, score"),
    ("my_code:VALUE", "my_code has no function 'VALUE'; callables there: lookup, score"),
]


@pytest.mark.unit
@pytest.mark.parametrize(("name", "tail"), CASES)
def test_both_registries_refuse_a_bad_name_in_the_same_one_line(own_module, name, tail):
    with pytest.raises(ValueError) as reward:
        import_reward(name)
    with pytest.raises(ValueError) as tool:
        get_tool(name)
    assert str(reward.value) == f"reward {name!r}: " + tail.format(example="my_rewards:score")
    assert str(tool.value) == f"tool {name!r}: " + tail.format(example="my_tools:lookup")
    assert "\n" not in str(reward.value) + str(tool.value)


@pytest.mark.unit
def test_both_registries_call_the_function_the_name_names(own_module):
    assert import_callable("my_code:lookup", "tool", "x:y")("km") == "KM"
    assert get_tool("my_code:lookup")("km").text == "KM"
    assert import_reward("my_code:score").fn("7", "7").acc

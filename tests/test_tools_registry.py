"""The tool registry (names, duplicates, import paths, faults as data), the calculator and the python tool's text."""

from __future__ import annotations

import sys
import textwrap

import pytest

from dapo_mcore.tools import get_tool, register_tool, tool_names
from dapo_mcore.tools.calculator import evaluate
from dapo_mcore.tools.python_tool import code_of, output_of
from dapo_mcore.tools.registry import _TOOLS
from dapo_mcore.tools.sandbox import SandboxResult

pytestmark = pytest.mark.unit


def test_the_builtins_are_registered_and_an_unknown_name_lists_them():
    assert {"python", "calculator"} <= set(tool_names())
    with pytest.raises(ValueError, match=r"unknown tool 'pyhton'; registered: calculator, python"):
        get_tool("pyhton")


def test_a_duplicate_name_is_refused_and_a_registered_function_is_called():
    @register_tool("test-echo")
    def echo(text: str) -> str:
        return text.upper()

    try:
        with pytest.raises(ValueError, match="already registered"):
            register_tool("test-echo")(echo)
        out = get_tool("test-echo")("hi")
        assert (out.text, out.kind, out.errored) == ("HI", "ok", False)
        assert out.seconds >= 0
    finally:
        del _TOOLS["test-echo"]


def test_faults_of_a_tool_become_error_outputs(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(textwrap.dedent("""
        from dapo_mcore.tools import ToolOutput
        def boom(text):
            raise RuntimeError("the lookup service is down\\nsecond line")
        def wrong(text):
            return 42
        def custom(text):
            return ToolOutput("no such unit: " + text, "error")
        def lookup(text):
            return {"km": "1000 m"}.get(text.strip(), "unknown")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_tools", raising=False)
    boom = get_tool("my_tools:boom")("x")
    assert (boom.text, boom.kind, boom.errored) == ("RuntimeError: the lookup service is down", "error", True)
    assert get_tool("my_tools:wrong")("x").text == "tool my_tools:wrong returned int, not str or ToolOutput"
    custom = get_tool("my_tools:custom")("furlong")
    assert (custom.text, custom.kind) == ("no such unit: furlong", "error")
    assert get_tool("my_tools:lookup")(" km ").text == "1000 m"
    with pytest.raises(ValueError, match=r"my_tools has no function 'nope'; callables there: .*lookup"):
        get_tool("my_tools:nope")
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        get_tool("no_such_module:f")


def test_the_python_tool_needs_a_sandbox():
    with pytest.raises(ValueError, match="runs code in the sandbox"):
        get_tool("python")


@pytest.mark.parametrize("expr, want", [("3 * (17 + 4) ** 2 / 7", 3 * (17 + 4) ** 2 / 7), ("-2 ** 10 // 3", -(2**10) // 3),
                                        ("max(2, sqrt(16), abs(-3))", 4.0), ("10 % 4 + round(2.5)", 4)])
def test_the_calculator_matches_python_arithmetic(expr, want):
    assert evaluate(expr) == want
    assert get_tool("calculator")(expr).text == repr(want)


@pytest.mark.parametrize("expr, why", [("__import__('os').system('true')", "is not arithmetic"),
                                       ("(1).__class__", "is not arithmetic"), ("2 ** 10 ** 10", "exponent"),
                                       (" * ".join(["9 ** 999"] * 5), "digits"),
                                       ("1 / 0", "division by zero"), ("1 +", "not an arithmetic expression"),
                                       ("(-8) ** 0.5", "complex")])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expr, why):
    out = get_tool("calculator")(expr)
    assert out.kind == "error" and why in out.text


def test_a_markdown_fence_inside_the_call_is_taken_off():
    assert code_of("```python\nprint(1)\n```") == "print(1)"
    assert code_of("\n```py\nx = 1\nprint(x)\n```\n") == "x = 1\nprint(x)"
    assert code_of("print('```')") == "print('```')"


class _Budget:
    timeout_s = 2.0
    max_output_bytes = 100


@pytest.mark.parametrize("result, text, kind", [
    (SandboxResult("4\n", "", 0, False, False, 0.1, "ok"), "4\n", "ok"),
    (SandboxResult("a\n", "Traceback ...\n  x\nZeroDivisionError: division by zero\n", 1, False, False, 0.1, "error"),
     "a\nZeroDivisionError: division by zero", "error"),
    (SandboxResult("", "", -9, False, False, 0.1, "error"), "the code was killed by SIGKILL", "error"),
    (SandboxResult("1\n", "", None, True, False, 2.0, "timeout"),
     "1\nTimeoutError: the code ran past 2 s and was stopped", "timeout"),
    (SandboxResult("xx", "", -9, False, True, 0.1, "truncated"),
     "xx\n[output truncated: the code printed more than 100 bytes and was stopped]", "truncated"),
    (SandboxResult("", "bwrap: Creating new namespace failed\n", 1, False, False, 0.1, "sandbox_failure"),
     "sandbox failure: bwrap: Creating new namespace failed", "sandbox_failure"),
])
def test_what_the_model_reads_back_from_each_kind_of_result(result, text, kind):
    out = output_of(result, _Budget())
    assert (out.text, out.kind, out.seconds) == (text, kind, result.seconds)

"""The ``calculator`` tool: an example of a tool that is a plain function (no sandbox), and a safe one.

It evaluates one arithmetic expression (``3 * (17 + 4) ** 2 / 7``, integers, decimals, ``+ - * / // % **``,
parentheses, ``abs round min max sqrt``) by walking its syntax tree, never ``eval``: a name, an attribute, a call
of anything else or a number too large to print is refused as an error the model reads back.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from dapo_mcore.tools.registry import ToolOutput, register_tool

MAX_EXPONENT = 1000
MAX_DIGITS = 4000
MAX_CHARS = 2000

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., float]] = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt}


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is what the model reads."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (raises CalculatorError)."""
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression ({exc.msg})") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            out = _BINARY[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError) as exc:
            raise CalculatorError(str(exc)) from None
        if isinstance(out, int) and out.bit_length() > MAX_DIGITS * 3.33:
            raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
        return out
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        try:
            return _FUNCTIONS[node.func.id](*(_value(a) for a in node.args))
        except (TypeError, ValueError) as exc:
            raise CalculatorError(f"{node.func.id}: {exc}") from None
    raise CalculatorError(f"{ast.unparse(node)[:80]!r} is not arithmetic")


@register_tool("calculator")
def calculator(text: str) -> str | ToolOutput:
    """The value of the expression in ``text``, or the reason it was refused (kind ``error``)."""
    try:
        value = evaluate(text)
    except CalculatorError as exc:
        return ToolOutput(f"CalculatorError: {exc}", "error")
    if isinstance(value, complex):
        return ToolOutput("CalculatorError: the result is complex", "error")
    return repr(value)

"""Registry of tools a model may call: name -> a function from the call's text to the tool's output text.

A tool function takes the text between the call's tags and returns a ``str`` (success) or a :class:`ToolOutput`
(to report an error or a kind of its own). Register one with :func:`register_tool`; one that needs the code sandbox
(the ``python`` tool) registers a factory with :func:`register_tool_factory`, called once with the run's
:class:`~dapo_mcore.tools.sandbox.Sandbox`. Besides registered names, ``package.module:function`` names a tool
function by import path (your own, outside this package).

:func:`get_tool` returns a :class:`Tool`, whose call never raises: an exception, a wrong return type or a sandbox
fault becomes a ``ToolOutput`` with ``kind`` other than ``ok``, which the rollout turns into error text in the
trajectory and a counter.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from dapo_mcore.plugins import import_callable

if TYPE_CHECKING:
    from dapo_mcore.tools.sandbox import Sandbox

log = logging.getLogger(__name__)

OutputKind = Literal["ok", "error", "timeout", "truncated", "sandbox_failure"]
OUTPUT_KINDS: tuple[str, ...] = ("ok", "error", "timeout", "truncated", "sandbox_failure")


@dataclass(frozen=True)
class ToolOutput:
    """One call's result, as the trajectory sees it."""

    text: str
    """What goes back to the model (the rollout wraps it in its tags and trims it to fit)."""
    kind: OutputKind = "ok"
    """``ok``; ``error`` (the code failed, or the tool raised: ``text`` is the error); ``timeout``; ``truncated``
    (the output was cut); ``sandbox_failure`` (the sandbox did not start: not the model's fault)."""
    seconds: float = 0.0
    """Wall time of the call (filled in by :class:`Tool`)."""

    @property
    def errored(self) -> bool:
        """Whether the call counts as a tool error (every kind but ``ok``)."""
        return self.kind != "ok"


ToolFn = Callable[[str], "str | ToolOutput"]
ToolFactory = Callable[["Sandbox | None"], ToolFn]


@dataclass(frozen=True)
class Tool:
    """A tool ready to call: ``tool(text) -> ToolOutput``, never raising."""

    name: str
    fn: ToolFn

    def __call__(self, text: str) -> ToolOutput:
        start = time.monotonic()
        try:
            out = self.fn(text)
        except Exception as exc:  # a fault of the tool becomes data, never a crash of the rollout
            first = self.name not in _RAISED
            _RAISED.add(self.name)
            log.warning("tool %s raised %s: %s%s", self.name, type(exc).__name__, exc,
                        "" if first else " (traceback logged at its first failure)", exc_info=first)
            return ToolOutput(f"{type(exc).__name__}: {exc}".splitlines()[0], "error", time.monotonic() - start)
        seconds = time.monotonic() - start
        if isinstance(out, str):
            return ToolOutput(out, "ok", seconds)
        if isinstance(out, ToolOutput) and out.kind in OUTPUT_KINDS:
            return ToolOutput(out.text, out.kind, seconds)
        return ToolOutput(f"tool {self.name} returned {type(out).__name__}, not str or ToolOutput", "error", seconds)


_TOOLS: dict[str, ToolFactory] = {}
_RAISED: set[str] = set()  # tools whose first exception (with its traceback) has been logged


def register_tool_factory(name: str) -> Callable[[ToolFactory], ToolFactory]:
    """Decorator registering ``factory(sandbox) -> tool function`` under ``name`` (duplicate names are refused)."""

    def deco(factory: ToolFactory) -> ToolFactory:
        if name in _TOOLS:
            raise ValueError(f"tool {name!r} is already registered; pick another name")
        _TOOLS[name] = factory
        return factory

    return deco


def register_tool(name: str) -> Callable[[ToolFn], ToolFn]:
    """Decorator registering a tool function ``fn(text) -> str | ToolOutput`` under ``name`` (duplicates refused)."""

    def deco(fn: ToolFn) -> ToolFn:
        register_tool_factory(name)(lambda sandbox: fn)
        return fn

    return deco


def get_tool(name: str, sandbox: Sandbox | None = None) -> Tool:
    """A registered tool (built with ``sandbox``), or ``package.module:function`` imported; the error lists the
    registered names. Raises ValueError (one line) for an unknown name or a tool that needs a sandbox and got none."""
    _load_builtins()
    if ":" in name:
        return Tool(name, import_callable(name, "tool", "my_tools:lookup"))
    if name not in _TOOLS:
        raise ValueError(f"unknown tool {name!r}; registered: {', '.join(sorted(_TOOLS))}, or package.module:function "
                         "for your own")
    return Tool(name, _TOOLS[name](sandbox))


def tool_names() -> list[str]:
    """Registered tool names, sorted."""
    _load_builtins()
    return sorted(_TOOLS)


def _load_builtins() -> None:
    """The built-in tools register themselves when their modules are imported."""
    importlib.import_module("dapo_mcore.tools.python_tool")
    importlib.import_module("dapo_mcore.tools.calculator")

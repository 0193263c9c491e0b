"""Tools a model calls between thoughts: the code sandbox (bubblewrap, or unboxed) and the registry of tools
(name -> a function from the call's text to the tool's output text). ``docs/tools.md`` is the security model."""

from dapo_mcore.tools.box import SandboxUnavailable
from dapo_mcore.tools.registry import (
    Tool,
    ToolOutput,
    get_tool,
    register_tool,
    register_tool_factory,
    tool_names,
)
from dapo_mcore.tools.sandbox import Sandbox, SandboxResult

__all__ = [
    "Sandbox",
    "SandboxResult",
    "SandboxUnavailable",
    "Tool",
    "ToolOutput",
    "get_tool",
    "register_tool",
    "register_tool_factory",
    "tool_names",
]

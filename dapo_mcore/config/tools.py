"""``rollout.tools``: multi-turn rollouts with a tool (ReTool's Python interpreter), the settings and their checks.

The model writes ``<code>`` ... ``</code>``; the engine stops there, runs the block with the tool, appends
``<interpreter>`` + the tool's output + ``</interpreter>`` as tokens and goes on (docs/rollout.md, "Tool use").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dapo_mcore.config.tree import ConfigError

__all__ = ["ToolsConfig"]


@dataclass
class ToolsConfig:
    """Tool calls inside a response (off by default: single-turn DAPO)."""

    enabled: bool = False
    """Turn multi-turn tool use on: responses may call ``tool`` up to ``max_calls`` times."""
    tool: str = "python"
    """The registered tool a ``<code>`` block is handed to (``dapo_mcore.tools.registry``)."""
    sandbox: Literal["bwrap", "none"] = "bwrap"
    """Where model-written code runs: ``bwrap`` (bubblewrap: no network, private /tmp, nothing of the host but the
    system and the interpreter, rlimits, the process tree killed at the timeout) or ``none`` (a plain subprocess:
    model-written code runs unboxed, with a warning at every start; only where user namespaces are off)."""
    max_calls: int = 4
    """Most tool calls per response; a ``</code>`` past it ends nothing: the model just goes on writing."""
    timeout_s: float = 10.0
    """Wall-clock limit of one call; at it the call's whole process tree is killed and the call reads as an error."""
    memory_mb: int = 1024
    """Address-space limit of one call (MiB)."""
    max_output_tokens: int = 256
    """Most tokens of tool output appended per call (and never more than what is left of the response budget):
    longer output is cut and marked as cut."""
    python: str = ""
    """The interpreter the tool runs code with (its own environment: ReTool's code imports numpy and sympy); empty =
    the sandbox's default ``python3``."""
    pool_size: int = 0
    """Tool calls that run at once (a thread pool on the engine node; each call is one sandboxed process);
    0 = the node's CPU count."""

    def validate(self) -> None:
        """Each field's own range (cross-field rules: ``config.rules.validate_tools``)."""
        if self.max_calls < 1:
            raise ConfigError(f"rollout.tools.max_calls={self.max_calls} must be >= 1 (ReTool: 1 per turn, many turns;"
                              " or set rollout.tools.enabled=false)")
        if not self.timeout_s > 0:
            raise ConfigError(f"rollout.tools.timeout_s={self.timeout_s} must be > 0 (seconds per call)")
        if self.memory_mb < 64:
            raise ConfigError(f"rollout.tools.memory_mb={self.memory_mb} is too small for an interpreter; use >= 64")
        if self.max_output_tokens < 1:
            raise ConfigError(f"rollout.tools.max_output_tokens={self.max_output_tokens} must be >= 1")
        if self.pool_size < 0:
            raise ConfigError(f"rollout.tools.pool_size={self.pool_size} must be >= 0 (0 = the CPU count)")
        if not self.tool:
            raise ConfigError("rollout.tools.tool is empty; name a registered tool (e.g. python)")

"""The ``python`` tool (ReTool's code interpreter): runs the call's code block in the sandbox and returns what the
model reads back: stdout; when the code failed, stdout then the error's last line (``ZeroDivisionError: division by
zero``); at the timeout or the output cap, what was printed plus a line saying the code was stopped."""

from __future__ import annotations

import re
import signal

from dapo_mcore.tools.registry import ToolFn, ToolOutput, register_tool_factory
from dapo_mcore.tools.sandbox import Sandbox, SandboxResult

_FENCE = re.compile(r"^\s*```[A-Za-z0-9_+-]*[ \t]*\n(.*?)\n?```\s*$", re.DOTALL)


def code_of(text: str) -> str:
    """The code in a call's text: a Markdown fence (```python ... ```) inside the tags is taken off."""
    match = _FENCE.match(text)
    return match.group(1) if match else text


def _error_line(result: SandboxResult) -> str:
    lines = [ln.strip() for ln in result.stderr.splitlines() if ln.strip()]
    if lines:
        return lines[-1]
    code = result.exit_code
    if code is not None and code < 0:
        return f"the code was killed by {signal.Signals(-code).name}"
    return f"the code exited with status {code}"


def output_of(result: SandboxResult, sandbox: Sandbox) -> ToolOutput:
    """What the model reads back from one run of its code."""
    if result.kind == "sandbox_failure":
        return ToolOutput(f"sandbox failure: {_error_line(result)}", "sandbox_failure", result.seconds)
    if result.kind == "timeout":
        note = f"TimeoutError: the code ran past {sandbox.timeout_s:g} s and was stopped"
        return ToolOutput(result.stdout + note, "timeout", result.seconds)
    if result.kind == "truncated":
        note = f"\n[output truncated: the code printed more than {sandbox.max_output_bytes} bytes and was stopped]"
        return ToolOutput(result.stdout + note, "truncated", result.seconds)
    if result.kind == "error":
        return ToolOutput(result.stdout + _error_line(result), "error", result.seconds)
    return ToolOutput(result.stdout, "ok", result.seconds)


@register_tool_factory("python")
def python_tool(sandbox: Sandbox | None) -> ToolFn:
    """``text`` is Python code; it runs in ``sandbox``."""
    if sandbox is None:
        raise ValueError("tool 'python' runs code in the sandbox: build it with a Sandbox (get_tool('python', sandbox))")

    def run(text: str) -> ToolOutput:
        return output_of(sandbox.run(code_of(text)), sandbox)

    return run

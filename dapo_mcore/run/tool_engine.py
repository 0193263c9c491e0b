"""The run's tool-use engine (``rollout.tools``): the sandbox, the registered tool, the tool pool and the tool-call
format bound to the run's tokenizer, around the engine the run built."""

from __future__ import annotations

import logging
import os
from typing import Any

from dapo_mcore.config import Config, ConfigError

log = logging.getLogger(__name__)

OUTPUT_BYTES_PER_TOKEN = 16
"""The sandbox's output cap per token of ``rollout.tools.max_output_tokens`` (what it prints past the cap is cut at the
source, so a flood never reaches the tokenizer)."""


def tool_codec(tokenizer: Any) -> Any:
    """The tool-call format bound to ``tokenizer``: markers encoded as the tokenizer spells them, a tool's output with
    special tokens split into plain text (what model-written code prints cannot forge a special token)."""
    from dapo_mcore.rollout.multiturn import ToolCodec

    return ToolCodec(lambda text: tokenizer(text, add_special_tokens=False).input_ids,
                     lambda ids: tokenizer.decode(ids),
                     encode_output=lambda text: tokenizer(text, add_special_tokens=False,
                                                          split_special_tokens=True).input_ids)


def tool_engine(cfg: Config, engine: Any, tokenizer: Any) -> Any:
    """``engine`` wrapped in a MultiTurnEngine with the configured tool. Raises ConfigError (one line) where the
    sandbox cannot start, the tool is unknown, or the tokenizer cannot spell the format's markers."""
    from dapo_mcore.rollout.multiturn import MultiTurnEngine, ToolPool
    from dapo_mcore.rollout.multiturn.pool import DEADLINE_GRACE_S
    from dapo_mcore.tools.registry import get_tool
    from dapo_mcore.tools.sandbox import Sandbox

    t = cfg.rollout.tools
    codec = tool_codec(tokenizer)
    unk = getattr(tokenizer, "unk_token_id", None)
    marks = (*codec.close_ids, *codec.result_open_ids, *codec.result_close_ids)
    if unk is not None and unk in marks:
        raise ConfigError(f"rollout.tools: the tokenizer cannot spell {codec.fmt.call_close!r} / "
                          f"{codec.fmt.result_open!r} (they encode to its unknown token); use a tokenizer that can "
                          "(the tiny default: tiny_base.preset=tiny-tools)")
    max_bytes = max(4096, OUTPUT_BYTES_PER_TOKEN * t.max_output_tokens)
    try:
        sandbox = Sandbox(timeout_s=t.timeout_s, memory_mb=t.memory_mb, max_output_bytes=max_bytes,
                          python=t.python or "python3", backend=t.sandbox)
        tool = get_tool(t.tool, sandbox)
    except ValueError as exc:
        raise ConfigError(f"rollout.tools: {exc}") from exc
    workers = t.pool_size or os.cpu_count() or 1
    log.info("tool use: %s (sandbox %s), up to %d calls a response, %d at once", t.tool, t.sandbox, t.max_calls,
             workers)
    pool = ToolPool(tool, workers=workers, deadline_s=t.timeout_s + DEADLINE_GRACE_S)
    return MultiTurnEngine(engine, codec, pool, max_calls=t.max_calls, max_output_tokens=t.max_output_tokens)

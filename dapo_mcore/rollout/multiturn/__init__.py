"""Multi-turn tool-use rollouts (ReTool): the tool-call format as tokens, the tool pool, and the engine that
interleaves a model's turns with its tool calls (docs/rollout.md, "Tool use")."""

from dapo_mcore.rollout.multiturn.engine import MultiTurnEngine
from dapo_mcore.rollout.multiturn.format import ToolCodec, ToolFormat
from dapo_mcore.rollout.multiturn.pool import ToolCounters, ToolPool

__all__ = ["MultiTurnEngine", "ToolCodec", "ToolCounters", "ToolFormat", "ToolPool"]

"""ReTool's tool-call format as token ids of one tokenizer: what ends a turn, where a call's code is, and how the
tool's output becomes tokens.

The model writes ``<code>`` ... ``</code>``; the rollout appends ``<interpreter>`` + output + ``</interpreter>``. The
output is tokenized once, here, and appended to the response's token list: nothing is ever re-tokenized from text
(token-in/token-out), so the tokens the actor trains on are exactly the tokens the engine saw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["ToolCodec", "ToolFormat"]


@dataclass(frozen=True)
class ToolFormat:
    """The four markers (ReTool's)."""

    call_open: str = "<code>"
    call_close: str = "</code>"
    result_open: str = "<interpreter>"
    result_close: str = "</interpreter>"


class ToolCodec:
    """:class:`ToolFormat` bound to a tokenizer's ``encode`` (text -> ids, no special tokens added) and ``decode``.

    ``close_ids`` is the token sequence that ends a turn (a stop sequence for the engine). ``encode_output`` encodes
    a tool's output (default: ``encode``): the output is what model-written code printed, so it must spell a special
    token's text as plain text (``split_special_tokens``), never as the special token itself, or the code could plant
    an end-of-turn in the trajectory."""

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[Sequence[int]], str],
                 fmt: ToolFormat | None = None, encode_output: Callable[[str], list[int]] | None = None) -> None:
        self.fmt = fmt or ToolFormat()
        self.encode, self.decode = encode, decode
        self.encode_output = encode_output or encode
        self.close_ids = tuple(encode(self.fmt.call_close))
        self.result_open_ids = list(encode(self.fmt.result_open))
        self.result_close_ids = list(encode(self.fmt.result_close))
        if not self.close_ids:
            raise ValueError(f"the tokenizer encodes {self.fmt.call_close!r} to no tokens; it cannot end a turn")

    def ends_call(self, tokens: Sequence[int]) -> bool:
        """True when ``tokens`` end with ``</code>`` (as token ids)."""
        k = len(self.close_ids)
        return len(tokens) >= k and tuple(tokens[-k:]) == self.close_ids

    def call_text(self, turn: Sequence[int]) -> str | None:
        """The text of the call that ``turn`` (one turn's generated tokens, ending in ``</code>``) makes: what lies
        between its last ``<code>`` and the closing marker (the tool takes a Markdown fence off itself); None
        without a ``<code>``."""
        text = self.decode(list(turn))
        end = text.rfind(self.fmt.call_close)
        start = text.rfind(self.fmt.call_open, 0, max(end, 0))
        if end < 0 or start < 0:
            return None
        return text[start + len(self.fmt.call_open):end]

    def result_ids(self, text: str, max_tokens: int, budget: int) -> tuple[list[int], bool]:
        """``<interpreter>`` + ``text`` (at most ``max_tokens`` of its tokens) + ``</interpreter>`` as token ids, cut
        to ``budget`` tokens in all (what is left of the response). Returns ``(ids, cut)``: ``cut`` when any of the
        output did not fit."""
        body = list(self.encode_output(text))
        cut = len(body) > max_tokens
        ids = self.result_open_ids + body[:max_tokens] + self.result_close_ids
        if len(ids) > budget:
            return ids[:max(budget, 0)], True
        return ids, cut

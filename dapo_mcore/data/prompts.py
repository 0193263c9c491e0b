"""Prompt wording and chat-template rendering, with prompt-length filtering or left truncation.

Raw math problems get DAPO's wording (instruction, blank line, problem, blank line, reminder); every
prompt is then rendered as one user turn plus the generation prompt with the tokenizer's chat template.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from dapo_mcore.data.records import PromptRecord

logger = logging.getLogger(__name__)

DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem."
)
DAPO_REMINDER = 'Remember to put your answer on its own line after "Answer:".'

Truncation = Literal["drop", "left"]
TRUNCATION_MODES: tuple[str, ...] = ("drop", "left")


def dapo_math_prompt(problem: str) -> str:
    """The DAPO-Math user message for a raw problem statement."""
    return f"{DAPO_INSTRUCTION}\n\n{problem}\n\n{DAPO_REMINDER}"


def render_prompt_text(tokenizer: PreTrainedTokenizerBase, content: str, system: str | None = None) -> str:
    """One user turn (after a ``system`` turn, if given) plus the generation prompt, rendered with the tokenizer's chat
    template."""
    if tokenizer.chat_template is None:
        raise ValueError("tokenizer has no chat_template; use a chat/instruct tokenizer or the tiny one")
    turns = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": content}]
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except TemplateError as err:
        from dapo_mcore.errors import UserError

        what = "a system turn and a user turn" if system is not None else "a user turn"
        raise UserError(f"the tokenizer's chat template cannot render {what}: {err}; use a dataset without system "
                        "messages or a tokenizer whose template renders them (model.tokenizer_path)") from err


def render_prompt_ids(tokenizer: PreTrainedTokenizerBase, content: str, system: str | None = None) -> list[int]:
    """Token ids of :func:`render_prompt_text` (the template already holds any bos token)."""
    return tokenizer(render_prompt_text(tokenizer, content, system), add_special_tokens=False).input_ids


@dataclass(frozen=True)
class EncodedPrompt:
    """A record with its rendered prompt token ids; ``truncated`` marks a left-truncated prompt."""

    record: PromptRecord
    input_ids: list[int]
    truncated: bool


def encode_prompts(records: list[PromptRecord], tokenizer: PreTrainedTokenizerBase, max_prompt_len: int,
                   truncation: Truncation = "drop") -> tuple[list[EncodedPrompt], list[tuple[int, str]]]:
    """Render and tokenize prompts; over-long ones are dropped (with reason) or left-truncated.

    Returns the kept prompts and ``(record.index, reason)`` for each dropped one. Left truncation
    keeps the last ``max_prompt_len`` tokens (the problem's end and the generation prompt), as verl does.
    """
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"truncation={truncation!r}; use one of {TRUNCATION_MODES}")
    if max_prompt_len < 1:
        raise ValueError(f"max_prompt_len={max_prompt_len} must be >= 1")
    kept: list[EncodedPrompt] = []
    dropped: list[tuple[int, str]] = []
    for rec in records:
        ids = render_prompt_ids(tokenizer, rec.prompt, rec.system)
        if len(ids) <= max_prompt_len:
            kept.append(EncodedPrompt(rec, ids, truncated=False))
        elif truncation == "left":
            kept.append(EncodedPrompt(rec, ids[-max_prompt_len:], truncated=True))
        else:
            dropped.append((rec.index, f"prompt has {len(ids)} tokens > max_prompt_len={max_prompt_len}"))
    n_trunc = sum(p.truncated for p in kept)
    if dropped or n_trunc:
        logger.warning("prompt length %d: dropped %d and left-truncated %d of %d prompts",
                       max_prompt_len, len(dropped), n_trunc, len(records))
    return kept, dropped

"""The run's stop tokens: one set, built once, that every engine stops on.

transformers' ``generate`` and vLLM both stop on the EOS ids of the model's ``generation_config.json`` (Qwen2.5
instruct models list ``[151645, 151643]``: ``<|im_end|>`` and ``<|endoftext|>``) as well as the tokenizer's EOS
token. An engine told only the tokenizer's EOS runs every response that ends in the other id to the length limit, so
the CPU rehearsal and the GPU run would disagree. :func:`resolve_stop_tokens` gathers the three sources (generation
config, tokenizer, ``rollout.stop_token_ids``) into one :class:`StopTokens`; the engine build hands the same ids to
the transformers engine (its EOS set) and to vLLM (each request's ``stop_token_ids``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["GENERATION_CONFIG", "StopTokens", "StopTokenError", "read_generation_eos", "resolve_stop_tokens"]

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"


class StopTokenError(ValueError):
    """A stop-token source that cannot be read or names ids outside the vocabulary (the message says the fix)."""


@dataclass(frozen=True)
class StopTokens:
    """The ids that end a response, each with where it came from."""

    ids: tuple[int, ...]
    """Sorted, unique."""
    sources: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """id -> the sources that named it: "generation_config", "tokenizer", "rollout.stop_token_ids"."""

    def describe(self, decode: Any = None) -> str:
        """``151643 '<|endoftext|>' (generation_config), 151645 '<|im_end|>' (generation_config, tokenizer)``."""
        parts = []
        for i in self.ids:
            text = f" {decode([i])!r}" if decode is not None else ""
            parts.append(f"{i}{text} ({', '.join(self.sources[i])})")
        return ", ".join(parts)


def _as_ids(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise StopTokenError(f"{where}: eos_token_id={value!r} must be an int or a list of ints.")
    return list(values)


def read_generation_eos(model_dir: str | Path | None) -> list[int]:
    """``eos_token_id`` of ``model_dir/generation_config.json`` (int or list) as a list; [] without the file."""
    if model_dir is None:
        return []
    path = Path(model_dir) / GENERATION_CONFIG
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise StopTokenError(f"{path} is not valid JSON ({err}); fix or remove it (it sets the model's stop "
                             "tokens).") from err
    if not isinstance(data, dict):
        raise StopTokenError(f"{path} is not a JSON object; is it a Hugging Face generation_config.json?")
    return _as_ids(data.get("eos_token_id"), str(path))


def resolve_stop_tokens(model_dir: str | Path | None, tokenizer_eos: int | None, extra: list[int] | tuple[int, ...],
                        vocab_size: int) -> StopTokens:
    """The union of the generation config's EOS ids, the tokenizer's EOS id and ``extra`` (rollout.stop_token_ids).

    Raises StopTokenError for an id outside ``[0, vocab_size)`` or when the union is empty (nothing would end a
    response before the length limit).
    """
    named: dict[str, list[int]] = {
        "generation_config": read_generation_eos(model_dir),
        "tokenizer": [] if tokenizer_eos is None else [int(tokenizer_eos)],
        "rollout.stop_token_ids": [int(t) for t in extra],
    }
    sources: dict[int, tuple[str, ...]] = {}
    for source, ids in named.items():
        for i in ids:
            if not 0 <= i < vocab_size:
                where = (f"{Path(model_dir) / GENERATION_CONFIG}" if source == "generation_config" else source)
                raise StopTokenError(f"{where}: stop token id {i} lies outside the vocabulary [0, {vocab_size}); "
                                     "use ids of the model's tokenizer.")
            if source not in sources.get(i, ()):
                sources[i] = sources.get(i, ()) + (source,)
    if not sources:
        raise StopTokenError("no stop token: the tokenizer has no EOS token and the model has no generation_config.json "
                             "eos_token_id; set rollout.stop_token_ids=[ID].")
    return StopTokens(ids=tuple(sorted(sources)), sources=sources)

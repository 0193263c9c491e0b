"""Registry of reward functions (name -> callable) and the tail-slicing contract they share.

A reward function takes ``(response: str | bytes, ground_truth: str)`` and returns a
:class:`~dapo_mcore.reward.math_verifier.RewardResult`. Besides registered names, ``package.module:function``
names a function by import path (your own verifier, outside this package): it may return a ``RewardResult``, a
bool (correct or not: +1/-1) or a number (the score; correct when > 0), numpy and torch scalars included, and may declare ``fn.tail_chars = N``. One registered with ``tail_chars=N`` promises to look at
no more than :func:`decode_tail(response, N) <decode_tail>`, so callers (the worker pool) may slice long responses
before shipping them to a worker without changing any score.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dapo_mcore.plugins import import_callable

RewardFn = Callable[..., Any]

TAIL_BYTES_PER_CHAR = 8
"""Bytes kept per wanted character when slicing ``bytes`` before decoding (UTF-8 uses at most 4 per character;
the decoder resynchronises within 4 bytes of a cut, so 8 per character keeps the decoded tail exact)."""


def decode_tail(response: str | bytes | bytearray, chars: int) -> str:
    """The last ``chars`` characters of a response; bytes are decoded as UTF-8 with U+FFFD for invalid input.

    Only a suffix of a bytes response is decoded, so a 1 MB response costs no more than a short one; the
    result equals ``bytes(response).decode("utf-8", "replace")[-chars:]``.
    """
    if isinstance(response, str):
        return response[-chars:]
    if isinstance(response, bytes | bytearray):
        return bytes(response[-chars * TAIL_BYTES_PER_CHAR:]).decode("utf-8", errors="replace")[-chars:]
    raise TypeError(f"response must be str or bytes, got {type(response).__name__}")


@dataclass(frozen=True)
class RewardSpec:
    """A registered reward function."""

    name: str
    """Registry key (the dataset's ``data_source`` or the config's reward name)."""
    fn: RewardFn
    """``fn(response, ground_truth) -> RewardResult``; must be a module-level function (picklable by name)."""
    tail_chars: int | None
    """The function reads at most the last ``tail_chars`` characters of the response; None = all of it."""


_REWARDS: dict[str, RewardSpec] = {}


def register_reward(name: str, *, tail_chars: int | None = None) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under ``name`` (duplicate names are refused)."""

    def deco(fn: RewardFn) -> RewardFn:
        if name in _REWARDS:
            raise ValueError(f"reward function {name!r} is already registered; pick another name")
        _REWARDS[name] = RewardSpec(name=name, fn=fn, tail_chars=tail_chars)
        return fn

    return deco


def get_reward(name: str) -> RewardSpec:
    """A registered reward, or ``package.module:function`` imported; the error lists the registered names."""
    if ":" in name:
        return import_reward(name)
    if name not in _REWARDS:
        raise ValueError(f"unknown reward function {name!r}; registered: {', '.join(sorted(_REWARDS))}, or "
                         "package.module:function for your own")
    return _REWARDS[name]


class ImportedReward:
    """A user's reward function adapted to the ``RewardResult`` contract.

    Pickled by its import path (not by the function object), so a spawned pool worker imports the same module
    and function by name: the user's verifier runs there with the same timeout and isolation as a built-in one.
    """

    def __init__(self, path: str):
        self.path = path
        self.fn = import_callable(path, "reward", "my_rewards:score")

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return ImportedReward, (self.path,)

    def __call__(self, response: str | bytes, ground_truth: str, **kwargs: Any) -> Any:
        from dapo_mcore.reward.result import as_result

        out = self.fn(response, ground_truth, **kwargs)
        try:
            return as_result(out)
        except TypeError as exc:
            raise TypeError(f"reward {self.path} {exc}") from None


def import_reward(path: str) -> RewardSpec:
    """``package.module:function`` as a :class:`RewardSpec` (raises ValueError with a fix if it cannot be loaded)."""
    adapted = ImportedReward(path)
    tail = getattr(adapted.fn, "tail_chars", None)
    if tail is not None and (not isinstance(tail, int) or tail < 1):
        raise ValueError(f"reward {path!r}: tail_chars={tail!r} must be a positive int (or absent)")
    return RewardSpec(name=path, fn=adapted, tail_chars=tail)


def reward_names() -> list[str]:
    """Registered reward function names, sorted."""
    return sorted(_REWARDS)

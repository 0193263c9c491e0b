"""How many rows the embedding and output layer hold: the vocabulary padding rule (torch-free: config reads it).

Two rules, chosen by ``model.vocab_padding`` and recorded in every canonical checkpoint's layout:

- ``tp``: keep the vocabulary as it is when tensor parallelism divides it (what Megatron-Bridge's GPTModelProvider
  builds with its default ``should_pad_vocab=False``); otherwise pad to the next multiple of ``d * tp``, where ``d`` is
  the largest power of two <= ``divisible_by`` that divides the vocabulary (Bridge's ``should_pad_vocab`` divisor).
- ``megatron``: Megatron-LM's ``--make-vocab-size-divisible-by`` rule, the next multiple of ``divisible_by * tp``
  (dapo-mcore's only rule before Megatron-Bridge interop; checkpoints that name no rule were written with it).
"""

from __future__ import annotations

VOCAB_PADDINGS = ("tp", "megatron")


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _power_of_two_divisor(vocab_size: int, cap: int) -> int:
    """The largest power of two that is <= ``cap`` and divides ``vocab_size``."""
    d = 1
    while d * 2 <= cap and vocab_size % (d * 2) == 0:
        d *= 2
    return d


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int, padding: str = "megatron") -> int:
    """Rows of the (tensor-parallel split) embedding and output layer for ``vocab_size`` tokens under ``padding``
    (see the module docstring); always a multiple of ``tensor_parallel`` and >= ``vocab_size``."""
    if padding == "megatron":
        return _ceil_to(vocab_size, divisible_by * tensor_parallel)
    if padding == "tp":
        if vocab_size % tensor_parallel == 0:
            return vocab_size
        return _ceil_to(vocab_size, _power_of_two_divisor(vocab_size, divisible_by) * tensor_parallel)
    raise ValueError(f"unknown vocabulary padding {padding!r}; choose one of {', '.join(VOCAB_PADDINGS)}.")

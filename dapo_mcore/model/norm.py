"""The local layer spec's RMSNorm under sequence parallelism (so MoE with tensor parallelism runs on a CPU).

Megatron-Core's local spec builds its norms as ``WrappedTorchNorm`` (megatron/core/transformer/torch_norm.py), which
asserts ``not config.sequence_parallel``. Sequence parallelism changes nothing in a norm's forward (it is per token);
what it changes is the weight's gradient: each TP rank sees 1/TP of the tokens, so the gradient must be summed over
the TP group. Megatron does that in ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``) for
every parameter marked ``sequence_parallel = True``, which Transformer Engine's norms are and the torch norm is not.
``SequenceParallelRMSNorm`` is torch's RMSNorm with that mark, and `with_sequence_parallel_norms` swaps it into a
layer spec in place of the torch norm. Megatron requires sequence parallelism for MoE layers with TP > 1, so this is
what lets the project's CPU tests run an MoE model at TP = 2 (and expert-TP below TP).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built from Megatron's norm arguments, its weight marked for the TP all-reduce of its
    gradient when ``config.sequence_parallel`` (what TE's ``TENorm`` does)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError("SequenceParallelRMSNorm is an RMSNorm without zero-centred gamma; this config asks for "
                             f"normalization={config.normalization!r}.")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def _is_torch_norm(module: Any) -> bool:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return module is WrappedTorchNorm


def with_sequence_parallel_norms(spec: Any) -> Any:
    """`spec` (a ``ModuleSpec``, a submodules dataclass or a list of them) with every ``WrappedTorchNorm`` replaced by
    `SequenceParallelRMSNorm`; everything else is kept (new spec objects, the input is not changed)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if _is_torch_norm(spec):
        return SequenceParallelRMSNorm
    if isinstance(spec, list):
        return [with_sequence_parallel_norms(s) for s in spec]
    if isinstance(spec, ModuleSpec):
        module = SequenceParallelRMSNorm if _is_torch_norm(spec.module) else spec.module
        sub = spec.submodules
        return dataclasses.replace(spec, module=module,
                                   submodules=None if sub is None else with_sequence_parallel_norms(sub))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: with_sequence_parallel_norms(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    return spec

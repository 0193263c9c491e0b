"""What an engine rank keeps of a staged version: only the part of each tensor its own engine loads.

Every engine rank receives each version whole (trainer rank 0 broadcasts the HF export), but an engine at vLLM
tensor parallel k loads about 1/k of it: vLLM's weight loaders ``narrow`` each column-parallel tensor (q/k/v,
gate/up, the embedding and the LM head) along its output dimension and each row-parallel one (o_proj, down_proj)
along its input dimension to the rank's slice, copy the replicated ones (norms, the router) whole, and with expert
parallelism skip the experts the rank does not hold. Holding the whole version on the host per staged copy
(``rollout.pipeline.async_channels.VersionReceiver``) costs k times what the engine can use.

Which part is read is not written down here as a second copy of vLLM's sharding rules: it is recorded, once, while
the start's version loads (straight into the engine, never staged) through the engine's own ``update_weights``.
Each tensor is handed in wrapped (:class:`_Watched`, a ``torch.Tensor`` subclass whose ``__torch_function__`` sees
every torch call made on it, ``torch.ops`` included): a ``narrow`` records its dimension and range (the result is a
plain tensor, so what the loader does with the slice is its business), shape and dtype queries record nothing, and
any other use records "whole". Per tensor the staged part is then:

- all reads ``narrow`` along one dimension: the range they cover on it (their span);
- any other use, or ``narrow`` along two dimensions: the whole tensor;
- never read at all (an expert this rank does not hold, a tied LM head the loader skips): nothing.

Loading a staged version hands the engine each tensor at its full shape again (one tensor at a time, the part copied
into zeros; a tensor not read is a zero-strided view that takes no memory): the loader reads exactly the part it read
the first time, so the engine ends up with the same weights as from the whole version.

What this cannot see: a loader that passes a received tensor to code outside torch's Python API (a pybind function
of an extension, ``data_ptr`` arithmetic) leaves no record, so that tensor would be staged as not read. vLLM's loaders
(``vllm/model_executor/layers/linear.py``, ``parameter.py``, ``vocab_parallel_embedding.py``, ``fused_moe/layer.py``)
use ``narrow`` and ``copy_``; this has not run with vLLM on a GPU (docs/rollout.md).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from dapo_mcore.rollout.protocol import WeightBucket

__all__ = ["NOT_READ", "WHOLE", "ReadRecorder", "Span", "StagedTensor", "expand", "stage", "staged_bytes"]

WHOLE = "whole"
"""The loader used the whole tensor (or in a way other than ``narrow`` along one dimension)."""
NOT_READ = "not read"
"""The loader never touched the tensor's data."""


@dataclasses.dataclass(frozen=True)
class Span:
    """The part of a tensor its loader read: ``length`` entries from ``start`` along ``dim``."""

    dim: int
    start: int
    length: int


Region = Span | str
"""A tensor's read part: a Span, WHOLE or NOT_READ."""

_METADATA = frozenset({"size", "dim", "numel", "nelement", "element_size", "is_contiguous", "stride", "__len__",
                       "get_device", "is_floating_point", "is_complex"})
"""Tensor methods that read no data."""
_PROPERTIES = frozenset({"shape", "dtype", "device", "ndim", "layout", "is_cuda", "is_cpu", "is_meta", "requires_grad",
                         "is_sparse", "is_quantized", "names", "itemsize", "nbytes"})
"""Tensor properties that read no data (``__torch_function__`` sees their getters)."""
_NARROW = (torch.Tensor.narrow, torch.narrow)


def _name_of(func: Any) -> tuple[str, bool]:
    """The called name, and whether it is a property getter."""
    if getattr(func, "__name__", "") == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", ""), True
    return getattr(func, "__name__", ""), False


class _Watched(torch.Tensor):
    """A received tensor on its way into the engine's loader; every torch call on it is recorded (module docstring)."""

    _dapo_reads: list
    """The recorder's list for this tensor's name (shared, appended to)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        watched = [a for a in (*args, *kwargs.values()) if isinstance(a, _Watched)]
        name, prop = _name_of(func)
        if func in _NARROW and len(watched) == 1 and args and args[0] is watched[0]:
            dim, start, length = _narrow_args(args[1:], kwargs)
            dim = dim % watched[0].dim()
            start = start % watched[0].shape[dim] if start < 0 else start
            watched[0]._dapo_reads.append(Span(dim, int(start), int(length)))
        elif not ((prop and name in _PROPERTIES) or (not prop and name in _METADATA)):
            for w in watched:
                w._dapo_reads.append(WHOLE)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return _plain(out)


def _narrow_args(args: tuple, kwargs: dict) -> tuple[int, int, int]:
    values = list(args) + [kwargs[k] for k in ("dim", "start", "length") if k in kwargs]
    dim, start, length = (int(v.item()) if isinstance(v, torch.Tensor) else int(v) for v in values[:3])
    return dim, start, length


def _plain(value: Any) -> Any:
    if isinstance(value, _Watched):
        return value.as_subclass(torch.Tensor)
    if isinstance(value, (tuple, list)):
        return type(value)(_plain(v) for v in value)
    return value


class ReadRecorder:
    """Records which part of each tensor an engine's ``update_weights`` reads (module docstring)."""

    def __init__(self) -> None:
        self._reads: dict[str, list] = {}
        self._lock = threading.Lock()

    def wrap(self, buckets: Iterable[WeightBucket]) -> Iterator[WeightBucket]:
        """``buckets`` with each tensor watched; hand the result to the engine's ``update_weights``."""
        for bucket in buckets:
            yield [(name, self._watch(name, t)) for name, t in bucket]

    def _watch(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        with self._lock:
            reads = self._reads.setdefault(name, [])
        watched = tensor.as_subclass(_Watched)
        watched._dapo_reads = reads
        return watched

    def regions(self) -> dict[str, Region]:
        """Per tensor name received, the part its loader read."""
        return {name: _region(reads) for name, reads in self._reads.items()}


def _region(reads: list) -> Region:
    if not reads:
        return NOT_READ
    if any(r == WHOLE for r in reads) or len({r.dim for r in reads}) > 1:
        return WHOLE
    start, end = min(r.start for r in reads), max(r.start + r.length for r in reads)
    return Span(reads[0].dim, start, end - start)


@dataclasses.dataclass
class StagedTensor:
    """One tensor of a staged version: its name, full shape and dtype, and the part kept on the host."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    region: Region
    part: torch.Tensor | None
    """The kept part (the whole tensor for WHOLE, None for NOT_READ), a host tensor of its own storage."""

    @property
    def nbytes(self) -> int:
        return 0 if self.part is None else self.part.numel() * self.part.element_size()


def stage(bucket: WeightBucket, regions: dict[str, Region]) -> list[StagedTensor]:
    """The parts of ``bucket`` to keep on the host, each copied off the received buffer (a name not recorded is kept
    whole)."""
    out = []
    for name, t in bucket:
        region = regions.get(name, WHOLE)
        if isinstance(region, Span) and region.length == t.shape[region.dim]:
            region = WHOLE
        if region == NOT_READ:
            part = None
        else:
            view = t.narrow(region.dim, region.start, region.length) if isinstance(region, Span) else t
            part = view.to("cpu", copy=True).contiguous()  # own storage: the received buffer is not kept alive
        out.append(StagedTensor(name, tuple(t.shape), t.dtype, region, part))
    return out


def expand(staged: list[StagedTensor]) -> WeightBucket:
    """A staged bucket at full shape for the engine's loader: each kept part in place, zeros elsewhere."""
    bucket: WeightBucket = []
    for s in staged:
        if s.part is None:
            full = torch.zeros((), dtype=s.dtype).expand(s.shape)
        elif isinstance(s.region, Span):
            full = torch.zeros(s.shape, dtype=s.dtype)
            full.narrow(s.region.dim, s.region.start, s.region.length).copy_(s.part)
        else:
            full = s.part
        bucket.append((s.name, full))
    return bucket


def staged_bytes(buckets: Iterable[list[StagedTensor]]) -> tuple[int, int]:
    """Host bytes a staged version holds, and the bytes of the whole version it was staged from."""
    buckets = list(buckets)
    whole = sum(torch.Size(s.shape).numel() * s.dtype.itemsize for bucket in buckets for s in bucket)
    return sum(s.nbytes for bucket in buckets for s in bucket), whole

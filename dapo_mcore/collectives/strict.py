"""NCCL on CPU: every tensor collective that dapo_mcore code issues on a group that is NCCL on a GPU refuses a tensor
that did not come through the collective device, with NCCL's own error.

On a GPU the default group and Megatron's model/data/expert groups are NCCL, which refuses a CPU tensor ("No backend
type associated with device type cpu"); on CPU they are gloo, which takes anything, so a collective on a CPU tensor
passes every CPU test and fails on first use on a cluster. With ``DAPO_MCORE_STRICT_DEVICE=1`` (set by the test suite
and by ``dapo-mcore rehearse``, never otherwise) :func:`install` wraps torch.distributed's tensor collectives: a call
whose caller is a module of ours (``dapo_mcore.*``, ``conversion.*``) on such a group checks that each tensor was made
by or moved through :func:`dapo_mcore.collectives.device.collective_device` (a ``SimulatedDevice`` on CPU), or is a
view of such a tensor. Every module of ours is checked: none is exempt.

Why the caller's frame and not our call sites: a wrapper at each call site is only as complete as the list of call
sites, and a new ``dist.all_reduce`` written tomorrow would go unchecked; wrapping torch.distributed itself sees every
call, and the caller's module (one frame up, a dictionary look-up) keeps Megatron-Core's own collectives, whose tensors
are its model's and whose device is its business, out of it. Groups made as gloo on purpose stay gloo on a GPU too and
are not checked: those made with ``new_group(backend="gloo")`` (Megatron's ``*_GLOO`` groups) and gloo process groups
constructed directly (the async bridge's ``all`` and ``batches`` groups). The weights group has its own check
(``DeviceStrictGroup``). Object collectives and barriers are not checked: torch moves those onto the current device
itself.

Point-to-point ops are checked the same way: ``send``/``recv`` and ``isend``/``irecv`` called from a module of ours,
and every op of a ``batch_isend_irecv`` a module of ours issues (the route exchange's ``P2POp`` list: each op's tensor
on its op's group). ``isend``/``irecv`` are replaced in ``torch.distributed.distributed_c10d`` too, where ``P2POp``
and ``batch_isend_irecv`` compare an op against them by identity, so Megatron's pipeline (``P2POp(dist.isend, ...)``)
keeps working; its own ops (its caller is Megatron) are not checked.

It is installed when ``dapo_mcore`` is imported with the variable set, so every process that runs our code is covered
however it made its process group (``init_distributed``, the async split world, a test's own ``init_process_group``).

What it cannot see:

- code that runs only on a GPU: a branch taken under ``torch.cuda.is_available()`` or on an NCCL backend (the NCCL
  export path's ``all_gather_into_tensor``, Transformer Engine, vLLM's own communicators) never runs here, so its
  tensors are never checked; nor is anything that decides the device from the backend name it finds;
- collectives issued by other packages on our behalf (Megatron-Core, vLLM, torch's own helpers): the caller's module
  decides, one frame up, so a helper of ours that hands a CPU tensor to a library that then calls torch.distributed
  is not seen;
- object collectives (``all_gather_object``, ``broadcast_object_list``...) and barriers: torch moves those onto the
  current device itself, so they pass on NCCL too, but their cost (a pickle through GPU memory) is not flagged;
- whether the tensor is on the *right* GPU or stream (the simulated device is one device);
- two threads driving two communicators in different orders on two ranks is seen only as NCCL's worst case: a
  synchronous collective of ours on a group that is NCCL on a GPU holds the simulated device from its start to its
  completion (``device.device_held``), so such an order deadlocks here as it may on a GPU (and ends in the group's
  timeout); asynchronous ops (``async_op=True``, point-to-point) are not held;
- dtypes NCCL lacks are not refused (gloo and NCCL differ there too).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.collectives.device import ENV, SimulatedDevice, device_held

__all__ = ["NCCL_CPU_ERROR", "StrictDeviceError", "gloo_on_purpose", "install", "installed"]

NCCL_CPU_ERROR = "No backend type associated with device type cpu"
"""What ProcessGroupNCCL's dispatcher says to a CPU tensor (torch's ``ProcessGroup::getBackend``)."""

_TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather",
                       "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                       "send", "recv")
_P2P_OPS = ("isend", "irecv")
"""Wrapped in ``torch.distributed`` and in ``distributed_c10d``'s globals alike: ``P2POp`` checks ``op in [isend,
irecv]`` and ``batch_isend_irecv`` tells them apart with ``op.op is isend`` against the module's own names."""
_OURS = ("dapo_mcore.", "conversion.")
_REDISPATCH = "dapo_mcore.model.cpu_compat"
"""Its torch-function mode hands an op (isend/irecv are torch functions) back to the public name, i.e. to the wrapper
again: that second call is the first one's, whose caller was already judged."""
_gloo_on_purpose: dict[int, Any] = {}
_installed = False


class StrictDeviceError(RuntimeError):
    """A collective of ours got a tensor that NCCL would refuse."""


def installed() -> bool:
    return _installed


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def gloo_on_purpose(group: Any) -> None:
    """``group`` is gloo on a GPU too (the async engine side's default group): not checked."""
    _gloo_on_purpose[id(group)] = group  # kept alive: the id stays this group's


def _nccl_on_gpu(group: Any) -> bool:
    """Whether ``group`` (None: the default group) would be NCCL on a GPU."""
    if group is None and _gloo_on_purpose and dist.is_initialized():
        group = dist.distributed_c10d._get_default_group()
    if group is not None and (isinstance(group, dist.ProcessGroupGloo) or id(group) in _gloo_on_purpose):
        return False
    return dist.get_backend(group) == "gloo"  # gloo here, because this is a CPU: NCCL there


def _refuse(name: str, arg: str, caller: Any, module: str) -> StrictDeviceError:
    return StrictDeviceError(
        f"{NCCL_CPU_ERROR} (dist.{name}, argument {arg!r}, from {module} line {caller.f_lineno}: the tensor did not "
        "come through dapo_mcore.collectives.device.collective_device(); NCCL refuses it on a GPU; "
        f"{ENV}=1 simulates that on CPU)")


def _checked(name: str, fn: Any) -> Any:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def collective(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        module = caller.f_globals.get("__name__", "")
        if module.startswith(_OURS) and module != _REDISPATCH:
            bound = sig.bind(*args, **kwargs)
            if _nccl_on_gpu(bound.arguments.get("group")):
                for arg, value in bound.arguments.items():
                    for t in _tensors(value):
                        if not SimulatedDevice.holds(t):
                            raise _refuse(name, arg, caller, module)
                if not bound.arguments.get("async_op") and name not in _P2P_OPS:
                    with device_held():  # start to completion, as an NCCL kernel holds the device (device.py)
                        return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    collective.__wrapped_strict__ = True
    return collective


def _checked_batch(fn: Any) -> Any:
    """``batch_isend_irecv``: each ``P2POp``'s tensor on its own group (the ops' functions are torch's, already
    wrapped; called from torch, they do not check themselves)."""

    @functools.wraps(fn)
    def batch_isend_irecv(p2p_op_list: Any) -> Any:
        caller = sys._getframe(1)
        module = caller.f_globals.get("__name__", "")
        if module.startswith(_OURS):
            for i, op in enumerate(p2p_op_list):
                if _nccl_on_gpu(op.group) and not SimulatedDevice.holds(op.tensor):
                    raise _refuse(f"batch_isend_irecv ({getattr(op.op, '__name__', op.op)})",
                                  f"p2p_op_list[{i}].tensor", caller, module)
        return fn(p2p_op_list)

    batch_isend_irecv.__wrapped_strict__ = True
    return batch_isend_irecv


def _new_group(fn: Any) -> Any:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        group = fn(*args, **kwargs)
        backend = sig.bind(*args, **kwargs).arguments.get("backend")
        if group is not None and str(backend).lower() == "gloo":
            _gloo_on_purpose[id(group)] = group  # kept alive: the id stays this group's
        return group

    new_group.__wrapped_strict__ = True
    return new_group


def install() -> None:
    """Wrap torch.distributed's tensor collectives, its point-to-point ops and ``new_group`` (idempotent; see the module
    docstring)."""
    global _installed
    if _installed:
        return
    from torch.distributed import distributed_c10d as c10d

    for name in _TENSOR_COLLECTIVES:
        setattr(dist, name, _checked(name, getattr(dist, name)))
    for name in _P2P_OPS:  # one wrapper under both names: P2POp compares by identity
        wrapped = _checked(name, getattr(c10d, name))
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    dist.batch_isend_irecv = _checked_batch(dist.batch_isend_irecv)
    dist.new_group = _new_group(dist.new_group)
    _installed = True


def install_if_asked() -> None:
    if os.environ.get(ENV) == "1":
        install()

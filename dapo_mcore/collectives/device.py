"""Where the weights group's tensors live, and a CPU stand-in for a GPU that refuses what NCCL refuses.

On a GPU the weights group is a ``ProcessGroupNCCL``, which refuses any tensor not on a CUDA device
(``check_gpu_single_tensor``: "Tensors must be CUDA and dense"); on CPU it is gloo, which takes anything. So that the
CPU tests catch a tensor that skips the move to the device (a header's CPU size tensor once did), the bridge moves
every tensor for that group through one :class:`TransferDevice`, and ``DAPO_MCORE_STRICT_DEVICE=1`` (set by the
tests, never otherwise) makes it a :class:`SimulatedDevice` whose :class:`DeviceStrictGroup` refuses every tensor
that did not come through it, with NCCL's error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = ["ENV", "DeviceStrictGroup", "SimulatedDevice", "TransferDevice", "collective_device", "device_held"]

ENV = "DAPO_MCORE_STRICT_DEVICE"
_MARK = "_dapo_on_transfer_device"


class TransferDevice:
    """The device of the weights group's tensors: ``cuda`` (NCCL) or ``cpu`` (gloo)."""

    def __init__(self, name: str):
        self.name = name

    def to(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.name)

    def empty(self, size: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``size`` (a number of elements or a shape) on this device."""
        return torch.empty(size, dtype=dtype, device=self.name)

    def host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the host: one device-to-host copy, which waits for the device (a host sync)."""
        return tensor.cpu()

    def synchronize(self) -> None:
        """Block the host until the device's queued work (a broadcast) is done: without it the sender of the
        weights would queue every bucket at once on a GPU, each holding its buffer (up to about twice the model)."""
        if self.name.startswith("cuda"):
            torch.cuda.current_stream().synchronize()


class SimulatedDevice(TransferDevice):
    """A CPU stand-in for ``cuda``: tensors are marked as they are moved onto it or made on it; counts host syncs."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.syncs = 0

    def to(self, tensor: torch.Tensor) -> torch.Tensor:
        moved = tensor.to("cpu").clone()  # a new tensor, as a move to another device makes
        setattr(moved, _MARK, True)
        return moved

    def empty(self, size: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        made = torch.empty(size, dtype=dtype)
        setattr(made, _MARK, True)
        return made

    def host(self, tensor: torch.Tensor) -> torch.Tensor:
        self.syncs += 1
        return tensor.detach().clone()  # unmarked: back on the host

    def synchronize(self) -> None:
        self.syncs += 1

    @staticmethod
    def holds(tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` was moved onto or made on this device, or is a view of such a tensor (a view shares its
        base's storage, so lives where its base does: a slice of a received buffer, a reshaped staging buffer)."""
        base = tensor._base
        return bool(getattr(tensor, _MARK, False) or (base is not None and getattr(base, _MARK, False)))


class DeviceStrictGroup:
    """A gloo group that refuses tensors not on the :class:`SimulatedDevice`, as ProcessGroupNCCL refuses tensors
    off its CUDA device; everything else passes through to the wrapped group."""

    def __init__(self, group: Any, device: SimulatedDevice):
        self._group, self.device = group, device

    def _check(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if not (SimulatedDevice.holds(t) and t.layout == torch.strided):
                raise ValueError("Tensors must be CUDA and dense (DeviceStrictGroup: a tensor the weights group got "
                                 "was not moved through the bridge's transfer device)")

    def __getattr__(self, name: str) -> Any:
        verb = getattr(self._group, name)
        if name not in _COLLECTIVES:
            return verb

        def checked(tensors: list[torch.Tensor], *args: Any) -> Any:
            self._check(tensors)
            with device_held():  # start to completion (the bridge waits on every op at once anyway)
                work = verb(tensors, *args)
                if hasattr(work, "wait"):
                    work.wait()
            return work

        return checked


_COLLECTIVES = frozenset({"broadcast", "allreduce", "send", "recv", "reduce"})
"""The group's verbs that take a list of tensors first (the only ones the bridge uses on the weights group)."""


def transfer_device(backend: str) -> TransferDevice:
    """The device of a group on ``backend``; the simulated one on gloo when ``DAPO_MCORE_STRICT_DEVICE=1`` (one per
    process, so its host syncs add up)."""
    global _SIMULATED
    if backend == "nccl":
        return TransferDevice(f"cuda:{torch.cuda.current_device()}")
    if os.environ.get(ENV) == "1":
        if _SIMULATED is None:
            log.info("%s=1: groups that are NCCL on a GPU refuse tensors off their (simulated) device", ENV)
            _SIMULATED = SimulatedDevice()
        return _SIMULATED
    return TransferDevice("cpu")


_SIMULATED: SimulatedDevice | None = None
_HELD = threading.RLock()


@contextlib.contextmanager
def device_held() -> Iterator[None]:
    """Under ``DAPO_MCORE_STRICT_DEVICE=1``: hold the simulated device while one collective runs, start to completion.

    NCCL's worst case, which its documentation tells applications to plan for: a collective's kernel waits on the
    device for its peers, and another communicator's kernel may not run beside it. Two threads of one rank issuing
    collectives on two such groups, in an order another rank does not share, then deadlock; here they do too (each
    waits for the device the other holds, until the groups' timeout), where plain gloo would let both run. Held per
    process, re-entrant (a collective handed back to the public name by a torch-function mode runs inside itself)."""
    if _SIMULATED is None:
        yield
        return
    with _HELD:
        yield


def collective_device(group: Any = None) -> TransferDevice:
    """The device of ``group``'s tensors (the default group when None): every tensor a collective of ours sends on a
    group that is NCCL on a GPU goes through it (``.to``/``.empty``), and comes back with ``.host`` (one sync)."""
    import torch.distributed as dist

    return transfer_device(dist.get_backend(group))


def strict(group: Any, device: TransferDevice) -> Any:
    """``group`` wrapped in a DeviceStrictGroup where ``device`` is simulated; otherwise ``group`` itself."""
    return DeviceStrictGroup(group, device) if isinstance(device, SimulatedDevice) else group

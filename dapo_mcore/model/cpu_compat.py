"""Let Megatron-Core run on a machine without CUDA (gloo backend, CPU tensors).

Megatron-Core assumes CUDA in about 130 places (``device="cuda"`` in tensor factories,
``tensor.to(torch.cuda.current_device())``, ``.cuda()``, the CUDA RNG tracker, ``torch.cuda.synchronize``,
type-name asserts in grad clipping). Patching those call sites one by one would chase every release, so this
module redirects at the torch level instead:

* a ``TorchFunctionMode`` rewrites any CUDA device argument (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")``,
  an integer index) of factory functions and ``Tensor.to`` to the CPU, turns ``Tensor.cuda()`` into a no-op,
  and reports CPU tensor type names under their CUDA names (``torch.cuda.FloatTensor``);
* the public ``torch.cuda`` RNG functions act on one private CPU generator that stands in for "the GPU's"
  generator, so Megatron's RNG tracker forks and restores real states without touching the global CPU RNG;
* ``torch.cuda.current_device`` answers device index 0 (which the mode maps to the CPU), ``synchronize``
  and ``empty_cache`` become no-ops, and ``current_stream``/``Stream``/``Event`` get inert CPU stand-ins;
* ``torch.cuda.is_initialized()`` answers True, because Megatron's RNG tracker sets states through
  ``torch.cuda._lazy_call``, which only runs its callback at once when CUDA counts as initialised.

The redirect is narrow on purpose: it serves CUDA *tensor* requests on the CPU but does not pretend to answer
CUDA *device queries*. ``torch.cuda._lazy_init`` (behind ``get_device_properties``, ``get_device_capability``,
``init`` and the other queries) still raises "Torch not compiled with CUDA enabled", as an error that is both an
AssertionError (what torch raises without CUDA) and a RuntimeError (what torch raises without a driver), so the
probes of torch's compilers (inductor's cache key, vLLM's compiled sampler ops) take their no-GPU branch instead of
failing with ``NameError: _get_device_properties`` (which is what ``is_initialized() == True`` alone led to).

It is applied explicitly by entry points and tests (never on import), and does nothing when CUDA is present.
``apply()`` is idempotent; ``is_active()`` says whether the redirect is on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")
_lock = threading.Lock()
_state: dict[str, Any] = {"active": False, "mode": None}
_fake_generator = torch.Generator(device="cpu")

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value == "cuda" or value.startswith("cuda:")
    # An int device index (e.g. from torch.cuda.current_device()); bools are not devices.
    return isinstance(value, int) and not isinstance(value, bool)


def _redirect(value: Any) -> Any:
    return _CPU if _is_cuda_device(value) else value


class _CpuRedirectMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU for every torch call made while it is on the stack."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.autograd.backward or func is torch.Tensor.backward:
            # torch 2.13 hands backward() to the mode, which is off while its handler runs: the engine, and a full
            # recompute's forward inside it (Megatron's router moves its weight to torch.cuda.current_device()), would
            # run without the redirect. Run the engine with the mode back on.
            with _CpuRedirectMode():
                return _run_backward(func, *args, **kwargs)
        if "device" in kwargs:
            kwargs["device"] = _redirect(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            return _CUDA_TYPE_NAMES.get(tensor.dtype, tensor.type()) if tensor.device.type == "cpu" else func(*args)
        if func is torch.Tensor.to and len(args) > 1:
            # Only `to` takes a device positionally; the positional ints of new_zeros(2, 3) etc. are sizes.
            args = (args[0], *(_redirect(a) if not isinstance(a, torch.Tensor) else a for a in args[1:]))
        return func(*args, **kwargs)


def _run_backward(func: Any, tensors: Any, grad_tensors: Any = None, retain_graph: bool | None = None,
                  create_graph: bool = False, inputs: Any = None, **legacy: Any) -> None:
    """``torch.autograd.backward`` / ``Tensor.backward`` (``gradient=``) without handing it to the modes again."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    if func is torch.Tensor.backward and "gradient" in legacy:
        grad_tensors = legacy.pop("gradient")
    if legacy:
        raise TypeError(f"backward() got unexpected arguments {sorted(legacy)}")
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False)
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs or ())
    _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph, inputs,
                         allow_unreachable=True, accumulate_grad=True)


def _fake_get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return _fake_generator.get_state()


def _fake_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    _fake_generator.set_state(new_state)


def _fake_manual_seed(seed: int) -> None:
    _fake_generator.manual_seed(int(seed))


class CudaUnavailableError(AssertionError, RuntimeError):
    """Raised by CUDA device queries under the redirect: the types torch itself raises without CUDA."""


def _refuse_cuda_init() -> None:
    raise CudaUnavailableError("Torch not compiled with CUDA enabled (dapo_mcore's CPU compatibility layer serves "
                               "CUDA tensor requests on the CPU, not CUDA device queries)")


class _InertStream:
    """A CUDA stream stand-in: every CPU op is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _InertEvent:
        return event if event is not None else _InertEvent()


class _InertEvent:
    """A CUDA event stand-in that is always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _patches() -> dict[str, Any]:
    inert_stream = _InertStream()
    return {
        "current_device": lambda: 0,
        "device_count": lambda: 1,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "is_initialized": lambda: True,
        "_lazy_init": _refuse_cuda_init,
        "default_generators": (_fake_generator,),
        "get_rng_state": _fake_get_rng_state,
        "set_rng_state": _fake_set_rng_state,
        "manual_seed": _fake_manual_seed,
        "manual_seed_all": _fake_manual_seed,
        "current_stream": lambda device=None: inert_stream,
        "default_stream": lambda device=None: inert_stream,
        "stream": lambda s=None: contextlib.nullcontext(),
        "Stream": _InertStream,
        "Event": _InertEvent,
    }


def is_active() -> bool:
    """Whether the CPU redirect is applied in this process."""
    return bool(_state["active"])


def apply(force: bool = False) -> bool:
    """Redirect Megatron-Core's CUDA assumptions to the CPU. Returns True if the redirect is (now) active.

    Does nothing (returns False) when CUDA is available, unless ``force`` is set (used by tests only).
    """
    with _lock:
        if _state["active"]:
            return True
        if torch.cuda.is_available() and not force:
            return False
        for name, value in _patches().items():
            setattr(torch.cuda, name, value)
        # Megatron calls torch.cuda.random.get_rng_state directly as well.
        torch.cuda.random.get_rng_state = _fake_get_rng_state
        torch.cuda.random.set_rng_state = _fake_set_rng_state
        torch.cuda.random.manual_seed = _fake_manual_seed
        mode = _CpuRedirectMode()
        mode.__enter__()
        _state.update(active=True, mode=mode)
        log.info("CPU compatibility layer applied: CUDA device requests are served on the CPU")
        return True


def seed_fake_cuda_generator(seed: int) -> None:
    """Seed the stand-in "GPU" generator (what ``torch.cuda.manual_seed`` seeds once applied)."""
    _fake_generator.manual_seed(int(seed))


def fake_cuda_rng_state() -> torch.Tensor:
    """The stand-in generator's state, for checkpointing RNG states exactly on CPU."""
    return _fake_generator.get_state()

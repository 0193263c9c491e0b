"""Megatron-Core's start-up, cut by half without changing what it runs.

Importing ``megatron.core`` costs every process of a run (each trainer and engine rank, each ``convert`` and
``verify``) about 6 CPU-seconds, half of it for two things no dapo-mcore run uses at import time:

- ``torch.compile``: Megatron's ``jit_fuser`` is ``torch.compile``, and decorating its fused kernels with it at
  import loads TorchDynamo and Inductor (~2.5 CPU-s) although ``torch.compile`` compiles nothing before a first
  call. While a ``megatron.core`` module loads, ``torch.compile`` of a plain function is deferred: the decorated
  function calls the real ``torch.compile`` at its first call and is that compiled function from then on, which is
  what ``torch.compile`` itself does (it compiles on the first call). A kernel that runs is compiled as before.
- ``wandb``: Megatron's timers and its inference engine import W&B at module load for their own logging, which
  dapo-mcore does not use (its W&B sink, ``telemetry``, imports W&B itself when ``log.wandb`` is on). While a
  ``megatron.core`` module loads (in that thread), ``import wandb`` fails as if W&B were absent, so those two keep
  W&B off; an import of W&B anywhere else is untouched, and where W&B was imported first Megatron gets it.

`install` (called by ``dapo_mcore/__init__``) puts a finder at the front of ``sys.meta_path`` that wraps the
loading of each ``megatron.core`` module; ``DAPO_MCORE_PLAIN_MEGATRON_IMPORT=1`` leaves the import as it is.
Measured in ``benchmarks/startup.py``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["deferred_compile", "install", "installed"]

_PREFIX = "megatron.core"
_lock = threading.Lock()  # guards the swap of torch.compile only (never held while a module runs)
_swap = {"depth": 0, "real": None}
_here = threading.local()  # .depth: megatron.core modules this thread is loading now


def deferred_compile(real: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` with the compile of a plain function deferred to its first call (see the module
    docstring); anything else (a module, a method, decorator mode's later call) goes to ``real`` unchanged."""

    def compile_(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # decorator mode: @torch.compile(**kwargs)
            return lambda fn: compile_(fn, **kwargs)
        if not inspect.isfunction(model):
            return real(model, **kwargs)
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kw: Any) -> Any:
            if not compiled:
                compiled.append(real(model, **kwargs))
            return compiled[0](*args, **kw)

        return first_call_compiles  # functools.wraps: __wrapped__ is the plain function

    return compile_


@contextlib.contextmanager
def _megatron_loading() -> Iterator[None]:
    """While a megatron.core module runs its top level: torch.compile deferred (process-wide, which is harmless: the
    same semantics), ``import wandb`` refused in this thread only (`_Finder`). Nested and concurrent loads share one
    swap of torch.compile."""
    import torch

    with _lock:
        if _swap["depth"] == 0:
            _swap["real"] = torch.compile
            torch.compile = deferred_compile(torch.compile)
        _swap["depth"] += 1
    _here.depth = getattr(_here, "depth", 0) + 1
    try:
        yield
    finally:
        _here.depth -= 1
        with _lock:
            _swap["depth"] -= 1
            if _swap["depth"] == 0:
                torch.compile = _swap["real"]
                _swap["real"] = None


class _Loader(importlib.abc.Loader):
    """A megatron.core module's own loader, run inside the window; everything else is the inner loader's."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        with _megatron_loading():
            self._inner.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # get_data, get_resource_reader, is_package, ...
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "wandb" and getattr(_here, "depth", 0):
            raise ImportError("wandb is not imported while megatron.core loads (dapo_mcore.model.megatron_import)",
                              name="wandb")
        if name != _PREFIX and not name.startswith(_PREFIX + "."):
            return None
        for finder in sys.meta_path:  # the finder that would have found it without us
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


_FINDER = _Finder()


def install() -> None:
    """Put the finder in front (once), unless DAPO_MCORE_PLAIN_MEGATRON_IMPORT=1."""
    if os.environ.get("DAPO_MCORE_PLAIN_MEGATRON_IMPORT") == "1" or installed():
        return
    sys.meta_path.insert(0, _FINDER)


def installed() -> bool:
    return _FINDER in sys.meta_path

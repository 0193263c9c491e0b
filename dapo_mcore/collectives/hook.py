"""Install the NCCL-on-CPU check (``collectives.strict``) once torch.distributed is imported, not before: importing
``dapo_mcore`` stays light (no torch), so a command's own start-up (its Ctrl-C handling, its fast paths) runs first."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

_TARGET = "torch.distributed"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: the first time torch.distributed is looked up, it wraps that module's loader so the
    check is installed right after the module has run."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            from dapo_mcore.collectives.strict import install

            install()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install_when_torch_distributed_loads() -> None:
    """The check now if torch.distributed is already imported, else right after it is."""
    if _TARGET in sys.modules:
        from dapo_mcore.collectives.strict import install

        install()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())

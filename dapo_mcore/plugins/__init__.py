"""A user's own code named as ``package.module:function`` (a reward function, a tool): imported, or refused in one line.

One helper for every registry that takes such a name, so each says the same thing about the same mistake: a name
without ``:``, a module that does not import (install it, or put its directory on ``PYTHONPATH``), a module without
that function (the callables it does have). Each registry names its kind and an example of the form.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_callable(path: str, kind: str, example: str) -> Callable[..., Any]:
    """The callable ``path`` (``package.module:function``) names; a ValueError of one line, starting
    ``{kind} {path!r}:`` and naming the fix (``example`` shows the form), when there is none."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{kind} {path!r}: write package.module:function, e.g. {example}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"{kind} {path!r}: cannot import {module_name!r} ({exc}); install it, or put its directory "
                         "on PYTHONPATH (e.g. PYTHONPATH=$PWD for a file in the current directory)") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        found = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ValueError(f"{kind} {path!r}: {module_name} has no function {attr!r}; callables there: "
                         f"{', '.join(found[:12]) or 'none'}")
    return fn

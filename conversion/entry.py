"""What every conversion command line shares: `--debug`, and user errors as one line with exit code 2.

A user-caused failure (a missing or truncated file, an existing output, a full or read-only disk, a layout
that cannot split the model, a config feature Megatron cannot reproduce) prints ``dapo-mcore convert: <message>``
and exits 2; `--debug` or ``DAPO_MCORE_DEBUG=1`` shows the traceback instead. Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from dapo_mcore.model.qwen import HFConfigError
from dapo_mcore.weights.errors import WeightsError

EXIT_USAGE = 2
USER_ERRORS: tuple[type[BaseException], ...] = (WeightsError, HFConfigError)
"""What `run` turns into one line (and what `dapo-mcore`'s own guard should catch for `convert`)."""


def add_debug_flag(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (also DAPO_MCORE_DEBUG=1)")
    return parser


def debug_enabled(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("DAPO_MCORE_DEBUG", "") not in ("", "0")


def run(body: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Call `body(args)`; a user error becomes one line on stderr and exit code 2 (unless debugging).

    SIGTERM and Ctrl-C end the command with one line and 143 / 130 wherever they arrive: inside an output's
    ``atomic_directory`` it removes the partial output first (``weights.atomic``), elsewhere nothing was written.
    """
    from dapo_mcore.weights.atomic import stop_signal, terminating

    try:
        with terminating():
            return body(args)
    except USER_ERRORS as err:
        if debug_enabled(args):
            raise
        print(f"dapo-mcore convert: {err}", file=sys.stderr)
        return EXIT_USAGE
    except BaseException as exc:
        stop = None if isinstance(exc, SystemExit) else stop_signal(exc)
        if stop is None:
            raise
        out = getattr(args, "out", None)
        if out is not None and Path(out).is_dir() and any(Path(out).iterdir()):
            # the signal came after the output was renamed into place (it was absent or empty before): it is whole
            report_written(str(out))
            return 0
        what = "terminated (SIGTERM)" if stop == signal.SIGTERM else "interrupted (SIGINT)"
        print(f"dapo-mcore convert: {what}; no output was written", file=sys.stderr)
        return 128 + stop


def parse_and_run(parser: argparse.ArgumentParser, body: Callable[[argparse.Namespace], int],
                  argv: list[str] | None) -> int:
    """A conversion command's `main`: parse `argv`, log INFO lines as ``LEVEL name: message``, `run` the body."""
    import logging

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not debug_enabled(args):
        quiet_library_warnings()
    return run(body, args)


LIBRARY_WARNINGS = (r"Transformer Engine and Apex are not installed.*", r"Apex is not installed.*",
                    r"full scope is deprecated.*", r"`load_state_dict` is deprecated.*",
                    r"Please use DTensor instead and we are deprecating ShardedTensor.*",
                    r"When using async grad allreduce it is recommended.*")
"""Megatron's and torch's notices about their own internals (a missing fused kernel the conversion does not use,
deprecations inside dist_checkpointing): nothing a user of ``convert`` can act on. ``--debug`` shows them."""


def quiet_library_warnings() -> None:
    import warnings

    for pattern in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def report_written(out: str) -> None:
    """Print ``wrote OUT`` once OUT is complete; from then on a stop signal no longer changes the exit code (0)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    print(f"wrote {out}", flush=True)

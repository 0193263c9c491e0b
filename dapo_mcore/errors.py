"""User errors: mistakes a user can fix, reported by the CLI as one line on stderr with exit code 2.

`UserError` is for commands' own checks (a step that is not stored, a missing tokenizer). File-system failures
stay ``OSError``s; `describe_os_error` turns one into a line that names the path and the fix. The CLI
(``cli._guard``) also treats configuration, dataset, checkpoint and layout errors as user errors.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from pathlib import Path

EXIT_USAGE = 2

_FIXES = {
    errno.ENOSPC: "the disk is full: free space on it (df -h) or use a path on another disk",
    errno.EDQUOT: "the disk quota is exhausted: free space or use a path elsewhere",
    errno.EROFS: "the file system is read-only: use a writable path",
    errno.EACCES: "permission denied: fix the permissions or use another path",
    errno.EPERM: "operation not permitted: fix the permissions or use another path",
    errno.ENOENT: "it does not exist: check the path, or create its parent directory first",
    errno.ENOTDIR: "part of the path is a file, not a directory: fix the path",
    errno.EISDIR: "it is a directory, not a file: fix the path",
    errno.EEXIST: "it already exists: remove it or choose another path",
    errno.EIO: "the device reported an I/O error: check the disk",
}


class UserError(Exception):
    """A mistake the user can fix; the message says what to change."""


def describe_os_error(exc: OSError) -> str:
    """One line: the path, what went wrong, and the fix (``/runs/x/metrics.jsonl: No space left on device; ...``)."""
    paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
    what = exc.strerror or str(exc)
    head = f"{' -> '.join(paths)}: {what}" if paths else str(exc)
    fix = _FIXES.get(exc.errno)
    return (f"{head}; {fix}." if fix else head).replace("\n", " ")


@contextlib.contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """Give an OSError raised inside (a library's write that lost the file name) the `path` it was about."""
    try:
        yield
    except OSError as err:
        if err.filename is not None or err.errno is None:
            raise
        raise OSError(err.errno, err.strerror, str(path)) from err


class NonFiniteError(UserError):
    """A NaN or infinity where a number must be finite (an update, a checkpoint's weights, a reward); the message
    names where it was found and what to change."""

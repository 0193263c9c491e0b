"""User-caused failures of reading, writing or converting weights: one base class for the CLI to catch.

Every error here is the user's to fix (a truncated download, a full or read-only disk, an existing output,
a layout that cannot split the model). Messages name the file or setting and the fix, so a command line
can print one line and exit 2 instead of a traceback. Internal invariants stay asserts / plain exceptions.
"""

from __future__ import annotations

import errno


class WeightsError(ValueError):
    """Base of the user errors raised by `dapo_mcore.weights` and `conversion` (message: file/setting + fix)."""


class InputFileError(WeightsError):
    """An input file that is missing, truncated or not what its header / index says."""


class InputMissingError(InputFileError, FileNotFoundError):
    """An input file or directory that does not exist (also a FileNotFoundError)."""


class OutputPathError(WeightsError):
    """An output that cannot be written: it exists, its parent is missing, read-only or full."""


_OS_FIXES = {
    errno.ENOSPC: "free space on that filesystem or write elsewhere",
    errno.EDQUOT: "the disk quota is exhausted; free space or write elsewhere",
    errno.EROFS: "the filesystem is read-only; write to a writable directory",
    errno.EACCES: "no permission to write there; choose a directory you own",
    errno.EPERM: "no permission to write there; choose a directory you own",
    errno.EIO: "the storage reported an I/O error; check it, then run again",
    errno.EFBIG: "the file is too large for that filesystem; write elsewhere or use smaller shards",
}


def is_output_os_error(err: OSError) -> bool:
    """An OSError a user fixes by choosing another place to write (full, read-only, no permission, I/O)."""
    return err.errno in _OS_FIXES


def output_os_error(err: OSError, target: object) -> OutputPathError:
    """An OSError met while writing `target`, as a one-line OutputPathError with the fix (when one is known)."""
    fix = _OS_FIXES.get(err.errno, "check the filesystem, then run again")
    where = err.filename or target
    return OutputPathError(f"writing {target} failed at {where}: {err.strerror or err}; {fix}.")

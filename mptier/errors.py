"""Exceptions raised by mptier.

One base class, :class:`MptierError`. Configuration and input errors are also
``ValueError`` so callers that only know the standard library still catch them.
Every exception here survives pickling (its constructor arguments are kept in
``args``), because records cross process boundaries.
"""

from __future__ import annotations

import errno as _errno
import os
import signal


class MptierError(Exception):
    """Base class of every error mptier raises."""


class ConfigError(MptierError, ValueError):
    """A configuration value or an argument is invalid. The message names it."""


class TierClosedError(MptierError, RuntimeError):
    """The tier was shut down; no further work can be submitted."""


class RootFileError(MptierError, OSError):
    """A small file mptier reads from a root (``mptier.json``, ``config.json``) is not a
    regular file of a sane size: a symlink, FIFO, device or folder, or too large. The
    message names the path, what was found and what to do; ``errno`` is ELOOP (a
    symlink), EMEDIUMTYPE (not a regular file) or EFBIG (too large) -- the file's fault,
    never the file system's."""


class BatchIOError(MptierError, OSError):
    """A batch store/load stopped at its first failing block.

    ``n_done`` blocks (indices ``0 .. index-1``) completed before block
    ``index`` failed with ``errno``; blocks after ``index`` were not attempted.
    """

    def __init__(self, err: int, message: str, *, n_done: int, index: int,
                 path: str | None = None) -> None:
        super().__init__(err, message)
        self.n_done = n_done
        self.index = index
        self.path = path
        if path is not None:
            self.filename = path

    def __reduce__(self):  # keep the keyword-only fields across pickling
        return (_rebuild_batch_io_error,
                (self.errno, self.strerror, self.n_done, self.index, self.path))

    def __str__(self) -> str:
        where = f" at block {self.index}" + (f" ({self.path})" if self.path else "")
        return (f"[Errno {self.errno}] {self.strerror}{where}; "
                f"{self.n_done} block(s) succeeded before it")


def _rebuild_batch_io_error(err, message, n_done, index, path):
    return BatchIOError(err, message, n_done=n_done, index=index, path=path)


def describe_exit(exitcode: int | None) -> str:
    """Say how a child ended, from a ``Popen.returncode``-style code.

    ``-9`` becomes ``"was killed by SIGKILL(-9)"``, ``3`` becomes ``"exited with code 3"``.
    """
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}({exitcode})"
    return f"exited with code {exitcode}"


def errno_name(err: int) -> str:
    """``errno_name(2) == "ENOENT"``; unknown numbers come back as ``"errno 1234"``."""
    return _errno.errorcode.get(err, f"errno {err}")


def strerror(err: int) -> str:
    try:
        return os.strerror(err)
    except ValueError:
        return f"errno {err}"

"""Lock files: an exclusive ``flock`` taken without waiting, and whether the file a
descriptor holds is still the one at its name.

A lock file proves its holder alive for as long as the holder's process lives (the
kernel, or a distributed file system's metadata engine, drops the lock with it). Two
kinds of lock file use these: the walker election's seat on a shared root
(:mod:`mptier.storage.election`) and a status endpoint's name in the run folder
(:mod:`mptier.monitor.endpoint`). Both replace a file whose holder is judged gone, so a
lock taken on a descriptor counts only while that descriptor's file is still the one at
the name: :func:`still_named` says so.
"""

from __future__ import annotations

import fcntl
import os


def try_flock(fd: int) -> bool:
    """Take ``flock(LOCK_EX | LOCK_NB)`` on ``fd``: True when held now, False when
    another open file description holds it (``fd`` is left open either way). Never
    waits; other errors raise ``OSError``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def still_named(fd: int, name: str, dir_fd: int | None = None) -> bool:
    """Whether ``name`` (not followed; relative to ``dir_fd`` if given) is still the file
    ``fd`` has open: False when it is gone or another file took its place."""
    try:
        named = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)

"""Reading the small files mptier keeps in a root, which anyone with write access to the
root may have replaced.

A root is shared (other engines, other nodes, operators), so a file at a name mptier
owns is input, not trust: ``mptier.json`` as a symlink to ``/dev/zero`` would be read
until memory runs out, and as a FIFO an ``open`` waits for a writer that never comes
(the start then hangs for ``io_timeout_s`` and blames a healthy file system).
:func:`read_root_file` is the one way mptier reads such a file: ``O_NOFOLLOW`` (a
symlink fails at once), ``O_NONBLOCK`` (a FIFO opens at once), ``fstat`` after the open
(regular files only: the check and the read are on the same inode) and at most ``limit``
bytes. Everything it refuses raises :class:`~mptier.errors.RootFileError` naming the
path, what was found and what to do.
"""

from __future__ import annotations

import errno
import os
import stat

from mptier.errors import RootFileError

# The records mptier reads from a root are a few hundred bytes (mptier.json is
# {"block_bytes": N}; vLLM's config.json lists the layout fields and the KV-cache
# groups, a few KiB for the largest models). 1 MiB is far past any real one and bounds
# what a planted file can make a tier read into memory.
ROOT_FILE_LIMIT_BYTES = 1 << 20

# A record is replaced by a rename, and on a shared file system the rename may come
# from another node while this one reads the old file: NFS then says ESTALE, JuiceFS
# EBADF on the read or ENOENT on the fstat right after the open (both seen: two tiers on
# two mounts starting at once, each publishing mptier.json). The name leads to the new
# record by then, so it is opened again; this many tries, since a record is renamed over
# only at a tier's start. (ENOENT from the open itself means no record: None, not this.)
REPLACED_ERRNOS = frozenset({errno.ESTALE, errno.EBADF, errno.ENOENT})
REPLACED_TRIES = 3

_EMEDIUMTYPE = getattr(errno, "EMEDIUMTYPE", errno.EINVAL)
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _fix(path: str) -> str:
    return (f"mptier reads only regular files there; remove {path!r} (mptier writes its "
            "own records again) or use another root_dir")


def read_root_file(path: str, limit: int = ROOT_FILE_LIMIT_BYTES) -> bytes | None:
    """The bytes of the regular file ``path``, or ``None`` when it does not exist.

    Never follows a symlink, never blocks on a FIFO, never reads more than ``limit``
    bytes, and does not update the file's access time where it may (reading a record is
    not using it). Raises :class:`RootFileError` for a symlink, a non-regular file or a
    file larger than ``limit``; ``OSError`` for anything else the file system says.
    A record replaced through another node while it is read is read again by name
    (:data:`REPLACED_ERRNOS`).
    """
    tries = 1
    while True:
        try:
            return _read_once(path, limit)
        except OSError as exc:
            if exc.errno not in REPLACED_ERRNOS or isinstance(exc, RootFileError) \
                    or tries >= REPLACED_TRIES:
                raise
            tries += 1


def _read_once(path: str, limit: int) -> bytes | None:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        try:
            fd = os.open(path, flags | os.O_NOATIME)
        except PermissionError:  # O_NOATIME needs ownership of the file
            fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise RootFileError(errno.ELOOP, f"{path} is a symlink; {_fix(path)}",
                            path) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise RootFileError(_EMEDIUMTYPE, f"{path} is {what}; {_fix(path)}", path)
        chunks, left = [], limit + 1
        while left > 0:  # a network file system may return less than asked
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise RootFileError(errno.EFBIG, f"{path} is larger than {limit} bytes, more than "
                            f"any record mptier writes; {_fix(path)}", path)
    return data

"""Argument checks and fault injection for :mod:`mptier.native` (both backends).

Everything here runs before any I/O and raises ``ValueError`` / ``TypeError`` naming the
bad value and the fix; nothing here raises for an I/O error.
"""

from __future__ import annotations

import errno as _errno
import operator
import os
import re
import secrets
import string
import warnings
from typing import NamedTuple

from mptier.native import _pure

FAULT_ENV = "MPTIER_FAULT_ERRNO"
_TAG_RE = re.compile(rb"[0-9a-z]{%d}" % _pure.TAG_LEN)
_TAG_ALPHABET = string.digits + string.ascii_lowercase


def new_tag() -> str:
    """A random writer tag: 16 characters of [0-9a-z] (about 82 bits)."""
    return "".join(secrets.choice(_TAG_ALPHABET) for _ in range(_pure.TAG_LEN))


def open_root(path) -> int:
    """Open directory ``path`` as a root for the batch calls; the caller closes the fd.

    The root itself may be reached through symlinks (an operator's choice); nothing
    beneath it is. Raises ``OSError`` naming the path when it is not a usable directory.
    """
    return os.open(os.fspath(path), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


class _Fault(NamedTuple):
    op: str
    index: int
    errno: int


def _parse_fault(spec: str | None) -> _Fault | None:
    if not spec:
        return None
    parts = spec.strip().split(":")
    try:
        op, index_text, err_text = parts
        index = int(index_text)
        err = int(err_text) if err_text.strip().isdigit() else getattr(_errno, err_text.strip())
    except (ValueError, AttributeError):
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected 'op:index:errno' such as "
                         f"'load:2:13' or 'store:0:EIO'") from None
    if op not in ("store", "load") or index < 0 or err <= 0:
        raise ValueError(f"{FAULT_ENV}={spec!r}: op must be 'store' or 'load', index >= 0 "
                         f"and errno > 0")
    return _Fault(op, index, err)


_fault: _Fault | None = _parse_fault(os.environ.get(FAULT_ENV))


def set_fault(spec: str | None) -> None:
    """Set (``"load:2:13"``) or clear (``None``) the injected fault for this process.

    Same format and effect as the ``MPTIER_FAULT_ERRNO`` variable, which it overrides.
    Raises ``ValueError`` for a malformed spec.
    """
    global _fault
    _fault = _parse_fault(spec)


def fault_set(op: str) -> bool:
    """Whether an injected fault applies to ``op`` batches (some of them: the batch
    must reach the fault's index)."""
    return _fault is not None and _fault.op == op


def faulted(op: str, fn, root_fd, paths, buffer, offsets, block_bytes, *rest
            ) -> tuple[int, int, int, int, str]:
    """Run a store / load batch with the injected fault applied:
    ``(rc, n_done, fail_index, tmp_unlink_errno, note)``; ``note`` names an injection."""
    fault = _fault
    n = len(paths)
    if fault is None or fault.op != op or fault.index >= n:
        out = fn(root_fd, paths, buffer, offsets, block_bytes, *rest)
        return out[0], out[1], out[2], out[3] if len(out) > 3 else 0, ""
    stop, tmp_errno = fault.index, 0
    if stop > 0:
        out = fn(root_fd, paths[:stop], buffer, offsets[:stop], block_bytes, *rest)
        tmp_errno = out[3] if len(out) > 3 else 0
        if out[0]:
            return out[0], out[1], out[2], tmp_errno, ""
    return -fault.errno, stop, stop, tmp_errno, f" (injected by {FAULT_ENV})"


def flags(o_direct, checksum, touch, tmpfile, no_openat2, uring=False) -> int:
    return ((_pure.O_DIRECT_FLAG if o_direct else 0) | (_pure.CHECKSUM if checksum else 0)
            | (_pure.TOUCH if touch else 0) | (_pure.TMPFILE if tmpfile else 0)
            | (_pure.NO_OPENAT2 if no_openat2 else 0) | (_pure.URING if uring else 0))


_process_tag: tuple[int, bytes] | None = None


def tag(value) -> bytes:
    """The writer tag as bytes; None gives this process's own random tag."""
    global _process_tag
    if value is None:
        if _process_tag is None or _process_tag[0] != os.getpid():  # a forked child: anew
            _process_tag = (os.getpid(), new_tag().encode())
        return _process_tag[1]
    raw = value.encode() if isinstance(value, str) else value
    if not isinstance(raw, bytes) or not _TAG_RE.fullmatch(raw):
        raise ValueError(f"tag={value!r}: a writer tag is exactly {_pure.TAG_LEN} "
                         f"characters of [0-9a-z] (the writer's lease name), e.g. from "
                         f"mptier.native.new_tag()")
    return raw


def block_size(block_bytes) -> int:
    block_bytes = operator.index(block_bytes)
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    return block_bytes


def paths(values) -> list[bytes]:
    """Relative paths as bytes: non-empty, no NUL, no leading "/", no empty, "." or ".."
    component (the calls resolve beneath a root and refuse to leave it)."""
    encoded = [os.fsencode(p) for p in values]
    for i, p in enumerate(encoded):
        if not p or b"\0" in p:
            raise ValueError(f"paths[{i}] = {p!r}: a path must be non-empty and contain "
                             f"no NUL byte")
        if p.startswith(b"/"):
            raise ValueError(f"paths[{i}] = {p!r}: must be relative to the root, e.g. "
                             f"FileMapper.relative_path_for(key), not absolute")
        if any(part in (b"", b".", b"..") for part in p.split(b"/")):
            raise ValueError(f"paths[{i}] = {p!r}: no empty, '.' or '..' components: "
                             f"a path names a file beneath the root, the plain way")
    return encoded


def contiguous(data):
    """``data`` if it exports a C-contiguous buffer, else ``TypeError``/``ValueError``."""
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"data must support the buffer protocol, "
                        f"got {type(data).__name__}") from None
    with view:
        if not view.c_contiguous:
            raise ValueError(f"data ({type(data).__name__}) is not C-contiguous")
    return data


def batch(path_values, buffer, offsets, block_bytes) -> tuple[list[bytes], list[int], int]:
    block_bytes = block_size(block_bytes)
    encoded = paths(path_values)
    offs = [operator.index(o) for o in offsets]
    if len(encoded) != len(offs):
        raise ValueError(f"{len(encoded)} paths but {len(offs)} offsets: "
                         f"need one offset per path")
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TypeError(f"buffer must support the buffer protocol, "
                        f"got {type(buffer).__name__}") from None
    with view:
        if view.readonly:
            raise ValueError(f"buffer ({type(buffer).__name__}) is read-only; "
                             f"a writable buffer is required")
        if not view.c_contiguous:
            raise ValueError(f"buffer ({type(buffer).__name__}) is not C-contiguous")
        nbytes = view.nbytes
    if offs and (min(offs) < 0 or max(offs) > nbytes - block_bytes):
        for i, off in enumerate(offs):
            if off < 0:
                raise ValueError(f"offsets[{i}] = {off} is negative")
            if off + block_bytes > nbytes:
                raise ValueError(f"offsets[{i}] = {off}: block [{off}, {off + block_bytes}) "
                                 f"ends past the buffer's {nbytes} bytes")
    return encoded, offs, block_bytes


class Root:
    """``with Root(path_or_fd) as (fd, where)``: a root fd (opened and closed here when
    given a path) and ``where(rel) -> str``, the full path for messages."""

    def __init__(self, root) -> None:
        if isinstance(root, bool) or not isinstance(root, (int, str, bytes, os.PathLike)):
            raise TypeError(f"root must be a directory path or an fd from "
                            f"mptier.native.open_root, got {type(root).__name__}")
        self._given = root
        self._fd = -1

    def __enter__(self):
        if isinstance(self._given, int):
            self._fd = self._given
            try:
                base = os.readlink(f"/proc/self/fd/{self._fd}")
            except OSError:
                base = f"<root fd {self._fd}>"
        else:
            self._fd = open_root(self._given)
            base = os.fsdecode(self._given)
        return self._fd, lambda rel: os.path.join(base, os.fsdecode(rel))

    def __exit__(self, *exc) -> None:
        if not isinstance(self._given, int):
            os.close(self._fd)


def warn_temp_left(err: int, where) -> None:
    warnings.warn(f"mptier: a temporary file under {where('')} could not be removed "
                  f"({_errno.errorcode.get(err, err)}: {os.strerror(err)}); a sweeper "
                  f"removes it once its writer's lease is free", ResourceWarning,
                  stacklevel=3)

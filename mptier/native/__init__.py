"""Batch block I/O between a memory buffer and block files: the native layer of mptier.

One call moves a whole batch of fixed-size blocks::

    buffer (any writable, C-contiguous buffer: shm mmap, numpy array, bytearray ...)
      block i = buffer[offsets[i] : offsets[i] + block_bytes]   <-->   paths[i]

    batch_store / batch_load / batch_exists / probe_o_direct      (this module)
      validate arguments, apply MPTIER_FAULT_ERRNO, raise on error  (the one place)
        |-- "native": _native -> _mptier_cffi -> mptier_io.c   (cffi API mode, GIL released)
        '-- "python": _pure                                     (same steps, os.* calls)

Every call blocks its thread until the batch is done; calls may run concurrently from
several threads and processes. The two backends behave identically:

- Store: an existing final file counts as stored and is left untouched (names are
  content hashes). Otherwise the block goes to ``<final>.<pid>.<tid>.<counter>.tmp``
  (``O_EXCL``, same directory; missing parent directories are created) and is renamed
  onto the final name; a rename failing with EEXIST is success. The temporary file never
  survives a failure, and no reader ever sees a partial file at a final name.
- Load: reads exactly ``block_bytes`` into the block's slot. A shorter file is corrupt:
  it is deleted and the block fails with ENODATA. Any other error leaves the file alone.
- Both stop at the first failing block and raise :class:`mptier.errors.BatchIOError`
  with ``errno``, ``index`` (the failing block), ``n_succeeded`` (blocks ``0 ..
  index-1``, which are done) and the failing path as ``path`` / ``filename``. Blocks
  after ``index`` are not attempted (their slots are untouched on load).
- O_DIRECT is used when ``use_o_direct`` is true and the block's address and
  ``block_bytes`` are multiples of 4096; a block whose O_DIRECT open or I/O fails with
  EINVAL is redone buffered, so O_DIRECT never fails a block. Callers probe a root once
  with :func:`probe_o_direct` and pass the answer as ``use_o_direct``.
- Bad arguments raise ``ValueError`` (or ``TypeError`` for wrong types) before any I/O.

Choosing the backend: the module-level functions use the compiled core when it was
built (``HAS_NATIVE``), unless the environment sets ``MPTIER_NATIVE=0`` at import;
``BACKEND`` says which one they use. :func:`get_backend` gives either one by name.

Fault injection (tests): ``MPTIER_FAULT_ERRNO=op:index:errno``, e.g. ``load:2:13`` or
``store:0:EIO``, makes every ``op`` batch (``store`` or ``load``) of either backend fail
at block ``index`` with that errno, as if the block's I/O had failed: blocks before it
are done for real, block ``index`` and later are not touched (no file is deleted, no
temporary file is left). Batches shorter than ``index + 1`` are unaffected. The variable
is read once at import (worker processes inherit it); :func:`set_fault` changes it at
run time. The injected error says "injected" in its message.
"""

from __future__ import annotations

import errno as _errno
import operator
import os
from typing import NamedTuple

from mptier.errors import BatchIOError, errno_name, strerror
from mptier.native import _pure

try:
    from mptier.native import _native
except ImportError as _exc:  # not built, or built for another interpreter
    _native = None
    NATIVE_IMPORT_ERROR: str | None = f"{type(_exc).__name__}: {_exc}"
else:
    NATIVE_IMPORT_ERROR = None

__all__ = [
    "BACKEND",
    "FAULT_ENV",
    "HAS_NATIVE",
    "Backend",
    "batch_exists",
    "batch_load",
    "batch_store",
    "get_backend",
    "probe_o_direct",
    "set_fault",
]

FAULT_ENV = "MPTIER_FAULT_ERRNO"
NATIVE_ENV = "MPTIER_NATIVE"

HAS_NATIVE: bool = _native is not None


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


def _encode_paths(paths) -> list[bytes]:
    encoded = [os.fsencode(p) for p in paths]
    if not all(encoded) or b"\0" in b"".join(encoded):
        for i, p in enumerate(encoded):
            if not p or b"\0" in p:
                raise ValueError(f"paths[{i}] = {p!r}: a path must be non-empty and "
                                 f"contain no NUL byte")
    return encoded


def _check_batch(paths, buffer, offsets, block_bytes) -> tuple[list[bytes], list[int], int]:
    block_bytes = operator.index(block_bytes)
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    encoded = _encode_paths(paths)
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


_HINTS = {
    ("load", _errno.ENODATA): "file shorter than the block, so corrupt; it was deleted",
    ("store", _errno.ENOTDIR): "a component of the path is a file, not a directory",
}


def _batch_error(op: str, err: int, n_done: int, index: int, paths: list[bytes],
                 note: str = "") -> BatchIOError:
    hint = _HINTS.get((op, err))
    message = (f"batch {op} failed: {strerror(err)} ({errno_name(err)})"
               + (f": {hint}" if hint else "") + note)
    return BatchIOError(err, message, n_succeeded=n_done, index=index,
                        path=os.fsdecode(paths[index]))


class Backend:
    """The four batch operations bound to one implementation ("native" or "python").

    Get one with :func:`get_backend`. Methods block the calling thread until the batch
    is done and may be called from several threads at once.
    """

    def __init__(self, name: str, impl) -> None:
        self.name = name
        self._impl = impl
        self._probe_cache: dict[bytes, bool] = {}

    def __repr__(self) -> str:
        return f"<mptier.native.Backend {self.name!r}>"

    def _run(self, op: str, fn, paths, buffer, offsets, block_bytes, use_o_direct) -> None:
        encoded, offs, block_bytes = _check_batch(paths, buffer, offsets, block_bytes)
        flags = _pure.O_DIRECT_FLAG if use_o_direct else 0
        n = len(encoded)
        fault = _fault
        stop = fault.index if fault is not None and fault.op == op and fault.index < n else n
        if stop > 0:
            rc, n_done, index = fn(encoded[:stop], buffer, offs[:stop], block_bytes, flags)
            if rc:
                raise _batch_error(op, -rc, n_done, index, encoded)
        if stop < n:
            raise _batch_error(op, fault.errno, stop, stop, encoded,
                               note=f" (injected by {FAULT_ENV})")

    def batch_store(self, paths, buffer, offsets, block_bytes, *, use_o_direct=True) -> None:
        """Write block i of ``buffer`` to ``paths[i]``; see the module docstring."""
        self._run("store", self._impl.batch_store, paths, buffer, offsets, block_bytes,
                  use_o_direct)

    def batch_load(self, paths, buffer, offsets, block_bytes, *, use_o_direct=True) -> None:
        """Read ``paths[i]`` into block i of ``buffer``; see the module docstring."""
        self._run("load", self._impl.batch_load, paths, buffer, offsets, block_bytes,
                  use_o_direct)

    def batch_exists(self, paths) -> list[bool]:
        """Whether each path exists (one ``access`` call each; any error means False)."""
        return self._impl.batch_exists(_encode_paths(paths))

    def probe_o_direct(self, directory) -> bool:
        """Whether an aligned O_DIRECT write works in ``directory``; leaves no file.

        Blocks for one small write. A definite answer is cached per directory for the
        life of the process; an unusable directory (missing, not a directory, no
        permission) answers False and is probed again on the next call.
        """
        key = os.path.abspath(os.fsencode(directory))
        known = self._probe_cache.get(key)
        if known is not None:
            return known
        rc = self._impl.probe_o_direct(key)
        if rc < 0:
            return False
        self._probe_cache[key] = works = rc == 1
        return works


_BACKENDS = {"python": Backend("python", _pure)}
if _native is not None:
    _BACKENDS["native"] = Backend("native", _native)

_forced_python = os.environ.get(NATIVE_ENV, "").strip().lower() in ("0", "false", "no", "off")
BACKEND: str = "native" if HAS_NATIVE and not _forced_python else "python"
_default = _BACKENDS[BACKEND]


def get_backend(name: str | None = None) -> Backend:
    """The backend called ``name`` ("native" or "python"), or the default one (``BACKEND``).

    Raises ``ImportError`` for "native" when the compiled core is not available (the
    message says why), ``ValueError`` for an unknown name.
    """
    if name is None:
        return _default
    if name == "native" and _native is None:
        raise ImportError(f"mptier native backend is not available ({NATIVE_IMPORT_ERROR}); "
                          f"reinstall mptier with a C compiler present")
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown mptier I/O backend {name!r}: "
                         f"expected 'native' or 'python'") from None


def batch_store(paths, buffer, offsets, block_bytes, *, use_o_direct=True) -> None:
    """Store block i (``buffer[offsets[i]:offsets[i] + block_bytes]``) to ``paths[i]``.

    Existing files are skipped; see the module docstring for the full contract. Blocks
    until done. Raises ``ValueError``/``TypeError`` for bad arguments (before any I/O)
    and :class:`~mptier.errors.BatchIOError` at the first block that fails.
    """
    _default.batch_store(paths, buffer, offsets, block_bytes, use_o_direct=use_o_direct)


def batch_load(paths, buffer, offsets, block_bytes, *, use_o_direct=True) -> None:
    """Load ``paths[i]`` into block i (``buffer[offsets[i]:offsets[i] + block_bytes]``).

    A short file is deleted and fails with ENODATA; see the module docstring. Blocks
    until done. Raises ``ValueError``/``TypeError`` for bad arguments (before any I/O)
    and :class:`~mptier.errors.BatchIOError` at the first block that fails.
    """
    _default.batch_load(paths, buffer, offsets, block_bytes, use_o_direct=use_o_direct)


def batch_exists(paths) -> list[bool]:
    """Whether each of ``paths`` exists, in order."""
    return _default.batch_exists(paths)


def probe_o_direct(directory) -> bool:
    """Whether O_DIRECT works in ``directory`` (cached per directory; False if unusable)."""
    return _default.probe_o_direct(directory)

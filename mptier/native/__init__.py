"""Batch block I/O between a memory buffer and block files beneath a root: mptier's native layer.

One call moves a whole batch of fixed-size blocks::

    buffer (any writable, C-contiguous buffer: shm mmap, numpy array, bytearray ...)
      block i = buffer[offsets[i] : offsets[i] + block_bytes]  <-->  <root>/paths[i]

    Backend.store / load / lookup          errno layer: trusted arguments, returns codes
    Backend.batch_store / _load / _lookup  validated wrappers: raise BatchIOError
      (this module: validation, MPTIER_FAULT_ERRNO, errors -> exceptions, the one place)
        |-- "native": _native -> _mptier_cffi -> mptier_io.c ...  (cffi, GIL released)
        '-- "python": _pure, _crc32c                         (same steps, os.* and numpy)

Every call blocks its thread until the batch is done; calls may run concurrently from
several threads and processes. The two backends behave identically:

- Paths are relative to a root directory descriptor (:func:`open_root`) and resolve
  beneath it without following a symlink (openat2 with RESOLVE_BENEATH |
  RESOLVE_NO_SYMLINKS where the kernel has it, else a per-component O_NOFOLLOW walk;
  flag ``NO_OPENAT2`` forces the walk). A symlink at a block path or a layout
  sub-folder is removed; only a regular file of exactly ``block_bytes`` is served.
- Store: an existing regular file of exactly ``block_bytes`` counts as stored (names are
  content hashes; ``TOUCH`` sets its atime). A shorter file or a symlink there is removed
  and the block written; a directory, FIFO or other non-file (EMEDIUMTYPE), a longer file
  (EFBIG), or a non-directory where a sub-folder must be (ENOTDIR) fails the block and is
  left in place. The block goes into an ``O_TMPFILE`` file linked into place (``TMPFILE``,
  where the file system allows) or into ``<final>.<tag>.<counter>.tmp`` renamed onto the
  final name; either way no reader sees a partial file at a final name, and a link or rename
  failing with EEXIST is success. ``CHECKSUM`` sets vLLM's record (xattr
  ``user.vllm.kv_crc32c``, the CRC32C as 4 bytes big-endian) on the temporary file before it
  is published. A temporary file never survives a failure; if removing one fails, the store
  reports that errno (``tmp_unlink_errno``) so the caller can warn.
- Load: reads exactly ``block_bytes``. Missing: ENOENT. A symlink (removed): ELOOP. A
  non-file: EMEDIUMTYPE; longer: EFBIG (both left in place). Shorter: ENODATA, removed.
  With ``CHECKSUM``, a record that is not 4 bytes or does not match: EBADMSG, removed; no
  record at all: loads (caches written without checksums stay valid). "Removed" only
  while the name still points at the inode that was read. ``TOUCH`` sets the atime of a
  loaded block. A FIFO is never opened in a way that blocks.
- Lookup: one status per path (``LOOKUP_*``); it removes symlinks, nothing else.
- Store and load stop at the first failing block. The errno layer returns ``(rc,
  n_done, fail_index[, tmp_unlink_errno])``, ``rc`` 0 or -errno; the wrappers raise
  :class:`mptier.errors.BatchIOError` with ``errno``, ``index``, ``n_done`` and the
  failing path. Blocks ``0 .. index - 1`` are done; nothing after ``index`` is
  published, removed or touched. The buffer slots of a *load*'s blocks from ``index``
  on have undefined contents: the failing block may be partly read, and with ``URING``
  later blocks may have been read while the batch ran. All I/O into the buffer has
  ended when the call returns. (A store with ``URING`` may also have made empty
  folders for blocks after ``index``.)
- ``URING`` runs a store or load through io_uring with up to 32 blocks in flight (each
  block's opens, folder making, stat and read/write in the ring; checks, checksums,
  publishing and removals in batch order, as the loop does them), and a lookup with
  every key's open in the ring (not with ``LOOP_LOOKUP``), where this process can use
  io_uring (:meth:`Backend.uring_status`); elsewhere, with ``NO_OPENAT2``, for one-block
  batches, and for loads into overlapping slots, the loop runs: the same results.
  It pays on block devices, where a lone process leaves the device idle between its
  dependent steps; in memory (:meth:`Backend.probe_in_memory`) the loop is as fast. The
  Python backend ignores it.
- O_DIRECT is used with flag ``O_DIRECT`` where the block's address and ``block_bytes``
  are multiples of 4096; a block whose O_DIRECT open or I/O fails with EINVAL is redone
  buffered, so O_DIRECT never fails a block. Probe a root once (:func:`probe_o_direct`,
  :func:`probe_xattr`, :func:`probe_o_tmpfile`) and pass the answers as flags.

Choosing the backend: the module-level functions use the compiled core when it was
built (``HAS_NATIVE``), unless the environment sets ``MPTIER_NATIVE=0`` at import;
``BACKEND`` says which one they use. :func:`get_backend` gives either one by name.

CRC32C: the native core runs the fastest path this CPU has (``Backend.crc32c_impls``,
best first: "avx512-vpclmulqdq", "avx2-vpclmulqdq", "pclmulqdq", "sse4.2" or
"armv8-crc", "table"); ``MPTIER_CRC32C_PATH=<name>`` at import makes every CRC of this
process (and of workers, which inherit it) run that one instead, for tests and
benchmarks. A name this CPU cannot run raises ``ConfigError`` saying what it lacks.
The Python backend has one path ("numpy") and ignores the variable.

Fault injection (tests): ``MPTIER_FAULT_ERRNO=op:index:errno``, e.g. ``load:2:13`` or
``store:0:EIO``, makes every ``op`` batch (``store`` or ``load``, errno layer and
wrappers, either backend) fail at block ``index`` with that errno, as if the block's
I/O had failed: blocks before it are done for real, block ``index`` and later are not
touched. Batches shorter than ``index + 1`` are unaffected. The variable is read once
at import (worker processes inherit it); :func:`set_fault` changes it at run time. The
wrappers' error says "injected".
"""

from __future__ import annotations

import errno as _errno
import os

from mptier.errors import BatchIOError, ConfigError, errno_name, strerror
from mptier.native import _checks, _pure, entries
from mptier.native._checks import FAULT_ENV, new_tag, open_root, set_fault
from mptier.native.tasks import TaskCalls

try:
    from mptier.native import _native
except ImportError as _exc:  # not built, or built for another interpreter
    _native = None
    NATIVE_IMPORT_ERROR: str | None = f"{type(_exc).__name__}: {_exc}"
else:
    NATIVE_IMPORT_ERROR = None

__all__ = [
    "BACKEND", "CHECKSUM", "FAULT_ENV", "HAS_NATIVE", "LOOKUP_ABSENT", "LOOKUP_BAD",
    "LOOKUP_PRESENT", "LOOKUP_SHORT", "LOOKUP_SYMLINK", "LOOP_LOOKUP", "NO_OPENAT2",
    "O_DIRECT", "TAG_LEN", "TEMP_SUFFIX_MAX_BYTES", "TMPFILE", "TOUCH", "URING",
    "WHOLE_BOUNCE", "XATTR_NAME", "Backend", "batch_error", "batch_load", "batch_lookup",
    "batch_store", "crc32c", "crc32c_impl", "get_backend", "new_tag", "open_root",
    "probe_o_direct", "probe_o_tmpfile", "probe_xattr", "set_fault", "uring_status",
]

NATIVE_ENV = "MPTIER_NATIVE"
CRC32C_PATH_ENV = "MPTIER_CRC32C_PATH"
HAS_NATIVE: bool = _native is not None

# Flags of store / load / lookup (the same bits in both backends and in C).
O_DIRECT = _pure.O_DIRECT_FLAG
CHECKSUM = _pure.CHECKSUM
TOUCH = _pure.TOUCH
TMPFILE = _pure.TMPFILE
NO_OPENAT2 = _pure.NO_OPENAT2
URING = _pure.URING
WHOLE_BOUNCE, LOOP_LOOKUP = _pure.WHOLE_BOUNCE, _pure.LOOP_LOOKUP  # side by side (C only)
# Lookup statuses. SHORT (a file shorter than a block) is a miss: the next store
# replaces it, a load removes it; lookup itself removes nothing but symlinks.
LOOKUP_ABSENT = _pure.LOOKUP_ABSENT
LOOKUP_PRESENT = _pure.LOOKUP_PRESENT
LOOKUP_SYMLINK = _pure.LOOKUP_SYMLINK
LOOKUP_BAD = _pure.LOOKUP_BAD
LOOKUP_SHORT = _pure.LOOKUP_SHORT
TAG_LEN = _pure.TAG_LEN
# Longest ".<tag>.<counter>.tmp": a final name may be NAME_MAX (255) minus this.
TEMP_SUFFIX_MAX_BYTES = _pure.TEMP_SUFFIX_MAX_BYTES
XATTR_NAME = _pure.XATTR_NAME

def batch_error(op: str, err: int, n_done: int, index: int, path: str,
                note: str = "") -> BatchIOError:
    """The exception for a failed batch (``op`` "store" or "load"), with a hint per errno.

    Also what a caller of the errno layer uses to describe a failure in text.
    """
    hint = entries.hint(op, err)
    message = (f"batch {op} failed: {strerror(err)} ({errno_name(err)})"
               + (f": {hint}" if hint else "") + note)
    return BatchIOError(err, message, n_done=n_done, index=index, path=path)


class Backend(TaskCalls):
    """The batch operations bound to one implementation ("native" or "python"), and the
    worker's calls on task records (:class:`~mptier.native.tasks.TaskCalls`).

    Get one with :func:`get_backend`. Every method blocks the calling thread until it
    is done and may be called from several threads at once.

    The errno layer (:meth:`store`, :meth:`load`, :meth:`lookup`) trusts its arguments
    and raises nothing for I/O errors: the hot path of a worker. The ``batch_*`` methods
    validate, accept a root path or fd, and raise.
    """

    def __init__(self, name: str, impl) -> None:
        self.name = name
        self._impl = impl
        self._probe_cache: dict[tuple[str, bytes], bool] = {}
        self.crc32c_impls: tuple[str, ...] = impl.CRC32C_IMPLS

    def __repr__(self) -> str:
        return f"<mptier.native.Backend {self.name!r}>"

    # -- errno layer -------------------------------------------------------------------
    def store(self, root_fd: int, paths, buffer, offsets, block_bytes: int, flags: int,
              tag: bytes, found: bytearray | None = None, bounce=None):
        """Store block i to ``paths[i]``: ``(rc, n_done, fail_index, tmp_unlink_errno)``;
        ``found[i]``: done block i was there already; ``bounce``: each block written from
        a slot of it (workers.bounce; -EINVAL if under a block). Faults apply."""
        return _checks.faulted("store", self._impl.store, root_fd, paths, buffer, offsets,
                               block_bytes, flags, tag, found, bounce)[:4]

    def load(self, root_fd: int, paths, buffer, offsets, block_bytes: int, flags: int):
        """Load ``paths[i]`` into block i: ``(rc, n_done, fail_index)``. No validation."""
        return _checks.faulted("load", self._impl.load, root_fd, paths, buffer, offsets,
                               block_bytes, flags)[:3]

    def load_via(self, root_fd: int, paths, buffer, offsets, block_bytes: int, flags: int,
                 bounce) -> tuple[int, int, int]:
        """:meth:`load`, reading each block into a slot of ``bounce`` (private,
        page-aligned memory of whole blocks) and copying it to ``buffer`` only after its
        read returned (``mptier.workers.bounce``; with ``URING`` in waves unless
        ``WHOLE_BOUNCE``: uring.c); a failed block's slot is never written. No
        validation beyond ``bounce`` holding a block (else -EINVAL)."""
        return _checks.faulted("load", self._impl.load_via, root_fd, paths, buffer,
                               offsets, block_bytes, flags, bounce)[:3]

    def lookup(self, root_fd: int, paths, block_bytes: int, flags: int = 0) -> bytes:
        """One ``LOOKUP_*`` status byte per path. No validation."""
        return self._impl.lookup(root_fd, paths, block_bytes, flags)

    # -- validated wrappers --------------------------------------------------------------
    def batch_store(self, root, paths, buffer, offsets, block_bytes, *, o_direct=True,
                    checksum=False, touch=False, tmpfile=False, tag=None,
                    no_openat2=False, uring=False) -> None:
        """Write block i of ``buffer`` to ``<root>/paths[i]``; see the module docstring.

        ``root`` is a directory path or an fd from :func:`open_root`; ``tag`` names the
        writer in temporary names (default: one random tag per process). Raises
        ``ValueError``/``TypeError`` for bad arguments (before any I/O) and
        ``BatchIOError`` at the first block that fails. A temporary file that could not
        be removed is reported as a ``ResourceWarning``.
        """
        flags = _checks.flags(o_direct, checksum, touch, tmpfile, no_openat2, uring)
        tag_bytes = _checks.tag(tag)
        with _checks.Root(root) as (fd, where):
            encoded, offs, block_bytes = _checks.batch(paths, buffer, offsets, block_bytes)
            rc, n_done, index, tmp_errno, note = _checks.faulted(
                "store", self._impl.store, fd, encoded, buffer, offs, block_bytes, flags,
                tag_bytes)
        if tmp_errno:
            _checks.warn_temp_left(tmp_errno, where)
        if rc:
            raise batch_error("store", -rc, n_done, index, where(encoded[index]), note)

    def batch_load(self, root, paths, buffer, offsets, block_bytes, *, o_direct=True,
                   checksum=False, touch=False, no_openat2=False, uring=False) -> None:
        """Read ``<root>/paths[i]`` into block i of ``buffer``; see the module docstring.

        Raises ``ValueError``/``TypeError`` for bad arguments (before any I/O) and
        ``BatchIOError`` at the first block that fails.
        """
        flags = _checks.flags(o_direct, checksum, touch, False, no_openat2, uring)
        with _checks.Root(root) as (fd, where):
            encoded, offs, block_bytes = _checks.batch(paths, buffer, offsets, block_bytes)
            rc, n_done, index, _, note = _checks.faulted(
                "load", self._impl.load, fd, encoded, buffer, offs, block_bytes, flags)
        if rc:
            raise batch_error("load", -rc, n_done, index, where(encoded[index]), note)

    def batch_lookup(self, root, paths, block_bytes, *, no_openat2=False, uring=False):
        """The ``LOOKUP_*`` status of each of ``<root>/paths[i]``, in order (a list)."""
        flags = _checks.flags(False, False, False, False, no_openat2, uring)
        block_bytes = _checks.block_size(block_bytes)
        with _checks.Root(root) as (fd, _):
            return list(self._impl.lookup(fd, _checks.paths(paths), block_bytes, flags))

    # -- the rest ----------------------------------------------------------------------------
    def crc32c(self, data, value: int = 0, *, impl: str | None = None) -> int:
        """CRC32C (Castagnoli) of ``data`` (any C-contiguous buffer), continuing from
        ``value`` as ``zlib.crc32`` does. ``impl`` picks one of :attr:`crc32c_impls`
        (tests); None is the fastest."""
        if impl is not None and impl not in self.crc32c_impls:
            raise ValueError(f"crc32c impl {impl!r} is not available in the {self.name} "
                             f"backend here; choose one of {self.crc32c_impls}")
        return self._impl.crc32c_with(_checks.contiguous(data), value & 0xFFFFFFFF, impl)

    def crc32c_impl(self) -> str:
        """Which CRC32C implementation (path) runs: one of :attr:`crc32c_impls`, the
        first unless ``MPTIER_CRC32C_PATH`` named another."""
        return self._impl.crc32c_impl()

    def crc32c_lacks(self, impl: str) -> str:
        """What this machine lacks to run CRC32C path ``impl``: "" when it is one of
        :attr:`crc32c_impls`, else the missing CPU features (as /proc/cpuinfo names
        them). Raises ``ValueError`` for a name this backend does not know."""
        lacks = self._impl.crc32c_lacks(impl)
        if lacks is None:
            raise ValueError(f"{impl!r} names no CRC32C path of the {self.name} backend; "
                             f"this machine runs {', '.join(self.crc32c_impls)}")
        return lacks

    def resolver(self) -> str:
        """How paths resolve beneath a root without NO_OPENAT2: "openat2" or "walk"."""
        return self._impl.resolver()

    def uring_status(self) -> str:
        """"io_uring" when ``URING`` batches of this backend run through io_uring in this
        process, else why they take the system-call loop (probed once per process)."""
        return self._impl.uring_status()

    def uring_available(self) -> bool:
        """Whether ``URING`` batches run through io_uring in this process."""
        return self.uring_status() == "io_uring"

    def probe_in_memory(self, directory) -> bool:
        """Whether ``directory``'s file system keeps file data in memory (tmpfs, ramfs),
        where more I/O in flight buys nothing; False for an unusable directory."""
        return self._probe("in_memory", self._impl.probe_in_memory, directory)

    def _probe(self, what: str, fn, directory) -> bool:
        key = (what, os.path.abspath(os.fsencode(directory)))
        known = self._probe_cache.get(key)
        if known is not None:
            return known
        rc = fn(key[1])
        if rc < 0:
            return False
        self._probe_cache[key] = works = rc == 1
        return works

    def probe_o_direct(self, directory) -> bool:
        """Whether an aligned O_DIRECT write works in ``directory``; leaves no file.

        Blocks for one small write. A definite answer is cached per directory for the
        life of the process; an unusable directory (missing, not a directory, no
        permission) answers False and is probed again on the next call. The same holds
        for :meth:`probe_xattr` and :meth:`probe_o_tmpfile`.
        """
        return self._probe("o_direct", self._impl.probe_o_direct, directory)

    def probe_xattr(self, directory) -> bool:
        """Whether user extended attributes (the checksum record) work in ``directory``."""
        return self._probe("xattr", self._impl.probe_xattr, directory)

    def probe_o_tmpfile(self, directory) -> bool:
        """Whether an O_TMPFILE file can be made and linked into place in ``directory``."""
        return self._probe("o_tmpfile", self._impl.probe_o_tmpfile, directory)


_BACKENDS = {"python": Backend("python", _pure)}
if _native is not None:
    _BACKENDS["native"] = Backend("native", _native)



def _force_crc32c_path() -> None:
    """Apply ``MPTIER_CRC32C_PATH`` to the native core (once, at import)."""
    name = os.environ.get(CRC32C_PATH_ENV, "").strip()
    if not name or _native is None:
        return
    rc, lacks = _native.crc32c_select(name)  # lacks: None for no such path
    if rc == -_errno.EINVAL:
        raise ConfigError(f"{CRC32C_PATH_ENV}={name!r} names no CRC32C path; use one of "
                          f"{', '.join(_native.CRC32C_IMPLS)} (this CPU's) or unset it")
    if rc:
        raise ConfigError(f"{CRC32C_PATH_ENV}={name!r}: this CPU lacks {lacks}; use one "
                          f"of {', '.join(_native.CRC32C_IMPLS)} or unset it")


_force_crc32c_path()
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


def batch_store(root, paths, buffer, offsets, block_bytes, **options) -> None:
    """:meth:`Backend.batch_store` of the default backend."""
    _default.batch_store(root, paths, buffer, offsets, block_bytes, **options)


def batch_load(root, paths, buffer, offsets, block_bytes, **options) -> None:
    """:meth:`Backend.batch_load` of the default backend."""
    _default.batch_load(root, paths, buffer, offsets, block_bytes, **options)


def batch_lookup(root, paths, block_bytes, **options) -> list[int]:
    """:meth:`Backend.batch_lookup` of the default backend."""
    return _default.batch_lookup(root, paths, block_bytes, **options)


def crc32c(data, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value`` (default backend; GIL released in C)."""
    return _default.crc32c(data, value)


def crc32c_impl() -> str:
    """The CRC32C implementation the default backend runs."""
    return _default.crc32c_impl()


def probe_o_direct(directory) -> bool:
    """Whether O_DIRECT works in ``directory`` (cached per directory; False if unusable)."""
    return _default.probe_o_direct(directory)


def probe_xattr(directory) -> bool:
    """Whether user xattrs work in ``directory`` (cached per directory; False if unusable)."""
    return _default.probe_xattr(directory)


def probe_o_tmpfile(directory) -> bool:
    """Whether O_TMPFILE + link works in ``directory`` (cached; False if unusable)."""
    return _default.probe_o_tmpfile(directory)


def uring_status() -> str:
    """:meth:`Backend.uring_status` of the default backend."""
    return _default.uring_status()

"""Adapter from trusted Python arguments to the compiled core (``_mptier_cffi``).

Exposes the same functions with the same signatures and return values as ``_pure``.
Importing this module raises ``ImportError`` when the extension was not built (or was
built from other sources than ``_pure`` mirrors). cffi releases the GIL around each
call, so a whole batch, or a CRC of a large buffer, runs without it; the C side sees
only the paths blob, the buffer address and the offsets array.
"""

from __future__ import annotations

import array
import errno
import os
from collections.abc import Callable, Sequence

import mptier.native._mptier_cffi as _cffi
from mptier import fskind
from mptier.keys import GROUP_IDX_BYTES
from mptier.native import _pure, _pure_task

ffi, lib = _cffi.ffi, _cffi.lib

_MIRRORED = {
    "MPT_O_DIRECT": _pure.O_DIRECT_FLAG, "MPT_CHECKSUM": _pure.CHECKSUM,
    "MPT_TOUCH": _pure.TOUCH, "MPT_TMPFILE": _pure.TMPFILE,
    "MPT_NO_OPENAT2": _pure.NO_OPENAT2, "MPT_URING": _pure.URING,
    "MPT_WHOLE_BOUNCE": _pure.WHOLE_BOUNCE, "MPT_LOOP_LOOKUP": _pure.LOOP_LOOKUP,
    "MPT_DIRECT_ALIGN": _pure.DIRECT_ALIGN,
    "MPT_TAG_LEN": _pure.TAG_LEN, "MPT_TEMP_SUFFIX_MAX_BYTES": _pure.TEMP_SUFFIX_MAX_BYTES,
    "MPT_LOOKUP_ABSENT": _pure.LOOKUP_ABSENT, "MPT_LOOKUP_PRESENT": _pure.LOOKUP_PRESENT,
    "MPT_LOOKUP_SYMLINK": _pure.LOOKUP_SYMLINK, "MPT_LOOKUP_BAD": _pure.LOOKUP_BAD,
    "MPT_LOOKUP_SHORT": _pure.LOOKUP_SHORT,
    "MPT_TMPFS_MAGIC": fskind.TMPFS_MAGIC, "MPT_RAMFS_MAGIC": fskind.RAMFS_MAGIC,
    "MPT_GROUP_IDX_BYTES": GROUP_IDX_BYTES,
}
_differ = sorted(name for name, value in _MIRRORED.items() if getattr(lib, name) != value)
if _differ or ffi.string(lib.mpt_xattr_name()).decode() != _pure.XATTR_NAME:
    raise ImportError(f"mptier native core and mptier/native/_pure.py (or fskind) disagree on "
                      f"{', '.join(_differ) or 'the xattr name'}; rebuild the package")

# Names of the CRC32C implementations this CPU can run, best first.
CRC32C_IMPLS = tuple(ffi.string(lib.mpt_crc32c_impls()).decode().split(","))
_IMPL_CODE = {None: lib.MPT_CRC32C_BEST, "table": lib.MPT_CRC32C_TABLE,
              "sse4.2": lib.MPT_CRC32C_HW, "armv8-crc": lib.MPT_CRC32C_HW,
              "avx512-vpclmulqdq": lib.MPT_CRC32C_AVX512,
              "avx2-vpclmulqdq": lib.MPT_CRC32C_AVX2, "pclmulqdq": lib.MPT_CRC32C_PCLMUL}


def _blob(paths: Sequence[bytes]) -> bytes:
    return b"\0".join(paths) + b"\0"  # one allocation for the whole batch


# An offset no buffer can hold: what a negative or too large one becomes, so that C
# refuses it as outside the buffer (EINVAL) as the Python twin does, instead of cffi
# raising OverflowError.
_OUTSIDE = (1 << 64) - 1


def _offsets(offsets: Sequence[int]):
    try:
        return ffi.new("uint64_t[]", offsets)
    except OverflowError:  # not on the hot path: only a bad task record gets here
        return ffi.new("uint64_t[]", [o if 0 <= o < _OUTSIDE else _OUTSIDE for o in offsets])


def store(root_fd: int, paths: Sequence[bytes], buffer, offsets: Sequence[int],
          block_bytes: int, flags: int, tag: bytes, found: bytearray | None = None,
          bounce=None) -> tuple[int, int, int, int]:
    n = len(paths)
    if n == 0:
        return 0, 0, 0, 0
    offs = _offsets(offsets)
    out = ffi.new("size_t[2]")
    tmp_errno = ffi.new("int *")
    if found is not None and len(found) < n:
        raise ValueError(f"found holds {len(found)} flags for {n} blocks")
    seen = ffi.NULL if found is None else ffi.from_buffer("uint8_t[]", found,
                                                          require_writable=True)
    with ffi.from_buffer("char[]", buffer, require_writable=True) as base:
        if bounce is None:
            rc = lib.mpt_batch_store(root_fd, _blob(paths), n, base, len(base), offs,
                                     block_bytes, flags, tag, out, out + 1, tmp_errno, seen)
        else:
            with ffi.from_buffer("char[]", bounce, require_writable=True) as via:
                rc = lib.mpt_batch_store_via(root_fd, _blob(paths), n, base, len(base), offs,
                                             block_bytes, flags, tag, via,
                                             len(via) // block_bytes, out, out + 1,
                                             tmp_errno, seen)
    return rc, out[0], out[1], tmp_errno[0]


def load(root_fd: int, paths: Sequence[bytes], buffer, offsets: Sequence[int],
         block_bytes: int, flags: int) -> tuple[int, int, int]:
    n = len(paths)
    if n == 0:
        return 0, 0, 0
    offs = _offsets(offsets)
    out = ffi.new("size_t[2]")
    with ffi.from_buffer("char[]", buffer, require_writable=True) as base:
        rc = lib.mpt_batch_load(root_fd, _blob(paths), n, base, len(base), offs,
                                block_bytes, flags, out, out + 1)
    return rc, out[0], out[1]


def load_via(root_fd: int, paths: Sequence[bytes], buffer, offsets: Sequence[int],
             block_bytes: int, flags: int, bounce) -> tuple[int, int, int]:
    n = len(paths)
    if n == 0:
        return 0, 0, 0
    offs = _offsets(offsets)
    out = ffi.new("size_t[2]")
    with ffi.from_buffer("char[]", buffer, require_writable=True) as base, \
            ffi.from_buffer("char[]", bounce, require_writable=True) as via:
        rc = lib.mpt_batch_load_via(root_fd, _blob(paths), n, base, len(base), offs,
                                    block_bytes, flags, via, len(via) // block_bytes, out,
                                    out + 1)
    return rc, out[0], out[1]


_task_items = lib.mpt_task_items
_task_load = lib.mpt_task_load
_new = ffi.new


def task_items(record, block_bytes: int) -> tuple[int, list[bytes], list[int]]:
    """``(n, paths, offsets)`` of a task record (``n`` < 0: -errno, empty lists)."""
    lookup_record = record[4] == _pure_task.KIND_LOOKUP
    size = lib.MPT_LOOKUP_PATHS_BYTES if lookup_record else lib.MPT_TASK_PATHS_BYTES
    paths = _new("char[]", size)
    offsets = _new("uint64_t[]", lib.MPT_TASK_MAX_ITEMS)
    used = _new("size_t *")
    n = _task_items(_from_buffer(record), len(record), block_bytes, paths, size, used,
                    offsets, lib.MPT_TASK_MAX_ITEMS)
    if n <= 0:
        return n, [], []
    return (n, ffi.buffer(paths, used[0] - 1)[:].split(b"\0"),
            [] if lookup_record else ffi.unpack(offsets, n))


def record_taker(fds: tuple[int, ...], record) -> Callable[[], tuple[int, bool]]:
    """``mpt_take_record`` over ``fds`` into ``record``, as the twin's (_pure_task)."""
    queues = _new("int[]", list(fds))
    n, size = len(fds), len(record)
    more = _new("int *")
    take_record = lib.mpt_take_record

    def take() -> tuple[int, bool]:
        index = take_record(queues, n, _from_buffer(record), size, more)
        if index >= 0:
            return index, bool(more[0])
        if index == -errno.EAGAIN:
            return -1, False
        raise OSError(-index, os.strerror(-index))

    return take


def load_task(root_fd: int, record, buffer, block_bytes: int, flags: int,
              bounce) -> tuple[int, int, int]:
    out = _new("size_t[2]")
    with ffi.from_buffer("char[]", buffer, require_writable=True) as base:
        if bounce is None:
            rc = _task_load(root_fd, _from_buffer(record), len(record), base, len(base),
                            block_bytes, flags, ffi.NULL, 0, out, out + 1)
        else:
            with ffi.from_buffer("char[]", bounce, require_writable=True) as via:
                rc = _task_load(root_fd, _from_buffer(record), len(record), base,
                                len(base), block_bytes, flags, via,
                                len(via) // block_bytes, out, out + 1)
    return rc, out[0], out[1]


def lookup(root_fd: int, paths: Sequence[bytes], block_bytes: int, flags: int) -> bytes:
    n = len(paths)
    if n == 0:
        return b""
    out = ffi.new("uint8_t[]", n)
    lib.mpt_batch_lookup(root_fd, _blob(paths), n, block_bytes, flags, out)
    return ffi.buffer(out, n)[:]


def resolver() -> str:
    return ffi.string(lib.mpt_resolver()).decode()


def uring_status() -> str:
    return ffi.string(lib.mpt_uring_status()).decode()


same_folder = lib.mpt_same_folder
evict_block = lib.mpt_evict_block


def probe_in_memory(directory: bytes) -> int:
    return lib.mpt_fs_in_memory(directory)


# The task records' layout as the C encoder writes it (mptier.jobs checks it against its own).
WIRE_VERSION = lib.MPT_WIRE_VERSION
TASK_RECORD_BYTES = lib.MPT_TASK_RECORD_BYTES
TASK_HEADER_BYTES = lib.MPT_TASK_HEADER_BYTES
_KIND_LOOKUP = 3  # lookup records carry no block ids (MPT_KIND_LOOKUP)
_from_buffer = ffi.from_buffer
_encode = lib.mpt_encode_job


def encode_job(kind: int, first_task_id: int, keys: Sequence[bytes], block_ids,
               per_task: int) -> bytearray | None:
    """``mptier.jobs.encode_job``'s records in one C call, or ``None`` where the C
    encoder does not apply (keys of different lengths, a big-endian machine): the caller
    then encodes in Python. Raises ``ValueError`` when ``per_task`` items do not fit a
    record, as the Python encoder does."""
    n = len(keys)
    if n == 0:
        return bytearray()
    all_keys = b"".join(keys)
    key_len = len(keys[0])
    if len(all_keys) != n * key_len:
        return None  # mixed lengths: the loop of mptier.jobs
    if kind != _KIND_LOOKUP and len(block_ids) != n:
        return None  # the Python encoder raises for it
    if type(block_ids) is not array.array or block_ids.typecode != "q":
        block_ids = array.array("q", block_ids)
    out = bytearray(-(-n // per_task) * TASK_RECORD_BYTES)
    rc = _encode(_from_buffer(out), len(out), kind, first_task_id, all_keys, key_len, n,
                 _from_buffer("int64_t[]", block_ids), per_task)
    if rc >= 0:
        return out
    if rc == -errno.E2BIG:
        raise ValueError(f"{per_task} items of {key_len}-byte keys do not fit a task record")
    return None


def crc32c_impl() -> str:
    return ffi.string(lib.mpt_crc32c_selected()).decode()


def crc32c_lacks(name: str) -> str | None:
    lacks = lib.mpt_crc32c_lacks(name.encode())
    return None if lacks == ffi.NULL else ffi.string(lacks).decode()


def crc32c_select(name: str) -> tuple[int, str | None]:
    """Make ``name`` the path this process's CRCs run: ``(0 | -EINVAL | -ENOTSUP, what
    the CPU lacks for it or None for no such path)``."""
    return lib.mpt_crc32c_select(name.encode()), crc32c_lacks(name)


def crc32c_with(data, value: int, impl: str | None) -> int:
    """CRC32C of ``data`` continuing from ``value``; ``impl`` one of CRC32C_IMPLS or None."""
    with memoryview(data) as mv:
        nbytes = mv.nbytes
        with ffi.from_buffer("char[]", mv) as p:
            return lib.mpt_crc32c(value, p, nbytes, _IMPL_CODE[impl])


def probe_o_direct(directory: bytes) -> int:
    return lib.mpt_probe_o_direct(directory)


def probe_xattr(directory: bytes) -> int:
    return lib.mpt_probe_xattr(directory)


def probe_o_tmpfile(directory: bytes) -> int:
    return lib.mpt_probe_o_tmpfile(directory)


if (WIRE_VERSION, TASK_RECORD_BYTES, TASK_HEADER_BYTES) != (
        _pure_task.WIRE_VERSION, _pure_task.TASK_RECORD_BYTES, _pure_task.TASK_HEADER_BYTES):
    # Built for another wire version (as for encode_job): the records are decoded in
    # Python, the batch still runs here.
    def task_items(record, block_bytes: int) -> tuple[int, list[bytes], list[int]]:
        return _pure_task.task_items(record, block_bytes)

    def load_task(root_fd: int, record, buffer, block_bytes: int, flags: int,
                  bounce) -> tuple[int, int, int]:
        return _pure_task.load_task(load, load_via, root_fd, record, buffer, block_bytes,
                                    flags, bounce)

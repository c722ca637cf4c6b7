"""The pure-Python twin of the C core (``mptier_io.c``, ``block.c``, ``probes.c``;
``resolve.c`` is ``_pure_resolve.py``, ``crc32c.c`` is ``_crc32c.py``, the task
records' decoding of ``encode.c`` is ``_pure_task.py``).

Same steps, same return codes: ``store`` returns ``(rc, n_done, fail_index,
tmp_unlink_errno)``, ``load`` ``(rc, n_done, fail_index)`` with ``rc`` 0 or ``-errno``,
``lookup`` one status byte per path. Nothing here raises for an I/O error;
``mptier.native`` turns the codes into exceptions for both backends alike. Arguments
arrive validated: paths are non-empty relative ``bytes`` without NUL, "." or "..", the
buffer is writable and C-contiguous, the tag is 16 characters of [0-9a-z]. A block not
wholly inside the buffer is still refused (EINVAL) before any of its I/O, as in C: in a
service, offsets come from task records of an engine that is not trusted.

Paths resolve beneath the root with the component walk only (the C core's fallback,
``NO_OPENAT2``): Python has no openat2, and the walk gives the same answers.
``os.write`` and ``os.readv`` hand the memoryview's own address to the kernel, so
O_DIRECT works from here too when a block's address and size are aligned. Keep this
file and the C files in step: a change of behaviour goes into both.

Long because it mirrors the C core function for function (store, load, lookup, the
probes) with the same steps and return codes, so the two are read side by side and
changed together.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import itertools
import mmap
import os
import stat
from collections.abc import Sequence

from mptier import fskind
from mptier.native import _pure_task
from mptier.native._pure_resolve import (
    MKDIR_TRIES,
    _close_dir,
    _is_link,
    _is_reg,
    _open_beneath,
    _remove_if_same_fd,
    _split,
    _unlink_symlink,
    _walk,
)

O_DIRECT = getattr(os, "O_DIRECT", 0)

# Mirrors of mptier_native.h (checked against the compiled core when it loads).
O_DIRECT_FLAG = 1  # MPT_O_DIRECT: O_DIRECT where a block is aligned
CHECKSUM = 2  # MPT_CHECKSUM: write / verify the CRC32C record
TOUCH = 4  # MPT_TOUCH: atime to now on a load and on a store that finds the block
TMPFILE = 8  # MPT_TMPFILE: store through an O_TMPFILE file linked into place
NO_OPENAT2 = 16  # MPT_NO_OPENAT2: the component walk even where openat2 exists
URING = 32  # MPT_URING: several blocks in flight through io_uring (C only; same results)
WHOLE_BOUNCE = 64  # MPT_WHOLE_BOUNCE: a bounced io_uring load without waves (C only)
LOOP_LOOKUP = 128  # MPT_LOOP_LOOKUP: a URING lookup one key at a time (C only)
DIRECT_ALIGN = 4096  # O_DIRECT alignment of address, length and offset (512 B or 4 KiB)
TAG_LEN = 16  # a writer's tag: exactly 16 characters of [0-9a-z]
TEMP_SUFFIX_MAX_BYTES = 1 + TAG_LEN + 1 + 20 + 4  # ".<tag>.<uint64 counter>.tmp"
LOOKUP_ABSENT, LOOKUP_PRESENT, LOOKUP_SYMLINK, LOOKUP_BAD, LOOKUP_SHORT = range(5)
XATTR_NAME = "user.vllm.kv_crc32c"
NAME_TRIES = 8  # temporary names to try when one is already taken
CHUNK_BYTES = 256 * 1024  # buffered checksummed I/O: CRC each chunk beside its copy
CRC32C_IMPLS = ("numpy",)
URING_STATUS = "the pure-Python backend has no io_uring (the syscall loop only)"

_counter = itertools.count()  # next() on a count is atomic under the GIL
_ENOTSUP = getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)
_EMEDIUMTYPE = getattr(errno, "EMEDIUMTYPE", errno.EINVAL)
_UTIME_NOW, _UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2  # <sys/stat.h>
_AT_SYMLINK_NOFOLLOW = 0x100


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_ATIME_NOW = (_Timespec * 2)((0, _UTIME_NOW), (0, _UTIME_OMIT))  # atime now, mtime kept


def crc32c(data, value: int = 0) -> int:
    """CRC32C of ``data`` after ``value``: :func:`mptier.native._crc32c.crc32c`, imported
    at first use. That module needs numpy and builds its tables as it is imported (a
    fifth of a second of CPU), which a worker of the native backend, that reads only
    this module's constants, would otherwise pay at every start."""
    from mptier.native._crc32c import crc32c as numpy_crc32c

    return numpy_crc32c(data, value)


def _touch(fd: int) -> None:
    _libc.futimens(fd, _ATIME_NOW)  # best effort, as in C


def _touch_at(dirfd: int, name: bytes) -> None:
    _libc.utimensat(dirfd, name, _ATIME_NOW, _AT_SYMLINK_NOFOLLOW)


def _flat(buffer) -> tuple[memoryview, int]:
    """A flat byte view of ``buffer`` and the address of its first byte."""
    with memoryview(buffer) as mv:
        nbytes = mv.nbytes
    arr = (ctypes.c_char * nbytes).from_buffer(buffer)
    return memoryview(arr).cast("B"), ctypes.addressof(arr)


def _direct_ok(flags: int, address: int, length: int) -> bool:
    return bool(O_DIRECT and flags & O_DIRECT_FLAG and (address | length) % DIRECT_ALIGN == 0)


def _write_all(fd: int, chunk: memoryview) -> None:
    done, total = 0, len(chunk)
    while done < total:
        written = os.write(fd, chunk[done:])
        if written == 0:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        done += written


def _read_full(fd: int, chunk: memoryview) -> int:
    got, total = 0, len(chunk)
    while got < total:
        n = os.readv(fd, [chunk[got:]])
        if n == 0:
            break
        got += n
    return got


# -- the checksum record -------------------------------------------------------------------

def _record_of(fd: int) -> tuple[int, int | None]:
    """(0, crc) / (0, None) when absent / (-EBADMSG, None) / (-errno, None)."""
    try:
        value = os.getxattr(fd, XATTR_NAME)
    except OSError as e:
        if e.errno in (errno.ENODATA, _ENOTSUP):
            return 0, None  # written without checksums: valid, as vLLM reads it
        return -e.errno, None
    if len(value) != 4:
        return -errno.EBADMSG, None
    return 0, int.from_bytes(value, "big")


def _set_record(fd: int, crc: int) -> None:
    os.setxattr(fd, XATTR_NAME, crc.to_bytes(4, "big"))


# -- load ----------------------------------------------------------------------------------

def _read_block(fd: int, chunk: memoryview, direct: bool, check: bool) -> tuple[int, int]:
    """(rc, crc): read the block; with ``check``, CRC it (chunk by chunk when buffered)."""
    total = len(chunk)
    if not check or direct:
        if _read_full(fd, chunk) < total:
            return -errno.ENODATA, 0
        return 0, crc32c(chunk) if check else 0
    crc = done = 0
    while done < total:
        part = min(CHUNK_BYTES, total - done)
        with chunk[done : done + part] as piece:
            got = _read_full(fd, piece)
            crc = crc32c(piece[:got], crc)
        if got < part:
            return -errno.ENODATA, crc
        done += part
    return 0, crc


def _load_one(root: int, rel: bytes, chunk: memoryview, direct: bool, flags: int) -> int:
    fd = _open_beneath(root, rel, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
                       | (O_DIRECT if direct else 0))
    if fd < 0:
        return -_EMEDIUMTYPE if fd in (-errno.ENXIO, -errno.ENODEV) else fd
    remove = False
    try:
        st = os.fstat(fd)
        size, want = st.st_size, None
        if not _is_reg(st.st_mode):
            rc = -_EMEDIUMTYPE
        elif size > len(chunk):
            rc = -errno.EFBIG
        elif size < len(chunk):
            rc, remove = -errno.ENODATA, True
        else:
            rc = 0
            os.set_blocking(fd, True)  # a regular file: no FIFO wait to guard against
            if flags & CHECKSUM:
                rc, want = _record_of(fd)
                remove = rc == -errno.EBADMSG
            if rc == 0:
                rc, got = _read_block(fd, chunk, direct, want is not None)
                if rc == -errno.ENODATA:
                    remove = True  # shrank while we read
                elif rc == 0 and want is not None and got != want:
                    rc, remove = -errno.EBADMSG, True
                elif rc == 0 and flags & TOUCH:
                    _touch(fd)
        if remove:
            with contextlib.suppress(OSError):
                _remove_if_same_fd(root, rel, fd)
        return rc
    except OSError as e:
        return -e.errno
    finally:
        os.close(fd)


# -- store ---------------------------------------------------------------------------------

def _write_block(fd: int, chunk: memoryview, direct: bool, check: bool) -> None:
    """Twin of ``mpt_write_block``; raises ``OSError``."""
    if not check or direct:
        crc = crc32c(chunk) if check else 0
        _write_all(fd, chunk)
    else:
        crc = done = 0
        while done < len(chunk):
            with chunk[done : done + CHUNK_BYTES] as piece:
                crc = crc32c(piece, crc)
                _write_all(fd, piece)
            done += CHUNK_BYTES
    if check:
        _set_record(fd, crc)


class _Batch:
    """What one batch shares between its blocks (twin of ``struct mpt_batch``)."""

    __slots__ = ("flags", "found_one", "root", "tag", "tmp_errno")

    def __init__(self, root: int, flags: int, tag: bytes) -> None:
        self.root, self.flags, self.tag, self.tmp_errno = root, flags, tag, 0
        self.found_one = False  # the block just stored was there already

    def unlink_temp(self, dirfd: int, tmp: bytes) -> None:
        try:
            os.unlink(tmp, dir_fd=dirfd)
        except FileNotFoundError:
            pass
        except OSError as e:
            if not self.tmp_errno:
                self.tmp_errno = e.errno


def _store_named(b: _Batch, dirfd: int, leaf: bytes, chunk: memoryview, direct: bool) -> int:
    oflags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
              | (O_DIRECT if direct else 0))
    fd, rc, tmp = -1, -errno.EEXIST, b""
    for _ in range(NAME_TRIES):
        tmp = b"%s.%s.%d.tmp" % (leaf, b.tag, next(_counter))
        if len(tmp) > 255:
            return -errno.ENAMETOOLONG
        try:
            fd = os.open(tmp, oflags, 0o644, dir_fd=dirfd)
            break
        except OSError as e:
            rc = -e.errno
        if rc != -errno.EEXIST:
            break
    if fd < 0:
        if rc == -errno.EINVAL and direct:  # the kernel may create it before refusing
            b.unlink_temp(dirfd, tmp)
        return rc
    rc = 0
    try:
        _write_block(fd, chunk, direct, bool(b.flags & CHECKSUM))
    except OSError as e:
        rc = -e.errno
    try:
        os.close(fd)
    except OSError as e:
        rc = rc or -e.errno  # network file systems may report a failed write here
    if rc == 0:
        try:
            os.rename(tmp, leaf, src_dir_fd=dirfd, dst_dir_fd=dirfd)
            return 0
        except OSError as e:
            rc = 0 if e.errno == errno.EEXIST else -e.errno  # EEXIST: already published
    b.unlink_temp(dirfd, tmp)
    return rc


def _link_tmpfile(fd: int, dirfd: int, leaf: bytes) -> int:
    """Publish an O_TMPFILE file (Python has no AT_EMPTY_PATH link: /proc, as C falls
    back to)."""
    try:
        os.link(b"/proc/self/fd/%d" % fd, leaf, dst_dir_fd=dirfd, follow_symlinks=True)
        return 0
    except OSError as e:
        return -e.errno


def _store_tmpfile(b: _Batch, dirfd: int, leaf: bytes, chunk: memoryview,
                   direct: bool) -> int | None:
    """0 / -errno, or None where O_TMPFILE is refused (use a named file)."""
    try:
        fd = os.open(b".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC
                     | (O_DIRECT if direct else 0), 0o644, dir_fd=dirfd)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return None
        return -e.errno
    rc = 0
    try:
        _write_block(fd, chunk, direct, bool(b.flags & CHECKSUM))
    except OSError as e:
        rc = -e.errno
    if rc == 0:
        rc = _link_tmpfile(fd, dirfd, leaf)
        if rc == -errno.EEXIST:
            rc = 0  # another writer published it
    try:
        os.close(fd)
    except OSError as e:
        rc = rc or -e.errno
    return rc


def _store_in(b: _Batch, dirfd: int, leaf: bytes, chunk: memoryview, direct: bool,
              fresh: bool = False) -> int:
    try:  # a folder this store just made (fresh) holds nothing to check: mpt_store_in
        st = None if fresh else os.stat(leaf, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    except OSError as e:
        return -e.errno
    if st is not None:
        size, regular = st.st_size, _is_reg(st.st_mode)
        if regular and size == len(chunk):
            if b.flags & TOUCH:
                _touch_at(dirfd, leaf)
            b.found_one = True
            return 0  # names are content hashes: an existing block holds this one
        if regular and size > len(chunk):
            return -errno.EFBIG
        if not regular and not _is_link(st.st_mode):
            return -_EMEDIUMTYPE
        if _is_link(st.st_mode):
            rc = _unlink_symlink(dirfd, leaf)
            if rc:
                return rc
        else:  # a short file is corrupt: remove it, unless it was replaced
            try:
                again = os.stat(leaf, dir_fd=dirfd, follow_symlinks=False)
                if (again.st_dev, again.st_ino) == (st.st_dev, st.st_ino):
                    os.unlink(leaf, dir_fd=dirfd)
            except FileNotFoundError:
                pass
            except OSError as e:
                return -e.errno
    if b.flags & TMPFILE:
        rc = _store_tmpfile(b, dirfd, leaf, chunk, direct)
        if rc is not None:
            return rc
    return _store_named(b, dirfd, leaf, chunk, direct)


def _store_one(b: _Batch, rel: bytes, chunk: memoryview, direct: bool) -> int:
    folder, leaf = _split(rel)
    rc = 0
    for _ in range(MKDIR_TRIES + 1):
        made = [False]
        dirfd = _walk(b.root, folder, True, made)
        if dirfd == -errno.ENOENT:
            rc = dirfd  # a caretaker removed an empty parent while we made its child
            continue
        if dirfd < 0:
            return dirfd
        try:
            rc = _store_in(b, dirfd, leaf, chunk, direct, made[0])
        finally:
            _close_dir(dirfd, b.root)
        if rc != -errno.ENOENT:
            break  # ENOENT: the folder was removed under us; make it again
    return rc


# -- batches -------------------------------------------------------------------------------

def _batch(one, paths: Sequence[bytes], buffer, offsets: Sequence[int], block_bytes: int,
           flags: int, done=None) -> tuple[int, int, int]:
    n = len(paths)
    if n == 0:
        return 0, 0, 0
    view, base = _flat(buffer)
    last = len(view) - block_bytes  # the last offset a whole block fits at (as mpt_inside)
    with view:
        for i in range(n):
            off = offsets[i]
            if not 0 <= off <= last:  # outside the buffer: refused before any of its I/O
                return -errno.EINVAL, i, i
            direct = _direct_ok(flags, base + off, block_bytes)
            with view[off : off + block_bytes] as chunk:
                rc = one(paths[i], chunk, direct)
                if rc == -errno.EINVAL and direct:
                    rc = one(paths[i], chunk, False)  # never fail a block over O_DIRECT
            if rc:
                return rc, i, i
            if done is not None:
                done(i)
    return 0, n, n


def store(root_fd: int, paths: Sequence[bytes], buffer, offsets: Sequence[int],
          block_bytes: int, flags: int, tag: bytes, found: bytearray | None = None,
          bounce=None) -> tuple[int, int, int, int]:
    """Twin of ``mpt_batch_store`` (``mpt_batch_store_via`` with ``bounce``: each block
    copied into the first block of ``bounce`` and written from there):
    ``(rc, n_done, fail_index, tmp_unlink_errno)``; ``found[i]`` set to 1 where block i
    was there already (nothing written)."""
    b = _Batch(root_fd, flags, tag)
    if found is not None:
        found[:len(paths)] = bytes(len(paths))
    via = None
    if bounce is not None:
        via, via_base = _flat(bounce)
        if via.nbytes < block_bytes:
            via.release()
            return -errno.EINVAL, 0, 0, 0
        via_direct = _direct_ok(flags, via_base, block_bytes)

    def one(rel: bytes, chunk, direct: bool) -> int:
        b.found_one = False
        if via is not None:  # written from the bounce slot: its alignment decides
            via[:block_bytes] = chunk
            with via[:block_bytes] as slot:
                return _store_one(b, rel, slot, direct and via_direct)
        return _store_one(b, rel, chunk, direct)

    def stored(i: int) -> None:
        if found is not None:
            found[i] = b.found_one

    try:
        rc, n_done, index = _batch(one, paths, buffer, offsets, block_bytes, flags, stored)
    finally:
        if via is not None:
            via.release()
    return rc, n_done, index, b.tmp_errno


def load(root_fd: int, paths: Sequence[bytes], buffer, offsets: Sequence[int],
         block_bytes: int, flags: int) -> tuple[int, int, int]:
    """Twin of ``mpt_batch_load``: ``(rc, n_done, fail_index)``."""
    return _batch(lambda rel, chunk, direct: _load_one(root_fd, rel, chunk, direct, flags),
                  paths, buffer, offsets, block_bytes, flags)


def load_via(root_fd: int, paths: Sequence[bytes], buffer, offsets: Sequence[int],
             block_bytes: int, flags: int, bounce) -> tuple[int, int, int]:
    """Twin of ``mpt_batch_load_via``: each block read into the first block of
    ``bounce``, then copied to its slot once the read returned."""
    n = len(paths)
    if n == 0:
        return 0, 0, 0
    via, via_base = _flat(bounce)
    if via.nbytes < block_bytes:
        via.release()
        return -errno.EINVAL, 0, 0
    view, _ = _flat(buffer)
    last = len(view) - block_bytes  # the last offset a whole block fits at (as mpt_inside)
    with view, via, via[:block_bytes] as chunk:
        direct = _direct_ok(flags, via_base, block_bytes)
        for i in range(n):
            if not 0 <= offsets[i] <= last:  # outside the buffer: refused before its I/O
                return -errno.EINVAL, i, i
            rc = _load_one(root_fd, paths[i], chunk, direct, flags)
            if rc == -errno.EINVAL and direct:
                rc = _load_one(root_fd, paths[i], chunk, False, flags)
            if rc:
                return rc, i, i
            view[offsets[i]:offsets[i] + block_bytes] = chunk  # only after the read
    return 0, n, n


def _lookup_one(root: int, rel: bytes, block_bytes: int) -> int:
    fd = _open_beneath(root, rel, os.O_PATH)
    if fd < 0:
        return (LOOKUP_SYMLINK if fd == -errno.ELOOP
                else LOOKUP_BAD if fd == -errno.ENOTDIR else LOOKUP_ABSENT)
    try:
        st = os.fstat(fd)
    except OSError:
        return LOOKUP_ABSENT
    finally:
        os.close(fd)
    if _is_link(st.st_mode):
        folder, leaf = _split(rel)
        dirfd = _walk(root, folder, False)
        if dirfd >= 0:
            _unlink_symlink(dirfd, leaf)
            _close_dir(dirfd, root)
        return LOOKUP_SYMLINK
    if not _is_reg(st.st_mode) or st.st_size > block_bytes:
        return LOOKUP_BAD
    return LOOKUP_PRESENT if st.st_size == block_bytes else LOOKUP_SHORT


def task_items(record, block_bytes: int) -> tuple[int, list[bytes], list[int]]:
    """Twin of ``mpt_task_items``: see :func:`mptier.native._pure_task.task_items`."""
    return _pure_task.task_items(record, block_bytes)


def load_task(root_fd: int, record, buffer, block_bytes: int, flags: int,
              bounce) -> tuple[int, int, int]:
    """Twin of ``mpt_task_load``: :func:`load` (or :func:`load_via` through ``bounce``)
    of the record's blocks."""
    return _pure_task.load_task(load, load_via, root_fd, record, buffer, block_bytes,
                                flags, bounce)


record_taker = _pure_task.record_taker
same_folder = _pure_task.same_folder


def evict_block(path: bytes, size: int, ino: int, atime_ns: int, told: int) -> int:
    """Twin of ``mpt_evict_block``: 1 removed (and the emptied folders above), 0 kept,
    -errno when ``lstat`` (not told) or ``unlink`` fails otherwise."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return 0 if told or exc.errno == errno.ENOENT else -(exc.errno or errno.EIO)
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return 0
    if (st.st_atime_ns > atime_ns) if told else \
            (st.st_ino != ino or st.st_atime_ns != atime_ns):
        return 0
    try:
        os.unlink(path)
    except OSError as exc:
        return 0 if exc.errno == errno.ENOENT else -(exc.errno or errno.EIO)
    folder = path
    for _ in range(2):  # the <h2>_g<group> folder, then the <h3> folder above it
        folder = os.path.dirname(folder)
        try:
            os.rmdir(folder)
        except OSError:
            break
    return 1


def lookup(root_fd: int, paths: Sequence[bytes], block_bytes: int, flags: int) -> bytes:
    """Twin of ``mpt_batch_lookup``: one status byte per path."""
    return bytes(_lookup_one(root_fd, p, block_bytes) for p in paths)


def resolver() -> str:
    return "walk"


def uring_status() -> str:
    return URING_STATUS


def probe_in_memory(directory: bytes) -> int:
    """Twin of ``mpt_fs_in_memory``: 1 tmpfs / ramfs, 0 another file system, -errno."""
    try:
        return int(fskind.statfs_type(directory) in fskind.MEMORY_MAGICS)
    except OSError as exc:
        return -(exc.errno or errno.EIO)


def crc32c_impl() -> str:
    return CRC32C_IMPLS[0]


def crc32c_lacks(name: str) -> str | None:
    return "" if name in CRC32C_IMPLS else None


def crc32c_with(data, value: int, impl: str | None) -> int:
    """CRC32C of ``data``; ``impl`` must be None or "numpy" (the only one here)."""
    return crc32c(data, value)


# -- probes (probes.c) ---------------------------------------------------------------------

def _probe_path(directory: bytes) -> bytes:
    return b"%s/.mpt_probe.%d.%d.tmp" % (directory, os.getpid(), next(_counter))


def _probe_lock(fd: int) -> None:
    """Twin of ``mpt_probe_lock``: the probe file's flock, best effort."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _probe_open(path: bytes, oflags: int) -> int:
    fd = os.open(path, oflags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    _probe_lock(fd)
    return fd


def probe_o_direct(directory: bytes) -> int:
    """Twin of ``mpt_probe_o_direct``: 1 works, 0 unsupported (EINVAL), -errno unusable."""
    if not O_DIRECT:
        return 0
    path = _probe_path(directory)
    page = mmap.mmap(-1, DIRECT_ALIGN)  # page-aligned, as O_DIRECT wants
    try:
        try:
            fd = _probe_open(path, os.O_WRONLY | O_DIRECT)
        except OSError as e:
            if e.errno == errno.EINVAL:
                with contextlib.suppress(OSError):
                    os.unlink(path)  # the kernel may have created it before refusing
                return 0
            return -e.errno
        try:
            with memoryview(page) as view:
                _write_all(fd, view)
            return 1
        except OSError as e:
            return 0 if e.errno == errno.EINVAL else -e.errno
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
    finally:
        page.close()


def probe_xattr(directory: bytes) -> int:
    """Twin of ``mpt_probe_xattr``: 1 works, 0 refused, -errno unusable."""
    path = _probe_path(directory)
    try:
        fd = _probe_open(path, os.O_WRONLY)
    except OSError as e:
        return -e.errno
    try:
        _set_record(fd, 0xE3069283)
        return 1 if len(os.getxattr(fd, XATTR_NAME)) == 4 else -errno.EIO
    except OSError as e:
        return 0 if e.errno in (_ENOTSUP, errno.EPERM) else -e.errno
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


def probe_o_tmpfile(directory: bytes) -> int:
    """Twin of ``mpt_probe_o_tmpfile``: 1 works, 0 refused, -errno unusable."""
    try:
        dirfd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        return -e.errno
    try:
        try:
            fd = os.open(b".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o644, dir_fd=dirfd)
        except OSError as e:
            return 0 if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL) else -e.errno
        name = b".mpt_probe.%d.%d.tmp" % (os.getpid(), next(_counter))
        _probe_lock(fd)  # locked before it has a name
        try:
            os.write(fd, b"m")
            rc = _link_tmpfile(fd, dirfd, name)
        except OSError as e:
            rc = -e.errno
        finally:
            os.close(fd)
        if rc:
            return 0 if rc in (-errno.EPERM, -errno.ENOENT, -errno.EOPNOTSUPP) else rc
        # Published is not enough: some FUSE file systems (JuiceFS 1.4) name the file,
        # then drop its inode when the O_TMPFILE descriptor closes. Only a name that
        # still reads back after the close proves the way works.
        try:
            check = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
            _probe_lock(check)  # unlocked since the close: leases.PROBE_TEMP_GRACE_S
            try:
                return 1 if os.read(check, 1) == b"m" else 0
            finally:
                os.close(check)
        except OSError:
            return 0
        finally:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dirfd)
    finally:
        os.close(dirfd)

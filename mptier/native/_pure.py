"""The pure-Python twin of ``mptier_io.c``: same steps, same return codes.

Each function mirrors its C namesake and returns what the C call reports:
``(rc, n_done, fail_index)`` with ``rc`` 0 or ``-errno``. Nothing here raises for an
I/O error; ``mptier.native`` turns the codes into exceptions for both backends alike.
Arguments arrive validated: paths are non-empty ``bytes`` without NUL, the buffer is
writable and C-contiguous, every block lies inside it.

``os.write`` and ``os.readv`` hand the memoryview's own address to the kernel, so
O_DIRECT works from here as well when a block's address and size are aligned. Keep
this file and the C file in step: a change of behaviour goes into both.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import mmap
import os
import threading
from collections.abc import Sequence

O_DIRECT = getattr(os, "O_DIRECT", 0)

# Mirrors of MPT_O_DIRECT, MPT_DIRECT_ALIGN, MPT_MKDIR_TRIES, MPT_NAME_TRIES in mptier_io.c.
O_DIRECT_FLAG = 1  # flags bit: use O_DIRECT where a block is aligned
DIRECT_ALIGN = 4096  # O_DIRECT alignment of address, length and offset (512 B or 4 KiB sectors)
MKDIR_TRIES = 3  # rounds of "create the parents, open again" against a concurrent rmdir
NAME_TRIES = 8  # temporary names to try when one is already taken

_log = logging.getLogger("mptier.native")
_counter = itertools.count()  # next() on a count is atomic under the GIL


def _tmp_name(final: bytes) -> bytes:
    return b"%s.%d.%d.%d.tmp" % (final, os.getpid(), threading.get_native_id(), next(_counter))


def _flat(buffer) -> tuple[memoryview, int]:
    """A flat byte view of ``buffer`` and the address of its first byte."""
    with memoryview(buffer) as mv:
        nbytes = mv.nbytes
    arr = (ctypes.c_char * nbytes).from_buffer(buffer)
    return memoryview(arr).cast("B"), ctypes.addressof(arr)


def _direct_ok(flags: int, address: int, length: int) -> bool:
    return bool(O_DIRECT and flags & O_DIRECT_FLAG and (address | length) % DIRECT_ALIGN == 0)


def _unlink_quietly(path: bytes) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _unlink_or_warn(path: bytes, what: str) -> None:
    """Remove ``path``; if that fails (other than "already gone") the file stays behind,
    so say so as a warning, as vLLM's tier does. The C core cannot log: it is getting an
    out-parameter for this, through which ``mptier.native`` will log for both backends."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        _log.warning("mptier: could not remove the %s %s: %s", what, os.fsdecode(path), e)


def _mkdirs(directory: bytes) -> int:
    try:
        os.mkdir(directory, 0o777)
        return 0
    except FileExistsError:
        return 0
    except OSError as e:
        if e.errno != errno.ENOENT:
            return -e.errno
    cut = directory.rfind(b"/")
    while cut > 0 and directory[cut - 1 : cut] == b"/":
        cut -= 1
    if cut <= 0:
        return -errno.ENOENT
    rc = _mkdirs(directory[:cut])
    if rc:
        return rc
    try:
        os.mkdir(directory, 0o777)
    except FileExistsError:
        pass
    except OSError as e:
        return -e.errno
    return 0


def _make_parent(path: bytes) -> int:
    cut = path.rfind(b"/")
    if cut <= 0:
        return -errno.ENOENT  # "x" or "/x": the parent exists, so ENOENT stands
    return _mkdirs(path[:cut])


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


def _store_one(path: bytes, chunk: memoryview, direct: bool) -> int:
    if os.access(path, os.F_OK):
        return 0  # names are content hashes: an existing file holds this block
    oflags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (O_DIRECT if direct else 0)
    mkdir_tries = name_tries = 0
    while True:
        tmp = _tmp_name(path)
        try:
            fd = os.open(tmp, oflags, 0o644)
            break
        except OSError as e:
            err = e.errno
        if err == errno.EINVAL and direct:
            _unlink_quietly(tmp)  # the kernel may create the file before refusing O_DIRECT
            return -errno.EINVAL
        if err == errno.ENOENT and mkdir_tries < MKDIR_TRIES:
            mkdir_tries += 1
            rc = _make_parent(path)
            if rc:
                return rc
            continue
        if err == errno.EEXIST and name_tries < NAME_TRIES:
            name_tries += 1
            continue
        return -err
    published = False
    try:
        rc = 0
        try:
            _write_all(fd, chunk)
        except OSError as e:
            rc = -e.errno
        try:
            os.close(fd)
        except OSError as e:
            rc = rc or -e.errno
        if rc == 0:
            try:
                os.rename(tmp, path)
                published = True
            except OSError as e:
                rc = 0 if e.errno == errno.EEXIST else -e.errno  # EEXIST: already published
        return rc
    finally:
        if not published:
            _unlink_or_warn(tmp, "temporary file of a failed store")


def _remove_if_same(fd: int, path: bytes) -> None:
    try:
        held, named = os.fstat(fd), os.stat(path)
    except OSError:
        return
    if (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
        _unlink_or_warn(path, "short (corrupt) block file")


def _load_one(path: bytes, chunk: memoryview, direct: bool) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
    except OSError as e:
        return -e.errno
    try:
        if _read_full(fd, chunk) < len(chunk):
            _remove_if_same(fd, path)
            return -errno.ENODATA  # a short file is corrupt
        return 0
    except OSError as e:
        return -e.errno
    finally:
        os.close(fd)


def _batch(one, paths: Sequence[bytes], buffer, offsets: Sequence[int], block_bytes: int,
           flags: int) -> tuple[int, int, int]:
    n = len(paths)
    if n == 0:
        return 0, 0, 0
    view, base = _flat(buffer)
    with view:
        for i in range(n):
            off = offsets[i]
            direct = _direct_ok(flags, base + off, block_bytes)
            with view[off : off + block_bytes] as chunk:
                rc = one(paths[i], chunk, direct)
                if rc == -errno.EINVAL and direct:
                    rc = one(paths[i], chunk, False)  # never fail a block over O_DIRECT
            if rc:
                return rc, i, i
    return 0, n, n


def batch_store(paths: Sequence[bytes], buffer, offsets: Sequence[int], block_bytes: int,
                flags: int) -> tuple[int, int, int]:
    """Twin of ``mpt_batch_store``: ``(rc, n_done, fail_index)``."""
    return _batch(_store_one, paths, buffer, offsets, block_bytes, flags)


def batch_load(paths: Sequence[bytes], buffer, offsets: Sequence[int], block_bytes: int,
               flags: int) -> tuple[int, int, int]:
    """Twin of ``mpt_batch_load``: ``(rc, n_done, fail_index)``."""
    return _batch(_load_one, paths, buffer, offsets, block_bytes, flags)


def batch_exists(paths: Sequence[bytes]) -> list[bool]:
    """Twin of ``mpt_batch_exists``."""
    return [os.access(p, os.F_OK) for p in paths]


def probe_o_direct(directory: bytes) -> int:
    """Twin of ``mpt_probe_o_direct``: 1 works, 0 unsupported (EINVAL), -errno unusable."""
    if not O_DIRECT:
        return 0
    path = b"%s/.mpt_odirect_probe.%d.%d.%d.tmp" % (
        directory, os.getpid(), threading.get_native_id(), next(_counter))
    page = mmap.mmap(-1, DIRECT_ALIGN)  # page-aligned, as O_DIRECT wants
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o644)
        except OSError as e:
            if e.errno == errno.EINVAL:
                _unlink_quietly(path)  # the kernel may have created it before refusing
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
            _unlink_quietly(path)
    finally:
        page.close()

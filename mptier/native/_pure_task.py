"""The pure-Python twin of ``mpt_take_record``, ``mpt_task_items``, ``mpt_task_load`` and
``mpt_same_folder`` (queue.c, encode.c, mptier_io.c, probes.c): a worker's take of a
task record from its queues, a record's keys as the file layout's paths and its block
ids as buffer offsets, the load of a whole task from its record, and the check that a
root is still the folder it opened.

The record's layout is :mod:`mptier.jobs`' (its docstring); the path of a key is
:meth:`mptier.layout.FileMapper.relative_path_for`'s. Both are repeated here rather than
imported (``mptier.jobs`` imports this package), and tests/test_native_tasks.py holds the
three -- C, this twin and the code they stand in for -- to the same answers.
"""

from __future__ import annotations

import array
import errno
import fcntl
import os
import stat
import struct
import termios
from collections.abc import Callable

from mptier.keys import GROUP_IDX_BYTES

WIRE_VERSION = 3  # MPT_WIRE_VERSION
TASK_RECORD_BYTES = 4096  # MPT_TASK_RECORD_BYTES
_HEADER = struct.Struct("<3sBBBHIQ")
TASK_HEADER_BYTES = _HEADER.size  # MPT_TASK_HEADER_BYTES
KIND_LOOKUP = 3  # MPT_KIND_LOOKUP: lookup records carry no block ids
_KINDS = (1, 2, 3)  # store, load, lookup
# MPT_TASK_MAX_ITEMS: most items of a store or load record (a block id and a length each)
TASK_MAX_ITEMS = (TASK_RECORD_BYTES - TASK_HEADER_BYTES) // 10
_OUTSIDE = (1 << 64) - 1  # an offset that overflows: outside any buffer, as in C


def key_path(key: bytes) -> bytes:
    """The layout's path of ``key`` (FileMapper.relative_path_for, encoded)."""
    hex_hash = key[:-GROUP_IDX_BYTES].hex()
    group = int.from_bytes(key[-GROUP_IDX_BYTES:], "big")
    return f"{hex_hash[:3]}/{hex_hash[3:5]}_g{group}/{hex_hash}.bin".encode()


def task_items(record, block_bytes: int) -> tuple[int, list[bytes], list[int]]:
    """Twin of ``mpt_task_items``: ``(n, paths, offsets)`` of ``record``; ``n`` is the
    number of items, or ``-EINVAL`` (and empty lists) for a record that does not decode.
    A lookup record has no offsets."""
    if len(record) < TASK_HEADER_BYTES:
        return -errno.EINVAL, [], []
    magic, version, kind, _, _, n, _ = _HEADER.unpack_from(record, 0)
    if magic != b"MPT" or version != WIRE_VERSION or kind not in _KINDS:
        return -errno.EINVAL, [], []
    size = min(len(record), TASK_RECORD_BYTES)
    id_bytes = 0 if kind == KIND_LOOKUP else 8
    if n > (size - TASK_HEADER_BYTES) // (id_bytes + 2):
        return -errno.EINVAL, [], []
    pos = TASK_HEADER_BYTES
    ids = array.array("Q", bytes(record[pos:pos + id_bytes * n]))  # (the machine's
    pos += id_bytes * n  # order, as the encoders write them and decode_task reads them)
    lengths = array.array("H", bytes(record[pos:pos + 2 * n]))
    pos += 2 * n
    if sum(lengths) > size - pos:
        return -errno.EINVAL, [], []
    paths = []
    for length in lengths:
        paths.append(key_path(bytes(record[pos:pos + length])))
        pos += length
    offsets = [i * block_bytes if i * block_bytes < _OUTSIDE else _OUTSIDE for i in ids]
    return n, paths, offsets


def load_task(load, load_via, root_fd: int, record, buffer, block_bytes: int, flags: int,
              bounce) -> tuple[int, int, int]:
    """Twin of ``mpt_task_load`` over the backend's ``load`` and ``load_via``."""
    n, paths, offsets = task_items(record, block_bytes)
    if n < 0 or record[4] == KIND_LOOKUP:
        return -errno.EINVAL, 0, 0
    if bounce is not None:
        return load_via(root_fd, paths, buffer, offsets, block_bytes, flags, bounce)
    return load(root_fd, paths, buffer, offsets, block_bytes, flags)


def record_taker(fds: tuple[int, ...], record) -> Callable[[], tuple[int, bool]]:
    """Twin of ``mpt_take_record``: a function that reads one whole record into
    ``record`` from the first of ``fds`` (non-blocking queues) that has one and says
    ``(index of that queue, whether a queue still holds a record)``; ``(-1, False)``
    when none had one. A short read (never, with whole-record writes) zeroes the
    record's header and goes on: a half record is never run. Raises ``OSError`` for a
    read or ioctl that fails otherwise."""
    size = len(record)
    waiting = array.array("i", [0])
    buffers = [record]

    def take() -> tuple[int, bool]:
        for index, fd in enumerate(fds):
            try:
                n = os.readv(fd, buffers)
            except BlockingIOError:
                continue
            if n != size:
                record[:TASK_HEADER_BYTES] = bytes(TASK_HEADER_BYTES)
                continue
            for queue in fds:
                fcntl.ioctl(queue, termios.FIONREAD, waiting)
                if waiting[0] >= size:
                    return index, True
            return index, False
        return -1, False

    return take


def same_folder(path: bytes, dev: int, ino: int) -> int:
    """Twin of ``mpt_same_folder``: 1 when ``path`` is a folder of device ``dev`` and
    inode ``ino`` now, 0 when not, -errno when its stat fails."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return -(exc.errno or errno.EIO)
    return int(stat.S_ISDIR(st.st_mode) and st.st_dev == dev and st.st_ino == ino)

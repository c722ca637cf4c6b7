"""Pipes of whole records, as both sides use them: :class:`RecordWriter` (the write end
for one process, never blocking, with an overflow list) and :func:`drain_records`.

The engine's task queues and completion pipe (:mod:`mptier.channels`) are built of these;
the workers and their supervisor write their reports through a :class:`RecordWriter`
of their own and drain queues with :func:`drain_records`. Below both: this module knows
nothing of engines, sessions or pools.
"""

from __future__ import annotations

import array
import collections
import contextlib
import fcntl
import os
import select
import termios
import threading

from mptier.jobs import TASK_RECORD_BYTES

F_SETPIPE_SZ = 1031
F_GETPIPE_SZ = 1032
# Largest pipe an unprivileged process may ask for (/proc/sys/fs/pipe-max-size default).
# 1 MiB holds 256 task records: seconds of work even for small blocks, so the overflow
# list is rarely touched, while keeping kernel memory per tier small.
PIPE_BYTES = 1 << 20
# The lifeline and doorbell carry no data worth queueing: the smallest pipe will do.
LIFELINE_BYTES = 4096


def make_pipe(size: int = PIPE_BYTES) -> tuple[int, int]:
    """A close-on-exec pipe, enlarged to ``size`` bytes where the system allows."""
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        fcntl.fcntl(write_fd, F_SETPIPE_SZ, size)
    return read_fd, write_fd


def set_nonblocking(fd: int) -> None:
    os.set_blocking(fd, False)


class RecordWriter:
    """The write end of a pipe, for one process: whole records in, never blocks.

    A record is one atomic ``write`` (at most ``PIPE_BUF`` bytes: a task record, or a
    completion message). One that does not fit waits in an in-process overflow list,
    pushed on by :meth:`flush`. The descriptor is made non-blocking (a flag of the open
    pipe, so every process holding it writes this way). Several threads may write (a
    lock keeps the pipe and the list in order). ``sent`` counts records that went into
    the pipe, for writers that tell the engine so (the control block's counters).
    """

    def __init__(self, write_fd: int) -> None:
        self.write_fd = write_fd
        self.overflow: collections.deque[bytes] = collections.deque()
        self.sent = 0
        self._lock = threading.Lock()
        set_nonblocking(write_fd)

    def put(self, record: bytes) -> None:
        """Enqueue one record; never blocks. Raises ``BrokenPipeError`` when nobody
        reads the pipe any more."""
        if len(record) > select.PIPE_BUF:
            raise ValueError(f"a record of {len(record)} bytes is not written atomically "
                             f"(PIPE_BUF is {select.PIPE_BUF})")
        with self._lock:
            if self.overflow or not self._write(record):
                self.overflow.append(record)

    def put_records(self, blob: bytes | bytearray) -> None:
        """Enqueue consecutive records (a job's tasks); never blocks.

        They go into the pipe in one ``write``: one system call for the engine and one
        wake-up. Records are exactly one page and pipe buffers are pages, so a pipe with
        too little room takes a whole number of records and the rest waits in the
        overflow list. (A non-blocking write copies what fits under the pipe's lock, so
        another writer's records cannot land inside it.)
        """
        with self._lock:
            if self.overflow or (not _RECORD_IS_PAGE and len(blob) > self._room()):
                self.overflow.extend(_split(blob))  # partial writes could split a record
                return
            try:
                written = os.write(self.write_fd, blob)
            except BlockingIOError:
                written = 0
            if written % TASK_RECORD_BYTES:  # never seen; finish the torn record anyway
                written += _write_fully(self.write_fd, memoryview(blob)[
                    written:written + TASK_RECORD_BYTES - written % TASK_RECORD_BYTES])
            self.sent += written // TASK_RECORD_BYTES
            if written < len(blob):
                self.overflow.extend(_split(memoryview(blob)[written:]))

    def flush(self) -> int:
        """Move overflow into the pipe while it has room. Returns records still waiting.
        Raises ``BrokenPipeError`` when nobody reads the pipe any more."""
        if not self.overflow:
            return 0
        with self._lock:
            while self.overflow and self._write(self.overflow[0]):
                self.overflow.popleft()
            return len(self.overflow)

    def take_all(self) -> list[bytes]:
        """Remove and return the records waiting in the overflow list."""
        with self._lock:
            out = list(self.overflow)
            self.overflow.clear()
        return out

    def _write(self, record: bytes) -> bool:
        try:
            os.write(self.write_fd, record)
        except BlockingIOError:
            return False
        self.sent += 1
        return True

    def _room(self) -> int:
        """Free bytes in the pipe (FIONREAD works on either end of a pipe)."""
        queued = array.array("i", [0])
        fcntl.ioctl(self.write_fd, termios.FIONREAD, queued)
        return fcntl.fcntl(self.write_fd, F_GETPIPE_SZ) - queued[0]


# Pipe buffers are pages: when a record is exactly a page, a short write of a run of
# records always ends on a record boundary.
_RECORD_IS_PAGE = os.sysconf("SC_PAGE_SIZE") == TASK_RECORD_BYTES


def drain_records(read_fd: int) -> list[bytes]:
    """Take every whole record waiting in a non-blocking queue pipe."""
    out = []
    while True:
        try:
            record = os.read(read_fd, TASK_RECORD_BYTES)
        except (BlockingIOError, OSError):
            break
        if len(record) != TASK_RECORD_BYTES:
            break
        out.append(record)
    return out


def _write_fully(fd: int, data: memoryview) -> int:
    done = 0
    while done < len(data):
        select.select([], [fd], [], 1.0)
        try:
            done += os.write(fd, data[done:])
        except BlockingIOError:
            continue
    return done


def _split(blob: bytes | bytearray | memoryview) -> list[bytes]:
    view = memoryview(blob)
    return [bytes(view[pos:pos + TASK_RECORD_BYTES])
            for pos in range(0, len(view), TASK_RECORD_BYTES)]

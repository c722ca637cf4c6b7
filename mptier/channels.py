"""The pipes between the engine and its workers.

* :class:`TaskQueue` -- one per priority (load, store). The engine writes fixed-size task
  records into a pipe; idle workers read them. A write of at most ``PIPE_BUF`` bytes is
  atomic and a read of exactly one record returns exactly one record, so many workers can
  share a queue with no lock and a worker killed mid-read cannot tear one. When the pipe
  is full, records wait in an in-process overflow list that every engine call (and the
  supervisor's tick) pushes on: submission never blocks and never drops a job, whatever
  the depth.
* :class:`CompletionReader` -- the single pipe workers report on; the engine drains it
  without blocking. Messages are length-prefixed and written atomically.
* the *lifeline* -- a pipe whose write end only the engine holds. Workers poll its read
  end: when the engine exits (however it dies) or shuts down, they see end-of-file and
  leave.

All of them are plain descriptors, so a standalone worker service can be handed named
FIFOs instead of inherited pipes.
"""

from __future__ import annotations

import array
import collections
import contextlib
import fcntl
import mmap
import os
import select
import termios
import threading

from mptier.jobs import TASK_RECORD_BYTES, Message, decode_messages

F_SETPIPE_SZ = 1031
F_GETPIPE_SZ = 1032
# Largest pipe an unprivileged process may ask for (/proc/sys/fs/pipe-max-size default).
# 1 MiB holds 256 task records: seconds of work even for small blocks, so the overflow
# list is rarely touched, while keeping kernel memory per tier small.
PIPE_BYTES = 1 << 20


def make_pipe(size: int = PIPE_BYTES) -> tuple[int, int]:
    """A close-on-exec pipe, enlarged to ``size`` bytes where the system allows."""
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        fcntl.fcntl(write_fd, F_SETPIPE_SZ, size)
    return read_fd, write_fd


def set_nonblocking(fd: int) -> None:
    os.set_blocking(fd, False)


class TaskQueue:
    """A priority queue of task records (see module docstring).

    ``put`` may be called from the engine thread and the supervisor thread; a lock
    keeps the pipe and the overflow list in order. Workers only ever read.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.read_fd, self.write_fd = make_pipe()
        set_nonblocking(self.read_fd)  # shared by every worker: reads never block
        set_nonblocking(self.write_fd)  # only the engine writes: submits never block
        self.overflow: collections.deque[bytes] = collections.deque()
        self._lock = threading.Lock()
        self.pipe_bytes = fcntl.fcntl(self.write_fd, F_GETPIPE_SZ)
        self._fionread = array.array("i", [0])

    def put(self, record: bytes) -> None:
        """Enqueue one record; never blocks."""
        with self._lock:
            if self.overflow or not self._write(record):
                self.overflow.append(record)

    def put_records(self, blob: bytes | bytearray) -> None:
        """Enqueue consecutive records (a job's tasks); never blocks.

        They go into the pipe in one ``write``: one system call for the engine and one
        wake-up. Records are exactly one page and pipe buffers are pages, so a pipe with
        too little room takes a whole number of records and the rest waits in the
        overflow list. (A write larger than ``PIPE_BUF`` is not atomic against other
        writers, but every writer holds the lock.)
        """
        with self._lock:
            if self.overflow:
                self.overflow.extend(_split(blob))
                return
            if not _RECORD_IS_PAGE and len(blob) > self.pipe_bytes - self._queued_bytes():
                self.overflow.extend(_split(blob))  # partial writes could split a record
                return
            try:
                written = os.write(self.write_fd, blob)
            except BlockingIOError:
                written = 0
            if written % TASK_RECORD_BYTES:  # never seen; finish the torn record anyway
                written += _write_fully(self.write_fd, memoryview(blob)[
                    written:written + TASK_RECORD_BYTES - written % TASK_RECORD_BYTES])
            if written < len(blob):
                self.overflow.extend(_split(memoryview(blob)[written:]))

    def flush(self) -> int:
        """Move overflow into the pipe while it has room. Returns records still waiting."""
        if not self.overflow:
            return 0
        with self._lock:
            while self.overflow and self._write(self.overflow[0]):
                self.overflow.popleft()
            return len(self.overflow)

    def _write(self, record: bytes) -> bool:
        try:
            os.write(self.write_fd, record)
        except BlockingIOError:
            return False
        return True

    def take_all(self) -> list[bytes]:
        """Remove every queued record (pipe and overflow); used when shutting down."""
        out = []
        with self._lock:
            while True:
                try:
                    record = os.read(self.read_fd, TASK_RECORD_BYTES)
                except BlockingIOError:
                    break
                if len(record) != TASK_RECORD_BYTES:
                    break
                out.append(record)
            out.extend(self.overflow)
            self.overflow.clear()
        return out

    @property
    def overflow_depth(self) -> int:
        return len(self.overflow)

    def _queued_bytes(self) -> int:
        fcntl.ioctl(self.read_fd, termios.FIONREAD, self._fionread)
        return self._fionread[0]

    def pipe_depth(self) -> int:
        """Records waiting in the pipe."""
        return self._queued_bytes() // TASK_RECORD_BYTES

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.read_fd = self.write_fd = -1


# Pipe buffers are pages: when a record is exactly a page, a short write of a run of
# records always ends on a record boundary.
_RECORD_IS_PAGE = mmap.PAGESIZE == TASK_RECORD_BYTES


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


class CompletionReader:
    """The engine's end of the completion pipe."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = make_pipe()
        set_nonblocking(self.read_fd)
        self._pending = bytearray()

    def read_available(self) -> list[Message]:
        """Every whole message that has arrived; never blocks."""
        try:
            chunk = os.read(self.read_fd, PIPE_BYTES)
        except BlockingIOError:
            return []
        self._pending += chunk
        while len(chunk) == PIPE_BYTES:  # there may be more
            try:
                chunk = os.read(self.read_fd, PIPE_BYTES)
            except BlockingIOError:
                break
            self._pending += chunk
        return decode_messages(self._pending)

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.read_fd = self.write_fd = -1

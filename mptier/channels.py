"""The pipes between the engine and its workers.

* :class:`TaskQueue` -- one per kind of task (lookup, load, store). The engine writes
  fixed-size task records into a pipe (:class:`RecordWriter`); idle workers read them.
  A write of at most ``PIPE_BUF`` bytes is atomic and a read of exactly one record
  returns exactly one record, so many workers can share a queue with no lock and a
  worker killed mid-read cannot tear one. When the pipe is full, records wait in an
  in-process overflow list that every engine call pushes on: submission never blocks
  and never drops a job, whatever the depth. Only the engine writes: a task whose
  worker died comes back as a RETRY message and the engine queues it again.
* :class:`CompletionReader` -- the single pipe workers report on; the engine drains it
  without blocking. Messages are length-prefixed and written atomically. Its writers
  (every worker, the supervisor) write through a :class:`RecordWriter` of their own, as
  the engine does its tasks: when the engine does not read for a while and the pipe
  fills, messages wait in the writer's list and go in when it drains -- a worker or
  the supervisor never blocks on the engine, and no report is dropped.
* the *lifeline* -- a pipe whose write end only the engine holds. Workers and the
  supervisor poll its read end: when the engine exits (however it dies) or shuts down,
  they see end-of-file and the session is over.

All of them are plain descriptors, handed to the workers' pool as a
:class:`~mptier.workers.Session` (over a Unix socket when the pool is a separate service).
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

from mptier.jobs import TASK_RECORD_BYTES, Message, TaskKind, decode_messages

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


class TaskQueue:
    """A priority queue of task records, as the engine holds it (see module docstring).

    ``put_records`` may be called from the engine's thread and a helper thread; workers
    only ever read.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.read_fd, write_fd = make_pipe()
        set_nonblocking(self.read_fd)  # shared by every worker: reads never block
        set_nonblocking(write_fd)  # submits never block
        self.writer = RecordWriter(write_fd)
        self.write_fd = write_fd
        self.pipe_bytes = fcntl.fcntl(write_fd, F_GETPIPE_SZ)
        self._fionread = array.array("i", [0])

    def put_records(self, blob: bytes | bytearray) -> None:
        self.writer.put_records(blob)

    def flush(self) -> int:
        return self.writer.flush()

    @property
    def overflow(self) -> collections.deque[bytes]:
        return self.writer.overflow

    def take_all(self) -> list[bytes]:
        """Remove every queued record (pipe and overflow); used when failing them."""
        return drain_records(self.read_fd) + self.writer.take_all()

    @property
    def overflow_depth(self) -> int:
        return len(self.writer.overflow)

    def pipe_depth(self) -> int:
        """Records waiting in the pipe."""
        fcntl.ioctl(self.read_fd, termios.FIONREAD, self._fionread)
        return self._fionread[0] // TASK_RECORD_BYTES

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.read_fd = self.write_fd = -1


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
        set_nonblocking(self.write_fd)  # its writers never block (see RecordWriter)
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


class EngineChannels:
    """Every pipe an engine owns: a queue per kind of task, the completion pipe, the
    lifeline (only the engine holds its write end) and the workers' doorbell."""

    def __init__(self) -> None:
        self.queues: dict[TaskKind, TaskQueue] = {}
        self.completions: CompletionReader | None = None
        self.lifeline_r = self.lifeline_w = -1
        self.doorbell = (-1, -1)
        try:
            for kind in TaskKind:
                self.queues[kind] = TaskQueue(kind.name.lower())
            self.completions = CompletionReader()
            self.lifeline_r, self.lifeline_w = make_pipe(LIFELINE_BYTES)
            self.doorbell = make_pipe(LIFELINE_BYTES)
            for fd in self.doorbell:
                set_nonblocking(fd)
        except BaseException:
            self.close()
            raise

    def session(self, *, segments: list, nbytes: int, block_bytes: int,
                layout: dict, label: str):
        """The :class:`~mptier.workers.Session` that hands these channels to a pool
        (descriptors are borrowed: the pool duplicates what it keeps)."""
        from mptier.workers import Session

        assert self.completions is not None
        return Session(queues={k: q.read_fd for k, q in self.queues.items()},
                       completion=self.completions.write_fd, lifeline=self.lifeline_r,
                       doorbell=self.doorbell, segments=segments, nbytes=nbytes,
                       block_bytes=block_bytes, layout=layout, engine_pid=os.getpid(),
                       label=label)

    def close_lifeline(self) -> None:
        """End the session: workers finish their copy, detach, and wait for the next."""
        if self.lifeline_w >= 0:
            os.close(self.lifeline_w)
            self.lifeline_w = -1

    def close(self) -> None:
        """Close everything. Idempotent."""
        self.close_lifeline()
        for queue in self.queues.values():
            queue.close()
        if self.completions is not None:
            self.completions.close()
        for fd in (self.lifeline_r, *self.doorbell):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.lifeline_r = -1
        self.doorbell = (-1, -1)

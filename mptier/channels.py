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
import termios

from mptier.jobs import TASK_RECORD_BYTES, Message, TaskKind, decode_messages
from mptier.pipes import (  # noqa: F401 -- F_SETPIPE_SZ: named here for the tests
    F_GETPIPE_SZ,
    F_SETPIPE_SZ,
    LIFELINE_BYTES,
    PIPE_BYTES,
    RecordWriter,
    drain_records,
    make_pipe,
    set_nonblocking,
)


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

"""What one worker holds while it serves a session: its roots, each opened and leased at
first use (:class:`RootHandle`), and everything the serving loop
(:mod:`~mptier.workers.serving`) and the I/O on roots (:mod:`~mptier.workers.rootio`)
need (:class:`WorkerContext`, built by :meth:`WorkerContext.open` only).
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from mptier import native
from mptier.layout import FileMapper
from mptier.pipes import RecordWriter
from mptier.storage.leases import Lease
from mptier.storage.roots import RootRouter
from mptier.workers.bounce import Bounce
from mptier.workers.control import SlotWriter
from mptier.workers.session import QUEUE_ORDER, IoSettings, WorkerSession

log = logging.getLogger("mptier.workers")


@dataclass
class RootHandle:
    """One root as a worker uses it: opened, and leased, at first use inside a task (a
    root that hangs then hangs a task, which the supervisor's io_timeout_s covers, not
    an attach, which nothing would)."""

    index: int
    path: str
    mapper: FileMapper
    flags: int  # the native layer's flags for this root (O_DIRECT, CHECKSUM, ...)
    fd: int = -1  # the blocks folder: every path resolves beneath it, no symlinks
    # (st_dev, st_ino) of the root folder when ``fd`` was opened: a task whose root path
    # leads elsewhere now (a mount over it, a folder swapped in) follows the path.
    identity: tuple[int, int] | None = None
    lease: Lease | None = None
    bounce: bool = False  # loads go through the worker's bounce buffer (bounce.py)
    bounce_stores: bool = False  # ... and stores (TierConfig.bounce_stores)

    def __post_init__(self) -> None:
        self.encoded_path = os.fsencode(self.path)  # for the native stat of each run

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    def release(self) -> None:
        """Close the folder and give up the lease (after this worker's last store)."""
        self.close()
        if self.lease is not None:
            try:
                self.lease.release()
            except OSError as exc:  # the sweeper removes it once the lock is free
                log.warning("mptier: could not remove lease %s: %s", self.lease.path, exc)
            self.lease = None


@dataclass
class WorkerContext:
    """Everything one worker needs to serve one session. Built by :meth:`open` only."""

    role: str
    slot_writer: SlotWriter
    queues: tuple[int, ...]  # read ends, in this role's QUEUE_ORDER
    completion_fd: int
    lifeline_fd: int
    doorbell_fd: int
    doorbell_write_fd: int
    memory: memoryview
    block_bytes: int
    roots: list[RootHandle]
    router: RootRouter
    backend: Any
    io: IoSettings
    session: WorkerSession
    tag: bytes  # names this writer's temporary files: its lease's tag on every root
    mapped: Any = None  # the MappedBuffer when this worker mapped the buffer itself
    owns_descriptors: bool = True  # False for threads: the fds are the engine's
    bounce: Bounce | None = None  # loads that may outlive a kill go through it (bounce.py)
    # Where root health results go: (root, ok, errno, text) -> None. Process workers
    # send them to the supervisor; thread workers apply them to the pool's RootHealth.
    report_root: Callable[[int, bool, int, str], None] = lambda *a: None
    # Before probing a root that is out of rotation: (root) -> None.
    report_probe: Callable[[int], None] = lambda r: None
    caretaker: Any = None  # a Caretaker once the supervisor designates roots
    reports: RecordWriter | None = None  # this worker's messages to the completion pipe

    def report(self, message: bytes | None = None) -> None:
        """Put ``message`` (if any) behind the reports still waiting and write what fits
        into the completion pipe; never blocks. Each one written is counted in the
        slot's message counter. Raises ``BrokenPipeError`` when the engine is gone."""
        reports = self.reports
        assert reports is not None
        before = reports.sent
        try:
            if message is not None:
                reports.put(message)
            reports.flush()
        finally:
            self.slot_writer.message_sent(reports.sent - before)

    @property
    def mapper(self) -> FileMapper:
        """The first root's file layout."""
        return self.roots[0].mapper

    @classmethod
    def open(cls, *, role: str, slot_writer: SlotWriter, session: WorkerSession,
             io: IoSettings, backend: Any, memory: memoryview | None = None
             ) -> WorkerContext:
        """Map the session's buffer (unless ``memory`` is given: thread workers use the
        engine's own) and get ready to serve it. Touches no root (they are opened at
        first use). Raises on failure, having released what it took; the session's
        descriptors stay the caller's to close."""
        from mptier.mapping import MappedBuffer
        from mptier.workers.caretaker import Caretaker

        mapped = None
        if memory is None:
            mapped = MappedBuffer(session.segments, session.nbytes)
            for seg in session.segments:  # mapped: the descriptors are no longer needed
                os.close(seg.fd)
            session.segments = [replace(s, fd=-1) for s in session.segments]
            if io.prefault:
                mapped.prefault()
            memory = mapped.memory
        # A process worker can be killed while stuck in a read; the read must not land
        # in a slot the engine reused since (see mptier.workers.bounce). Thread workers
        # die with the engine: no bounce, for loads or stores.
        roots = [RootHandle(i, r.path, FileMapper(r.path, **session.layout), io.flags(i),
                            bounce=mapped is not None and r.bounce,
                            bounce_stores=mapped is not None and r.bounce_stores)
                 for i, r in enumerate(io.roots)]
        ctx = cls(role=role, slot_writer=slot_writer,
                  queues=tuple(session.queues[k] for k in QUEUE_ORDER[role]),
                  completion_fd=session.completion, lifeline_fd=session.lifeline,
                  doorbell_fd=session.doorbell[0], doorbell_write_fd=session.doorbell[1],
                  memory=memory, block_bytes=session.block_bytes, roots=roots,
                  router=RootRouter(io.root_dirs), backend=backend, io=io,
                  session=session, tag=native.new_tag().encode(), mapped=mapped,
                  owns_descriptors=mapped is not None,
                  bounce=Bounce(session.block_bytes)
                  if any(r.bounce or r.bounce_stores for r in roots) else None)
        if ctx.bounce is not None:
            ctx.bounce.map()  # now, like the pre-fault: not in the first load's time
        ctx.caretaker = Caretaker(ctx)
        ctx.reports = RecordWriter(session.completion)
        return ctx

    def close(self) -> None:
        """Give up the leases, unmap the buffer and close the session's descriptors
        (process workers)."""
        if self.caretaker is not None:
            self.caretaker.close()
        for root in self.roots:
            root.release()
        if self.bounce is not None:
            self.bounce.close()
            self.bounce = None
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None
        if self.owns_descriptors:
            self.session.close()


def describe(exc: BaseException) -> str:
    """An exception as one line, for a message to the supervisor or the log."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()

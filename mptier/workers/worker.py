"""The worker: takes task records, runs one native batch call each, reports, repeats.

A worker is a process (or, for a buffer that cannot be shared, a thread of the engine)
that owns one slot of the control block. Its life::

    boot ─▶ ready ─▶ ( attach ─▶ serve ─▶ detach )* ─▶ leave
            │         └ an engine's session: queues, completion pipe, lifeline, buffer
            └ over its control socket (mptier.workers.protocol)

While serving it blocks only in ``epoll`` on its queues and the doorbell (exclusive
wake-ups), the lifeline and the control socket, and in file I/O::

    lookup queue ─┐
    own queue    ─┤
    other queue  ─┼─ epoll ─▶ read one record into the slot ─▶ batch I/O ─▶ message ─▶ pipe
    doorbell     ─┤           (lookups, own queue, other)       (no GIL)
    lifeline, control socket ─▶ end of session, heartbeat, detach/exit requests

Lookups are tiny and gate the engine's scheduling, so every worker takes them first;
then its own priority's queue; then the other one (see ``session.QUEUE_ORDER``).

Reports never block either. The completion pipe is non-blocking; when it is full (the
engine has not read for a while) a report waits in the worker's own list (the
:class:`~mptier.pipes.RecordWriter` the engine uses for its tasks) while the worker
waits for room in ``poll``, answering heartbeats. It keeps the task in its slot until
the report is in the pipe -- a death meanwhile is handled like one after the I/O -- and
marks the slot REPORTING, so the supervisor never takes the wait for a hung file system.

The I/O never blocks the engine: if it hangs, the supervisor kills this process and
handles the task its slot holds.

Run as a process by :mod:`mptier.workers.launcher`, which makes sure it is the
engine's own mptier that runs (:func:`main`).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import select
import signal
import socket
import stat
import termios
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from mptier import native
from mptier.jobs import (
    TASK_HEADER_BYTES,
    TASK_RECORD_BYTES,
    MessageType,
    TaskKind,
    decode_task,
    encode_message,
    peek_task,
)
from mptier.layout import FileMapper
from mptier.pipes import RecordWriter
from mptier.storage.leases import Lease
from mptier.storage.roots import RootRouter, root_identity
from mptier.workers import protocol
from mptier.workers.bounce import Bounce
from mptier.workers.control import ControlBlock, RootState, SlotState, SlotWriter
from mptier.workers.health import is_fault, out_of_rotation_text, read_only_text
from mptier.workers.session import QUEUE_ORDER, IoSettings, WorkerSession

# Idle wake-up: a backstop for the lifeline's end-of-file event; nothing depends on it.
IDLE_POLL_S = 1.0
# A store waiting for its root's caretaker to make room looks again this often.
ROOM_POLL_S = 0.005
# How long a report still waiting for room in the completion pipe is kept trying once
# the engine closed its lifeline: an engine shutting down reads its pipe while its
# workers detach (for up to mptier.workers.pool.DETACH_GRACE_S), one that is gone never
# will. After this the report is dropped and the engine fails the task itself.
REPORT_AFTER_LIFELINE_S = 5.0
_EPOLLEXCLUSIVE = getattr(select, "EPOLLEXCLUSIVE", 0)
log = logging.getLogger("mptier.workers")
_PR_SET_PDEATHSIG = 1
# What the kernel sends a worker when the thread that started it (the supervisor, in the
# engine or in ``mptier serve``) ends -- its process SIGKILLed included (vLLM's offline
# teardown SIGKILLs its EngineCore). Not SIGKILL: the worker finishes the task it holds
# (the buffer stays mapped here, so a store's bytes are still there), takes no more, and
# leaves in order (see :func:`_watch_supervisor`). SIGUSR1: no terminal or shell sends it
# to a process group, so only the kernel (or an operator) means it.
ORPHAN_SIGNAL = signal.SIGUSR1
# How long a worker whose supervisor is gone may take to finish its task and leave, from
# the moment the kernel tells it (io_timeout_s instead when shorter: the longest a task
# may run before the tier calls the file system hung). One task is at most task_bytes
# (8 MiB by default: under a second even at 10 MB/s), and leaving is closing files and
# removing a lease per root, so 10 s leaves room for a loaded machine and a slow network
# file system, while every worker of a dead engine is gone before a service manager's
# stop timeout would escalate (docker stop: 10 s; Kubernetes: 30 s; systemd: 90 s). A
# worker still there then is ended by SIGALRM (its default action; the kernel's timer,
# whatever the worker is doing): what its unfinished store left (a temporary file, its
# lease) is swept by the next tier on the root, as after any kill.
ORPHAN_EXIT_S = 10.0
# Fault injection for tests: MPTIER_FAULT_STALL="store:0.5,load:2" makes the worker sleep
# that long at the start of each task of that kind, as a slow or hung file system would.
STALL_ENV = "MPTIER_FAULT_STALL"

# Why serve() returned.
ENDED_LIFELINE = "the engine closed its lifeline"
ENDED_ENGINE_GONE = "the engine's completion pipe is closed"
ENDED_DETACH = "the supervisor ended the session"
ENDED_EXIT = "the supervisor asked the worker to leave"
ENDED_SUPERVISOR_GONE = "the supervisor is gone"
_LEAVE = (ENDED_EXIT, ENDED_SUPERVISOR_GONE)


def _parse_stalls(spec: str) -> dict[TaskKind, float]:
    stalls = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, seconds = part.partition(":")
        stalls[TaskKind[kind.upper()]] = float(seconds)
    return stalls


# Set by the watcher thread once the supervisor is gone (ORPHAN_SIGNAL).
_ORPHANED = threading.Event()
# What the watcher looks at (set at boot): the slot's task record, and whether the
# supervisor runs in the engine -- then its end is the engine's, whose slots nobody
# reuses any more; in ``mptier serve`` the engine may live on.
_WATCHED: dict[str, Any] = {"record": None, "in_engine": False}
_STALLS = _parse_stalls(os.environ.get(STALL_ENV, ""))
# Fault injection for tests: a worker fails its boot while the file MPTIER_FAULT_BOOT
# names exists (a broken installation that may get fixed), and each task makes a worker
# keep MPTIER_FAULT_GROW more bytes of private memory (a leak).
BOOT_FAULT_ENV = "MPTIER_FAULT_BOOT"
GROW_FAULT_ENV = "MPTIER_FAULT_GROW"
_GROW = int(os.environ.get(GROW_FAULT_ENV, "0") or 0)
_leaked: list[bytearray] = []


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
    fionread: array.array = field(default_factory=lambda: array.array("i", [0]))
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
        # die with the engine: no bounce.
        roots = [RootHandle(i, r.path, FileMapper(r.path, **session.layout), io.flags(i),
                            bounce=mapped is not None and r.bounce)
                 for i, r in enumerate(io.roots)]
        ctx = cls(role=role, slot_writer=slot_writer,
                  queues=tuple(session.queues[k] for k in QUEUE_ORDER[role]),
                  completion_fd=session.completion, lifeline_fd=session.lifeline,
                  doorbell_fd=session.doorbell[0], doorbell_write_fd=session.doorbell[1],
                  memory=memory, block_bytes=session.block_bytes, roots=roots,
                  router=RootRouter(io.root_dirs), backend=backend, io=io,
                  session=session, tag=native.new_tag().encode(), mapped=mapped,
                  owns_descriptors=mapped is not None,
                  bounce=Bounce(session.block_bytes) if any(r.bounce for r in roots)
                  else None)
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


def serve(ctx: WorkerContext, control: socket.socket | None) -> str:
    """Serve tasks until the session ends; returns why (one of the ``ENDED_*`` texts)."""
    writer = ctx.slot_writer
    record = writer.record
    pid = os.getpid()
    with select.epoll() as work, select.epoll() as news:
        # Wake-ups are exclusive: the engine's one write of a job's tasks wakes one idle
        # worker, not the whole pool, so the engine's thread pays for one wake-up. A
        # worker that takes a task and sees more waiting rings the doorbell, which wakes
        # one more idle worker: a job fans out over the pool in a chain paid for by the
        # workers. The lifeline and the control socket wake everyone.
        for fd in (*ctx.queues, ctx.doorbell_fd):
            work.register(fd, select.EPOLLIN | _EPOLLEXCLUSIVE)
        for poller in (work, news):
            poller.register(ctx.lifeline_fd, select.EPOLLIN)
            if control is not None:
                poller.register(control.fileno(), select.EPOLLIN)
        writer.set_state(SlotState.IDLE)
        caretaker = ctx.caretaker
        reports = ctx.reports
        assert reports is not None
        watching_room = False  # the completion pipe is in `work`, for room
        while True:
            took = _take(ctx.queues, record)
            if not took:
                wait = IDLE_POLL_S
                if caretaker:  # idle: look after this worker's roots, if any
                    caretaker.run(busy=False)
                    wait = caretaker.wait_s(IDLE_POLL_S)
                if reports.overflow:  # the caretaker's REMOVED messages wait for room
                    try:
                        ctx.report()
                    except BrokenPipeError:
                        return ENDED_ENGINE_GONE
                if bool(reports.overflow) != watching_room:
                    watching_room = not watching_room
                    if watching_room:
                        work.register(ctx.completion_fd, select.EPOLLOUT)
                    else:
                        work.unregister(ctx.completion_fd)
                for fd, _ in work.poll(wait):
                    if fd == ctx.completion_fd:
                        continue  # room: written at the top of the next round
                    ended = _news(ctx, control, fd)
                    if ended:
                        return ended
                continue
            if _ORPHANED.is_set():  # taken as the supervisor went: dropped, not run
                writer.release()
                return ENDED_SUPERVISOR_GONE
            if _more_waiting(ctx):
                with contextlib.suppress(BlockingIOError):
                    os.write(ctx.doorbell_write_fd, b"!")
            started = time.monotonic_ns()
            writer.mark_started(started)
            message, nbytes, failed = _run_task(ctx, record, started, pid)
            peeked = peek_task(record)
            # Report first, then let go of the task: a death in between leaves the task
            # in the slot, and the engine ignores the supervisor's second report of it.
            writer.account(nbytes, time.monotonic_ns() - started, failed, started,
                           peeked[0] if peeked else None)
            ended = _report_task(ctx, control, message, started)
            writer.release()
            if ended:
                return ended
            if caretaker:  # busy: a step now and then, often while evicting
                caretaker.run(busy=True)
            for fd, _ in news.poll(0):  # one cheap check per task: session over? asked?
                ended = _news(ctx, control, fd)
                if ended:
                    return ended


def _report_task(ctx: WorkerContext, control: socket.socket | None, message: bytes,
                 started: int) -> str:
    """Report a finished task, behind this worker's reports still waiting. While the
    completion pipe is full, wait for room (the slot says REPORTING; heartbeats are
    answered). Returns why serving ends ("" to go on). The task stays in the slot
    until the report is in the pipe -- or is dropped because the session ended, when
    the engine fails it itself."""
    try:
        ctx.report(message)
    except BrokenPipeError:
        return ENDED_ENGINE_GONE
    if not ctx.reports.overflow:
        return ""
    ctx.slot_writer.mark_reporting(started)
    poller = select.poll()
    poller.register(ctx.completion_fd, select.POLLOUT)
    poller.register(ctx.lifeline_fd, select.POLLIN)
    if control is not None:
        poller.register(control.fileno(), select.POLLIN)
    ended, give_up_at = "", float("inf")
    while ctx.reports.overflow:
        if time.monotonic() > give_up_at:
            return ended
        for fd, _ in poller.poll(IDLE_POLL_S * 1000):
            if fd == ctx.completion_fd:  # room (or an error the write will name)
                try:
                    ctx.report()
                except BrokenPipeError:
                    return ENDED_ENGINE_GONE
            elif fd == ctx.lifeline_fd:  # the session ends; the engine may still read
                poller.unregister(fd)
                ended = ENDED_LIFELINE
                give_up_at = time.monotonic() + REPORT_AFTER_LIFELINE_S
            else:
                news = _news(ctx, control, fd)
                if news:
                    return news
    return ended


def _news(ctx: WorkerContext, control: socket.socket | None, fd: int) -> str:
    """Handle a readable non-queue descriptor; returns why serving ends, or ""."""
    if fd == ctx.lifeline_fd:
        return ENDED_LIFELINE
    if fd == ctx.doorbell_fd:
        with contextlib.suppress(BlockingIOError):
            os.read(ctx.doorbell_fd, 4096)
        return ""
    if control is not None and fd == control.fileno():
        got = protocol.receive(control)
        if got is None:
            return ENDED_SUPERVISOR_GONE
        message, fds = got
        for extra in fds:  # nothing sent while serving carries descriptors
            os.close(extra)
        op = message["op"]
        if op == protocol.PING:
            protocol.send(control, protocol.PONG, seq=message.get("seq", 0))
        elif op == protocol.DETACH:
            return ENDED_DETACH
        elif op == protocol.EXIT:
            return ENDED_EXIT
        elif op == protocol.CARETAKE and ctx.caretaker is not None:
            ctx.caretaker.take([int(r) for r in message.get("roots", [])])
    return ""


def _take(queues: tuple[int, ...], record: memoryview) -> bool:
    for fd in queues:
        try:
            n = os.readv(fd, [record])
        except BlockingIOError:
            continue
        if n == TASK_RECORD_BYTES:
            return True
        # Cannot happen with whole-record writes; never run half a record.
        record[:TASK_HEADER_BYTES] = bytes(TASK_HEADER_BYTES)
    return False


def _more_waiting(ctx: WorkerContext) -> bool:
    fionread = ctx.fionread
    for fd in ctx.queues:
        fcntl.ioctl(fd, termios.FIONREAD, fionread)
        if fionread[0] >= TASK_RECORD_BYTES:
            return True
    return False


def _run_task(ctx: WorkerContext, record: memoryview, started: int, pid: int
              ) -> tuple[bytes, int, bool]:
    try:
        task = decode_task(record)
    except ValueError as exc:  # not a record an engine of ours writes (a hostile one's,
        # in a service): fail it and keep serving, rather than die and be replaced
        message = encode_message(MessageType.DONE, ctx.slot_writer.slot, pid,
                                 errno=errno.EINVAL, n_done=0, task_id=0, started_ns=started,
                                 elapsed_ns=time.monotonic_ns() - started,
                                 payload=f"malformed task record: {exc}")
        return message, 0, True
    if _STALLS and task.kind in _STALLS:
        time.sleep(_STALLS[task.kind])
    if _GROW:
        _leaked.append(bytearray(b"\1" * _GROW))
    err = 0
    n_done = len(task.keys)
    payload: bytes | str = b""
    try:
        if task.kind == TaskKind.LOOKUP:
            payload = _lookup(ctx, task.keys)
        else:
            block_bytes = ctx.block_bytes
            offsets = [block_id * block_bytes for block_id in task.block_ids]
            err, n_done, payload = _transfer(ctx, task.kind == TaskKind.STORE, task.keys,
                                             offsets)
    except Exception as exc:  # a bug or bad input must not kill the worker: report it
        err, n_done = errno.EIO, 0
        payload = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    elapsed = time.monotonic_ns() - started
    nbytes = 0 if task.kind == TaskKind.LOOKUP else n_done * ctx.block_bytes
    message = encode_message(MessageType.DONE, ctx.slot_writer.slot, pid, errno=err,
                             n_done=n_done, task_id=task.task_id, started_ns=started,
                             elapsed_ns=elapsed, payload=payload)
    return message, nbytes, bool(err)


# -- keys on roots -------------------------------------------------------------------------

def _transfer(ctx: WorkerContext, store: bool, keys: list[bytes], offsets: list[int]
              ) -> tuple[int, int, str]:
    """Store or load ``keys`` in order, as runs of keys on one root, stopping at the
    first failure: ``(errno, n_done, error text)``. n_done counts from the task's
    first key, so the engine's prefix semantics hold across roots."""
    n_done = 0
    for index, start, end in ctx.router.runs(keys):
        whole = start == 0 and end == len(keys)
        err, done, text = _run_on_root(
            ctx, store, ctx.roots[index], keys if whole else keys[start:end],
            offsets if whole else offsets[start:end])
        n_done += done
        if err:
            return err, n_done, text
    return 0, n_done, ""


def _gate(ctx: WorkerContext, root: RootHandle, store: bool) -> tuple[int, str] | None:
    """None when ``root`` may be used now (in rotation; read-only, for a load, or for a
    store once a retry is due; out and due for a probe that just succeeded); else
    ``(errno, text)`` to fail its keys with at once."""
    state, err, failures, retry_at = ctx.slot_writer.control.root_health(root.index)
    if state == RootState.IN:
        return None
    if state == RootState.READ_ONLY:
        if not store:
            return None
        if time.monotonic_ns() < retry_at:
            ctx.slot_writer.count_read_only(root.index)
            return errno.EROFS, read_only_text(root.path, retry_at)
        ctx.report_probe(root.index)  # this store tries it; the others still fail fast
        return None
    if time.monotonic_ns() < retry_at:
        return err or errno.EIO, out_of_rotation_text(root.path, err, failures, retry_at)
    ctx.report_probe(root.index)  # others wait for this probe instead of probing too
    root.close()
    try:
        _probe(ctx, root)
    except OSError as exc:
        perr = exc.errno or errno.EIO
        text = f"probe of root {root.path} failed: {exc}"
        ctx.report_root(root.index, False, perr, text)
        root.close()
        return perr, (f"root {root.path} is out of rotation and a probe of it just "
                      f"failed ({exc}); its keys read as misses and stores of them fail")
    ctx.report_root(root.index, True, 0, "")
    return None


def _probe(ctx: WorkerContext, root: RootHandle) -> None:
    """Does ``root`` answer? The root folder must stat as a folder, and its block
    folder open (a missing block folder is an answer too: a store makes it again).
    Raises OSError when not."""
    if not stat.S_ISDIR(os.stat(root.path).st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", root.path)
    try:
        os.fstat(_open_root(ctx, root, create=False))
    except FileNotFoundError:
        pass


def _open_root(ctx: WorkerContext, root: RootHandle, create: bool) -> int:
    """The root's block folder, opened at first use. A folder removed under a running
    tier is made again for a store (a load or lookup of it is a miss); a root path that
    leads to another folder now is followed (:func:`root_identity`). Raises OSError."""
    try:
        identity = root_identity(root.path)  # one stat per run: followed by path
    except FileNotFoundError:
        if not create:
            raise  # a load or lookup of a root that is not there is a miss
        root.release()  # wiped whole (or never made): a store makes it again
        root.mapper.prepare(ctx.block_bytes)
        identity = root_identity(root.path)
    if root.fd >= 0 and identity != root.identity:
        log.warning("mptier: root %s now leads to another folder (device %d:%d inode %d, "
                    "was %d:%d inode %d: a file system mounted over it or taken away, or "
                    "the folder replaced); following the path", root.path,
                    os.major(identity[0]), os.minor(identity[0]), identity[1],
                    os.major(root.identity[0]), os.minor(root.identity[0]),
                    root.identity[1])
        root.release()  # the lease lives in the old folder's .mptier: take one anew
    if root.fd < 0:
        try:
            root.fd = native.open_root(root.mapper.blocks_dir)
        except FileNotFoundError:
            if not create:
                raise
            root.mapper.prepare(ctx.block_bytes)
            root.fd = native.open_root(root.mapper.blocks_dir)
        root.identity = identity
    return root.fd


def _health_after(ctx: WorkerContext, root: RootHandle, store: bool, err: int,
                  text: str) -> None:
    """Tell the health owner what a run on ``root`` proved: a fault counts against it;
    anything else clears earlier failures (only then: no message on the hot path). A
    load proves nothing about a read-only root's writes."""
    if err and is_fault(err):
        root.close()  # a later use opens it afresh (a remounted file system)
        ctx.report_root(root.index, False, err, text)
        return
    state, _, failures, _ = ctx.slot_writer.control.root_health(root.index)
    if state == RootState.READ_ONLY and not store:
        return
    if failures or state != RootState.IN:
        ctx.report_root(root.index, True, 0, "")


def _run_on_root(ctx: WorkerContext, store: bool, root: RootHandle, keys: list[bytes],
                 offsets: list[int]) -> tuple[int, int, str]:
    gate = _gate(ctx, root, store)
    if gate is not None:
        return gate[0], 0, gate[1]
    ctx.slot_writer.set_root(root.index)  # a timeout now is blamed on this root
    relative = root.mapper.relative_path_for
    paths = [relative(key).encode() for key in keys]
    text = ""
    try:
        fd = _open_root(ctx, root, create=store)
        rc, n_done, index, text = _move(ctx, store, root, fd, paths, offsets)
        if rc == -errno.ENOENT and _folder_removed(root):  # an operator wiped the cache
            root.close()  # made again for a store; a load of it is a miss
            log.warning("mptier: %s was removed under the running tier; opening it again",
                        root.mapper.blocks_dir)
            fd = _open_root(ctx, root, create=store)
            rc, n_done, index, text = _move(ctx, store, root, fd, paths, offsets)
    except OSError as exc:
        rc, n_done, index = -(exc.errno or errno.EIO), 0, 0
        text = f"root {root.path}: {exc}"
    err = -rc
    if err and not text:
        text = str(native.batch_error("store" if store else "load", err, n_done, index,
                                      f"{root.mapper.blocks_dir}/{paths[index].decode()}"))
    _health_after(ctx, root, store, err, text)
    return err, n_done, text


def _move(ctx: WorkerContext, store: bool, root: RootHandle, fd: int, paths: list[bytes],
          offsets: list[int]) -> tuple[int, int, int, str]:
    """Store or load one run on ``root``: the native errno layer's ``(rc, n_done,
    fail_index)`` and an error text when the run failed before the native call."""
    if store:
        return _store_run(ctx, root, fd, paths, offsets)
    if root.bounce and ctx.bounce is not None:
        rc, n_done, index = ctx.bounce.load(ctx.backend, fd, paths, ctx.memory, offsets,
                                            root.flags)
    else:
        rc, n_done, index = ctx.backend.load(fd, paths, ctx.memory, offsets,
                                             ctx.block_bytes, root.flags)
    return rc, n_done, index, ""


def _folder_removed(root: RootHandle) -> bool:
    """Whether the blocks folder ``root`` holds open was removed (its link count is 0;
    a network file system may say ESTALE instead)."""
    if root.fd < 0:
        return False
    try:
        return os.fstat(root.fd).st_nlink == 0
    except OSError as exc:
        return exc.errno == errno.ESTALE


def _store_run(ctx: WorkerContext, root: RootHandle, fd: int, paths: list[bytes],
               offsets: list[int]) -> tuple[int, int, int, str]:
    if root.lease is None:  # before the first temporary name carrying our tag
        root.lease = Lease.create(root.path, tag=ctx.tag.decode())
    block_bytes = ctx.block_bytes
    capacity = ctx.io.capacity_bytes
    # Blocks already there cost this existence check: the store finds them too and only
    # touches them (names are content hashes), writing nothing; the check counts them
    # (skipped, not written) and keeps them out of the room a budget must make. The new
    # ones are counted exactly, budget or not, so stats()' usage never lags ours.
    statuses = ctx.backend.lookup(fd, paths, block_bytes, 0)
    new = [i for i, status in enumerate(statuses) if status != native.LOOKUP_PRESENT]
    need = len(new) * block_bytes
    writer = ctx.slot_writer
    writer.reserve(root.index, need)  # before the check: every later check counts it
    try:
        if capacity and need and not _room(ctx, root.index, need):
            usage = writer.control.usage_now(root.index) - need
            return -errno.ENOSPC, 0, 0, (
                f"root {root.path} is full: storing {len(new)} new block(s) ({need} bytes) "
                f"would take its usage ({usage} bytes) past capacity_bytes={capacity}, and "
                f"eviction could not make room within {ctx.io.room_wait_s:g} s; nothing "
                "was written")
        rc, n_done, index, temp_err = ctx.backend.store(fd, paths, ctx.memory, offsets,
                                                        block_bytes, root.flags, ctx.tag)
        if rc in (-errno.ENOSPC, -errno.EDQUOT):  # out of blocks, inodes or quota: the
            writer.count_no_space(root.index)  # caretaker evicts on the rise
        if temp_err:
            log.warning("mptier: a temporary file in %s could not be removed (%s); the "
                        "sweeper removes it once this writer's lease is free",
                        os.path.dirname(f"{root.mapper.blocks_dir}/{paths[index].decode()}"),
                        os.strerror(temp_err))
        written = [paths[i] for i in new if i < n_done]
        writer.count_stored(len(written) * block_bytes,
                            (n_done - len(written)) * block_bytes)
        if written:
            _count_new(ctx, root.index, written)
    finally:
        writer.reserve(root.index, 0)  # after the count: for an instant both, never none
    return rc, n_done, index, ""


def _count_new(ctx: WorkerContext, index: int, paths: list[bytes]) -> None:
    """Count blocks this worker created for the caretaker, sorted against the walk's
    published position (RootMaintainer.record_other_stores)."""
    if not paths:
        return
    writer = ctx.slot_writer
    control = writer.control
    pass_id, position, listed = control.walk_state(index)
    if not listed:  # the pass has not listed the block folder yet: it will see them all
        ahead = len(paths)
    else:  # ahead: past the walk's position, in an h3 folder its listing holds
        tops = [int(p[:3], 16) for p in paths]
        ahead = sum(1 for top in tops if top > position and control.listed(index, top))
    behind = len(paths) - ahead
    size = ctx.block_bytes
    writer.add_made(index, len(paths) * size)  # first: usage_now counts it from here
    writer.add_stores(index, pass_id, (ahead * size, ahead), (behind * size, behind))
    writer.ring_add(index, paths)  # into the caretaker's eviction index at once


def _room(ctx: WorkerContext, index: int, nbytes: int) -> bool:
    """Whether the ``nbytes`` this store reserved may be written on root ``index``,
    waiting (bounded by room_wait_s) for its caretaker to evict; this worker evicts
    itself when it is the caretaker.

    A store starts at once while the usage before it (the exact usage, every other
    store's reservation included) is within the budget: it may pass the budget by its
    own task, which the caretaker, seeing the reservation, evicts for at once. So the
    budget is exceeded by at most one task per writer in flight, and a store waits only
    when eviction is a whole task behind (waiting for each unlink made stores wait on
    nearly every task near the budget)."""
    control = ctx.slot_writer.control
    capacity = ctx.io.capacity_bytes
    if nbytes > capacity:
        return False  # no eviction can make room for more than the whole budget
    if control.usage_now(index) - nbytes <= capacity:
        return True
    started = time.monotonic_ns()
    deadline = time.monotonic() + ctx.io.room_wait_s
    writer = ctx.slot_writer
    try:
        if ctx.caretaker is not None and index in ctx.caretaker.kept:
            return ctx.caretaker.make_room(index, nbytes, deadline)
        writer.want_free(index, nbytes)
        try:
            while time.monotonic() < deadline:
                time.sleep(ROOM_POLL_S)
                if control.usage_now(index) - nbytes <= capacity:
                    return True
            return False
        finally:
            writer.want_free(index, 0)
    finally:
        writer.waited_for_room(time.monotonic_ns() - started)


def _lookup(ctx: WorkerContext, keys: list[bytes]) -> bytes:
    """One lookup status per key; keys of a root out of rotation are misses."""
    if ctx.router.single:
        return _lookup_on(ctx, ctx.roots[0], keys)
    out = bytearray(len(keys))
    groups: dict[int, list[int]] = {}
    for i, index in enumerate(ctx.router.indices(keys)):
        groups.setdefault(index, []).append(i)
    for index, positions in groups.items():
        statuses = _lookup_on(ctx, ctx.roots[index], [keys[i] for i in positions])
        for j, i in enumerate(positions):
            out[i] = statuses[j]
    return bytes(out)


def _lookup_on(ctx: WorkerContext, root: RootHandle, keys: list[bytes]) -> bytes:
    if _gate(ctx, root, store=False) is not None:
        return bytes(len(keys))  # LOOKUP_ABSENT: a miss
    ctx.slot_writer.set_root(root.index)
    relative = root.mapper.relative_path_for
    paths = [relative(key).encode() for key in keys]
    try:
        fd = _open_root(ctx, root, create=False)
    except OSError as exc:
        if exc.errno is not None and is_fault(exc.errno):
            _health_after(ctx, root, False, exc.errno, f"root {root.path}: {exc}")
        return bytes(len(keys))
    return ctx.backend.lookup(fd, paths, ctx.block_bytes, root.flags)


# -- the process -------------------------------------------------------------------------

def _leave_with_parent(parent_pid: int, control: socket.socket, bound_s: float) -> None:
    """Ask the kernel for ORPHAN_SIGNAL when the thread that spawned us (the supervisor)
    ends, and watch for it on a thread of our own (:func:`_watch_supervisor`). The
    launcher's boot script blocked the signal before any import could start a thread
    (blocked again here for a worker started otherwise), so every thread inherits the
    block and only the watcher's ``sigwait`` ever takes it."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the exit bound's timer ends us
    signal.pthread_sigmask(signal.SIG_BLOCK, {ORPHAN_SIGNAL})
    threading.Thread(target=_watch_supervisor, args=(control, bound_s),
                     name="mptier-orphan-watch", daemon=True).start()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, ORPHAN_SIGNAL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def _watch_supervisor(control: socket.socket, bound_s: float) -> None:
    """(The watcher thread.) When ORPHAN_SIGNAL comes -- the supervisor is gone, the
    engine with it -- arm the kernel's timer for the exit bound, then shut the control
    socket: the serving loop takes that end of file as the supervisor's (after the task
    in hand, never during it), drops the tasks still queued, gives up its leases and
    leaves; :func:`_leave_no_trace` then removes what the dead engine left behind."""
    signal.sigwait({ORPHAN_SIGNAL})
    signal.setitimer(signal.ITIMER_REAL, bound_s)
    _ORPHANED.set()  # from here on the loop runs no task it takes (see serve)
    record = _WATCHED["record"]
    held = peek_task(record) if record is not None else None
    if held is not None and (held[0] != TaskKind.STORE or not _WATCHED["in_engine"]):
        # Only a dead engine's stores are finished. A load or lookup helps nobody now;
        # and when only the service died, the engine lives on: it fails the task itself
        # and may reuse the slot, which a store or load finishing later would read from
        # or land in. End now, as a killed worker would.
        os.kill(os.getpid(), signal.SIGKILL)
    with contextlib.suppress(OSError):
        control.shutdown(socket.SHUT_RDWR)


def _leave_no_trace() -> None:
    """An orphan's last act: remove the status sockets and locks that dead processes
    (its engine) left in the run directory, and the mptier objects in /dev/shm nobody
    holds (its engine's buffer; the mapping here stays valid) -- what the engine's next
    start would remove, done now. Both take each object's lock first, so nothing live
    is touched; several workers doing it at once is harmless."""
    from mptier.monitor.endpoint import remove_stale
    from mptier.shm import cleanup_stale

    for clean in (remove_stale, cleanup_stale):
        try:
            clean()
        except Exception as exc:  # best effort: the next start removes them anyway
            log.warning("mptier: a worker leaving after its engine died could not clean "
                        "up (%s): %s", clean.__name__, _describe(exc))


def _batch_policy() -> None:
    """Run this worker (and the threads it starts) under SCHED_BATCH: the same CPU share
    as before (nice still applies), but a worker woken by the engine's write of a task
    never preempts the engine's thread on that CPU. Woken after an idle spell, a normal
    worker did, and the engine's first submit_store waited 2-12 ms for its CPU back
    (docs/performance.md, "Tails"). Best effort: without it the worker runs as before."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def process_main(boot: dict[str, Any]) -> int:
    """Boot, then serve sessions as the supervisor hands them over, until told to leave
    or the supervisor is gone. Returns the exit code."""
    from mptier import native

    control = socket.socket(fileno=boot["control_socket"])
    _leave_with_parent(boot["parent_pid"], control,
                     min(ORPHAN_EXIT_S, boot.get("io_timeout_s") or ORPHAN_EXIT_S))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the engine's terminal
    slot, role = boot["slot"], boot["role"]
    try:
        fault = os.environ.get(BOOT_FAULT_ENV)
        if fault and os.path.exists(fault):
            raise RuntimeError(f"boot failure injected ({BOOT_FAULT_ENV}={fault})")
        if boot.get("nice"):
            os.setpriority(os.PRIO_PROCESS, 0, boot["nice"])
        _batch_policy()
        if boot.get("cpus"):
            os.sched_setaffinity(0, boot["cpus"])
        backend = native.get_backend(boot["backend"])
        block = ControlBlock(boot["n_slots"], fd=boot["control_block"])
        writer = SlotWriter(block, slot, role)
    except Exception as exc:
        with contextlib.suppress(OSError):
            protocol.send(control, protocol.BOOT_FAILED, error=_describe(exc),
                          errno=getattr(exc, "errno", 0) or 0)
        return protocol.EXIT_BOOT_FAILED
    writer.set_state(SlotState.IDLE)
    _WATCHED["record"], _WATCHED["in_engine"] = writer.record, boot.get("in_engine", True)
    try:
        protocol.send(control, protocol.READY, pid=os.getpid())
        code = _between_sessions(control, writer, role, backend)
    except (BrokenPipeError, ConnectionResetError):
        code = 0  # the supervisor is gone; nobody to tell
    if _ORPHANED.is_set():
        _leave_no_trace()
    return code


def _between_sessions(control: socket.socket, writer: SlotWriter, role: str,
                      backend: Any) -> int:
    while True:
        got = protocol.receive(control)
        if got is None:
            return 0
        message, fds = got
        op = message["op"]
        if op == protocol.PING:
            protocol.send(control, protocol.PONG, seq=message.get("seq", 0))
        elif op == protocol.EXIT:
            writer.set_state(SlotState.LEAVING)
            protocol.send(control, protocol.LEAVING)
            return 0
        elif op == protocol.DETACH:
            protocol.send(control, protocol.DETACHED, reason="not attached")
        elif op == protocol.ATTACH:
            ended = _attached(control, writer, role, backend, message, fds)
            if ended in _LEAVE:
                writer.set_state(SlotState.LEAVING)
                with contextlib.suppress(OSError):
                    protocol.send(control, protocol.LEAVING, reason=ended)
                return 0
        for extra in fds if op != protocol.ATTACH else ():
            os.close(extra)


def _attached(control: socket.socket, writer: SlotWriter, role: str, backend: Any,
              message: dict[str, Any], fds: list[int]) -> str:
    session = None
    try:
        session = WorkerSession.from_wire(message["session"], fds)
        ctx = WorkerContext.open(role=role, slot_writer=writer, session=session,
                                 io=IoSettings.from_wire(message["io"]), backend=backend)
    except Exception as exc:
        if session is not None:
            session.close()
        else:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        protocol.send(control, protocol.ATTACH_FAILED, error=_describe(exc))
        return ""
    def report_root(index: int, ok: bool, err: int, text: str) -> None:
        with contextlib.suppress(OSError):
            protocol.send(control, protocol.ROOT_HEALTH, root=index, ok=ok, errno=err,
                          text=text[:400])

    def report_probe(index: int) -> None:
        with contextlib.suppress(OSError):
            protocol.send(control, protocol.ROOT_PROBE, root=index)

    ctx.report_root, ctx.report_probe = report_root, report_probe
    protocol.send(control, protocol.ATTACHED, backend=backend.name,
                  temp_tag=ctx.tag.decode())
    try:
        ended = serve(ctx, control)
    finally:
        ctx.close()
        writer.set_state(SlotState.IDLE)
    if ended not in _LEAVE:
        protocol.send(control, protocol.DETACHED, reason=ended)
    return ended


def main(package_dir: str, spec: str) -> int:
    """The process's entry (see :mod:`mptier.workers.launcher`): boot from the JSON
    ``spec`` -- unless this mptier is not the one in ``package_dir``, the engine's,
    which is a boot failure naming both (never run another tree's code)."""
    import mptier

    here = os.path.dirname(os.path.abspath(mptier.__file__))
    boot = json.loads(spec)
    if os.path.realpath(here) != os.path.realpath(package_dir) or \
            os.path.realpath(os.path.dirname(__file__)) != \
            os.path.realpath(os.path.join(package_dir, "workers")):
        with socket.socket(fileno=boot["control_socket"]) as control, \
                contextlib.suppress(OSError):
            protocol.send(control, protocol.BOOT_FAILED, errno=0, error=(
                f"the worker imported mptier from {here}, not the engine's {package_dir}"
                " (check PYTHONPATH and .pth files)"))
        return protocol.EXIT_BOOT_FAILED
    return process_main(boot)

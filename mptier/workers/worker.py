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

The I/O never blocks the engine: if it hangs, the supervisor kills this process and
handles the task its slot holds.

Run as a process: ``python -m mptier.workers.worker '<json boot spec>'`` (see
:mod:`mptier.workers.launcher`).
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
import sys
import termios
import time
import traceback
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
)
from mptier.layout import FileMapper
from mptier.workers import protocol
from mptier.workers.control import ControlBlock, SlotState, SlotWriter
from mptier.workers.session import QUEUE_ORDER, IoSettings, WorkerSession

# Idle wake-up: a backstop for the lifeline's end-of-file event; nothing depends on it.
IDLE_POLL_S = 1.0
_EPOLLEXCLUSIVE = getattr(select, "EPOLLEXCLUSIVE", 0)
log = logging.getLogger("mptier.workers")
_PR_SET_PDEATHSIG = 1
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


_STALLS = _parse_stalls(os.environ.get(STALL_ENV, ""))
# Fault injection for tests: a worker fails its boot while the file MPTIER_FAULT_BOOT
# names exists (a broken installation that may get fixed), and each task makes a worker
# keep MPTIER_FAULT_GROW more bytes of private memory (a leak).
BOOT_FAULT_ENV = "MPTIER_FAULT_BOOT"
GROW_FAULT_ENV = "MPTIER_FAULT_GROW"
_GROW = int(os.environ.get(GROW_FAULT_ENV, "0") or 0)
_leaked: list[bytearray] = []


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
    mapper: FileMapper
    backend: Any
    io: IoSettings
    session: WorkerSession
    root_fd: int  # the blocks folder: every path resolves beneath it, no symlinks
    flags: int  # the native layer's flags (O_DIRECT, CHECKSUM, TOUCH, TMPFILE)
    tag: bytes  # names this writer's temporary files (its lease)
    mapped: Any = None  # the MappedBuffer when this worker mapped the buffer itself
    owns_descriptors: bool = True  # False for threads: the fds are the engine's
    fionread: array.array = field(default_factory=lambda: array.array("i", [0]))

    @classmethod
    def open(cls, *, role: str, slot_writer: SlotWriter, session: WorkerSession,
             io: IoSettings, backend: Any, memory: memoryview | None = None
             ) -> WorkerContext:
        """Map the session's buffer (unless ``memory`` is given: thread workers use the
        engine's own) and get ready to serve it. Raises on failure, having released
        what it took; the session's descriptors stay the caller's to close."""
        from mptier.mapping import MappedBuffer

        mapped = None
        if memory is None:
            mapped = MappedBuffer(session.segments, session.nbytes)
            for seg in session.segments:  # mapped: the descriptors are no longer needed
                os.close(seg.fd)
            session.segments = [replace(s, fd=-1) for s in session.segments]
            if io.prefault:
                mapped.prefault()
            memory = mapped.memory
        try:
            mapper = FileMapper(io.root_dir, **session.layout)
            root_fd = native.open_root(mapper.blocks_dir)
        except BaseException:
            if mapped is not None:
                mapped.close()
            raise
        return cls(role=role, slot_writer=slot_writer,
                   queues=tuple(session.queues[k] for k in QUEUE_ORDER[role]),
                   completion_fd=session.completion, lifeline_fd=session.lifeline,
                   doorbell_fd=session.doorbell[0], doorbell_write_fd=session.doorbell[1],
                   memory=memory, block_bytes=session.block_bytes, mapper=mapper,
                   backend=backend, io=io, session=session, root_fd=root_fd,
                   flags=io.flags(), tag=native.new_tag().encode(), mapped=mapped,
                   owns_descriptors=mapped is not None)

    def close(self) -> None:
        """Unmap the buffer and close the session's descriptors (process workers)."""
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1
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
        while True:
            took = _take(ctx.queues, record)
            if not took:
                for fd, _ in work.poll(IDLE_POLL_S):
                    ended = _news(ctx, control, fd)
                    if ended:
                        return ended
                continue
            if _more_waiting(ctx):
                with contextlib.suppress(BlockingIOError):
                    os.write(ctx.doorbell_write_fd, b"!")
            started = time.monotonic_ns()
            writer.mark_started(started)
            message, nbytes, failed = _run_task(ctx, record, started, pid)
            # Report first, then let go of the task: a death in between leaves the task
            # in the slot, and the engine ignores the supervisor's second report of it.
            writer.account(nbytes, time.monotonic_ns() - started, failed, started)
            try:
                os.write(ctx.completion_fd, message)
            except BrokenPipeError:
                writer.release()
                return ENDED_ENGINE_GONE
            writer.message_sent()
            writer.release()
            for fd, _ in news.poll(0):  # one cheap check per task: session over? asked?
                ended = _news(ctx, control, fd)
                if ended:
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
    task = decode_task(record)
    if _STALLS and task.kind in _STALLS:
        time.sleep(_STALLS[task.kind])
    if _GROW:
        _leaked.append(bytearray(b"\1" * _GROW))
    relative = ctx.mapper.relative_path_for
    paths = [relative(key).encode() for key in task.keys]
    err = 0
    n_done = len(paths)
    payload: bytes | str = b""
    backend = ctx.backend
    try:
        if task.kind == TaskKind.LOOKUP:
            payload = backend.lookup(ctx.root_fd, paths, ctx.block_bytes, ctx.flags)
        else:
            block_bytes = ctx.block_bytes
            offsets = [block_id * block_bytes for block_id in task.block_ids]
            if task.kind == TaskKind.STORE:
                rc, n_done, index, temp_err = backend.store(
                    ctx.root_fd, paths, ctx.memory, offsets, block_bytes, ctx.flags, ctx.tag)
                if temp_err:
                    log.warning("mptier: a temporary file in %s could not be removed (%s); "
                                "the sweeper removes it once this writer's lease is free",
                                os.path.dirname(f"{ctx.mapper.blocks_dir}/"
                                                f"{paths[index].decode()}"),
                                os.strerror(temp_err))
            else:
                rc, n_done, index = backend.load(ctx.root_fd, paths, ctx.memory, offsets,
                                                 block_bytes, ctx.flags)
            if rc:
                err = -rc
                payload = str(native.batch_error(
                    "store" if task.kind == TaskKind.STORE else "load", err, n_done, index,
                    f"{ctx.mapper.blocks_dir}/{paths[index].decode()}"))
    except Exception as exc:  # a bug or bad input must not kill the worker: report it
        err, n_done = errno.EIO, 0
        payload = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    elapsed = time.monotonic_ns() - started
    nbytes = 0 if task.kind == TaskKind.LOOKUP else n_done * ctx.block_bytes
    message = encode_message(MessageType.DONE, ctx.slot_writer.slot, pid, errno=err,
                             n_done=n_done, task_id=task.task_id, started_ns=started,
                             elapsed_ns=elapsed, payload=payload)
    return message, nbytes, bool(err)


# -- the process -------------------------------------------------------------------------

def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL us if the thread that spawned us exits (the supervisor)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


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

    _die_with_parent(boot["parent_pid"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the engine's terminal
    control = socket.socket(fileno=boot["control_socket"])
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
    try:
        protocol.send(control, protocol.READY, pid=os.getpid())
        return _between_sessions(control, writer, role, backend)
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the supervisor is gone; nobody to tell


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


if __name__ == "__main__":
    sys.exit(process_main(json.loads(sys.argv[1])))

"""The serving loop: take a task record, run it, report, repeat -- until the session ends.

It blocks only in ``epoll`` on its queues and the doorbell (exclusive wake-ups), the
lifeline and the control socket, and in file I/O::

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

The same loop runs in a worker process and on a thread of the engine
(:class:`~mptier.workers.threads.ThreadWorkers`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import time
import traceback

from mptier.jobs import (
    MessageType,
    TaskKind,
    check_task,
    encode_message,
)
from mptier.native.entries import Outcome, outcome
from mptier.workers import protocol
from mptier.workers.context import WorkerContext
from mptier.workers.control import SlotState
from mptier.workers.orphan import ORPHANED
from mptier.workers.rootio import lookup_task, transfer_task

log = logging.getLogger("mptier.workers")

# Idle wake-up: a backstop for the lifeline's end-of-file event; nothing depends on it.
IDLE_POLL_S = 1.0
# How long a report still waiting for room in the completion pipe is kept trying once
# the engine closed its lifeline: an engine shutting down reads its pipe while its
# workers detach (for up to mptier.workers.poolbase.DETACH_GRACE_S), one that is gone never
# will. After this the report is dropped and the engine fails the task itself.
REPORT_AFTER_LIFELINE_S = 5.0
_EPOLLEXCLUSIVE = getattr(select, "EPOLLEXCLUSIVE", 0)
# Fault injection for tests: MPTIER_FAULT_STALL="store:0.5,load:2" makes the worker sleep
# that long at the start of each task of that kind, as a slow or hung file system would.
STALL_ENV = "MPTIER_FAULT_STALL"
# With MPTIER_FAULT_STALL_WHILE=PATH as well, only the tasks taken while PATH exists
# stall: a test decides which of a running engine's tasks stall (its last step's stores,
# say) after the workers started with the variables in their environment.
STALL_WHILE_ENV = "MPTIER_FAULT_STALL_WHILE"
# Why serve() returned.
ENDED_LIFELINE = "the engine closed its lifeline"
ENDED_ENGINE_GONE = "the engine's completion pipe is closed"
ENDED_DETACH = "the supervisor ended the session"
ENDED_EXIT = "the supervisor asked the worker to leave"
ENDED_SUPERVISOR_GONE = "the supervisor is gone"
LEAVE = (ENDED_EXIT, ENDED_SUPERVISOR_GONE)


def _parse_stalls(spec: str) -> dict[TaskKind, float]:
    stalls = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, seconds = part.partition(":")
        stalls[TaskKind[kind.upper()]] = float(seconds)
    return stalls


_STALLS = _parse_stalls(os.environ.get(STALL_ENV, ""))
_STALL_WHILE = os.environ.get(STALL_WHILE_ENV, "")
# Fault injection for tests: each task makes a worker keep MPTIER_FAULT_GROW more bytes
# of private memory (a leak).
GROW_FAULT_ENV = "MPTIER_FAULT_GROW"
_GROW = int(os.environ.get(GROW_FAULT_ENV, "0") or 0)
_leaked: list[bytearray] = []
_PAGE = os.sysconf("SC_PAGE_SIZE")


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
        # One native call reads a record from the first queue holding one (lookups, own,
        # other: QUEUE_ORDER) and says whether more wait (bench/experiments/task_cpu.py).
        take = ctx.backend.record_taker(ctx.queues, record)
        while True:
            taken, more = take()
            if taken < 0:
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
            if ORPHANED.is_set():  # taken as the supervisor went: dropped, not run
                writer.release()
                return ENDED_SUPERVISOR_GONE
            if more:  # the doorbell chain: wake one more idle worker
                with contextlib.suppress(BlockingIOError):
                    os.write(ctx.doorbell_write_fd, b"!")
            started = time.monotonic_ns()
            writer.mark_started(started)
            message, nbytes, failed, kind = _run_task(ctx, record, started, pid)
            # Report first, then let go of the task: a death in between leaves the task
            # in the slot, and the engine ignores the supervisor's second report of it.
            writer.account(nbytes, time.monotonic_ns() - started, failed, started, kind)
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


def _run_task(ctx: WorkerContext, record: memoryview, started: int, pid: int
              ) -> tuple[bytes, int, bool, TaskKind | None]:
    """Run the task in ``record``: ``(report, bytes moved, failed, kind)``; the kind is
    None for a record that names no task (malformed, or task id 0: peek_task's None)."""
    try:
        kind, task_id, n = check_task(record)
    except ValueError as exc:  # not a record an engine of ours writes (a hostile one's,
        # in a service): fail it and keep serving, rather than die and be replaced
        message = encode_message(MessageType.DONE, ctx.slot_writer.slot, pid,
                                 errno=errno.EINVAL, n_done=0, task_id=0, started_ns=started,
                                 elapsed_ns=time.monotonic_ns() - started,
                                 payload=f"malformed task record: {exc}",
                                 outcome=Outcome.OTHER)
        return message, 0, True, None
    if _STALLS and kind in _STALLS and (not _STALL_WHILE or os.path.exists(_STALL_WHILE)):
        time.sleep(_STALLS[kind])
    if _GROW:
        grown = bytearray(_GROW)  # each page written once: private, resident, and
        grown[::_PAGE] = b"\1" * len(range(0, _GROW, _PAGE))  # never twice the size
        _leaked.append(grown)
    err = 0
    n_done = n
    payload: bytes | str = b""
    result = Outcome.OK
    try:
        if kind == TaskKind.LOOKUP:
            payload = lookup_task(ctx, record)
        else:
            store = kind == TaskKind.STORE
            err, n_done, payload = transfer_task(ctx, store, record)
            result = outcome("store" if store else "load", err)
    except Exception as exc:  # a bug or bad input must not kill the worker: report it
        err, n_done, result = errno.EIO, 0, Outcome.OTHER
        payload = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    elapsed = time.monotonic_ns() - started
    nbytes = 0 if kind == TaskKind.LOOKUP else n_done * ctx.block_bytes
    message = encode_message(MessageType.DONE, ctx.slot_writer.slot, pid, errno=err,
                             n_done=n_done, task_id=task_id, started_ns=started,
                             elapsed_ns=elapsed, payload=payload, outcome=result)
    return message, nbytes, bool(err), kind if task_id else None

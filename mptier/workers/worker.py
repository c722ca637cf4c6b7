"""The worker loop: take a task record, run one native batch call, report, repeat.

A worker (a process, or a thread when the buffer cannot be shared) owns one slot of the
control block. It polls three descriptors and blocks only there:

    lookup queue ─┐
    own queue    ─┤
    other queue  ─┼─ poll() ─▶ read one record into the slot ─▶ batch I/O ─▶ message ─▶ pipe
    lifeline     ─┘            (lookups, own queue, other)       (no GIL)

Existence checks (lookups) are tiny and gate the engine's scheduling, so every worker
takes them first; then its own priority's queue; then the other one.

It leaves when the lifeline reaches end-of-file (the engine shut down or died), after
sending LEAVING, so a planned exit is never mistaken for a crash. The I/O never blocks
the engine: if it hangs, the supervisor kills this process and handles the held task.

Run as a process: ``python -m mptier.workers.worker '<json spec>'`` (see
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
import sys
import termios
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from mptier import native
from mptier.jobs import (
    TASK_RECORD_BYTES,
    MessageType,
    TaskKind,
    decode_task,
    encode_message,
    pack_bitmap,
)
from mptier.layout import FileMapper
from mptier.workers.control import SlotState, SlotWriter

log = logging.getLogger(__name__)

_POLL_S = 1.0  # idle wake-up, a backstop for the lifeline's end-of-file event
_EPOLLEXCLUSIVE = getattr(select, "EPOLLEXCLUSIVE", 0)
_PR_SET_PDEATHSIG = 1
# Fault injection for tests: MPTIER_FAULT_STALL="store:0.5,load:2" makes the worker sleep
# that long at the start of each task of that kind, as a slow or hung file system would.
STALL_ENV = "MPTIER_FAULT_STALL"


def _parse_stalls(spec: str) -> dict[TaskKind, float]:
    stalls = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, seconds = part.partition(":")
        stalls[TaskKind[kind.upper()]] = float(seconds)
    return stalls


_STALLS = _parse_stalls(os.environ.get(STALL_ENV, ""))


def temp_tag(pid: int) -> bytes:
    """The tag in this worker's temporary names: its pid, zero-padded to the 16
    characters a tag has. Interim, until writers hold leases: the pool finds a dead
    worker's temporary files by it."""
    return b"%016d" % pid


@dataclass
class WorkerContext:
    slot: int
    role: str
    lookup_fd: int
    own_fd: int
    other_fd: int
    completion_fd: int
    lifeline_fd: int
    doorbell_fd: int
    doorbell_write_fd: int
    memory: memoryview
    slot_writer: SlotWriter
    mapper: FileMapper
    backend: Any
    use_o_direct: bool
    block_bytes: int
    fionread: array.array = field(default_factory=lambda: array.array("i", [0]))
    root_fd: int = -1  # mapper.blocks_dir, opened by run_worker unless given
    tag: bytes = b""  # writer tag in temporary names; temp_tag(pid) unless given


def run_worker(ctx: WorkerContext) -> str:
    """Serve tasks until the lifeline closes. Returns why the worker left.

    Raises ``OSError`` if the blocks folder cannot be opened.
    """
    if not ctx.tag:
        ctx.tag = temp_tag(os.getpid())
    if ctx.root_fd >= 0:
        return _run_worker(ctx)
    ctx.root_fd = native.open_root(ctx.mapper.blocks_dir)
    try:
        return _run_worker(ctx)
    finally:
        os.close(ctx.root_fd)
        ctx.root_fd = -1


def _run_worker(ctx: WorkerContext) -> str:
    with select.epoll() as poller:
        # Wake-ups are exclusive: the engine's one write of a job's tasks wakes one idle
        # worker, not the whole pool, so the engine's thread pays for one wake-up. A
        # worker that takes a task and sees more waiting rings the doorbell, which wakes
        # one more idle worker: the job fans out over the pool in a chain, paid for by
        # the workers. The lifeline wakes everyone.
        for fd in (ctx.lookup_fd, ctx.own_fd, ctx.other_fd, ctx.doorbell_fd):
            poller.register(fd, select.EPOLLIN | _EPOLLEXCLUSIVE)
        poller.register(ctx.lifeline_fd, select.EPOLLIN)
        return _serve(ctx, poller)


def _serve(ctx: WorkerContext, poller: select.epoll) -> str:
    record = ctx.slot_writer.record
    pid = os.getpid()
    ctx.slot_writer.set_state(SlotState.IDLE)
    _send(ctx, encode_message(MessageType.READY, ctx.slot, pid))
    while True:
        took = (_take(ctx.lookup_fd, record) or _take(ctx.own_fd, record)
                or _take(ctx.other_fd, record))
        if not took:
            for fd, _ in poller.poll(_POLL_S):
                if fd == ctx.lifeline_fd:
                    return "engine closed the lifeline"
                if fd == ctx.doorbell_fd:
                    with contextlib.suppress(BlockingIOError):
                        os.read(ctx.doorbell_fd, 4096)
            continue
        if _more_waiting(ctx):
            with contextlib.suppress(BlockingIOError):
                os.write(ctx.doorbell_write_fd, b"!")
        started = time.monotonic_ns()
        ctx.slot_writer.mark_started(started)
        message, nbytes, failed = _run_task(ctx, record, started, pid)
        # Report first, then let go of the task: a death in between leaves the task in
        # the slot, and the engine ignores the supervisor's second report of it.
        ctx.slot_writer.account(nbytes, time.monotonic_ns() - started, failed)
        _send(ctx, message)
        ctx.slot_writer.release()


def _take(fd: int, record: memoryview) -> bool:
    try:
        n = os.readv(fd, [record])
    except BlockingIOError:
        return False
    if n != TASK_RECORD_BYTES:  # cannot happen with whole-record writes; never run half
        record[:16] = bytes(16)
        return False
    return True


def _more_waiting(ctx: WorkerContext) -> bool:
    fionread = ctx.fionread
    for fd in (ctx.lookup_fd, ctx.own_fd, ctx.other_fd):
        fcntl.ioctl(fd, termios.FIONREAD, fionread)
        if fionread[0] >= TASK_RECORD_BYTES:
            return True
    return False


def _send(ctx: WorkerContext, message: bytes) -> None:
    """Write a message, then count it: the engine reads the pipe only when a count moved."""
    os.write(ctx.completion_fd, message)
    ctx.slot_writer.message_sent()


def _run_task(ctx: WorkerContext, record: memoryview, started: int, pid: int
              ) -> tuple[bytes, int, bool]:
    task = decode_task(record)
    if _STALLS and task.kind in _STALLS:
        time.sleep(_STALLS[task.kind])
    paths = [ctx.mapper.relative_path_for(key).encode() for key in task.keys]
    err = 0
    n_done = len(paths)
    payload: bytes | str = b""
    try:
        if task.kind == TaskKind.EXISTS:
            statuses = ctx.backend.lookup(ctx.root_fd, paths, ctx.block_bytes)
            payload = pack_bitmap([s == native.LOOKUP_PRESENT for s in statuses])
        else:
            offsets = [block_id * ctx.block_bytes for block_id in task.block_ids]
            flags = native.O_DIRECT if ctx.use_o_direct else 0
            if task.kind == TaskKind.STORE:
                rc, n_done, index, tmp_errno = ctx.backend.store(
                    ctx.root_fd, paths, ctx.memory, offsets, ctx.block_bytes, flags, ctx.tag)
                if tmp_errno:
                    log.warning("mptier: could not remove a temporary file under %s: %s",
                                ctx.mapper.blocks_dir, os.strerror(tmp_errno))
            else:
                rc, n_done, index = ctx.backend.load(
                    ctx.root_fd, paths, ctx.memory, offsets, ctx.block_bytes, flags)
            if rc:
                err = -rc
                payload = str(native.batch_error(
                    "store" if task.kind == TaskKind.STORE else "load", err, n_done, index,
                    f"{ctx.mapper.blocks_dir}/{paths[index].decode()}"))
    except Exception as exc:  # a bug or bad input must not kill the worker: report it
        err, n_done = errno.EIO, 0
        payload = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    elapsed = time.monotonic_ns() - started
    nbytes = 0 if task.kind == TaskKind.EXISTS else n_done * ctx.block_bytes
    message = encode_message(MessageType.DONE, ctx.slot, pid, errno=err, n_done=n_done,
                             task_id=task.task_id, started_ns=started, elapsed_ns=elapsed,
                             payload=payload)
    return message, nbytes, bool(err)


# -- process entry ---------------------------------------------------------------------

def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL us if the thread that spawned us exits (the supervisor)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def process_main(spec: dict[str, Any]) -> int:
    from mptier.mapping import MappedBuffer, Segment
    from mptier.workers.control import ControlBlock

    _die_with_parent(spec["parent_pid"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the engine's terminal
    slot, role = spec["slot"], spec["role"]
    completion_fd = spec["completion_fd"]
    control = ControlBlock(spec["n_slots"], fd=spec["control_fd"])
    writer = SlotWriter(control, slot, role)
    try:
        if spec.get("nice"):
            os.setpriority(os.PRIO_PROCESS, 0, spec["nice"])
        if spec.get("cpus"):
            os.sched_setaffinity(0, spec["cpus"])
        segments = [Segment(**seg) for seg in spec["segments"]]
        buffer = MappedBuffer(segments, spec["nbytes"])
        for seg in segments:  # mapped: the descriptors are no longer needed
            os.close(seg.fd)
        if spec.get("prefault"):
            buffer.prefault()
        backend = native.get_backend("native" if spec["native"] and native.HAS_NATIVE
                                     else "python")
        mapper = FileMapper(**spec["layout"])
        root_fd = native.open_root(mapper.blocks_dir)
    except Exception as exc:
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        os.write(completion_fd, encode_message(MessageType.BOOT_FAILED, slot, os.getpid(),
                                               errno=getattr(exc, "errno", 0) or 0,
                                               payload=text))
        writer.message_sent()
        return 3
    ctx = WorkerContext(slot=slot, role=role, lookup_fd=spec["lookup_fd"],
                        own_fd=spec["own_fd"],
                        other_fd=spec["other_fd"], completion_fd=completion_fd,
                        lifeline_fd=spec["lifeline_fd"], doorbell_fd=spec["doorbell_fd"],
                        doorbell_write_fd=spec["doorbell_write_fd"], memory=buffer.memory,
                        slot_writer=writer, mapper=mapper, backend=backend,
                        use_o_direct=spec["use_o_direct"], block_bytes=spec["block_bytes"],
                        root_fd=root_fd)
    try:
        reason = run_worker(ctx)
    except BrokenPipeError:
        return 0  # the engine is gone; nobody to tell
    writer.set_state(SlotState.LEAVING)
    try:
        _send(ctx, encode_message(MessageType.LEAVING, slot, os.getpid(), payload=reason))
    except BrokenPipeError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(process_main(json.loads(sys.argv[1])))

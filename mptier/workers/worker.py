"""The worker process: boots, serves sessions as the supervisor hands them over, leaves.

A worker is a process (or, for a buffer that cannot be shared, a thread of the engine)
that owns one slot of the control block. Its life::

    boot ─▶ ready ─▶ ( attach ─▶ serve ─▶ detach )* ─▶ leave
            │         └ an engine's session: queues, completion pipe, lifeline, buffer
            └ over its control socket (mptier.workers.protocol)

Here: boot, the control messages between sessions, attaching. Serving a session is
:mod:`~mptier.workers.serving` (the task loop) over :mod:`~mptier.workers.context`
(what the worker holds) and :mod:`~mptier.workers.rootio` (keys on roots); leaving
after the supervisor went is :mod:`~mptier.workers.orphan`.

The I/O never blocks the engine: if it hangs, the supervisor kills this process and
handles the task its slot holds.

Run as a process by :mod:`mptier.workers.launcher`, which makes sure it is the
engine's own mptier that runs (:func:`main`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
from typing import Any

from mptier import native
from mptier.workers import protocol
from mptier.workers.context import WorkerContext, describe
from mptier.workers.control import ControlBlock, SlotState, SlotWriter
from mptier.workers.orphan import (
    ORPHAN_EXIT_S,
    ORPHANED,
    WATCHED,
    leave_no_trace,
    leave_with_parent,
    name_process,
)
from mptier.workers.serving import LEAVE, serve
from mptier.workers.session import IoSettings, WorkerSession

log = logging.getLogger("mptier.workers")

# Fault injection for tests: a worker fails its boot while the file MPTIER_FAULT_BOOT
# names exists (a broken installation that may get fixed).
BOOT_FAULT_ENV = "MPTIER_FAULT_BOOT"


def _batch_policy() -> None:
    """Run this worker (and the threads it starts) under SCHED_BATCH: the same CPU share
    as before (nice still applies), but a worker woken by the engine's write of a task
    never preempts the engine's thread on that CPU. Woken after an idle spell, a normal
    worker did, and the engine's first submit_store waited 2-12 ms for its CPU back
    (docs/performance.md, "Tails"). Best effort: without it the worker runs as before."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def process_main(boot: dict[str, Any]) -> int:
    """Boot, then serve sessions as the supervisor hands them over, until told to leave
    or the supervisor is gone. Returns the exit code."""

    control = socket.socket(fileno=boot["control_socket"])
    leave_with_parent(boot["parent_pid"], control,
                     min(ORPHAN_EXIT_S, boot.get("io_timeout_s") or ORPHAN_EXIT_S))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the engine's terminal
    slot, role = boot["slot"], boot["role"]
    name_process(f"mptier-{role}-{slot}")
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
            protocol.send(control, protocol.BOOT_FAILED, error=describe(exc),
                          errno=getattr(exc, "errno", 0) or 0)
        return protocol.EXIT_BOOT_FAILED
    writer.set_state(SlotState.IDLE)
    WATCHED["record"], WATCHED["in_engine"] = writer.record, boot.get("in_engine", True)
    try:
        protocol.send(control, protocol.READY, pid=os.getpid())
        code = _between_sessions(control, writer, role, backend)
    except (BrokenPipeError, ConnectionResetError):
        code = 0  # the supervisor is gone; nobody to tell
    if ORPHANED.is_set():
        leave_no_trace()
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
            protocol.send(control, protocol.DETACHED, reason="not attached", session_id=0)
        elif op == protocol.ATTACH:
            ended = _attached(control, writer, role, backend, message, fds)
            if ended in LEAVE:
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
        protocol.send(control, protocol.ATTACH_FAILED, error=describe(exc),
                      session_id=message.get("session_id", 0))
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
                  temp_tag=ctx.tag.decode(), session_id=message.get("session_id", 0))
    try:
        ended = serve(ctx, control)
    finally:
        ctx.close()
        writer.set_state(SlotState.IDLE)
    if ended not in LEAVE:
        protocol.send(control, protocol.DETACHED, reason=ended,
                      session_id=message.get("session_id", 0))
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

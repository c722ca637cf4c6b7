"""A worker whose supervisor is gone: it finishes a dead engine's store, takes no more,
and leaves in order.

The kernel sends :data:`ORPHAN_SIGNAL` when the thread that started the worker ends
(:func:`leave_with_parent` asks for it at boot); a watcher thread of the worker's own
takes it (:func:`_watch_supervisor`), bounds the exit with the kernel's timer and shuts
the control socket, which the serving loop reads as the supervisor's end. On the way
out :func:`leave_no_trace` removes what the dead engine left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import threading
from typing import Any

from mptier.jobs import (
    TaskKind,
    peek_task,
)
from mptier.workers.context import describe

log = logging.getLogger("mptier.workers")

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# The kernel keeps a task's name in 16 bytes, its terminating NUL included.
_TASK_NAME_BYTES = 15
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
# (32 MiB by default on a disk or server: 3.4 s at 10 MB/s), and leaving is closing
# files and removing a lease per root, so 10 s leaves room for a loaded machine and a
# slow network file system, while every worker of a dead engine is gone before a
# service manager's stop timeout would escalate (docker stop: 10 s; Kubernetes: 30 s;
# systemd: 90 s). A worker still there then is ended by SIGALRM (its default action;
# the kernel's timer, whatever the worker is doing): what its unfinished store left (a
# temporary file, its lease) is swept by the next tier on the root, as after any kill.
ORPHAN_EXIT_S = 10.0
# Set by the watcher thread once the supervisor is gone (ORPHAN_SIGNAL).
ORPHANED = threading.Event()
# What the watcher looks at (set at boot): the slot's task record, and whether the
# supervisor runs in the engine -- then its end is the engine's, whose slots nobody
# reuses any more; in ``mptier serve`` the engine may live on.
WATCHED: dict[str, Any] = {"record": None, "in_engine": False}


def leave_with_parent(parent_pid: int, control: socket.socket, bound_s: float) -> None:
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


def name_process(name: str) -> None:
    """Give this process the name ``top``, ``ps -o comm``, ``pgrep`` and psutil's
    ``Process.name()`` show (``/proc/PID/comm``: "mptier-load-0" rather than "python"),
    cut to the kernel's 15 bytes. The command line is left as it is. Best effort: a
    kernel or libc without prctl leaves the name."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:_TASK_NAME_BYTES], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _watch_supervisor(control: socket.socket, bound_s: float) -> None:
    """(The watcher thread.) When ORPHAN_SIGNAL comes -- the supervisor is gone, the
    engine with it -- arm the kernel's timer for the exit bound, then shut the control
    socket: the serving loop takes that end of file as the supervisor's (after the task
    in hand, never during it), drops the tasks still queued, gives up its leases and
    leaves; :func:`leave_no_trace` then removes what the dead engine left behind."""
    signal.sigwait({ORPHAN_SIGNAL})
    signal.setitimer(signal.ITIMER_REAL, bound_s)
    ORPHANED.set()  # from here on the loop runs no task it takes (see serve)
    record = WATCHED["record"]
    held = peek_task(record) if record is not None else None
    if held is not None and (held[0] != TaskKind.STORE or not WATCHED["in_engine"]):
        # Only a dead engine's stores are finished. A load or lookup helps nobody now;
        # and when only the service died, the engine lives on: it fails the task itself
        # and may reuse the slot, which a store or load finishing later would read from
        # or land in. End now, as a killed worker would.
        os.kill(os.getpid(), signal.SIGKILL)
    with contextlib.suppress(OSError):
        control.shutdown(socket.SHUT_RDWR)


def leave_no_trace() -> None:
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
                        "up (%s): %s", clean.__name__, describe(exc))

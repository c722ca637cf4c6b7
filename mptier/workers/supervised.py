"""What the supervisor keeps of each worker, and the state its parts share.

:class:`~mptier.workers.supervisor.Supervisor` is one thread and one object, written in
parts (one module each, joined by inheritance): :mod:`~mptier.workers.spawning`
(starting workers, boot failures and backoff, exits), :mod:`~mptier.workers.held`
(the task a dead worker's slot held, and the reports about it),
:mod:`~mptier.workers.watchdog` (the tick: hung tasks, heartbeats, memory, parking) and
:mod:`~mptier.workers.assignment` (sessions and caretakers handed to workers).
:class:`SupervisorState` declares the state they share; the supervisor's ``__init__``
sets it, and every part runs on the supervisor's thread unless it says otherwise.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import errno
import logging
import os
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mptier.config import default_of
from mptier.layout import FileMapper
from mptier.pipes import RecordWriter
from mptier.storage.roots import RootRouter
from mptier.workers import protocol
from mptier.workers.control import ControlBlock
from mptier.workers.health import RootHealth
from mptier.workers.janitor import Janitor
from mptier.workers.launcher import BootSpec
from mptier.workers.session import IoSettings, Session

log = logging.getLogger("mptier.workers")


# Supervisor tick: bounds how late a hung task is noticed past io_timeout_s, and how
# often heartbeats and health are looked at. Deaths and messages wake it at once (pidfds,
# sockets). Every tick takes the GIL from the engine's scheduler thread for a moment, so
# ticks are rare.
TICK_S = 0.5
# errno values put on tasks the supervisor gives up on.
ERR_WORKER_DIED = errno.EOWNERDEAD
ERR_TIMED_OUT = errno.ETIMEDOUT
ERR_UNAVAILABLE = errno.EHOSTDOWN
# The slot number on messages the supervisor writes to the completion pipe.
SUPERVISOR_SLOT = 0xFFFF


class Phase(enum.Enum):
    BOOTING = "booting"  # started, not ready yet
    IDLE = "idle"  # ready, no session
    ATTACHING = "attaching"  # session sent, no answer yet
    SERVING = "serving"  # attached to the current session
    LEAVING = "leaving"  # said it is leaving, or was asked to
    KILLED = "killed"  # we sent SIGKILL; its task was handled; waiting for it to go
    STUCK = "stuck"  # KILLED for longer than STUCK_AFTER_S: parked, slot held
    GONE = "gone"  # exited; handled


@dataclass(eq=False)
class Worker:
    slot: int
    role: str
    proc: subprocess.Popen
    sock: socket.socket
    pidfd: int
    started_at: float
    generation: int
    phase: Phase = Phase.BOOTING
    session_id: int = 0
    killed_at: float = 0.0
    boot_error: str = ""
    temp_tag: str = ""
    backend: str = ""  # the I/O backend the worker says it runs
    attach_failed_at: float = 0.0
    ping_seq: int = 0
    ping_sent_at: float = 0.0
    ping_progress: int = 0
    last_ping_at: float = 0.0
    stuck_logged: bool = False
    # Temporary files its killed store may have left, removed once it has exited: while
    # a writer hangs in the kernel it holds its file's lock, and an unlink then waits
    # for it holding the folder's lock -- every lookup in that folder would hang too.
    temp_patterns: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.phase not in (Phase.GONE, Phase.KILLED, Phase.STUCK)


@dataclass
class PoolCounters:
    spawned: int = 0
    deaths: int = 0
    timeouts: int = 0
    tasks_retried: int = 0
    tasks_lost: int = 0
    boot_failures: int = 0
    heartbeat_kills: int = 0
    memory_kills: int = 0
    stuck: int = 0  # now parked (a gauge)
    reports_waiting: int = 0  # LOST/RETRY reports waiting for room in the pipe (a gauge)
    last_deaths: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class SupervisionSettings:
    """The TierConfig fields the supervisor runs by, with TierConfig's defaults. Declared
    here alone: :class:`~mptier.workers.poolbase.PoolSettings` and
    :class:`SupervisorSettings` have them by inheritance (keyword arguments, after their
    own fields), and the pool hands them on by name."""

    io_timeout_s: float = default_of("io_timeout_s")
    max_task_retries: int = default_of("max_task_retries")
    worker_start_timeout_s: float = default_of("worker_start_timeout_s")
    max_stuck_workers: int = default_of("max_stuck_workers")
    heartbeat_s: float = default_of("heartbeat_s")
    max_worker_rss_bytes: int = default_of("max_worker_rss_bytes")
    root_failures_to_fail: int = default_of("root_failures_to_fail")
    root_retry_s: float = default_of("root_retry_s")


@dataclass
class SupervisorSettings(SupervisionSettings):
    roles: list[str]
    boot: BootSpec
    root_label: str = ""  # for messages: "the file system at /mnt/kv"
    roots: list[str] = field(default_factory=list)  # every root, in root_dirs order


class SupervisorState:
    """The state the supervisor's parts share (set in ``Supervisor.__init__``), and the
    small helpers each of them uses."""

    settings: SupervisorSettings
    control: ControlBlock
    lock: threading.Lock
    changed: threading.Condition  # notified on every state change
    counters: PoolCounters
    workers: list[Worker]  # every worker not yet GONE (parked ones too)
    session: Session | None  # the supervisor's own copy of its descriptors
    session_id: int
    session_io: IoSettings | None
    attach_errors: list[str]
    health: RootHealth
    _free_slots: list[int]
    _respawn: list[tuple[float, str, int]]  # (due, role, generation)
    _boot_failures: int  # in a row
    _backoff_level: int  # deaths-while-booting in a row
    _cooldown_until: float
    _unavailable: str  # why the pool cannot serve ("" = it can)
    _unavailable_errno: int
    _reports: RecordWriter | None  # its reports to the session's engine
    _mappers: list[FileMapper]
    _janitor: Janitor  # removes temporary files: never this thread
    _next_shm_sweep: float
    _router: RootRouter
    _caretakers: dict[int, Worker]  # root index -> its caretaker
    _calls: collections.deque[Callable[[], object]]
    _stopping: bool
    _exit: bool

    def _notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def _live(self) -> list[Worker]:
        with self.lock:
            return [w for w in self.workers if w.alive]

    def _send(self, w: Worker, op: str, fds: list[int] | tuple[int, ...] = (),
              **fields: Any) -> bool:
        try:
            w.sock.setblocking(True)
            w.sock.settimeout(1.0)  # a few small messages never fill the buffer
            protocol.send(w.sock, op, fds, **fields)
            return True
        except OSError as exc:
            log.debug("mptier: could not send %s to worker pid %d: %s", op, w.pid, exc)
            return False
        finally:
            with contextlib.suppress(OSError):
                w.sock.setblocking(False)

    def _close_handles(self, w: Worker) -> None:
        if w.pidfd >= 0:
            with contextlib.suppress(OSError):
                os.close(w.pidfd)
            w.pidfd = -1
        with contextlib.suppress(OSError):
            w.sock.close()

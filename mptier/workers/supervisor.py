"""The supervisor: keeps the pool at size, and makes sure no task is lost or left silent.

One thread (in the engine, or in a ``mptier serve`` process) waits in ``poll()`` on a
wake-up pipe, every worker's pidfd and every worker's control socket, and ticks every
:data:`TICK_S`. It

* tells **boot failure** from **death**, as an arbiter should: a worker that says
  ``boot_failed`` (or exits with :data:`~mptier.workers.protocol.EXIT_BOOT_FAILED`)
  before it is ready failed to boot -- after :data:`MAX_BOOT_FAILURES` in a row the pool
  is *unavailable* for :data:`BOOT_COOLDOWN_S`, then tries again; a worker killed (by a
  signal, the OOM killer) while booting died, and is replaced with exponential backoff
  (:data:`BACKOFF_FIRST_S` doubling up to :data:`BACKOFF_MAX_S`; a worker that boots
  resets it). A worker that said ``leaving`` exited on purpose: never a crash;
* on a **death** handles the task the worker's slot holds: a store is sent back to the
  engine to queue again (stores are idempotent; at most ``max_task_retries`` times), a
  load or lookup it had *started* is reported LOST (its keys become a miss), one it had
  only dequeued is sent back too; then a new worker takes a free slot. Only the engine
  queues a task again, and only if nothing reported it yet: the worker may have sent
  DONE just before it died, and the job's slots may be reused since;
* kills a worker whose task runs past ``io_timeout_s`` (a hung mount), handles its task
  at once, and starts a replacement without waiting for the process to go: a process
  stuck in the kernel may never go. One still there :data:`STUCK_AFTER_S` after SIGKILL
  is **parked** ("stuck": its slot stays held, it is logged once). Slots are ``workers +
  max_stuck_workers``; when a hung worker needs parking and none is free, the file system
  is not responding: the pool is *unavailable* (every queued and new job fails at once,
  naming the cause) until a stuck worker finally exits and frees its slot;
* sends a **heartbeat** to idle workers every ``heartbeat_s``; one that answers nothing
  and makes no progress for as long (stopped, wedged) is killed and replaced, as is one
  whose private memory passes ``max_worker_rss_bytes``;
* while the pool is unavailable, fails every task still queued (never silence).

Its own reports (LOST, RETRY) never block it: they go through a
:class:`~mptier.pipes.RecordWriter` on the completion pipe, and when the engine does
not read for a while they wait in its list and go in when the pipe drains (the poll
watches the pipe for room meanwhile), so deaths are still handled and workers still
respawned. A worker whose slot says REPORTING waits for the same room: its I/O is over,
so io_timeout_s does not run for it; it still answers heartbeats.

Every exit is handled exactly once. No exception leaves the loop: each is logged with
its traceback and the loop goes on. Workers ask the kernel to kill them if this thread
exits, so it lives until they have left (:meth:`Supervisor.begin_stop`, then
:meth:`Supervisor.finish` once the pool has stopped them).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import errno
import glob
import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mptier.config import default_of
from mptier.errors import describe_exit
from mptier.jobs import MessageType, TaskKind, decode_task, encode_message
from mptier.layout import FileMapper
from mptier.pipes import RecordWriter, drain_records
from mptier.shm import cleanup_stale
from mptier.storage.roots import RootRouter
from mptier.workers import protocol
from mptier.workers.control import ControlBlock, PoolState, RootState, SlotState
from mptier.workers.health import RootHealth
from mptier.workers.janitor import Janitor
from mptier.workers.launcher import BootSpec, launch
from mptier.workers.session import IoSettings, Session

log = logging.getLogger("mptier.workers")

# Supervisor tick: bounds how late a hung task is noticed past io_timeout_s, and how
# often heartbeats and health are looked at. Deaths and messages wake it at once (pidfds,
# sockets). Every tick takes the GIL from the engine's scheduler thread for a moment, so
# ticks are rare.
TICK_S = 0.5
# Consecutive boot failures (not deaths) before the pool stops trying for a while: a
# broken installation fails every time, and respawning it in a loop helps nobody.
MAX_BOOT_FAILURES = 3
# How long an unavailable pool waits before trying to boot a worker again.
BOOT_COOLDOWN_S = 30.0
# Replacing a worker that died while booting: first delay, doubled per further death in
# a row, capped (a kill storm must not become a fork storm; the pool must still come
# back within seconds of the last kill).
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 5.0
# A SIGKILLed worker still present this long later is stuck in the kernel (e.g. on a dead
# NFS server): parked.
STUCK_AFTER_S = 1.0
# errno values put on tasks the supervisor gives up on.
ERR_WORKER_DIED = errno.EOWNERDEAD
ERR_TIMED_OUT = errno.ETIMEDOUT
ERR_UNAVAILABLE = errno.EHOSTDOWN
# A worker whose attach failed (e.g. it could not map the buffer) is offered the session
# again this much later, not on every tick.
ATTACH_RETRY_S = 5.0
# How often a live pool frees the buffers that dead engines left in /dev/shm (nobody
# holds their lock): a crash is cleaned up within this long by any pool on the machine,
# not only at the next start. One sweep lists /dev/shm (memory) and tries one
# non-blocking lock per mptier object: well under a millisecond for a few hundred.
SHM_SWEEP_S = 10.0
# The slot number on messages the supervisor writes to the completion pipe.
SUPERVISOR_SLOT = 0xFFFF
_PAGE = os.sysconf("SC_PAGE_SIZE")


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


@dataclass
class SupervisorSettings:
    roles: list[str]
    boot: BootSpec
    # The TierConfig fields of the same names, with their defaults.
    io_timeout_s: float = default_of("io_timeout_s")
    max_task_retries: int = default_of("max_task_retries")
    worker_start_timeout_s: float = default_of("worker_start_timeout_s")
    max_stuck_workers: int = default_of("max_stuck_workers")
    heartbeat_s: float = default_of("heartbeat_s")
    max_worker_rss_bytes: int = default_of("max_worker_rss_bytes")
    root_label: str = ""  # for messages: "the file system at /mnt/kv"
    roots: list[str] = field(default_factory=list)  # every root, in root_dirs order
    root_failures_to_fail: int = default_of("root_failures_to_fail")
    root_retry_s: float = default_of("root_retry_s")


class Supervisor:
    """The thread behind :class:`~mptier.workers.pool.WorkerPool` (see module doc).

    Public methods are called from other threads; they only post work to the
    supervisor's thread or read state under ``self.lock``.
    """

    def __init__(self, settings: SupervisorSettings, control: ControlBlock) -> None:
        self.settings = settings
        self.control = control
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified on every state change
        self.counters = PoolCounters()
        self.workers: list[Worker] = []  # every worker not yet GONE (parked ones too)
        self._free_slots = list(range(control.n_slots - 1, -1, -1))
        self._respawn: list[tuple[float, str, int]] = []  # (due, role, generation)
        self._boot_failures = 0  # in a row
        self._backoff_level = 0  # deaths-while-booting in a row
        self._cooldown_until = 0.0
        self._unavailable = ""  # why the pool cannot serve ("" = it can)
        self._unavailable_errno = 0
        self.session: Session | None = None  # the supervisor's own copy of its descriptors
        self._reports: RecordWriter | None = None  # its reports to the session's engine
        self.session_id = 0
        self.session_io: IoSettings | None = None
        self.attach_errors: list[str] = []
        self._mappers: list[FileMapper] = []
        self._janitor = Janitor()  # removes temporary files: never this thread
        self._next_shm_sweep = time.monotonic() + SHM_SWEEP_S
        roots = settings.roots or [settings.root_label]
        self._router = RootRouter(roots)
        self.health = RootHealth(control, roots, settings.root_failures_to_fail,
                                 settings.root_retry_s)
        self._caretakers: dict[int, Worker] = {}  # root index -> its caretaker
        self._calls: collections.deque[Callable[[], object]] = collections.deque()
        self._stopping = False
        self._exit = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._run, name="mptier-supervisor",
                                        daemon=True)

    # -- called from other threads ------------------------------------------------------

    def start(self) -> None:
        """Start the thread, which spawns every worker; returns at once."""
        self._thread.start()

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the supervisor's thread, soon."""
        self._calls.append(fn)
        self.wake()

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def unavailable(self) -> tuple[str, int]:
        return self._unavailable, self._unavailable_errno

    def begin_stop(self) -> None:
        """No more respawns, retries or heartbeats from here on."""
        self._stopping = True
        self.wake()

    def finish(self, timeout_s: float = 5.0) -> None:
        """End the thread (after the workers have gone) and close what it holds."""
        self._exit = True
        self.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        with self.lock:
            workers = list(self.workers)
        for w in workers:
            self._close_handles(w)
        self._janitor.close()
        if self.session is not None:
            self.session.close()
            self.session = None
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        for role in self.settings.roles:
            self._guarded(self._spawn, role, 0)
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        watched: dict[int, tuple[Any, str]] = {}
        next_tick = time.monotonic()
        while not self._exit:
            try:
                self._watch(poller, watched)
                timeout_ms = max(0.0, next_tick - time.monotonic()) * 1000
                events = poller.poll(timeout_ms)
                for fd, _ in events:
                    if fd == self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                        continue
                    w, what = watched.get(fd, (None, ""))
                    if w is None:
                        continue
                    if what == "lifeline":
                        self._guarded(self._lifeline_closed, w)
                    elif what == "completion":
                        self._guarded(self._flush_reports)
                    elif what == "sock":
                        self._guarded(self._read_messages, w, poller, watched)
                    else:
                        self._guarded(self._reap, w)
                while self._calls:
                    self._guarded(self._calls.popleft())
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + TICK_S
                    self._guarded(self._tick)
                self._guarded(self._respawn_due)
                self._guarded(self._update_state)
            except Exception:  # never let the supervisor die
                log.exception("mptier supervisor: unexpected error (continuing)")
                time.sleep(0.05)
        with self.changed:
            self.changed.notify_all()

    def _guarded(self, fn: Callable[..., object], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("mptier supervisor: %s failed (continuing)",
                          getattr(fn, "__name__", fn))

    def _watch(self, poller: select.poll, watched: dict[int, tuple[Any, str]]) -> None:
        with self.lock:
            workers = list(self.workers)
        wanted: dict[int, tuple[Any, str]] = {}
        if self.session is not None:  # the engine's lifeline: end of file = it is gone
            wanted[self.session.lifeline] = (self.session, "lifeline")
            if self._reports is not None and self._reports.overflow:  # room for them
                wanted[self.session.completion] = (self.session, "completion")
        for w in workers:
            if w.pidfd >= 0:
                wanted[w.pidfd] = (w, "pidfd")
            if w.sock.fileno() >= 0:
                wanted[w.sock.fileno()] = (w, "sock")
        for fd in list(watched):
            if wanted.get(fd) != watched[fd]:  # gone, or the number now names another
                with contextlib.suppress(KeyError, ValueError):
                    poller.unregister(fd)
                del watched[fd]
        for fd, entry in wanted.items():
            if fd not in watched:
                poller.register(fd, select.POLLOUT if entry[1] == "completion"
                                else select.POLLIN)
                watched[fd] = entry

    def _notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    # -- spawning ------------------------------------------------------------------------

    def _spawn(self, role: str, generation: int) -> bool:
        """Start a worker in a free slot; False (and a retry scheduled) if none is free
        or the start failed."""
        if self._stopping:
            return False
        if not self._free_slots:
            self._respawn.append((time.monotonic() + TICK_S, role, generation))
            return False
        slot = self._free_slots.pop()
        self.control.reset(slot, role)
        try:
            proc, sock = launch(self.settings.boot, slot, role)
        except OSError as exc:  # out of descriptors or processes: a boot failure
            self.control.release_slot(slot)
            self._free_slots.append(slot)
            self._boot_failed(f"could not start a {role} worker process: {exc}")
            # Try again (after the cool-down, when that was one failure too many): the
            # cause (an engine at its descriptor limit) may pass.
            self._schedule_respawn(role, generation + 1, TICK_S)
            return False
        try:
            pidfd = os.pidfd_open(proc.pid)
        except OSError:
            pidfd = -1  # out of descriptors: the tick polls this one (never waits on it)
        sock.setblocking(False)
        w = Worker(slot=slot, role=role, proc=proc, sock=sock, pidfd=pidfd,
                   started_at=time.monotonic(), generation=generation)
        with self.lock:
            self.workers.append(w)
            self.counters.spawned += 1
        if pidfd < 0:
            self._reap(w)
        return True

    def _schedule_respawn(self, role: str, generation: int, delay: float) -> None:
        if not self._stopping:
            self._respawn.append((time.monotonic() + delay, role, generation))

    def _respawn_due(self) -> None:
        if self._stopping or not self._respawn:
            return
        now = time.monotonic()
        if now < self._cooldown_until:
            return
        due = [r for r in self._respawn if r[0] <= now]
        self._respawn = [r for r in self._respawn if r[0] > now]
        for _, role, generation in due:
            if self._free_slots:
                self._spawn(role, generation)
            else:  # every spare slot is held by a stuck worker: wait for one to go
                self._respawn.append((now + TICK_S, role, generation))

    # -- messages from workers -----------------------------------------------------------

    def _read_messages(self, w: Worker, poller: select.poll,
                       watched: dict[int, tuple[Any, str]]) -> None:
        while True:
            try:
                got = protocol.receive(w.sock)
            except BlockingIOError:
                return
            except OSError:
                got = None
            if got is None:  # its end closed: it is exiting; the pidfd says when
                fd = w.sock.fileno()
                with contextlib.suppress(KeyError, ValueError):
                    poller.unregister(fd)
                watched.pop(fd, None)
                w.sock.close()
                if w.pidfd < 0:
                    self._reap(w)
                return
            message, fds = got
            for fd in fds:
                os.close(fd)
            self._on_message(w, message)

    def _on_message(self, w: Worker, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == protocol.READY:
            if w.phase is Phase.BOOTING:
                w.phase = Phase.IDLE
                self._boot_failures = 0
                self._backoff_level = 0
                if self.session is not None:
                    self._send_attach(w)
        elif op == protocol.BOOT_FAILED:
            w.boot_error = message.get("error", "")
        elif op == protocol.ATTACHED:
            if w.phase is Phase.ATTACHING and w.session_id == self.session_id:
                w.phase = Phase.SERVING
                w.temp_tag = message.get("temp_tag", "")
                w.backend = message.get("backend", "")
        elif op == protocol.ATTACH_FAILED:
            error = f"{w.role} worker pid {w.pid}: {message.get('error', '')}"
            log.error("mptier: a worker could not attach to %s: %s",
                      self.session.label if self.session else "the session", error)
            with self.lock:
                self.attach_errors.append(error)
            if w.phase is Phase.ATTACHING:
                w.phase = Phase.IDLE
                w.attach_failed_at = time.monotonic()
        elif op == protocol.DETACHED:
            if w.phase in (Phase.SERVING, Phase.ATTACHING):
                w.phase = Phase.IDLE
            w.session_id = 0
        elif op == protocol.LEAVING:
            if w.alive:
                w.phase = Phase.LEAVING
        elif op == protocol.PONG and message.get("seq") == w.ping_seq:
            w.ping_sent_at = 0.0
        elif op == protocol.ROOT_HEALTH:
            index = int(message.get("root", -1))
            if message.get("ok"):
                self.health.success(index)
            else:
                self.health.failure(index, int(message.get("errno") or errno.EIO),
                                    f"{w.role} worker pid {w.pid}: {message.get('text', '')}")
        elif op == protocol.ROOT_PROBE:
            self.health.probing(int(message.get("root", -1)))
        self._notify()

    # -- sessions ------------------------------------------------------------------------

    def attach(self, session: Session, io: IoSettings) -> int:
        """(Supervisor thread.) Make ``session`` (the supervisor's own copy) current and
        hand it to every ready worker. Returns its id."""
        if self.session is not None:
            self.session.close()
        self.session_id += 1
        self.session = session
        self._reports = RecordWriter(session.completion)
        self._count_waiting()
        self.session_io = io
        with self.lock:
            self.attach_errors = []
        self._mappers = [FileMapper(root, **session.layout) for root in io.root_dirs]
        self._router = RootRouter(io.root_dirs)
        self._caretakers.clear()
        for w in self._live():
            if w.phase is Phase.IDLE:
                self._send_attach(w)
        self._notify()
        return self.session_id

    def end_session(self, ask_workers: bool) -> None:
        """(Supervisor thread.) Forget the current session; with ``ask_workers``, tell
        attached workers to detach (otherwise they detach on the lifeline's end)."""
        if ask_workers:
            for w in self._live():
                if w.phase in (Phase.SERVING, Phase.ATTACHING):
                    self._send(w, protocol.DETACH)
        if self._reports is not None:
            self._flush_reports()  # what fits now; the rest is the engine's to fail
            if self._reports.overflow:
                log.warning("mptier: %d report(s) of tasks given up on were not delivered: "
                            "%s stopped reading its completion pipe and ended its session",
                            len(self._reports.overflow),
                            self.session.label if self.session else "the engine")
        self._reports = None
        self._count_waiting()
        if self.session is not None:
            self.session.close()
        self.session = None
        self._notify()

    def _lifeline_closed(self, session: Session) -> None:
        """The engine closed its lifeline or died: its workers detach by themselves."""
        if session is self.session:
            log.info("mptier: %s ended its session", session.label or "the engine")
            self.end_session(ask_workers=False)

    def _send_attach(self, w: Worker) -> None:
        assert self.session is not None and self.session_io is not None
        description, fds = self.session.to_worker()
        w.phase = Phase.ATTACHING
        w.session_id = self.session_id
        if not self._send(w, protocol.ATTACH, fds, session=description,
                          io=self.session_io.to_wire()):
            w.phase = Phase.IDLE
            w.session_id = 0

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

    def ask_to_leave(self) -> None:
        """(Supervisor thread.) Ask every worker to leave."""
        for w in self._live():
            if w.phase is not Phase.LEAVING:
                self._send(w, protocol.EXIT)
                w.phase = Phase.LEAVING
        self._notify()

    # -- exits ---------------------------------------------------------------------------

    def _reap(self, w: Worker) -> None:
        """A worker's pidfd became readable (or it could not be watched): it exited.
        Handles the exit exactly once."""
        if w.phase is Phase.GONE:
            return
        if w.proc.poll() is None:
            return  # still running (a spurious wake-up, or no pidfd: the tick looks again)
        was = w.phase
        w.phase = Phase.GONE
        self._close_handles(w)
        how = describe_exit(w.proc.returncode)
        # The slot is read (the task it held) before it is freed for a replacement.
        if was is Phase.STUCK:
            log.warning("mptier: stuck %s worker pid %d finally exited; its slot is free "
                        "again", w.role, w.pid)
        elif was is Phase.KILLED or was is Phase.LEAVING or self._stopping:
            pass  # killed: its task and replacement were handled then; else planned
        elif was is Phase.BOOTING:
            if w.boot_error or w.proc.returncode == protocol.EXIT_BOOT_FAILED:
                self._boot_failed(f"{w.role} worker pid {w.pid} failed to boot: "
                                  f"{w.boot_error or how}")
                self._schedule_respawn(w.role, w.generation + 1, 0.0)
            else:
                self._died(w, f"{w.role} worker pid {w.pid} {how} while booting",
                           ERR_WORKER_DIED)
                self._backoff_level += 1
                delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self._backoff_level - 1))
                self._schedule_respawn(w.role, w.generation + 1, delay)
        else:
            self._died(w, f"{w.role} worker pid {w.pid} {how}", ERR_WORKER_DIED)
            self._schedule_respawn(w.role, w.generation + 1, 0.0)
        with self.lock:
            if w in self.workers:
                self.workers.remove(w)
            if was is Phase.STUCK:
                self.counters.stuck -= 1
        self.control.release_slot(w.slot)
        self._free_slots.append(w.slot)
        if w.temp_patterns:  # it is gone: nothing holds its files any more
            self._janitor.remove(w.temp_patterns)
        self._notify()

    def _close_handles(self, w: Worker) -> None:
        if w.pidfd >= 0:
            with contextlib.suppress(OSError):
                os.close(w.pidfd)
            w.pidfd = -1
        with contextlib.suppress(OSError):
            w.sock.close()

    def _died(self, w: Worker, description: str, err: int) -> None:
        """Account a death and handle the task its slot held."""
        with self.lock:
            self.counters.deaths += 1
            self.counters.last_deaths = [*self.counters.last_deaths, description][-10:]
        log.warning("mptier: %s", description)
        self._handle_held_task(w, description, err)

    def _boot_failed(self, description: str) -> None:
        with self.lock:
            self.counters.boot_failures += 1
        self._boot_failures += 1
        log.error("mptier: %s", description)
        if self._boot_failures >= MAX_BOOT_FAILURES:
            self._cooldown_until = time.monotonic() + BOOT_COOLDOWN_S
            self._set_unavailable(
                f"{self._boot_failures} workers in a row failed to boot (last: "
                f"{description}); trying again in {BOOT_COOLDOWN_S:g} s", errno.ECHILD)
            self._boot_failures = MAX_BOOT_FAILURES - 1  # one more failure: cool down again

    def _handle_held_task(self, w: Worker, description: str, err: int) -> None:
        snap = self.control.snapshot(w.slot)
        held = snap.held_task
        if held is None:
            return
        kind, task_id, attempt = held
        record = self.control.full_record(w.slot)
        self.control.clear_record(w.slot)
        if kind == TaskKind.STORE and err != ERR_TIMED_OUT:
            # (After a timeout the root may hang: listing it here would hang this
            # thread. The sweeper removes those once the worker's lease is free.)
            self._remove_temp_files(decode_task(record).keys, w)
        if self.session is None or w.session_id != self.session_id:
            # The task of an earlier session (in a service: an engine that is gone). Its
            # id means nothing to the engine attached now -- or, worse, names one of its
            # own tasks: tell nobody.
            with self.lock:
                self.counters.tasks_lost += 1
            log.info("mptier: %s; its task belonged to a session that has ended",
                     description)
            return
        # A store is idempotent: run it again. A load or lookup that had not started yet
        # likewise; one that had started fails (its keys become a miss). The engine has
        # the last word: it drops the retry if the task was reported meanwhile.
        retry = (not self._stopping and attempt < self.settings.max_task_retries
                 and (kind == TaskKind.STORE or not snap.started_ns))
        text = f"{description} while running this task"
        if retry:
            with self.lock:
                self.counters.tasks_retried += 1
            self._post(MessageType.RETRY, task_id, err, text, attempt=attempt + 1)
            return
        with self.lock:
            self.counters.tasks_lost += 1
        self._post(MessageType.LOST, task_id, err, text)

    def _remove_temp_files(self, keys: list[bytes], w: Worker) -> None:
        """A killed store may leave ``<final>.<tag>.*.tmp`` files (where blocks are not
        written as O_TMPFILE files): have this worker's removed once it has exited (see
        :attr:`Worker.temp_patterns`) -- by the janitor's process, never this thread (a
        hung mount would hang it). Roots out of rotation are left alone; the sweeper
        finds those files later (the worker's lease is free by then)."""
        if not self._mappers or not w.temp_tag:
            return
        for key in keys:
            index = self._router.index_of(key)
            if index >= len(self._mappers) or \
                    self.control.root_health(index)[0] == RootState.OUT:
                continue
            final = glob.escape(self._mappers[index].path_for(key))
            w.temp_patterns.append(f"{final}.{w.temp_tag}.*.tmp")

    def _post(self, type_: MessageType, task_id: int, err: int, text: str,
              attempt: int = 0) -> None:
        """Tell the engine a task was given up on (LOST) or should run again (RETRY).
        Never blocks: while the engine's pipe is full the report waits in this thread's
        list, and goes in as soon as there is room (see the module docstring)."""
        if self._reports is None:
            return
        self._flush_reports(encode_message(type_, SUPERVISOR_SLOT, os.getpid(), errno=err,
                                           task_id=task_id, payload=text, attempt=attempt))

    def _flush_reports(self, message: bytes | None = None) -> None:
        """Put ``message`` (if any) behind the reports waiting, and write them while the
        pipe has room; each one written is counted (the engine reads when a counter
        moves)."""
        reports = self._reports
        if reports is None:
            return
        before = reports.sent
        try:
            if message is not None:
                reports.put(message)
            reports.flush()
        except OSError:
            reports.overflow.clear()  # the engine is gone: nobody to tell
        finally:
            self.control.bump(self.control.supervisor_counter, reports.sent - before)
            self._count_waiting()

    def _count_waiting(self) -> None:
        waiting = len(self._reports.overflow) if self._reports is not None else 0
        if waiting != self.counters.reports_waiting:
            with self.lock:
                self.counters.reports_waiting = waiting

    # -- the tick ------------------------------------------------------------------------

    def _live(self) -> list[Worker]:
        with self.lock:
            return [w for w in self.workers if w.alive]

    def _tick(self) -> None:
        now = time.monotonic()
        now_ns = time.monotonic_ns()
        s = self.settings
        with self.lock:
            unwatched = [w for w in self.workers if w.pidfd < 0]
        for w in unwatched:  # started without a pidfd: look for its exit here
            self._reap(w)
        self._flush_reports()  # a backstop for the poll's room event
        for w in self._live():
            snap = self.control.snapshot(w.slot)
            if w.phase is Phase.BOOTING and now - w.started_at > s.worker_start_timeout_s:
                w.boot_error = f"not ready within worker_start_timeout_s={s.start_timeout_s:g}"
                self._kill(w)
                continue
            # (A task whose report waits for room in the completion pipe is done with its
            # I/O: the engine is not reading, the file system is not hung.)
            if snap.held_task and snap.started_ns and snap.state != SlotState.REPORTING \
                    and now_ns - snap.started_ns > s.io_timeout_s * 1e9:
                with self.lock:
                    self.counters.timeouts += 1
                how = (f"was killed after its task ran {(now_ns - snap.started_ns) / 1e9:.1f}"
                       f" s (io_timeout_s={s.io_timeout_s:g})")
                self._blame_root(w, how)
                self._kill(w, how, ERR_TIMED_OUT)
                continue
            if w.phase is Phase.IDLE and self.session is not None and not self._stopping \
                    and now - w.attach_failed_at > ATTACH_RETRY_S:
                self._send_attach(w)  # a replacement that missed it, or a failed attach
            if s.heartbeat_s and not self._stopping:
                self._heartbeat(w, snap, now)
        for w in self._parked_candidates(now):
            w.phase = Phase.STUCK
            with self.lock:
                self.counters.stuck += 1
            log.error("mptier: %s worker pid %d did not exit %.0f s after SIGKILL: it is "
                      "stuck in the kernel (a dead mount?); parked, slot %d held", w.role,
                      w.pid, now - w.killed_at, w.slot)
        if s.max_worker_rss_bytes and not self._stopping:
            self._check_memory()
        self._janitor.poll()
        if now >= self._next_shm_sweep:
            self._next_shm_sweep = now + SHM_SWEEP_S
            cleanup_stale()

    def _parked_candidates(self, now: float) -> list[Worker]:
        with self.lock:
            return [w for w in self.workers if w.phase is Phase.KILLED
                    and now - w.killed_at > STUCK_AFTER_S]

    def _heartbeat(self, w: Worker, snap: Any, now: float) -> None:
        if w.phase not in (Phase.IDLE, Phase.SERVING):
            return
        if w.ping_sent_at:
            progressed = snap.tasks_done != w.ping_progress or snap.state == SlotState.BUSY
            if progressed:
                w.ping_sent_at = 0.0  # it is working: it answers after its task
            elif now - w.ping_sent_at > self.settings.heartbeat_s:
                with self.lock:
                    self.counters.heartbeat_kills += 1
                how = (f"did not answer a heartbeat within {self.settings.heartbeat_s:g} s "
                       "while idle")
                self._blame_root(w, how)  # a caretaker hung walking a root
                self._kill(w, how, ERR_WORKER_DIED)
            return
        # Idle, or waiting for room to report: either way it answers in a moment.
        if snap.state in (SlotState.IDLE, SlotState.REPORTING) and \
                now - w.last_ping_at >= self.settings.heartbeat_s:
            w.ping_seq += 1
            w.ping_progress = snap.tasks_done
            w.ping_sent_at = w.last_ping_at = now
            if not self._send(w, protocol.PING, seq=w.ping_seq):
                w.ping_sent_at = 0.0

    def _blame_root(self, w: Worker, how: str) -> None:
        """A worker hung: if it said which root it was working on, that root failed."""
        index = self.control.slot_root(w.slot)
        if index is not None:
            self.health.failure(index, errno.ETIMEDOUT, f"{w.role} worker pid {w.pid} {how}")

    def _assign_caretakers(self) -> None:
        """Give every root of the session a caretaker: a serving worker, store workers
        first, the fewest roots each. A caretaker that died, left or detached is
        replaced here (its roots' usage stays published meanwhile)."""
        if self.session is None or self._stopping or not self._mappers:
            return
        serving = [w for w in self._live() if w.phase is Phase.SERVING
                   and w.session_id == self.session_id]
        if not serving:
            return
        load: dict[Worker, int] = {w: 0 for w in serving}
        orphans = []
        for index in range(len(self._mappers)):
            w = self._caretakers.get(index)
            if w is not None and w in load:
                load[w] += 1
            else:
                orphans.append(index)
        if not orphans:
            return
        given: dict[Worker, list[int]] = {}
        for index in orphans:
            w = min(serving, key=lambda c: (load[c], c.role != "store", c.slot))
            load[w] += 1
            self._caretakers[index] = w
            given.setdefault(w, []).append(index)
        for w, indices in given.items():
            if not self._send(w, protocol.CARETAKE, roots=indices):
                for index in indices:
                    self._caretakers.pop(index, None)

    def _check_memory(self) -> None:
        limit = self.settings.max_worker_rss_bytes
        for w in self._live():
            private = private_memory(w.pid)
            if private is not None and private > limit:
                with self.lock:
                    self.counters.memory_kills += 1
                self._kill(w, f"was killed: private memory {private >> 20} MiB passed "
                              f"max_worker_rss_bytes={limit >> 20} MiB", ERR_WORKER_DIED)

    def _kill(self, w: Worker, how: str = "", err: int = ERR_WORKER_DIED) -> None:
        """SIGKILL ``w`` and handle it now, without waiting for it to go: its task is
        failed or retried and (unless booting) a replacement is started."""
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(w.pidfd, signal.SIGKILL) if w.pidfd >= 0 \
                else w.proc.kill()
        if w.phase is Phase.BOOTING:
            return  # its exit is a boot failure or a death; _reap decides
        w.phase = Phase.KILLED
        w.killed_at = time.monotonic()
        description = f"{w.role} worker pid {w.pid} {how}"
        self._died(w, description, err)
        self._schedule_respawn(w.role, w.generation + 1, 0.0)
        self._notify()

    # -- state ---------------------------------------------------------------------------

    def _set_unavailable(self, reason: str, err: int) -> None:
        if reason != self._unavailable:
            if reason:
                log.error("mptier: the worker pool cannot serve: %s", reason)
            elif self._unavailable:
                log.warning("mptier: the worker pool serves again")
        self._unavailable, self._unavailable_errno = reason, err
        self.control.set_pool_state(PoolState.UNAVAILABLE if reason else PoolState.SERVING,
                                    err, reason)
        self._notify()

    def _update_state(self) -> None:
        if self._stopping:
            return
        self._assign_caretakers()
        now = time.monotonic()
        with self.lock:
            stuck = sum(1 for w in self.workers if w.phase is Phase.STUCK)
        waiting_for_slot = bool(self._respawn) and not self._free_slots
        if now < self._cooldown_until:
            return  # the boot-failure reason stands until the cool-down ends
        if waiting_for_slot and stuck >= self.settings.max_stuck_workers:
            where = self.settings.root_label or "the root"
            self._set_unavailable(
                f"the file system at {where} is not responding: {stuck} worker(s) stuck in "
                f"I/O (max_stuck_workers={self.settings.max_stuck_workers}); failing I/O "
                "until one of them exits", ERR_UNAVAILABLE)
        elif self._unavailable and (self._unavailable_errno != errno.ECHILD
                                    or self._any_ready()):
            self._set_unavailable("", 0)
        if self._unavailable:
            self._fail_queued()

    def _any_ready(self) -> bool:
        return any(w.phase in (Phase.IDLE, Phase.SERVING) for w in self._live())

    def _fail_queued(self) -> None:
        """Nobody can run queued tasks now: fail them (never silence)."""
        if self.session is None:
            return
        for kind in TaskKind:
            for record in drain_records(self.session.queues[kind]):
                with self.lock:
                    self.counters.tasks_lost += 1
                self._post(MessageType.LOST, decode_task(record).task_id,
                           self._unavailable_errno, self._unavailable)


def private_memory(pid: int) -> int | None:
    """Resident memory of ``pid`` that is not shared (RSS less the shared buffer and
    other file pages it maps), from ``/proc/<pid>/statm``: a cheap read, unlike USS."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            fields = f.read().split()
    except OSError:
        return None
    return (int(fields[1]) - int(fields[2])) * _PAGE

"""The supervisor: keeps the pool at size, and makes sure no task is lost or left silent.

One thread (in the engine, or in a ``mptier serve`` process) waits in ``poll()`` on a
wake-up pipe, every worker's pidfd and every worker's control socket, and ticks every
:data:`TICK_S`. :class:`Supervisor` is the one object the pool talks to; it is written in
parts, one module each (:mod:`~mptier.workers.supervised` declares the state they share):

* :mod:`~mptier.workers.spawning` -- starting workers; **boot failure** told from
  **death** (a pool that cannot boot cools down; deaths are replaced with backoff);
  every exit handled exactly once;
* :mod:`~mptier.workers.held` -- the task a dead worker's slot held: retried or
  reported LOST, through reports that never block this thread;
* :mod:`~mptier.workers.watchdog` -- the tick: tasks past ``io_timeout_s`` killed,
  stuck workers parked, heartbeats, private-memory limits;
* :mod:`~mptier.workers.assignment` -- the session handed to every worker, and a
  caretaker for each root;
* here -- the thread and its poll, the workers' messages, and whether the pool can
  serve (unavailable while it cannot boot or too many workers are stuck; then every
  queued task fails: never silence).

No exception leaves the loop: each is logged with its traceback and the loop goes on.
Workers ask the kernel to kill them if this thread exits, so it lives until they have
left (:meth:`Supervisor.begin_stop`, then :meth:`Supervisor.finish` once the pool has
stopped them).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from mptier.storage.roots import RootRouter
from mptier.workers import protocol
from mptier.workers.assignment import Assignment
from mptier.workers.control import ControlBlock, PoolState
from mptier.workers.health import RootHealth
from mptier.workers.held import HeldTasks
from mptier.workers.janitor import Janitor
from mptier.workers.spawning import Spawning
from mptier.workers.supervised import (
    ERR_UNAVAILABLE,
    TICK_S,
    Phase,
    PoolCounters,
    SupervisorSettings,
    Worker,
    log,
)
from mptier.workers.watchdog import SHM_SWEEP_S, STUCK_AFTER_S, Watchdog

__all__ = ["SHM_SWEEP_S", "STUCK_AFTER_S", "TICK_S", "Phase", "PoolCounters", "Supervisor",
           "SupervisorSettings"]


class Supervisor(Spawning, HeldTasks, Watchdog, Assignment):
    """The thread behind :class:`~mptier.workers.pool.WorkerPool` (see module doc).

    Public methods are called from other threads; they only post work to the
    supervisor's thread or read state under ``self.lock``.
    """

    def __init__(self, settings: SupervisorSettings, control: ControlBlock) -> None:
        self.settings = settings
        self.control = control
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.counters = PoolCounters()
        self.workers = []
        self._free_slots = list(range(control.n_slots - 1, -1, -1))
        self._respawn = []
        self._boot_failures = 0
        self._backoff_level = 0
        self._cooldown_until = 0.0
        self._unavailable = ""
        self._unavailable_errno = 0
        self.session = None
        self._reports = None
        self.session_id = 0
        self.session_io = None
        self.attach_errors = []
        self._mappers = []
        self._janitor = Janitor()
        self._next_shm_sweep = time.monotonic() + SHM_SWEEP_S
        roots = settings.roots or [settings.root_label]
        self._router = RootRouter(roots)
        self.health = RootHealth(control, roots, settings.root_failures_to_fail,
                                 settings.root_retry_s)
        self._caretakers = {}
        self._calls = collections.deque()
        self._stopping = False
        self._exit = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._run, name="mptier-supervisor",
                                        daemon=True)

    # -- called from other threads -----------------------------------------------------

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

    # -- the thread --------------------------------------------------------------------

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

    # -- messages from workers ---------------------------------------------------------

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
            if (w.phase is Phase.ATTACHING and w.session_id == self.session_id
                    and message.get("session_id", w.session_id) == self.session_id):
                w.phase = Phase.SERVING
                w.temp_tag = message.get("temp_tag", "")
                w.backend = message.get("backend", "")
        elif op == protocol.ATTACH_FAILED:
            error = f"{w.role} worker pid {w.pid}: {message.get('error', '')}"
            current = self.session is not None and \
                message.get("session_id", w.session_id) == self.session_id
            if current:
                log.error("mptier: a worker could not attach to %s: %s",
                          self.session.label if self.session else "the session", error)
                with self.lock:
                    self.attach_errors.append(error)
            else:
                # An ended session's buffer (its engine may have broken it on its way
                # out): nothing to do with the current session, offered at once.
                log.info("mptier: a worker could not attach to an ended session: %s",
                         error)
            if w.phase is Phase.ATTACHING:
                w.phase = Phase.IDLE
                w.session_id = 0
                if current:
                    w.attach_failed_at = time.monotonic()
                elif self.session is not None and not self._stopping:
                    self._send_attach(w)
        elif op == protocol.DETACHED:
            # "Not attached" (session 0) answers a detach that crossed an attach still
            # on its way to the worker: that attach's answer decides.
            if message.get("session_id", w.session_id) == w.session_id:
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

    # -- state -------------------------------------------------------------------------

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


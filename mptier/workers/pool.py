"""The worker pool: what an engine (or a service) talks to. See :mod:`mptier.workers`.

:class:`WorkerPool` runs worker processes and the supervisor thread that keeps them
(:mod:`mptier.workers.supervisor`). :class:`~mptier.workers.threads.ThreadWorkers` runs
the same serving loop on threads of the engine, for a buffer that cannot be shared with
other processes. Both (on :mod:`~mptier.workers.poolbase`: settings, roots prepared by
:mod:`~mptier.workers.probe`, figures from :mod:`~mptier.workers.figures`)::

    pool = open_pool(settings, memory)    # WorkerPool, or ThreadWorkers when memory given
    pool.start()                          # workers boot; raises MptierError if they cannot
    io = pool.attach(session)             # prepares the root; every worker takes the session
    ...                                   # the engine queues tasks; workers report
    pool.end_session()                    # after the engine closed its lifeline
    pool.stop()                           # workers leave (escalating); idempotent

``start``, ``attach``, ``end_session`` and ``stop`` block (each for a bounded time);
``stats``, ``pids`` and ``unavailable`` do not.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, fields
from typing import Any

from mptier.errors import MptierError
from mptier.mapping import page_bytes
from mptier.workers.contract import Pool
from mptier.workers.control import ControlBlock, SlotState
from mptier.workers.figures import room_waits, root_figures, store_figures, task_latency
from mptier.workers.launcher import BootSpec
from mptier.workers.poolbase import DETACH_GRACE_S, STOP_GRACE_S, ControlDoor, PoolSettings
from mptier.workers.probe import bounded, prepare_io
from mptier.workers.session import IoSettings, Session
from mptier.workers.supervisor import (
    Phase,
    PoolCounters,
    Supervisor,
    SupervisorSettings,
)
from mptier.workers.threads import ThreadWorkers

# stop(): after asking (STOP_GRACE_S), how long workers get after SIGTERM, then after
# SIGKILL (a worker stuck in the kernel is then left behind).
TERM_GRACE_S = 2.0
KILL_GRACE_S = 2.0


def _same_fields(cls: type, settings: PoolSettings) -> dict[str, Any]:
    """The fields of settings class ``cls`` that ``settings`` has by the same name."""
    names = {f.name for f in fields(settings)}
    return {f.name: getattr(settings, f.name) for f in fields(cls) if f.name in names}


class WorkerPool(ControlDoor, Pool):
    """Worker processes kept by a supervisor thread (see module docstring)."""

    mode = "processes"

    def __init__(self, settings: PoolSettings, in_engine: bool = True) -> None:
        """``in_engine``: this process is the engine whose buffer the workers map (False
        in ``mptier serve``): a worker outliving it may finish the stores it holds."""
        self.settings = settings
        n_workers = len(settings.roles)
        # A parked (stuck) worker keeps its slot; its replacement needs another.
        self.control = ControlBlock(n_workers + settings.max_stuck_workers)
        boot = BootSpec(n_slots=self.control.n_slots, control_block_fd=self.control.fd,
                        in_engine=in_engine, **_same_fields(BootSpec, settings))
        self._supervisor = Supervisor(SupervisorSettings(
            roles=settings.roles, boot=boot, root_label=settings.root_label,
            roots=settings.roots, **_same_fields(SupervisorSettings, settings)),
            self.control)
        self._started = self._stopped = False
        self._last_stats: dict[str, Any] | None = None
        self.io: IoSettings | None = None

    @property
    def counters(self) -> PoolCounters:
        return self._supervisor.counters

    def start(self) -> None:
        """Start every worker; blocks until all are ready. Raises ``MptierError`` naming
        the cause when they cannot start (after cleaning up)."""
        sup = self._supervisor
        self._started = True
        sup.start()
        deadline = time.monotonic() + self.settings.worker_start_timeout_s
        want = len(self.settings.roles)
        with sup.changed:
            while True:
                ready = sum(1 for w in sup.workers if w.phase is not Phase.BOOTING
                            and w.alive)
                if ready >= want:
                    return
                reason, _ = sup.unavailable()
                if reason:  # boot failures in a row: a broken installation or setting
                    raise MptierError(f"mptier workers could not start: {reason}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MptierError(
                        f"only {ready} of {want} mptier workers were ready within "
                        f"worker_start_timeout_s={self.settings.worker_start_timeout_s:g} s")
                sup.changed.wait(min(left, 0.5))

    def attach(self, session: Session) -> IoSettings:
        """Prepare the root for the session's layout and hand the session to every
        worker; blocks until all have taken it -- or, when no worker can serve now
        (``unavailable()``), not for them: the engine fails its jobs with the reason
        until they are back. The pool keeps its own copies of the
        session's descriptors. Raises ``MptierError`` (or ``OSError``/``ConfigError``
        from the root) and leaves no session behind on failure."""
        sup = self._supervisor
        io = bounded(lambda: prepare_io(self.settings, session.layout, session.block_bytes,
                                        page_bytes(session.segments)),
                     self.settings.io_timeout_s, f"preparing {self.settings.root_label}")
        self.io = io
        own = session.dup()
        ids: list[int] = []
        sup.call_soon(lambda: ids.append(sup.attach(own, io)))
        deadline = time.monotonic() + self.settings.worker_start_timeout_s
        with sup.changed:
            while True:
                # (Read only once the supervisor thread has begun the session: until
                # then the list holds the last session's failures.)
                errors = list(sup.attach_errors) if ids else []
                if ids and not errors:
                    live = [w for w in sup.workers if w.alive]
                    # A worker still serving an earlier session (in a service whose last
                    # engine died mid-task; the task may hang until io_timeout_s) takes
                    # this one when that task ends: nobody needs waiting for.
                    if live and all(w.phase is Phase.SERVING for w in live):
                        return io
                    if not live and sup.unavailable()[0]:
                        # Nobody can serve now (every worker stuck, or cooling down
                        # after boot failures): the session is the pool's all the same.
                        # The engine reads why from the control block and fails its
                        # jobs at once; workers take the session when they are back.
                        return io
                if errors or time.monotonic() > deadline:
                    break
                sup.changed.wait(0.5)
        # Workers that answered are told to detach and waited for; one that has not
        # answered within worker_start_timeout_s reads the detach after its attach.
        self._end(True, DETACH_GRACE_S, None,
                  (Phase.SERVING, Phase.ATTACHING) if errors else (Phase.SERVING,))
        if errors:
            raise MptierError(f"mptier workers could not attach to the buffer: {errors[0]}")
        raise MptierError(f"mptier workers did not attach within "
                          f"worker_start_timeout_s={self.settings.worker_start_timeout_s:g} s")

    def end_session(self, ask_workers: bool = False, timeout_s: float = DETACH_GRACE_S,
                    on_wait: Callable[[], object] | None = None) -> None:
        """End the current session and wait (bounded) until no worker serves it: after
        the engine closed its lifeline, or with ``ask_workers`` to make them stop."""
        self._end(ask_workers, timeout_s, on_wait, (Phase.SERVING, Phase.ATTACHING))

    def _end(self, ask_workers: bool, timeout_s: float,
             on_wait: Callable[[], object] | None, waited: tuple[Phase, ...]) -> None:
        sup = self._supervisor
        sup.call_soon(lambda: sup.end_session(ask_workers))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with sup.changed:
                if sup.session is None and not any(w.phase in waited for w in sup.workers):
                    return
                sup.changed.wait(0.05)
            if on_wait is not None:
                on_wait()

    def unavailable(self) -> tuple[str, int]:
        """``(reason, errno)`` when the pool cannot serve now, else ``("", 0)``."""
        return self._supervisor.unavailable()

    def pids(self) -> list[int]:
        with self._supervisor.lock:
            return [w.pid for w in self._supervisor.workers]

    def worker_stats(self) -> list[dict[str, Any]]:
        """One entry per worker (parked ones included, in state ``"stuck"``)."""
        sup = self._supervisor
        with sup.lock:
            workers = list(sup.workers)
        now = time.monotonic_ns()
        out = []
        for w in workers:
            snap = self.control.snapshot(w.slot)
            busy = snap.state == SlotState.BUSY and snap.started_ns
            state = w.phase.value
            if w.phase is Phase.SERVING:
                state = "busy" if busy else "idle"
                if snap.state == SlotState.REPORTING:  # done; waiting for the engine to read
                    state = "reporting"
            out.append({
                "pid": w.pid, "role": w.role, "slot": w.slot, "state": state,
                "alive": w.alive, "ready": w.phase in (Phase.IDLE, Phase.SERVING),
                "tasks_done": snap.tasks_done, "tasks_failed": snap.tasks_failed,
                "bytes_done": snap.bytes_done, "busy_s": snap.busy_ns / 1e9,
                "task_age_s": (now - snap.started_ns) / 1e9 if busy else None,
                "generation": w.generation, "backend": w.backend,
                **room_waits(self.control, w.slot),
            })
        return out

    def stats(self) -> dict[str, Any]:
        """Counters, state and workers; after :meth:`stop`, the last figures."""
        if self._last_stats is not None:
            return self._last_stats
        with self._supervisor.lock:
            counters = asdict(self.counters)
        reason, _ = self.unavailable()
        return {"mode": self.mode, "counters": counters, "unavailable": reason,
                "workers": self.worker_stats(), "task_latency": task_latency(self.control),
                **store_figures(self.control),
                "roots": root_figures(self.control, self.io) if self.io else []}

    def stop(self, grace_s: float = STOP_GRACE_S,
             on_wait: Callable[[], object] | None = None) -> list[str]:
        """Ask every worker to leave, then escalate (SIGTERM, SIGKILL); ``on_wait`` runs
        between checks. Returns descriptions of workers that had to be forced or were
        left behind (stuck in the kernel). Idempotent."""
        if self._stopped:
            return []
        self._stopped = True
        sup = self._supervisor
        forced: list[str] = []
        if self._started:
            sup.begin_stop()
            sup.call_soon(sup.ask_to_leave)
            for sig, wait_s in ((None, grace_s), (signal.SIGTERM, TERM_GRACE_S),
                                (signal.SIGKILL, KILL_GRACE_S)):
                with sup.lock:
                    left = [w for w in sup.workers if w.phase is not Phase.STUCK]
                if not left:
                    break
                if sig is not None:
                    for w in left:
                        with contextlib.suppress(OSError):
                            w.proc.send_signal(sig)
                        forced.append(f"{w.role} worker pid {w.pid} needed {sig.name}")
                deadline = time.monotonic() + wait_s
                while time.monotonic() < deadline:
                    with sup.changed:
                        if not any(w in sup.workers for w in left):
                            break
                        sup.changed.wait(0.02)
                    if on_wait is not None:
                        on_wait()
            with sup.lock:
                forced += [f"{w.role} worker pid {w.pid} is stuck in the kernel and was "
                           "left behind" for w in sup.workers]
        self._last_stats = self.stats()
        sup.finish()
        self.control.close()
        return forced


def open_pool(settings: PoolSettings, memory: memoryview | None = None
              ) -> WorkerPool | ThreadWorkers:
    """A :class:`WorkerPool`, or :class:`ThreadWorkers` over ``memory`` when the
    buffer cannot be shared with other processes."""
    return WorkerPool(settings) if memory is None else ThreadWorkers(settings, memory)

"""The supervisor's part that starts workers and handles their exits.

It tells **boot failure** from **death**, as an arbiter should: a worker that says
``boot_failed`` (or exits with :data:`~mptier.workers.protocol.EXIT_BOOT_FAILED`) before
it is ready failed to boot -- after :data:`MAX_BOOT_FAILURES` in a row the pool is
*unavailable* for :data:`BOOT_COOLDOWN_S`, then tries again; a worker killed (by a
signal, the OOM killer) while booting died, and is replaced with exponential backoff
(:data:`BACKOFF_FIRST_S` doubling up to :data:`BACKOFF_MAX_S`; a worker that boots resets
it). A worker that said ``leaving`` exited on purpose: never a crash. A death hands the
slot's task to :mod:`~mptier.workers.held`; then a new worker takes a free slot. Every
exit is handled exactly once (:meth:`Spawning._reap`).
"""

from __future__ import annotations

import errno
import os
import time

from mptier.errors import describe_exit
from mptier.workers import protocol
from mptier.workers.launcher import launch
from mptier.workers.supervised import (
    ERR_WORKER_DIED,
    TICK_S,
    Phase,
    SupervisorState,
    Worker,
    log,
)

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


class Spawning(SupervisorState):
    """Starting workers, replacing them (with backoff), and handling each exit once."""

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

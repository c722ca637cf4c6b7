"""The supervisor's tick: the watchdog over hung, silent and swollen workers.

Every :data:`~mptier.workers.supervised.TICK_S` it

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
* offers the session again to a worker that missed it, and frees what dead engines left
  in /dev/shm every :data:`SHM_SWEEP_S`.

A worker whose slot says REPORTING waits for room in the completion pipe: its I/O is
over, so io_timeout_s does not run for it; it still answers heartbeats.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from typing import Any

from mptier.shm import cleanup_stale
from mptier.workers import protocol
from mptier.workers.control import SlotState
from mptier.workers.supervised import (
    ERR_TIMED_OUT,
    ERR_WORKER_DIED,
    Phase,
    SupervisorState,
    Worker,
    log,
)

# A SIGKILLed worker still present this long later is stuck in the kernel (e.g. on a dead
# NFS server): parked.
STUCK_AFTER_S = 1.0
# A worker whose attach failed (e.g. it could not map the buffer) is offered the session
# again this much later, not on every tick.
ATTACH_RETRY_S = 5.0
# How often a live pool frees the buffers that dead engines left in /dev/shm (nobody
# holds their lock): a crash is cleaned up within this long by any pool on the machine,
# not only at the next start. One sweep lists /dev/shm (memory) and tries one
# non-blocking lock per mptier object: well under a millisecond for a few hundred.
SHM_SWEEP_S = 10.0
_PAGE = os.sysconf("SC_PAGE_SIZE")


class Watchdog(SupervisorState):
    """The tick: timeouts, parking, heartbeats and memory limits."""

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


def private_memory(pid: int) -> int | None:
    """Resident memory of ``pid`` that is not shared (RSS less the shared buffer and
    other file pages it maps), from ``/proc/<pid>/statm``: a cheap read, unlike USS."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            fields = f.read().split()
    except OSError:
        return None
    return (int(fields[1]) - int(fields[2])) * _PAGE

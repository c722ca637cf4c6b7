"""The supervisor's part that accounts for the task a dead worker's slot held.

On a **death** the slot's task is handled: a store is sent back to the engine to queue
again (stores are idempotent; at most ``max_task_retries`` times), a load or lookup it had
*started* is reported LOST (its keys become a miss), one it had only dequeued is sent
back too. Only the engine queues a task again, and only if nothing reported it yet: the
worker may have sent DONE just before it died, and the job's slots may be reused since.
While the pool is unavailable, every task still queued fails (never silence).

These reports (LOST, RETRY) never block the supervisor: they go through a
:class:`~mptier.pipes.RecordWriter` on the completion pipe, and when the engine does not
read for a while they wait in its list and go in when the pipe drains (the poll watches
the pipe for room meanwhile), so deaths are still handled and workers still respawned.
"""

from __future__ import annotations

import glob
import os

from mptier.jobs import MessageType, TaskKind, decode_task, encode_message
from mptier.native.entries import Outcome
from mptier.pipes import drain_records
from mptier.workers.control import RootState
from mptier.workers.supervised import (
    ERR_TIMED_OUT,
    SUPERVISOR_SLOT,
    SupervisorState,
    Worker,
    log,
)


class HeldTasks(SupervisorState):
    """Retrying or failing a dead worker's task, and the reports that say so."""

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
                                           task_id=task_id, payload=text, attempt=attempt,
                                           outcome=Outcome.LOST))

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

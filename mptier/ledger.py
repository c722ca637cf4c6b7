"""The job ledger: which tasks each job is waiting for, and what became of them.

Pure bookkeeping on the engine's scheduler thread, no I/O. A task's id is
``(group << TASK_INDEX_BITS) | index``: a job (or a batch of existence checks) is one
*group* of consecutive tasks, so submitting a job adds one entry however many tasks it
has. The first report of a task counts; any later one (the twin of a retried store, a
hung worker that finished after all) is ignored, which is what makes "every job exactly
once" hold.
"""

from __future__ import annotations

import array
import collections
import logging
import os
import time
from dataclasses import dataclass, field

from mptier import native
from mptier.jobs import (
    JobResult,
    Message,
    MessageType,
    TaskKind,
    TierEvent,
    encode_task,
    unpack_keys,
)
from mptier.lookup import LookupTable
from mptier.native.entries import Outcome

# A lookup task's DONE payload holds one status byte per key (mptier.native's LOOKUP_*
# values): present means a regular file of exactly the block size; anything else is a
# miss, and these are entries that should not be there (counted as bad entries).
LOOKUP_PRESENT = native.LOOKUP_PRESENT
LOOKUP_BAD_STATUSES = frozenset({native.LOOKUP_SYMLINK, native.LOOKUP_BAD,
                                 native.LOOKUP_SHORT})  # removed / not a block / short
# What a store or load found, as its worker summed it up in the completion message
# (mptier.native.entries: the one home of what an errno means): a load that removed a
# corrupt block, or an entry at a block path that is not a block file.
CORRUPT_OUTCOMES = frozenset({Outcome.CORRUPT, Outcome.CHECKSUM})
log = logging.getLogger("mptier")

# Recent job latencies kept for stats() percentiles.
LATENCY_WINDOW = 4096


@dataclass(slots=True)
class Job:
    job_id: int
    kind: TaskKind
    keys: list[bytes]
    block_ids: array.array
    submitted_ns: int
    tasks_left: int
    ok: bytearray  # per key: 1 when it succeeded
    errno: int = 0
    error: str | None = None
    first_start_ns: int = 0
    last_end_ns: int = 0
    checksum_failed: bool = False


# A task's id is (group << TASK_INDEX_BITS) | index: one table entry per job (or lookup
# batch) instead of one per task keeps submit short.
TASK_INDEX_BITS = 20
TASK_INDEX_MASK = (1 << TASK_INDEX_BITS) - 1


@dataclass(slots=True)
class Group:
    """The tasks of one job, or of one batch of existence checks (``job`` None)."""

    job: Job | None
    keys: list[bytes]
    per_task: int
    done: bytearray  # per task: 1 once its first report arrived
    left: int


@dataclass
class Counters:
    jobs_submitted: dict[str, int] = field(default_factory=lambda: {"store": 0, "load": 0})
    jobs_failed: dict[str, int] = field(default_factory=lambda: {"store": 0, "load": 0})
    bytes_done: dict[str, int] = field(default_factory=lambda: {"store": 0, "load": 0})
    keys_checked: int = 0
    keys_found: int = 0
    corrupt_removed: int = 0  # blocks deleted on load: short, or failing their checksum
    checksum_failures: int = 0  # of those, the ones whose CRC32C record did not match
    bad_entries: int = 0  # non-block entries met at block paths (Outcome.BAD_ENTRY)
    evicted_keys: int = 0  # keys of this tier's folder evicted to stay within capacity


def spread_per_task(n: int, per_task: int, idle: int, least: int) -> int:
    """Blocks per task for a job of ``n`` blocks while ``idle`` workers wait for work:
    ``per_task`` (task_bytes' worth), or fewer, so that the job's tasks reach every idle
    worker -- but never fewer than ``least`` a task (a task's own cost). The job is
    then as many tasks as that makes (the manager's SPREAD_MIN_BYTES says why)."""
    if idle < 2 or n <= least or -(-n // per_task) >= idle:
        return per_task
    return min(per_task, max(least, -(-n // idle)))


class JobLedger:
    """Jobs in flight, their task groups, and the results and events they produced."""

    def __init__(self, block_bytes: int, lookups: LookupTable, stored_events: bool) -> None:
        self.jobs: dict[int, Job] = {}
        self.groups: dict[int, Group] = {}
        self._tasks_left = 0  # over every group: tasks_in_flight without a sum per call
        self._next_group = 1
        self._finished: list[JobResult] = []
        self._events: list[TierEvent] = []
        self.counters = Counters()
        self.latency: dict[str, collections.deque[float]] = {
            "store": collections.deque(maxlen=LATENCY_WINDOW),
            "load": collections.deque(maxlen=LATENCY_WINDOW)}
        self._block_bytes = block_bytes
        self._lookups = lookups
        self._stored_events = stored_events

    def add_job(self, job_id: int, kind: TaskKind, keys: list[bytes],
                block_ids: array.array, per_task: int) -> int:
        """Record a job; returns the id of its first task (0 for an empty job, which is
        finished at once). Raises ``ValueError`` if it would need too many tasks."""
        n = len(keys)
        job = Job(job_id, kind, keys, block_ids, time.monotonic_ns(), 0, bytearray(n))
        self.counters.jobs_submitted["store" if kind == TaskKind.STORE else "load"] += 1
        if not n:
            self._finish(job)
            return 0
        n_tasks = -(-n // per_task)
        if n_tasks > TASK_INDEX_MASK:
            raise ValueError(f"job {job_id}: {n} blocks make {n_tasks} tasks, more than "
                             f"{TASK_INDEX_MASK}; raise task_bytes or split the job")
        job.tasks_left = n_tasks
        self.jobs[job_id] = job
        return self._add_group(job, keys, per_task, n_tasks)

    def take_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call, in the order they finished."""
        out, self._finished = self._finished, []
        return out

    def has_finished(self) -> bool:
        return bool(self._finished)

    def take_events(self) -> list[TierEvent]:
        out, self._events = self._events, []
        return out

    def retry_record(self, task_id: int, attempt: int) -> tuple[TaskKind, bytes] | None:
        """The record to queue again for a task whose worker died, or None if the task
        was reported already (its worker sent DONE just before dying: running it again
        could write into slots the engine has since reused) or belongs to no job."""
        group = self.groups.get(task_id >> TASK_INDEX_BITS)
        index = task_id & TASK_INDEX_MASK
        if group is None or index >= len(group.done) or group.done[index]:
            return None
        start = index * group.per_task
        keys = group.keys[start:start + group.per_task]
        job = group.job
        if job is None:
            return TaskKind.LOOKUP, encode_task(TaskKind.LOOKUP, task_id, keys,
                                                attempt=attempt)
        ids = job.block_ids[start:start + group.per_task]
        return job.kind, encode_task(job.kind, task_id, keys, ids, attempt=attempt)

    def fail_group(self, first_task: int, err: int, text: str) -> None:
        """Fail every task of the group that starts at ``first_task`` (a job refused
        before it was queued: the pool cannot serve)."""
        group = self.groups.get(first_task >> TASK_INDEX_BITS)
        for index in range(len(group.done) if group else 0):
            self.fail_task(first_task | index, err, text)

    def add_lookups(self, keys: list[bytes], per_task: int) -> int:
        """Record a batch of existence checks; returns its first task id."""
        return self._add_group(None, keys, per_task, -(-len(keys) // per_task))

    def _add_group(self, job: Job | None, keys: list[bytes], per_task: int,
                   n_tasks: int) -> int:
        group = self._next_group
        self._next_group = group + 1
        self.groups[group] = Group(job, keys, per_task, bytearray(n_tasks), n_tasks)
        self._tasks_left += n_tasks
        return group << TASK_INDEX_BITS

    def keys_removed(self, m: Message) -> None:
        """Apply a REMOVED message: a caretaker evicted these keys of this tier's own
        folder. They become "removed" events, and requests holding a HIT for them see
        MISS from now on."""
        keys = unpack_keys(m.payload)
        if not keys:
            return
        self.counters.evicted_keys += len(keys)
        self._lookups.mark_miss(keys)
        self._events.append(TierEvent("removed", tuple(keys), {"reason": "evicted"}))

    def fail_task(self, task_id: int, err: int, text: str) -> None:
        self.task_finished(Message(MessageType.LOST, 0, 0, errno=err, task_id=task_id,
                                   payload=text.encode(), outcome=Outcome.LOST))

    def unfinished_task_ids(self) -> list[int]:
        return [(group_id << TASK_INDEX_BITS) | index
                for group_id, group in self.groups.items()
                for index, done in enumerate(group.done) if not done]

    @property
    def tasks_in_flight(self) -> int:
        """Tasks submitted and not yet reported (queued or running)."""
        return self._tasks_left

    def task_finished(self, m: Message) -> None:
        """Apply a DONE or LOST report; a job whose last task reported is finished."""
        group_id = m.task_id >> TASK_INDEX_BITS
        index = m.task_id & TASK_INDEX_MASK
        group = self.groups.get(group_id)
        if group is None or index >= len(group.done) or group.done[index]:
            return  # a second report of a task (its retry's twin): the first one counted
        group.done[index] = 1
        group.left -= 1
        self._tasks_left -= 1
        if not group.left:
            del self.groups[group_id]
        start = index * group.per_task
        keys = group.keys[start:start + group.per_task]
        job = group.job
        if job is None:
            statuses = m.payload[:len(keys)] if m.type == MessageType.DONE and not m.errno \
                else bytes(len(keys))
            exists = [status == LOOKUP_PRESENT for status in statuses]
            self.counters.bad_entries += sum(s in LOOKUP_BAD_STATUSES for s in statuses)
            self.counters.keys_checked += len(keys)
            self.counters.keys_found += sum(exists)
            self._lookups.answer(keys, exists)
            return
        n_done = m.n_done if m.type == MessageType.DONE else 0
        if n_done:
            job.ok[start:start + n_done] = b"\1" * n_done
        if m.errno:
            if not job.errno:
                job.errno, job.error = m.errno, m.text or os.strerror(m.errno)
            if m.outcome in CORRUPT_OUTCOMES:  # (a load: only a load finds corruption)
                checksum = m.outcome == Outcome.CHECKSUM
                self.counters.corrupt_removed += 1
                self.counters.checksum_failures += checksum
                job.checksum_failed |= checksum
                self._events.append(TierEvent("removed", (keys[n_done],), {
                    "reason": "checksum" if checksum else "corrupt"}))
            elif m.outcome == Outcome.BAD_ENTRY and m.type == MessageType.DONE:
                self.counters.bad_entries += 1
                log.warning("mptier: %s", m.text)
        if m.started_ns:
            end = m.started_ns + m.elapsed_ns
            if not job.first_start_ns or m.started_ns < job.first_start_ns:
                job.first_start_ns = m.started_ns
            if end > job.last_end_ns:
                job.last_end_ns = end
        job.tasks_left -= 1
        if job.tasks_left == 0:
            del self.jobs[job.job_id]
            self._finish(job)

    def _finish(self, job: Job) -> None:
        n_done = job.ok.count(1)
        n = len(job.keys)
        success = n_done == n
        name = "store" if job.kind == TaskKind.STORE else "load"
        successful_keys = None
        if not success:
            self.counters.jobs_failed[name] += 1
            if job.kind == TaskKind.LOAD:
                self._lookups.mark_miss(k for k, ok in zip(job.keys, job.ok) if not ok)
                if n_done:
                    successful_keys = tuple(k for k, ok in zip(job.keys, job.ok) if ok)
        elif job.kind == TaskKind.STORE and self._stored_events and n:
            self._events.append(TierEvent("stored", tuple(job.keys)))
        nbytes = n_done * self._block_bytes
        self.counters.bytes_done[name] += nbytes
        now = time.monotonic_ns()
        self.latency[name].append((now - job.submitted_ns) / 1e9)
        elapsed = (job.last_end_ns - job.first_start_ns) / 1e9 if job.first_start_ns else 0.0
        self._finished.append(JobResult(job.job_id, success, successful_keys, elapsed, nbytes,
                                        job.errno, job.error, job.checksum_failed))

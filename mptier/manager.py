"""``FileSystemTier``: the engine-side manager. Every public method is non-blocking
(except ``drain_jobs`` and ``shutdown``, which exist to block) and runs on the engine's
scheduler thread.

::

    engine process                                           worker processes
    ┌───────────────────────────────────────────┐           ┌───────────────────────────┐
    │ scheduler thread                          │  lookup   │ map primary buffer once   │
    │  submit_store/_load ─ split into tasks ─▶ │══ pipe ══▶│ take: lookup > own > other│
    │  lookup ─ on_schedule_end ─ exists tasks ▶│  load     │ native batch I/O (no GIL) │
    │                                           │══ pipe ══▶│ files under root_dir      │
    │  get_finished_jobs ◀─ drain, no block ────│  store    │                           │
    │                                           │══ pipe ══▶│                           │
    │                                           │◀═ completion pipe (messages) ═════════│
    │ supervisor thread: pidfds, io_timeout,    │           │ slot in the control block │
    │   retries, respawn, overflow flush        │◀═ shared memory: who holds which task │
    └───────────────────────────────────────────┘           └───────────────────────────┘
      the primary KV buffer is mapped by both sides: no block data crosses a pipe

Who blocks where:

* the scheduler thread blocks nowhere: task records go into non-blocking pipes (or an
  overflow list when a pipe is full) and completions are read with non-blocking reads;
* workers block in ``poll()`` on their queues and the lifeline, and in file I/O;
* the supervisor thread blocks in ``poll()`` on worker pidfds and a wake-up pipe, and
  ticks every 0.1 s; it holds the GIL only for microseconds at a time.

Every job appears in ``get_finished_jobs()`` exactly once: task ids are unique, the first
report of a task counts and any later one (a retried store's twin) is ignored.
"""

from __future__ import annotations

import array
import atexit
import collections
import contextlib
import errno
import logging
import os
import select
import time
import weakref
from collections.abc import Hashable, Iterable
from dataclasses import asdict
from typing import Any

from mptier import native
from mptier.channels import CompletionReader, TaskQueue, make_pipe
from mptier.config import TierConfig
from mptier.errors import ConfigError, MptierError, TierClosedError
from mptier.jobs import (
    JobResult,
    LookupResult,
    MessageType,
    TaskKind,
    TierEvent,
    TransferJob,
    decode_task,
    encode_job,
    task_record_capacity,
)
from mptier.keys import MAX_KEY_BYTES, check_key
from mptier.layout import FileMapper
from mptier.ledger import JobLedger
from mptier.lookup import LookupTable
from mptier.shm import SharedKVBuffer, cleanup_stale
from mptier.workers.control import ControlBlock
from mptier.workers.launcher import LaunchSpec
from mptier.workers.pool import ProcessPool, ThreadPool

log = logging.getLogger(__name__)

_warned_threads = False
# Tiers still running; shut down at interpreter exit so in-flight copies finish and
# workers leave cleanly instead of being killed with their parent.
_live_tiers: weakref.WeakSet[FileSystemTier] = weakref.WeakSet()


@atexit.register
def _shutdown_live_tiers() -> None:
    for tier in list(_live_tiers):
        with contextlib.suppress(Exception):
            tier.shutdown()
_NO_IDS = array.array("q")
_BYTES_ONLY = {bytes}
class FileSystemTier:
    """A secondary KV tier on a file system, served by worker processes.

    ``FileSystemTier(buffer, root_dir=..., **overrides)``: ``buffer`` is a
    :class:`SharedKVBuffer` or the engine's own memory (see
    :meth:`SharedKVBuffer.from_memoryview`); keyword overrides apply on top of ``config``
    (a :class:`TierConfig`, defaults otherwise). The constructor blocks until every worker
    is ready and raises :class:`MptierError` if they cannot start, ``OSError`` naming the
    path if ``root_dir`` cannot be used.
    """

    def __init__(self, buffer: SharedKVBuffer | Any, config: TierConfig | None = None,
                 **overrides: Any) -> None:
        self._closed = True  # until fully constructed, so shutdown() is safe on failure
        cfg = TierConfig.from_dict(overrides, base=config) if overrides or config is None \
            else config
        if not cfg.root_dir:
            raise ConfigError("TierConfig.root_dir is required: the folder block files go "
                              "into, e.g. FileSystemTier(buf, root_dir='/mnt/kv')")
        self.config = cfg
        if not isinstance(buffer, SharedKVBuffer):
            buffer = SharedKVBuffer.from_memoryview(buffer)
        self._buffer = buffer
        self._block_bytes = buffer.block_bytes
        self._num_blocks = buffer.num_blocks
        self.mapper = FileMapper(cfg.root_dir, **cfg.layout_kwargs())
        self.mapper.write_config()
        if cfg.use_o_direct == "auto":
            self.use_o_direct = native.probe_o_direct(self.mapper.blocks_dir)
        else:
            self.use_o_direct = bool(cfg.use_o_direct)
        self.native = cfg.native and native.HAS_NATIVE
        cleanup_stale()

        self._lookups = LookupTable()
        self._ledger = JobLedger(self._block_bytes, self._lookups, cfg.enable_events)
        self._boot_errors: list[str] = []
        self._ready = 0
        self._per_task = max(1, cfg.task_bytes // self._block_bytes)
        # Keys up to this length always fit self._per_task items in a record.
        self._fast_key_len = next((k for k in range(4096, 0, -1) if task_record_capacity(
            TaskKind.STORE, k) >= self._per_task), 0)
        self._queues = {kind: TaskQueue(name) for kind, name in (
            (TaskKind.EXISTS, "lookup"), (TaskKind.LOAD, "load"), (TaskKind.STORE, "store"))}
        self._lookup_q, self._load_q, self._store_q = self._queues.values()
        self._completions = CompletionReader()
        self._lifeline_r, self._lifeline_w = make_pipe(4096)
        self._doorbell = make_pipe(4096)  # workers wake each other for queued tasks
        for fd in self._doorbell:
            os.set_blocking(fd, False)
        self._segment_fds: list[int] = []
        roles = ["load"] * cfg.n_load_workers + ["store"] * cfg.n_store_workers
        # Two slots per worker: a hung worker keeps its slot until it is reaped.
        self._control = ControlBlock(2 * len(roles) + 2)
        self._seen_counts = self._control.counters_snapshot()
        self._closed = False
        self._shut_down = False
        _live_tiers.add(self)
        try:
            self._pool = self._make_pool(roles)
            self._pool.start()
            self._wait_ready(len(roles))
        except BaseException:
            self.shutdown()
            raise

    def _make_pool(self, roles: list[str]) -> ProcessPool | ThreadPool:
        cfg = self.config
        q = self._queues
        if not self._buffer.shareable:
            global _warned_threads
            if not _warned_threads:
                _warned_threads = True
                log.warning("mptier: the primary buffer cannot be shared with worker "
                            "processes (%s); running I/O on %d threads in this process "
                            "instead (io_timeout_s is not enforced there)",
                            self._buffer.unshareable_reason, len(roles))
            self.mode = "threads"
            return ThreadPool(
                roles=roles, control=self._control,
                memory=memoryview(self._buffer.view).cast("B"),
                lookup_queue=q[TaskKind.EXISTS], load_queue=q[TaskKind.LOAD],
                store_queue=q[TaskKind.STORE], completion_fd=self._completions.write_fd,
                lifeline_fd=self._lifeline_r, doorbell=self._doorbell, mapper=self.mapper,
                backend=native.get_backend("native" if self.native else "python"),
                use_o_direct=self.use_o_direct, block_bytes=self._block_bytes)
        self.mode = "processes"
        segments = self._buffer.open_segments()
        self._segment_fds = [s.fd for s in segments]
        spec = LaunchSpec(
            n_slots=self._control.n_slots, control_fd=self._control.fd,
            lookup_queue_fd=q[TaskKind.EXISTS].read_fd, load_queue_fd=q[TaskKind.LOAD].read_fd,
            store_queue_fd=q[TaskKind.STORE].read_fd,
            completion_fd=self._completions.write_fd, lifeline_fd=self._lifeline_r,
            doorbell_fd=self._doorbell[0], doorbell_write_fd=self._doorbell[1],
            segments=segments, nbytes=self._buffer.nbytes, block_bytes=self._block_bytes,
            layout={"root_dir": cfg.root_dir, **cfg.layout_kwargs()},
            use_o_direct=self.use_o_direct, native=self.native, nice=cfg.worker_nice,
            cpus=cfg.worker_cpus, prefault=cfg.prefault)
        return ProcessPool(
            spec=spec, roles=roles, control=self._control, lookup_queue=q[TaskKind.EXISTS],
            load_queue=q[TaskKind.LOAD], store_queue=q[TaskKind.STORE],
            completion_fd=self._completions.write_fd, mapper=self.mapper,
            io_timeout_s=cfg.io_timeout_s, max_task_retries=cfg.max_task_retries,
            start_timeout_s=cfg.worker_start_timeout_s)

    def _wait_ready(self, n_workers: int) -> None:
        deadline = time.monotonic() + self.config.worker_start_timeout_s
        while self._ready < n_workers:
            if self._pool.broken_reason:
                raise MptierError(f"mptier workers could not start: "
                                  f"{self._pool.broken_reason}")
            if time.monotonic() > deadline:
                raise MptierError(f"only {self._ready} of {n_workers} mptier workers "
                                  f"reported ready within {self.config.worker_start_timeout_s}"
                                  f" s; errors: {self._boot_errors or 'none reported'}")
            select.select([self._completions.read_fd], [], [], 0.05)
            self._pump()

    # -- submitting ------------------------------------------------------------------------

    def submit_store(self, job: TransferJob) -> None:
        """Queue a store of ``job.keys`` from slots ``job.block_ids``. Never blocks.

        Raises ``ValueError`` (nothing queued) for a bad key, a block id outside the
        buffer, mismatched lengths or a job id already in flight.
        """
        self._submit(TaskKind.STORE, job)

    def submit_load(self, job: TransferJob) -> None:
        """Queue a load of ``job.keys`` into slots ``job.block_ids``. Never blocks.

        Raises ``ValueError`` like :meth:`submit_store`.
        """
        self._submit(TaskKind.LOAD, job)

    def _submit(self, kind: TaskKind, job: TransferJob) -> None:
        if self._closed:
            raise TierClosedError("the tier was shut down; no more jobs can be submitted")
        job_id = job.job_id
        if job_id in self._ledger.jobs:
            raise ValueError(f"job_id {job_id!r} is already in flight; job ids must be "
                             "unique among unfinished jobs")
        keys = job.keys if type(job.keys) is list else list(job.keys)
        try:  # one C-level pass: ints (numpy integers too), anything else is refused
            block_ids = array.array("q", job.block_ids)
        except (TypeError, OverflowError) as exc:
            raise ValueError(f"job {job_id}: block_ids must be whole numbers "
                             f"({exc}): {list(job.block_ids)[:8]!r}") from None
        n = len(keys)
        if len(block_ids) != n:
            raise ValueError(f"job {job_id}: {n} keys but {len(block_ids)} block_ids; "
                             "each key needs exactly one block id")
        if n:
            lengths = list(map(len, keys)) if set(map(type, keys)) == _BYTES_ONLY else ()
            key_len = max(lengths) if lengths else 0
            if not lengths or key_len > MAX_KEY_BYTES or min(lengths) <= 4:
                keys = [check_key(k) for k in keys]  # raises ValueError naming the key
                key_len = max(map(len, keys))
        else:
            key_len = 0
        if n:
            low, high = min(block_ids), max(block_ids)
            if low < 0 or high >= self._num_blocks:
                bad = low if low < 0 else high
                raise ValueError(f"job {job_id}: block id {bad} is outside the primary "
                                 f"buffer (valid ids: 0..{self._num_blocks - 1})")
        per_task = self._per_task if key_len <= self._fast_key_len else \
            min(self._per_task, task_record_capacity(kind, key_len))
        if per_task < 1:
            raise ValueError(f"job {job_id}: a {key_len}-byte key is too long for a task")
        first_task = self._ledger.add_job(job_id, kind, keys, per_task)
        if first_task:
            self._queues[kind].put_records(
                encode_job(kind, first_task, keys, block_ids, per_task))

    # -- lookups -----------------------------------------------------------------------

    def lookup(self, key: bytes, req_id: Hashable = None) -> LookupResult:
        """HIT, MISS, or RETRY while the key waits for the next batched check. Never
        blocks: the check runs in a worker after :meth:`on_schedule_end`, and its answer
        is applied by the first call (of this method, :meth:`on_schedule_end` or
        :meth:`get_finished_jobs`) after it arrived, so a caller that only repeats
        ``lookup()`` after a step end still sees it."""
        if self._closed:
            raise TierClosedError("the tier was shut down")
        if type(key) is not bytes or not 4 < len(key) <= MAX_KEY_BYTES:
            key = check_key(key)
        # Apply finished checks first. The message counters in shared memory tell whether
        # anything arrived, so the common case costs one small compare, no system call.
        counts = self._control.counters_snapshot()
        if counts != self._seen_counts:
            self._seen_counts = counts
            self._pump()
        return self._lookups.lookup(key, req_id)

    def on_schedule_end(self) -> None:
        """Collect finished checks, then send this step's unchecked keys to the workers."""
        if self._closed:
            raise TierClosedError("the tier was shut down")
        self._poll()
        keys = self._lookups.take_unsent()
        if not keys:
            return
        per_task = min(self.config.lookup_batch_keys,
                       task_record_capacity(TaskKind.EXISTS, max(map(len, keys))))
        first_task = self._ledger.add_lookups(keys, per_task)
        self._lookup_q.put_records(
            encode_job(TaskKind.EXISTS, first_task, keys, _NO_IDS, per_task))

    def mark_miss(self, keys: Iterable[bytes]) -> None:
        """Make every request that holds a HIT for ``keys`` see MISS from now on (a load
        of them failed outside the tier). Never blocks."""
        self._lookups.mark_miss(keys)

    def on_request_finished(self, req_id: Hashable) -> None:
        """Forget what request ``req_id`` learned from lookups."""
        self._lookups.forget(req_id)

    # -- results -------------------------------------------------------------------------

    def get_finished_jobs(self) -> list[JobResult]:
        """Jobs finished since the last call (each job exactly once). Never blocks.

        Still works after :meth:`shutdown`, to collect the jobs it failed.
        """
        if not self._closed:
            self._poll()
        ledger = self._ledger
        if not ledger.finished:
            return []
        out, ledger.finished = ledger.finished, []
        return out

    def take_events(self) -> list[TierEvent]:
        """"stored" events (when ``enable_events``) and "removed" events since last call."""
        out, self._ledger.events = self._ledger.events, []
        return out

    def fileno(self) -> int:
        """The completion pipe's read end: readable when there may be news."""
        return self._completions.read_fd

    def drain_jobs(self) -> None:
        """Block until every submitted job has finished; after it returns no worker
        touches the buffer. Results stay queued for :meth:`get_finished_jobs`."""
        if self._closed:
            raise TierClosedError("the tier was shut down")
        while self._ledger.jobs:
            select.select([self._completions.read_fd], [], [], 0.05)
            self._pump()

    def _poll(self) -> None:
        """Read the completion pipe only if a message counter moved (no system call when
        nothing happened); push overflowed tasks on."""
        counts = self._control.counters_snapshot()
        if counts != self._seen_counts:
            self._seen_counts = counts
            self._pump()
        elif self._lookup_q.overflow or self._load_q.overflow or self._store_q.overflow:
            self._flush_overflow()

    def _flush_overflow(self) -> None:
        for queue in self._queues.values():
            queue.flush()

    def _pump(self) -> None:
        self._flush_overflow()
        messages = self._completions.read_available()
        for message in messages:
            if message.type == MessageType.DONE or message.type == MessageType.LOST:
                self._ledger.task_finished(message)
            elif message.type == MessageType.READY:
                self._ready += 1
                self._pool.mark_ready(message.slot, message.pid)
            elif message.type == MessageType.BOOT_FAILED:
                self._boot_errors.append(f"pid {message.pid}: {message.text}")
                log.error("mptier worker pid %d failed to start: %s", message.pid,
                          message.text)

    # -- introspection -------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters, queue depths, latency percentiles and one entry per worker."""
        def percentiles(samples: collections.deque[float]) -> dict[str, float | None]:
            ordered = sorted(samples)

            def pick(q: float) -> float | None:
                return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered \
                    else None

            return {"p50_s": pick(0.5), "p99_s": pick(0.99), "count": len(ordered)}

        queues = {}
        if not self._closed:
            queues = {q.name: q.pipe_depth() + q.overflow_depth
                      for q in self._queues.values()}
        return {
            "mode": self.mode if hasattr(self, "mode") else "none",
            "closed": self._closed,
            "root": self.mapper.base_path,
            "o_direct": self.use_o_direct,
            "native": self.native,
            "block_bytes": self._block_bytes,
            "blocks_per_task": self._per_task,
            "jobs_in_flight": len(self._ledger.jobs),
            "tasks_in_flight": self._ledger.tasks_in_flight,
            "queued_tasks": queues,
            "lookup_requests": self._lookups.requests,
            "lookup_keys_pending": self._lookups.pending_keys,
            **asdict(self._ledger.counters),
            "latency": {k: percentiles(v) for k, v in self._ledger.latency.items()},
            "pool": asdict(self._pool.counters) if hasattr(self, "_pool") else {},
            "workers": self._pool.worker_stats() if hasattr(self, "_pool") else [],
        }

    def worker_pids(self) -> list[int]:
        return self._pool.pids() if hasattr(self, "_pool") else []

    # -- shutting down -------------------------------------------------------------------

    def shutdown(self) -> None:
        """Drop queued work (reported failed), let in-flight copies finish, stop the
        workers and release every pipe and shared object the tier made. Idempotent.

        Blocks for at most the time in-flight tasks take (then escalates to SIGKILL).
        """
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        self._closed = True
        _live_tiers.discard(self)
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.begin_stop()
        for queue in getattr(self, "_queues", {}).values():
            for record in queue.take_all():
                self._ledger.fail_task(decode_task(record).task_id, errno.ECANCELED,
                                "cancelled: the tier shut down before the task ran")
        if hasattr(self, "_lifeline_w"):
            os.close(self._lifeline_w)
        forced = pool.stop(on_wait=self._read_completions) if pool is not None else []
        if forced:
            log.warning("mptier shutdown: %s", "; ".join(forced))
        if hasattr(self, "_completions"):
            self._read_completions()
        ledger = getattr(self, "_ledger", None)
        for task_id in ledger.unfinished_task_ids() if ledger else ():
            ledger.fail_task(task_id, errno.ECANCELED,
                             "the tier shut down while the task was running")
        for queue in getattr(self, "_queues", {}).values():
            queue.close()
        if hasattr(self, "_completions"):
            self._completions.close()
        for fd in (getattr(self, "_lifeline_r", -1), *getattr(self, "_doorbell", ())):
            with contextlib.suppress(OSError):
                os.close(fd)
        for fd in getattr(self, "_segment_fds", []):
            with contextlib.suppress(OSError):
                os.close(fd)
        if getattr(self, "_control", None) is not None:
            self._control.close()

    def _read_completions(self) -> None:
        for message in self._completions.read_available():
            if message.type in (MessageType.DONE, MessageType.LOST):
                self._ledger.task_finished(message)

    def __enter__(self) -> FileSystemTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if not getattr(self, "_shut_down", True):
            with contextlib.suppress(Exception):
                self.shutdown()


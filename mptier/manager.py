"""``FileSystemTier``: the engine-side manager. Every public method runs on the engine's
scheduler thread and never blocks, except ``drain_jobs`` and ``shutdown`` (which exist
to wait) and the constructor (bounded: the workers boot and take the session).

::

    engine process                                            worker processes
    ┌────────────────────────────────────────────┐           ┌───────────────────────────┐
    │ scheduler thread                           │  lookup   │ map primary buffer once   │
    │  submit_store/_load ─ split into tasks ──▶ │══ pipe ══▶│ take: lookup > own > other│
    │  lookup ─ on_schedule_end ─ lookup tasks ─▶│  load     │ native batch I/O (no GIL) │
    │                                            │══ pipe ══▶│ files under root_dir      │
    │  get_finished_jobs ◀─ drain, no block ─────│  store    │                           │
    │                                            │══ pipe ══▶│                           │
    │                                            │◀═ completion pipe (messages) ═════════│
    │ the pool (mptier.workers): a supervisor    │◀─ control sockets (ready, heartbeat) ─│
    │  thread -- deaths, hangs, stuck workers,   │◀═ control block (shared memory): who  │
    │  retries, respawn                          │   holds which task; the pool's state  │
    └────────────────────────────────────────────┘           └───────────────────────────┘
      the primary KV buffer is mapped by both sides: no block data crosses a pipe

Who blocks where:

* the scheduler thread blocks nowhere: task records go into non-blocking pipes (or an
  overflow list when a pipe is full), completions are read with non-blocking reads, and
  only when a message counter in shared memory moved;
* workers block in ``epoll`` on their queues, lifeline and control socket, and in file I/O;
* the supervisor thread blocks in ``poll()`` on worker pidfds, control sockets and a
  wake-up pipe, ticking every 0.5 s; it holds the GIL only for moments.

Every job appears in ``get_finished_jobs()`` exactly once: task ids are unique, the first
report of a task counts and any later one (a retried store's twin) is ignored. When the
pool cannot serve (workers cannot boot, the file system stopped responding) jobs fail at
once with the reason, and lookups answer MISS: never silence.

Long because it is the engine's one object: every public method's contract (never
blocks, which thread) is written where it is done, and submitting, lookups, completions
and stats share one ledger and one set of queues; the parts that stand alone live
elsewhere (ledger, lookup, channels, the pool).
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
import weakref
from collections.abc import Callable, Hashable, Iterable
from dataclasses import asdict
from typing import Any

from mptier.channels import EngineChannels
from mptier.config import TierConfig
from mptier.errors import ConfigError, TierClosedError
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
from mptier.ledger import JobLedger, spread_per_task
from mptier.lookup import LookupTable
from mptier.monitor.tier import attach_tier
from mptier.shm import SharedKVBuffer, cleanup_stale
from mptier.storage.roots import RootRouter
from mptier.workers import Pool, PoolSettings, open_pool

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
# Shortest valid key: a block hash of at least one byte plus the 4-byte group index.
_MIN_KEY_BYTES = 5
# errno of jobs the engine fails itself: queued work dropped at shutdown.
# A job that finds workers idle is cut into smaller tasks, so that it runs on every one
# of them at once: with one job in flight a 4 MiB job (one task of the default 8 MiB)
# kept one worker busy while the other CPU idled (docs/performance.md, section 18). Only
# while fewer tasks are in flight than workers can run at once (the workers, and the
# CPUs they may use), and never below this much a task: a task costs its worker ~170 µs
# outside its I/O (section 12), a fifth of a 1 MiB copy in memory.
SPREAD_MIN_BYTES = 1 << 20

ERR_CANCELLED = errno.ECANCELED


class FileSystemTier:
    """A secondary KV tier on a file system, served by worker processes.

    ``FileSystemTier(buffer, root_dir=..., **overrides)``: ``buffer`` is a
    :class:`SharedKVBuffer` or the engine's own memory (see
    :meth:`SharedKVBuffer.from_memoryview`); keyword overrides apply on top of ``config``
    (a :class:`TierConfig`, defaults otherwise). The constructor blocks until every worker
    is ready and has mapped the buffer, and raises :class:`MptierError` if they cannot
    start, ``OSError`` naming the path if ``root_dir`` cannot be used, ``ConfigError``
    for a bad setting or a folder holding blocks of another size. A failed construction
    leaves nothing behind.
    """

    def __init__(self, buffer: SharedKVBuffer | Any, config: TierConfig | None = None,
                 **overrides: Any) -> None:
        self._closed = self._shut_down = True  # until constructed: shutdown() is a no-op
        cfg = TierConfig.from_dict(overrides, base=config) if overrides or config is None \
            else config
        if not cfg.roots() and not cfg.service:  # a service brings its own root
            raise ConfigError("TierConfig.root_dir is required: the folder block files go "
                              "into, e.g. FileSystemTier(buf, root_dir='/mnt/kv') (or "
                              "root_dirs=[...] for several)")
        self.config = cfg
        if not isinstance(buffer, SharedKVBuffer):
            buffer = SharedKVBuffer.from_memoryview(buffer)
        self._buffer = buffer
        self._block_bytes = buffer.block_bytes
        self._num_blocks = buffer.num_blocks
        self.mapper = FileMapper((cfg.roots() or [""])[0], **cfg.layout_kwargs())
        # How many tasks run at once, and the least blocks a task of a spread job takes.
        self._spread_width = min(cfg.n_load_workers + cfg.n_store_workers,
                                 len(cfg.worker_cpus) or len(os.sched_getaffinity(0))) \
            if cfg.spread_jobs else 0
        self._spread_least = max(1, SPREAD_MIN_BYTES // self._block_bytes)
        self._lookups = LookupTable()
        self._ledger = JobLedger(self._block_bytes, self._lookups, cfg.enable_events)
        self._final_pool_stats: dict[str, Any] | None = None
        cleanup_stale()
        with contextlib.ExitStack() as stack:
            self._channels = EngineChannels()
            stack.callback(_quietly, self._channels.close)
            self._queues = self._channels.queues
            # The overflow lists, for the empty-poll fast path (no generator per call).
            self._overflow_a, self._overflow_b, self._overflow_c = (
                q.overflow for q in self._queues.values())
            self._completions = self._channels.completions
            self._pool: Pool = self._open_pool(cfg, buffer)
            stack.callback(_quietly, self._pool.stop)
            self.mode = self._pool.mode
            self._pool.start()
            segments = buffer.open_segments() if buffer.shareable else []
            try:
                session = self._channels.session(
                    segments=segments, nbytes=buffer.nbytes, block_bytes=self._block_bytes,
                    layout=cfg.layout_kwargs(), label=f"engine pid {os.getpid()}")
                self._io = self._pool.attach(session)
            finally:
                for seg in segments:  # the pool keeps copies of its own
                    os.close(seg.fd)
            if self._io.root_dir != self.mapper.root_dir:  # a service's root
                self.mapper = FileMapper(self._io.root_dir, **cfg.layout_kwargs())
            # Several roots: each key lives on the one RootRouter names.
            self.mappers = [FileMapper(r, **cfg.layout_kwargs()) for r in self._io.root_dirs]
            self._router = RootRouter(self._io.root_dirs)
            # Task size: "auto" by the roots the workers use (a service's, if attached
            # to one), not those this engine's config names.
            self._cut_tasks_of(cfg.task_bytes_for(self._io.root_dirs))
            self._seen_news = self._pool.news()
            # Status socket / metrics (config status_socket, metrics_port): threads that
            # sleep until an operator asks; see mptier.monitor.
            self._monitoring = attach_tier(self)
            stack.callback(_quietly, self._monitoring.close)
            self._cleanup = stack.pop_all()
        self._closed = self._shut_down = False
        _live_tiers.add(self)

    def _cut_tasks_of(self, task_bytes: int) -> None:
        """Cut jobs into tasks of at most ``task_bytes`` (at least a block each)."""
        self._per_task = max(1, task_bytes // self._block_bytes)
        # Keys up to this length always fit self._per_task items in a record.
        self._fast_key_len = next((k for k in range(MAX_KEY_BYTES, 0, -1)
                                   if task_record_capacity(TaskKind.STORE, k)
                                   >= self._per_task), 0)

    # What the workers do, as the pool (or the service, after each attach) settled it.
    @property
    def use_o_direct(self) -> bool:
        return self._pool.io.use_o_direct

    @property
    def checksum_blocks(self) -> bool:
        """Whether blocks carry vLLM's CRC32C record, written and verified: the probe's
        answer for "auto", the service's setting when attached to one."""
        return self._pool.io.checksum

    @property
    def backend(self) -> str:
        return self._pool.io.backend

    @staticmethod
    def _open_pool(cfg: TierConfig, buffer: SharedKVBuffer) -> Pool:
        if cfg.service:
            if not buffer.shareable:
                raise ConfigError(f"service={cfg.service!r} needs a buffer other processes "
                                  f"can map, but this one cannot be shared "
                                  f"({buffer.unshareable_reason}); use SharedKVBuffer or "
                                  "a file-backed shared mapping")
            from mptier.rundir import Trust
            from mptier.service import ServiceLink

            return ServiceLink(cfg.service, wait_s=cfg.worker_start_timeout_s,
                               trust=Trust.of(cfg.service_group, cfg.service_user))
        memory = None
        if not buffer.shareable:
            memory = memoryview(buffer.view).cast("B")
            _warn_threads(buffer.unshareable_reason, len(PoolSettings.from_config(cfg).roles))
        return open_pool(PoolSettings.from_config(cfg), memory)

    # -- submitting ------------------------------------------------------------------------

    def submit_store(self, job: TransferJob) -> None:
        """Queue a store of ``job.keys`` from slots ``job.block_ids``. Never blocks.

        Raises ``ValueError`` (nothing queued) for a bad key, a block id outside the
        buffer, mismatched lengths or a job id already in flight.
        """
        self._submit(TaskKind.STORE, job)

    def submit_load(self, job: TransferJob) -> None:
        """Queue a load of ``job.keys`` into slots ``job.block_ids``. Never blocks.

        Raises ``ValueError`` like :meth:`submit_store`, and also when the job names a
        block id twice (two keys cannot both land in one slot).
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
        key_len = 0
        if n:
            lengths = list(map(len, keys)) if set(map(type, keys)) == _BYTES_ONLY else ()
            key_len = max(lengths) if lengths else 0
            if not lengths or key_len > MAX_KEY_BYTES or min(lengths) < _MIN_KEY_BYTES:
                keys = [check_key(k) for k in keys]  # raises ValueError naming the key
                key_len = max(map(len, keys))
            low, high = min(block_ids), max(block_ids)
            if low < 0 or high >= self._num_blocks:
                bad = low if low < 0 else high
                raise ValueError(f"job {job_id}: block id {bad} is outside the primary "
                                 f"buffer (valid ids: 0..{self._num_blocks - 1})")
            if kind == TaskKind.LOAD and len(set(block_ids)) != n:
                twice = next(b for b, c in collections.Counter(block_ids).items() if c > 1)
                raise ValueError(f"job {job_id}: block id {twice} appears more than once; "
                                 "a load needs one slot per key")
        per_task = self._per_task if key_len <= self._fast_key_len else \
            min(self._per_task, task_record_capacity(kind, key_len))
        idle = self._spread_width - self._ledger.tasks_in_flight
        if idle > 1:
            per_task = spread_per_task(n, per_task, idle, self._spread_least)
        first_task = self._ledger.add_job(job_id, kind, keys, block_ids, per_task)
        if not first_task:
            return
        if not self._pool.serving():
            self._fail_unserved(first_task)
            return
        self._queues[kind].put_records(encode_job(kind, first_task, keys, block_ids, per_task))

    def _fail_unserved(self, first_task: int) -> None:
        err, reason = self._pool.refusal()
        self._ledger.fail_group(first_task, err or errno.EHOSTDOWN, reason)

    # -- lookups -----------------------------------------------------------------------

    def lookup(self, key: bytes, req_id: Hashable = None) -> LookupResult:
        """HIT, MISS, or RETRY while the key waits for the next batched check. Never
        blocks: the check runs in a worker after :meth:`on_schedule_end`; answers that
        arrived since are applied here (a moved message counter says so, without a
        system call). MISS while the pool cannot serve."""
        if self._closed:
            raise TierClosedError("the tier was shut down")
        if type(key) is not bytes or not _MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
            key = check_key(key)
        if self._pool.news() != self._seen_news:
            self._poll()
        answer = self._lookups.lookup(key, req_id)
        if answer is LookupResult.RETRY and not self._pool.serving():
            self._lookups.answer([key], [False])
            return LookupResult.MISS
        return answer

    def on_schedule_end(self) -> None:
        """Collect finished checks, then send this step's unchecked keys to the workers."""
        if self._closed:
            raise TierClosedError("the tier was shut down")
        self._poll()
        keys = self._lookups.take_unsent()
        if not keys:
            return
        if not self._pool.serving():
            self._lookups.answer(keys, [False] * len(keys))
            return
        per_task = min(self.config.lookup_batch_keys,
                       task_record_capacity(TaskKind.LOOKUP, max(map(len, keys))))
        first_task = self._ledger.add_lookups(keys, per_task)
        self._queues[TaskKind.LOOKUP].put_records(
            encode_job(TaskKind.LOOKUP, first_task, keys, _NO_IDS, per_task))

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
        return self._ledger.take_finished() if self._ledger.has_finished() else []

    def take_events(self) -> list[TierEvent]:
        """"stored" events (when ``enable_events``) and "removed" events since last call
        (corrupt blocks removed on load; blocks evicted to stay within capacity_bytes).
        Never blocks: reads what the workers reported meanwhile first."""
        if not self._closed:
            self._poll()
        return self._ledger.take_events()

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
        nothing happened); push overflowed tasks on, or fail them if nobody can run
        them."""
        news = self._pool.news()
        if news != self._seen_news:
            self._seen_news = news
            self._pump()
        elif self._overflow_a or self._overflow_b or self._overflow_c:
            self._flush_overflow()

    def _flush_overflow(self) -> None:
        if not self._pool.serving():
            err, reason = self._pool.refusal()
            for queue in self._queues.values():
                for record in queue.writer.take_all():
                    self._ledger.fail_task(decode_task(record).task_id, err, reason)
            return
        for queue in self._queues.values():
            queue.flush()

    def _pump(self) -> None:
        self._flush_overflow()
        self._read_completions()
        self._pool.settle_lost(self._fail_in_flight)

    def _fail_in_flight(self, reason: str, err: int) -> None:
        """The workers' side went away (a service stopped or died): fail every job in
        flight and everything still queued (the pool attaches again afterwards)."""
        err = err or errno.ECONNRESET
        for queue in self._queues.values():
            queue.take_all()
        for task_id in self._ledger.unfinished_task_ids():
            self._ledger.fail_task(task_id, err, reason)

    def _read_completions(self) -> None:
        for message in self._completions.read_available():
            if message.type == MessageType.DONE or message.type == MessageType.LOST:
                self._ledger.task_finished(message)
            elif message.type == MessageType.RETRY:
                self._retry(message)
            elif message.type == MessageType.REMOVED:
                self._ledger.keys_removed(message)

    def _retry(self, message: Any) -> None:
        """Queue a task again whose worker died, unless it was reported meanwhile."""
        again = self._ledger.retry_record(message.task_id, message.attempt)
        if again is None:
            return
        kind, record = again
        if self._closed:
            self._ledger.fail_task(message.task_id, ERR_CANCELLED,
                                   f"{message.text}; not retried: the tier shut down")
        elif not self._pool.serving():
            err, reason = self._pool.refusal()
            self._ledger.fail_task(message.task_id, err, reason)
        else:
            self._queues[kind].writer.put(record)

    # -- introspection -------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters, queue depths, latency percentiles, usage per root and one entry per
        worker. Never blocks; works after :meth:`shutdown` (the workers' last figures).
        The operating system's view of the workers (CPU, memory, I/O) is in
        :meth:`figures`, which costs milliseconds."""
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
        pool = self._final_pool_stats or self._pool.stats()
        roots = self._root_figures(pool)
        capacity = (self._pool.io or self._io).capacity_bytes
        usage = sum(r["usage_bytes"] for r in roots)
        return {
            "mode": self.mode,
            "closed": self._closed,
            "root": self.mapper.base_path,
            "o_direct": self.use_o_direct,
            "io_uring": self._io.uring,
            "backend": self.backend,
            "native": self.backend == "native",
            "block_bytes": self._block_bytes,
            "blocks_per_task": self._per_task,
            "unavailable": pool["unavailable"],
            "jobs_in_flight": len(self._ledger.jobs),
            "tasks_in_flight": self._ledger.tasks_in_flight,
            "queued_tasks": queues,
            "lookup_requests": self._lookups.requests,
            "lookup_keys_pending": self._lookups.pending_keys,
            **asdict(self._ledger.counters),
            "latency": {k: percentiles(v) for k, v in self._ledger.latency.items()},
            # How long the workers' tasks took (their control-block buckets; an attached
            # engine's service reports its own in its status)
            "task_latency": pool.get("task_latency", {}),
            # Of the blocks stored: bytes written, and bytes skipped (already on disk).
            # The pool's figures: in a service, those of every engine it served.
            "written_bytes": pool.get("written_bytes", 0),
            "skipped_bytes": pool.get("skipped_bytes", 0),
            # Bytes of blocks under the roots (every cache folder there, other models'
            # too; a lower bound until each root's first walk completed), and the budget
            # (capacity_bytes per root; 0 = unlimited).
            "usage_bytes": usage,
            "capacity_bytes": capacity * len(roots),
            "roots": roots,
            "pool": pool["counters"],
            "workers": pool["workers"],
            **({"service": {k: v for k, v in pool.items() if k not in (
                "counters", "workers", "mode", "unavailable")}} if "service" in pool else {}),
        }

    def path_for(self, key: bytes) -> str:
        """The block file of ``key``, on the root it maps to (several roots: by
        rendezvous hashing, see :mod:`mptier.storage.roots`)."""
        return self.mappers[self._router.index_of(key)].path_for(key)

    def root_of(self, key: bytes) -> str:
        """The root ``key`` lives on."""
        return self._router.roots[self._router.index_of(key)]

    def _root_figures(self, pool: dict[str, Any]) -> list[dict[str, Any]]:
        if not self._closed:
            return self._pool.root_figures()
        return pool.get("roots") or []

    @property
    def status_name(self) -> str | None:
        """Name of this tier's status endpoint (``mptier status --name``), or ``None``."""
        endpoint = self._monitoring.endpoint
        return endpoint.name if endpoint is not None else None

    def figures(self) -> dict[str, Any]:
        """What ``mptier status --json`` shows for this tier: :meth:`stats` plus, per
        worker, psutil's CPU %, RSS and private memory, I/O bytes and descriptors, and
        per tier jobs and bytes per second since the previous call, latency and disk use
        (docs/monitoring.md). Reading ``/proc`` takes milliseconds (tens when private
        memory is due): call it from a monitoring thread, not the scheduler's --
        :meth:`stats` stays the cheap call."""
        return self._monitoring.monitor.figures()

    def worker_pids(self) -> list[int]:
        return self._pool.pids()

    # -- shutting down -------------------------------------------------------------------

    def shutdown(self) -> None:
        """Drop queued work (reported failed), let in-flight copies finish, stop the
        workers and release every pipe and shared object the tier made. Idempotent.

        Blocks for at most the time in-flight tasks take (then escalates to SIGKILL).
        """
        if self._shut_down:
            return
        self._shut_down = self._closed = True
        _live_tiers.discard(self)
        self._monitoring.close()  # first: nobody reads stats() while the rest closes
        for queue in self._queues.values():
            for record in queue.take_all():
                self._ledger.fail_task(decode_task(record).task_id, ERR_CANCELLED,
                                       "cancelled: the tier shut down before the task ran")
        self._channels.close_lifeline()  # workers finish their copy and detach
        self._pool.end_session(on_wait=self._read_completions)
        self._final_pool_stats = self._pool.stats()
        forced = self._pool.stop(on_wait=self._read_completions)
        if forced:
            log.warning("mptier shutdown: %s", "; ".join(forced))
        self._read_completions()
        for task_id in self._ledger.unfinished_task_ids():
            self._ledger.fail_task(task_id, ERR_CANCELLED,
                                   "the tier shut down while the task was running")
        self._cleanup.close()

    def __enter__(self) -> FileSystemTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if not getattr(self, "_shut_down", True):
            with contextlib.suppress(Exception):
                self.shutdown()


def _quietly(fn: Callable[[], object]) -> None:
    """Run a clean-up step; log instead of raising, so the error that made us clean up
    is the one the caller sees."""
    try:
        fn()
    except Exception:
        log.exception("mptier: clean-up step %s failed", getattr(fn, "__qualname__", fn))


def _warn_threads(reason: str, n_threads: int) -> None:
    global _warned_threads
    if not _warned_threads:
        _warned_threads = True
        log.warning("mptier: the primary buffer cannot be shared with worker processes "
                    "(%s); running I/O on %d threads in this process instead (io_timeout_s"
                    " is not enforced there)", reason, n_threads)

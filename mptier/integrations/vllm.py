"""mptier as an out-of-tree secondary tier of vLLM's tiered KV offloading (vLLM 0.32-0.33).

Configuration (``--kv-transfer-config``)::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "MPFileSystemTierManager",
                             "module_path": "mptier.integrations.vllm",
                             "root_dir": "/mnt/kv", "n_load_workers": 2}]}}

vLLM's ``SecondaryTierFactory`` imports ``module_path``, takes the class named by
``type``, strips ``type``, ``module_path`` and ``backpressure`` from the dict and calls
``MPFileSystemTierManager(offloading_spec=..., primary_kv_view=..., tier_type=...,
backpressure_detector=..., **rest)``. ``rest`` is ``root_dir``, ``enable_kv_events``,
``locality``, ``checksum_blocks`` (as for vLLM's own ``fs`` tier), ``service`` (attach to
a running ``mptier serve --name NAME`` instead of starting workers), ``config`` (a TOML
file of :class:`~mptier.config.TierConfig` fields) and any ``TierConfig`` tunable. The
file layout comes from vLLM's configuration, exactly as vLLM's ``fs`` tier derives it,
so the two tiers read and write the same cache and a user can switch either way.

::

    vLLM scheduler process                                       mptier workers
    ┌──────────────────────────────────────────────────────┐    ┌──────────────────┐
    │ TieringOffloadingManager (holds its lock)            │    │ map the same     │
    │   └─ MPFileSystemTierManager  (this module)          │    │ /dev/shm file    │
    │        └─ mptier.FileSystemTier ── tasks, pipes ─────┼───▶│ read/write block │
    │ primary buffer: /dev/shm/vllm_offload_<engine>.mmap  │◀───┼─ completions     │
    └──────────────────────────────────────────────────────┘    └──────────────────┘

Every method runs on vLLM's scheduler thread under the tiering manager's lock and never
blocks, except ``drain_jobs`` and ``shutdown``, whose contract is to wait. Importing this
module imports vLLM (``import mptier`` alone never does) and raises an ``ImportError``
saying what to install when vLLM is missing. It creates nothing when imported, because
vLLM's metrics front end imports it too, to read
:meth:`MPFileSystemTierManager.build_metric_definitions`.

The tier's options are checked and turned into a :class:`~mptier.config.TierConfig` by
:mod:`mptier.integrations.vllm_options`; what differs between vLLM releases, and how
mptier's log joins vLLM's, is in :mod:`mptier.integrations.vllm_compat`.

Long because it is one class, vLLM's SecondaryTierManager, whose docstring is the
contract with vLLM (options, and every way the tier differs from vLLM's fs tier) and
whose methods vLLM calls; its options and the differences between vLLM releases live in
vllm_options and vllm_compat.
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from mptier import jobs as mjobs
from mptier.errors import ConfigError, MptierError, errno_name
from mptier.integrations.vllm_compat import (
    CHECKSUM_FLAG,
    CHECKSUM_METRIC_ATTR,
    join_vllm_logging,
    unsupported_vllm,
)
from mptier.integrations.vllm_options import (
    ChosenConfig,
    check_options,
    choose_config,
    events_wanted,
    layout_from_spec,
    parse_checksum,
    parse_locality,
    requested_checksums,
    vllm_file_mapper,
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import (
        LookupResult,
        Medium,
        OffloadingCounterMetadata,
        OffloadingEvent,
        OffloadingGaugeMetadata,
        OffloadingMetricMetadata,
        OffloadKey,
        ReqContext,
        RequestOffloadingContext,
        ScheduleEndContext,
    )
    from vllm.v1.kv_offload.tiering import base as _tiering_base
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
    from vllm.v1.kv_offload.tiering.base import (
        JobResult,
        SecondaryTierManager,
        TieringOffloadingMetrics,
        TransferJob,
    )
except ImportError as _exc:
    raise ImportError(unsupported_vllm(_exc)) from _exc

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

    from mptier.manager import FileSystemTier

log = logging.getLogger(__name__)


# The label vLLM's tiering metrics carry the tier's name under: vLLM 0.33 exports it as
# TIER_LABEL; 0.32 has no such name and writes "tier" where it is used.
TIER_LABEL: str = getattr(_tiering_base, "TIER_LABEL", "tier")


_LOOKUP = {
    mjobs.LookupResult.HIT: LookupResult.HIT,
    mjobs.LookupResult.MISS: LookupResult.MISS,
    mjobs.LookupResult.RETRY: LookupResult.RETRY,
}

# get_stats() reads the engine's counters at most this often. vLLM asks every step;
# the counters are cumulative, so reading less often loses nothing but freshness.
STATS_INTERVAL_S = 1.0

ROOT_LABEL = "mptier_root"
METRIC_CORRUPT = "vllm:kv_offload_mptier_corrupt_blocks"
METRIC_WORKER_DEATHS = "vllm:kv_offload_mptier_worker_deaths"
METRIC_TASKS_RETRIED = "vllm:kv_offload_mptier_tasks_retried"
METRIC_TASKS_LOST = "vllm:kv_offload_mptier_tasks_lost"
METRIC_QUEUED_TASKS = "vllm:kv_offload_mptier_queued_tasks"
# Of the bytes vLLM gave the tier to store (its kv_offload_tiering_write_bytes): those
# written, and those of blocks already on disk, which cost a lookup and no write.
METRIC_WRITTEN_BYTES = "vllm:kv_offload_mptier_written_bytes"
METRIC_SKIPPED_BYTES = "vllm:kv_offload_mptier_skipped_bytes"


# metric name -> where its value sits in FileSystemTier.stats()
_COUNTERS = {
    METRIC_CORRUPT: ("corrupt_removed",),
    METRIC_WORKER_DEATHS: ("pool", "deaths"),
    METRIC_TASKS_RETRIED: ("pool", "tasks_retried"),
    METRIC_TASKS_LOST: ("pool", "tasks_lost"),
    METRIC_WRITTEN_BYTES: ("written_bytes",),
    METRIC_SKIPPED_BYTES: ("skipped_bytes",),
}


def vllm_reports_checksum_failures() -> tuple[bool, str | None]:
    """What the installed vLLM can be told about a block that failed its checksum:
    whether its ``JobResult`` takes ``checksum_failed``, and the name of its
    ``TieringOffloadingMetrics.CHECKSUM_FAILURES`` metric (None without one).
    ``(False, None)`` on vLLM 0.33."""
    takes_flag = CHECKSUM_FLAG in inspect.signature(JobResult).parameters
    return takes_flag, getattr(TieringOffloadingMetrics, CHECKSUM_METRIC_ATTR, None)


class MPFileSystemTierManager(SecondaryTierManager):
    """vLLM secondary tier backed by :class:`mptier.FileSystemTier` (worker processes).

    Keyword options (the tier's entry in ``secondary_tiers``, minus what the factory
    strips): ``root_dir`` (required here or in ``config``, unless ``service`` is set),
    ``enable_kv_events``, ``locality`` (``"LOCAL"`` or ``"REMOTE"``, exactly),
    ``checksum_blocks``, ``service``, ``config`` (path to a TOML file of ``TierConfig``
    fields; options given here win over it) and any ``TierConfig`` tunable
    (``n_load_workers``, ``n_store_workers``, ``task_bytes``, ``io_timeout_s``,
    ``use_o_direct``, ``worker_nice``, ``prefault``...). Layout fields are not options:
    they follow vLLM's configuration (in the file they are overridden, and an INFO line
    names those that differ; so is ``enable_events``, with a warning if it was on).

    ``checksum_blocks`` has vLLM's meaning: true writes vLLM's CRC32C record (xattr
    ``user.vllm.kv_crc32c``) with every block and verifies it on load (a block that does
    not match fails its load, is deleted and becomes a miss; a block without a record
    loads as before), and refuses to start (``ValueError`` naming extended attributes)
    on a root without user extended attributes; false (vLLM's default, also when the
    option is absent) writes and checks none. ``"auto"`` is mptier's: on where the root
    keeps user extended attributes, off with one warning elsewhere. When checksums are
    asked for (true or "auto") and the installed vLLM has them (after 0.33), a failed
    check is reported to vLLM as ``JobResult.checksum_failed`` and the tier declares
    ``TieringOffloadingMetrics.CHECKSUM_FAILURES``; vLLM 0.33 gets neither (see
    :func:`vllm_reports_checksum_failures`).

    ``service``: attach to the running ``mptier serve --name NAME`` instead of starting
    workers. The service's workers map vLLM's primary buffer; root, worker counts and
    I/O settings (checksums too) come from the service's configuration, the layout from
    vLLM's, so blocks land where vLLM's fs tier would put them under the service's
    root. ``root_dir`` may then be left out; if given it must be the service's root.
    ``checksum_blocks`` says what this engine needs of the service: true refuses to
    start unless the service checks blocks, false or absent reports no failed check to
    vLLM (the service may still write and verify records; an explicit false then warns).

    Behaves like vLLM's ``fs`` tier (``FileSystemTierManager``) and has its public
    attributes: ``file_mapper`` (vLLM's own ``FileMapper`` for this tier, built as vLLM's
    fs tier builds it, so ``file_mapper.get_file_name(key)`` is where a block lives) and
    ``events`` (None when events are off; otherwise the events not yet taken, added by
    :meth:`get_finished_jobs` and emptied by :meth:`take_events`). It logs what vLLM's
    tier logs: every failed job at ERROR, a failed load also at DEBUG with its errno (the
    engine warns of the O_DIRECT fallback, naming ``root_dir``). The differences:

    * I/O runs in ``n_load_workers + n_store_workers`` processes that map vLLM's primary
      buffer (the ``/dev/shm/vllm_offload_<engine_id>.mmap`` file behind
      ``primary_kv_view``), not on threads of the scheduler process. A view that is not
      file-backed cannot be shared: the same I/O then runs on threads here, with a
      warning;
    * a lookup answer belongs to the request that asked; another request checks again
      (vLLM shares a cached answer with every request while one still holds it);
    * an answer is applied by any call after it arrived (vLLM's: by the first
      ``lookup`` after a step end, or the next step end);
    * only a regular file of exactly the block size is a hit, and a symlink at a block
      path is removed, never followed (vLLM's tier answers by existence and leaves it);
    * ``shutdown`` reports queued jobs as failed instead of dropping them.

    Like vLLM's tier, ``submit_store``/``submit_load`` never raise for a bad job: a job
    mptier refuses (a chunk id outside the primary buffer, a malformed key, a job id
    still in flight) is logged as an error and reported failed, once, by the next
    :meth:`get_finished_jobs`, with ``successful_keys=None``; a refused load also turns
    its keys into a miss for every request holding an answer for them. Events, when
    ``enable_kv_events`` and vLLM's KV cache events are both on, are exactly vLLM's:
    one stored event (``removed=False``, ``Medium.STORAGE``, this tier's locality) per
    successful store job of at least one key, keys in job order; none for loads, failed
    stores or the corrupt blocks mptier deletes on load. ``transfer_bytes`` is vLLM's
    figure: the job's keys times the primary row size, None for an empty job.

    Raises ``ValueError`` (a :class:`~mptier.errors.ConfigError`) for an unknown or
    misplaced option, a bad ``locality``, ``checksum_blocks`` or ``config`` file,
    checksums required where they cannot be kept, or a ``root_dir`` that is not the
    service's; ``OSError`` if ``root_dir`` is unusable, and
    :class:`~mptier.errors.MptierError` if the workers cannot start or the service is
    not running. Options are checked before a worker starts.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str | os.PathLike[str] | None = None,
        *,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
        checksum_blocks: bool | str | None = None,
        service: str | None = None,
        config: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        # The first four parameters are where vLLM's fs tier has them; the rest are
        # keywords (vLLM's factory passes everything by keyword).
        join_vllm_logging()  # before the first line this tier logs
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._tier: FileSystemTier | None = None
        # Refused jobs wait here for the next get_finished_jobs().
        self._refused: list[JobResult] = []
        # Job id -> (number of keys, is a load), for jobs mptier accepted: vLLM reports
        # transfer_bytes as keys x row bytes whatever the outcome, and logs a failed
        # load with its size.
        self._jobs: dict[int, tuple[int, bool]] = {}
        # Validate everything before any worker starts.
        self.locality = parse_locality(tier_type, locality)
        checksums = parse_checksum(tier_type, checksum_blocks)
        check_options(tier_type, service, options)
        events = events_wanted(tier_type, enable_kv_events, offloading_spec)
        # vLLM's attribute: None when events are off, else the events not yet taken
        # (filled by get_finished_jobs, emptied by take_events).
        self.events: list[OffloadingEvent] | None = [] if events else None
        chosen = choose_config(tier_type, offloading_spec, root_dir, config, service,
                               checksums, events, options)
        self._tier = tier = self._open_tier(primary_kv_view, offloading_spec, tier_type,
                                            chosen)
        # Failed checks go to vLLM only where it has the field and the metric was
        # declared for this tier (build_metric_definitions reads the same settings).
        takes_flag, _ = vllm_reports_checksum_failures()
        self._report_checksums = takes_flag and chosen.checksums is not False
        self._root_label = (tier.mapper.root_dir,)
        self._stats_due = 0.0
        self._reported: dict[str, float] = {}
        self._log_started(offloading_spec, tier_type, chosen)

    def _open_tier(self, primary_kv_view: memoryview, offloading_spec: OffloadingSpec,
                   tier_type: str, chosen: ChosenConfig) -> FileSystemTier:
        """Start the engine (its workers, or its link to the service), check what this
        tier asked of a service, and build vLLM's own mapper (:attr:`file_mapper`) for
        the root; the engine is shut down again if any of it fails."""
        from mptier.manager import FileSystemTier

        tier = FileSystemTier(primary_kv_view, chosen.tier_config)
        try:
            root = tier.mapper.root_dir
            if chosen.service:
                self._check_service(tier, tier_type, chosen.service, chosen.given_root,
                                    chosen.checksums, chosen.explicit_checksums)
            # vLLM's own mapper, as vLLM's fs tier has it (get_file_name/base_path).
            self.file_mapper = vllm_file_mapper(offloading_spec, root)
            if tier.mapper.base_path != self.file_mapper.base_path:
                raise MptierError(
                    f"mptier would store blocks under {tier.mapper.base_path!r} but vLLM's "
                    f"fs tier uses {self.file_mapper.base_path!r}: the layouts disagree, "
                    "so the two could not share a cache")
        except BaseException:
            tier.shutdown()
            raise
        return tier

    def _log_started(self, offloading_spec: OffloadingSpec, tier_type: str,
                     chosen: ChosenConfig) -> None:
        tier, tier_config, service = self.tier, chosen.tier_config, chosen.service
        if tier.mode == "threads":
            log.warning("%s: vLLM's primary buffer is not a shared file (expected "
                        "/dev/shm/vllm_offload_%s.mmap), so mptier cannot hand it to "
                        "worker processes; its I/O runs on %d threads in this process",
                        tier_type, offloading_spec.config.engine_id,
                        tier_config.n_load_workers + tier_config.n_store_workers)
        if service:
            log.info("mptier tier %r: attached to service %r, blocks under %s, %d-byte "
                     "blocks, checksums %s", tier_type, service, tier.mapper.base_path,
                     self.block_size_bytes, "on" if tier.checksum_blocks else "off")
        else:
            log.info("mptier tier %r: blocks under %s, %d+%d worker %s, %d-byte blocks, "
                     "checksums %s", tier_type, tier.mapper.base_path,
                     tier_config.n_load_workers, tier_config.n_store_workers, tier.mode,
                     self.block_size_bytes, "on" if tier.checksum_blocks else "off")

    @staticmethod
    def _check_service(tier: FileSystemTier, tier_type: str, service: str, given_root: str,
                       checksums: bool | str, explicit: bool) -> None:
        """What this engine asked of the service it attached to: the same root, and
        checksums if they were required. Raises ``ConfigError``."""
        root = tier.mapper.root_dir
        if given_root and os.path.realpath(given_root) != os.path.realpath(root):
            raise ConfigError(
                f"{tier_type}: root_dir {given_root!r} is not the root of mptier service "
                f"{service!r}, which stores under {root!r}; leave root_dir out (a service "
                "brings its own root) or attach to the service that serves it")
        if checksums is True and not tier.checksum_blocks:
            raise ConfigError(
                f"{tier_type}: checksum_blocks=true, but mptier service {service!r} does "
                f"not write or verify block checksums: its root {root} does not keep user "
                "extended attributes, or it runs with checksum_blocks=false. Run the "
                'service with checksum_blocks true or "auto" on a root with user extended '
                'attributes, or set checksum_blocks to "auto" or false here')
        if checksums is False and explicit and tier.checksum_blocks:
            log.warning("%s: checksum_blocks=false, but mptier service %r writes and "
                        "verifies block checksums (its own setting decides); failed "
                        "checks are not reported to vLLM as checksum failures",
                        tier_type, service)

    @property
    def tier(self) -> FileSystemTier:
        """The mptier engine behind this tier (for stats and tests)."""
        assert self._tier is not None
        return self._tier

    # -- requests and lookups -----------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT, MISS, or RETRY until the key's batched check (sent at the step's end)
        has answered. Never blocks."""
        return _LOOKUP[self.tier.lookup(key, req_context.req_id)]

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Collect finished checks and send this step's new keys to the workers."""
        self.tier.on_schedule_end()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.tier.on_request_finished(req_context.req_id)

    # -- transfers ----------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue a store of ``keys`` from primary rows ``chunk_ids``. Never blocks or
        raises for a bad job (see the class docstring)."""
        try:
            self.tier.submit_store(_job(job_metadata))
        except ValueError as exc:
            self._refuse(job_metadata, "store", exc)
        else:
            self._jobs[job_metadata.job_id] = (len(job_metadata.keys), False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queue a load of ``keys`` into primary rows ``chunk_ids``. Never blocks or
        raises for a bad job (see the class docstring)."""
        try:
            self.tier.submit_load(_job(job_metadata))
        except ValueError as exc:
            self._refuse(job_metadata, "load", exc)
            # Like a load that failed at its first block: requests that were promised
            # these keys must not be promised them again (they would retry forever).
            self.tier.mark_miss(job_metadata.keys)
        else:
            self._jobs[job_metadata.job_id] = (len(job_metadata.keys), True)

    def _refuse(self, job: TransferJob, kind: str, exc: ValueError) -> None:
        # ERROR, as vLLM's thread pool logs every job whose I/O raised.
        log.error("%s: %s job %s (%d keys) failed without being queued: %s",
                  self.tier_type, kind, job.job_id, len(job.keys), exc)
        self._refused.append(JobResult(job_id=job.job_id, success=False, transfer_time=0.0,
                                       transfer_bytes=self._bytes(len(job.keys))))

    def _bytes(self, n_keys: int) -> int | None:
        # vLLM's figure: the job's size, whatever moved; None for an empty job.
        return n_keys * self.block_size_bytes if n_keys else None

    def _log_failure(self, job_id: int, is_load: bool, n_keys: int, n_loaded: int,
                     err: int, text: str | None) -> None:
        if err == errno.ECANCELED:
            # Cancelled by shutdown (vLLM's tier drops such jobs without a word).
            log.debug("%s: job %s cancelled: %s", self.tier_type, job_id, text)
            return
        log.error("%s: %s job %s failed: %s", self.tier_type, "load" if is_load else "store",
                  job_id, text)
        if is_load:
            log.debug("%s: load of %d blocks for job %s failed, %d of them loaded: "
                      "errno %d (%s): %s", self.tier_type, n_keys, job_id, n_loaded, err,
                      errno_name(err), text)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Every job that finished after the previous call, each reported once; adds
        their stored events to :attr:`events`. Never blocks."""
        tier = self.tier
        finished = tier.get_finished_jobs()
        if not finished and not self._refused:
            return []  # the common case, every step: no more work than the engine's
        # Taken in the same breath as the results, so the "stored" events are exactly
        # those of the jobs above; taking them whenever jobs finish also keeps the
        # engine's list (which holds "removed" events too, made by loads of corrupt
        # blocks) from growing when nobody wants events.
        engine_events = tier.take_events()
        results = []
        report_checksums = self._report_checksums
        for r in finished:
            n_keys, is_load = self._jobs.pop(r.job_id, (0, False))
            if not r.success:
                self._log_failure(r.job_id, is_load, n_keys, len(r.successful_keys or ()),
                                  r.errno, r.error)
            result = JobResult(job_id=r.job_id, success=r.success,
                               successful_keys=r.successful_keys,
                               transfer_time=r.transfer_time,
                               transfer_bytes=self._bytes(n_keys),
                               **({CHECKSUM_FLAG: r.checksum_failed}
                                  if report_checksums else {}))
            results.append(result)
        if self.events is not None:
            # The engine emits "stored" for a successful store of at least one key, as
            # vLLM's tier does; its "removed" events (corrupt blocks deleted on load)
            # have no counterpart in vLLM's fs tier, which publishes nothing for loads.
            self.events.extend(
                OffloadingEvent(keys=list(e.keys), medium=self.medium, removed=False,
                                locality=self.locality)
                for e in engine_events if e.kind == "stored")
        if self._refused:
            results += self._refused
            self._refused = []
        return results

    def take_events(self) -> Iterator[OffloadingEvent]:
        """Yield the events in :attr:`events`, then empty it (the same list object stays).

        A generator, like vLLM's: nothing is taken until it is iterated to the end."""
        pending = self.events
        if pending:
            yield from pending
            del pending[:]

    def drain_jobs(self) -> None:
        """Wait until every submitted job has finished; results stay queued for
        :meth:`get_finished_jobs`. Afterwards no worker touches the primary buffer."""
        self.tier.drain_jobs()

    def shutdown(self) -> None:
        """Stop the workers and release what mptier created. Idempotent."""
        if self._tier is not None:
            self._tier.shutdown()

    # -- metrics ------------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """mptier's own metrics, and vLLM's checksum-failure metric when the installed
        vLLM has one and this tier's config (``extra_config``: its entry in
        ``secondary_tiers``) asks for checksums (see :func:`requested_checksums`).
        vLLM's tiering manager counts that one from ``JobResult.checksum_failed``,
        labelled by tier. Called in vLLM's metrics front end too: creates nothing."""
        labels = (ROOT_LABEL,)
        definitions: dict[str, OffloadingMetricMetadata] = {
            METRIC_CORRUPT: OffloadingCounterMetadata(
                documentation="Blocks mptier found corrupt on load and deleted.",
                labelnames=labels),
            METRIC_WORKER_DEATHS: OffloadingCounterMetadata(
                documentation="mptier worker processes that died or were killed while "
                              "running (replaced automatically).",
                labelnames=labels),
            METRIC_TASKS_RETRIED: OffloadingCounterMetadata(
                documentation="mptier store tasks retried after their worker died.",
                labelnames=labels),
            METRIC_TASKS_LOST: OffloadingCounterMetadata(
                documentation="mptier tasks failed because their worker died or hung.",
                labelnames=labels),
            METRIC_QUEUED_TASKS: OffloadingGaugeMetadata(
                documentation="mptier tasks waiting for a worker, by queue.",
                labelnames=(ROOT_LABEL, "queue")),
            METRIC_WRITTEN_BYTES: OffloadingCounterMetadata(
                documentation="Bytes of KV blocks mptier's stores wrote (attached to a "
                              "service: the service's, for every engine it served).",
                labelnames=labels),
            METRIC_SKIPPED_BYTES: OffloadingCounterMetadata(
                documentation="Bytes of KV blocks given to mptier to store that were "
                              "already on disk, so not written again (attached to a "
                              "service: the service's, for every engine it served).",
                labelnames=labels),
        }
        _, checksum_metric = vllm_reports_checksum_failures()
        if checksum_metric is not None and requested_checksums(extra_config) is not False:
            definitions[checksum_metric] = OffloadingCounterMetadata(
                documentation="KV blocks whose CRC32C record (xattr user.vllm.kv_crc32c) "
                              "did not match on load; each was deleted and became a miss.",
                labelnames=(TIER_LABEL,))
        return definitions

    def get_stats(self) -> OffloadingConnectorStats | None:
        """Counters since the last report and queue depths, at most once a second."""
        now = time.monotonic()
        if self._tier is None or now < self._stats_due:
            return None
        self._stats_due = now + STATS_INTERVAL_S
        snapshot = self._tier.stats()
        stats = OffloadingConnectorStats()
        for name, path in _COUNTERS.items():
            value: Any = snapshot
            for part in path:
                value = value.get(part, 0) if isinstance(value, dict) else 0
            delta = value - self._reported.get(name, 0)
            if delta:
                stats.increase_counter(name, delta, self._root_label)
                self._reported[name] = value
        for queue, depth in snapshot.get("queued_tasks", {}).items():
            stats.set_gauge(METRIC_QUEUED_TASKS, depth, (*self._root_label, queue))
        return None if stats.is_empty() else stats


def _job(job: TransferJob) -> mjobs.TransferJob:
    return mjobs.TransferJob(job.job_id, list(job.keys), job.chunk_ids)


__all__ = ["MPFileSystemTierManager", "join_vllm_logging", "layout_from_spec",
           "requested_checksums", "vllm_file_mapper", "vllm_reports_checksum_failures"]

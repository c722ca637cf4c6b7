"""mptier as an out-of-tree secondary tier of vLLM's tiered KV offloading (vLLM 0.33).

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
``locality`` (as for vLLM's own ``fs`` tier) and any :class:`~mptier.config.TierConfig`
tunable. The file layout comes from vLLM's configuration, exactly as vLLM's ``fs`` tier
derives it, so the two tiers read and write the same cache.

::

    vLLM scheduler process                                       mptier workers
    ┌──────────────────────────────────────────────────────┐    ┌──────────────────┐
    │ TieringOffloadingManager (holds its lock)            │    │ map the same     │
    │   └─ MPFileSystemTierManager  (this module)          │    │ /dev/shm file    │
    │        └─ mptier.FileSystemTier ── tasks, pipes ─────┼───▶│ read/write block │
    │ primary buffer: /dev/shm/vllm_offload_<engine>.mmap  │◀───┼─ completions     │
    └──────────────────────────────────────────────────────┘    └──────────────────┘

Every method runs on vLLM's scheduler thread under the tiering manager's lock and never
blocks, except ``drain_jobs`` and ``shutdown``, whose contract is to wait. This module
imports vLLM: it is only imported where vLLM is installed. It creates nothing when
imported, because vLLM's metrics front end imports it too, to read
:meth:`MPFileSystemTierManager.build_metric_definitions`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
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
from vllm.v1.kv_offload.file_mapper import FileMapper as VllmFileMapper
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from mptier import jobs as mjobs
from mptier.config import TierConfig
from mptier.errors import ConfigError, MptierError

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

    from mptier.manager import FileSystemTier

log = logging.getLogger(__name__)

# Layout fields are vLLM's to decide (model, dtype, parallelism...); a tier config that
# set them could write a cache vLLM's own fs tier would not find.
_LAYOUT_KEYS = frozenset({
    "model_name", "tokens_per_hash", "blocks_per_file", "tp_size", "pp_size", "pcp_size",
    "dcp_size", "rank", "dtype", "kv_cache_groups", "inference_engine", "parallel_agnostic",
    "replicated_layout", "canonical_format"})
# Options of vLLM's fs tier that mean something else here.
_RENAMED = {
    "n_read_threads": "n_load_workers (worker processes, default 2, not threads)",
    "n_write_threads": "n_store_workers (worker processes, default 2, not threads)",
    "enable_events": "enable_kv_events (as for vLLM's fs tier)",
}

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

# metric name -> where its value sits in FileSystemTier.stats()
_COUNTERS = {
    METRIC_CORRUPT: ("corrupt_removed",),
    METRIC_WORKER_DEATHS: ("pool", "deaths"),
    METRIC_TASKS_RETRIED: ("pool", "tasks_retried"),
    METRIC_TASKS_LOST: ("pool", "tasks_lost"),
}


def layout_from_spec(offloading_spec: OffloadingSpec, root_dir: str
                     ) -> tuple[dict[str, Any], str]:
    """The :class:`TierConfig` layout fields vLLM's fs tier would use for this engine,
    and the base folder vLLM's fs tier computes for them.

    Built from vLLM's own ``FileMapper.from_offloading_spec`` with the arguments its fs
    tier passes (one file per chunk, parallel-agnostic where vLLM allows it), so the
    base folder is the same by construction.
    """
    mapper = VllmFileMapper.from_offloading_spec(
        root_dir=root_dir, offloading_spec=offloading_spec,
        blocks_per_file=offloading_spec.blocks_per_chunk, parallel_agnostic=True)
    fields = mapper.get_run_config()
    return {
        "model_name": fields["model_name"],
        "tokens_per_hash": fields["tokens_per_hash"],
        "blocks_per_file": fields["blocks_per_file"],
        "tp_size": fields["tp_size"],
        "pp_size": fields["pp_size"],
        "pcp_size": fields["pcp_size"],
        "dcp_size": fields["dcp_size"],
        "rank": mapper.rank,
        "dtype": fields["dtype"],
        "kv_cache_groups": fields["kv_cache_groups"],
        "inference_engine": fields["inference_engine"],
        # vLLM writes "parallel_agnostic": false only when the cache is *not* agnostic.
        "parallel_agnostic": "parallel_agnostic" not in fields,
        "replicated_layout": bool(fields.get("replicated_layout", False)),
        "canonical_format": fields.get("canonical_format"),
    }, mapper.base_path


class MPFileSystemTierManager(SecondaryTierManager):
    """vLLM secondary tier backed by :class:`mptier.FileSystemTier` (worker processes).

    Behaves like vLLM's ``fs`` tier (``FileSystemTierManager``), with these differences:

    * I/O runs in ``n_load_workers + n_store_workers`` processes that map vLLM's primary
      buffer, not on threads of the scheduler process;
    * a lookup answer belongs to the request that asked; another request re-checks;
    * ``submit_store``/``submit_load`` raise ``ValueError`` for a chunk id outside the
      primary buffer (vLLM's tier fails the job instead; vLLM never sends one);
    * ``shutdown`` reports queued jobs as failed instead of dropping them;
    * with events enabled, blocks found corrupt (and deleted) are announced as removed.

    Raises ``ValueError`` (a :class:`~mptier.errors.ConfigError`) for an unknown or
    misplaced option or a bad ``locality``, ``OSError`` if ``root_dir`` is unusable, and
    :class:`~mptier.errors.MptierError` if the workers cannot start.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        backpressure_detector: BackpressureDetector | None = None,
        enable_kv_events: bool = False,
        locality: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._tier: FileSystemTier | None = None
        # Validate everything before any worker starts.
        self.locality = Locality(locality) if locality is not None else None
        for key in options:
            if key in _RENAMED:
                raise ConfigError(f"{tier_type}: unknown option {key!r}; use "
                                  f"{_RENAMED[key]}")
            if key in _LAYOUT_KEYS:
                raise ConfigError(f"{tier_type}: option {key!r} cannot be set here; the "
                                  "file layout follows vLLM's configuration")
        events = bool(enable_kv_events)
        if events and not offloading_spec.kv_events_config.enable_kv_cache_events:
            log.warning("enable_kv_events is set on secondary tier %r but KV cache events "
                        "are disabled globally; the tier will not emit events.", tier_type)
            events = False
        self._events_enabled = events
        layout, vllm_base = layout_from_spec(offloading_spec, root_dir)
        config = TierConfig.from_dict({**options, **layout, "root_dir": root_dir,
                                       "enable_events": events})

        from mptier.manager import FileSystemTier

        tier = FileSystemTier(primary_kv_view, config)
        if tier.mapper.base_path != vllm_base:
            tier.shutdown()
            raise MptierError(f"mptier would store blocks under {tier.mapper.base_path!r} "
                              f"but vLLM's fs tier uses {vllm_base!r}: the layouts "
                              "disagree, so the two could not share a cache")
        self._tier = tier
        self._root_label = (root_dir,)
        self._stats_due = 0.0
        self._reported: dict[str, float] = {}
        log.info("mptier tier %r: blocks under %s, %d+%d worker %s, %d-byte blocks",
                 tier_type, tier.mapper.base_path, config.n_load_workers,
                 config.n_store_workers, tier.mode, self.block_size_bytes)

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
        if not self._events_enabled:
            self.tier.take_events()  # nobody drains them: keep the list from growing

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.tier.on_request_finished(req_context.req_id)

    # -- transfers ----------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue a store of ``keys`` from primary rows ``chunk_ids``. Never blocks."""
        self.tier.submit_store(_job(job_metadata))

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queue a load of ``keys`` into primary rows ``chunk_ids``. Never blocks."""
        self.tier.submit_load(_job(job_metadata))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs finished since the last call, each exactly once. Never blocks."""
        return [JobResult(job_id=r.job_id, success=r.success,
                          successful_keys=r.successful_keys, transfer_time=r.transfer_time,
                          transfer_bytes=r.transfer_bytes)
                for r in self.tier.get_finished_jobs()]

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored events of successful stores and removed events of corrupt blocks,
        when ``enable_kv_events`` and vLLM's KV cache events are both on."""
        events = self.tier.take_events()
        if not self._events_enabled:
            return []
        return [OffloadingEvent(keys=list(e.keys), medium=Medium.STORAGE,
                                removed=e.kind == "removed", locality=self.locality)
                for e in events]

    def drain_jobs(self) -> None:
        """Block until every submitted job has finished; results stay queued for
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
        labels = (ROOT_LABEL,)
        return {
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
        }

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


__all__ = ["MPFileSystemTierManager", "layout_from_spec"]

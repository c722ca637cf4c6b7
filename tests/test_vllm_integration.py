"""mptier as an out-of-tree secondary tier of the real vLLM 0.33 (``-m vllm``).

Runs in the environment made by ``scripts/vllm-env.sh`` (``make vllm-test``); elsewhere
the whole module is skipped. No GPU and no model: the offloading spec is vLLM's own
``TieringOffloadingSpec`` built from an ``OffloadingConfig``, and the primary buffer is
vLLM's own scheduler-side ``SharedOffloadRegion`` in /dev/shm, as in a real engine.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.base",
    reason="vLLM is not installed here; run scripts/vllm-env.sh and use .venv-vllm",
)

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import (
    ScheduleEndContext,
    SecondaryTierManager,
    TransferJob,
)
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from mptier.integrations.vllm import MPFileSystemTierManager

pytestmark = pytest.mark.vllm

BLOCK = 64 << 10  # bytes of one primary row (one chunk)
ROWS = 16
OUR_TIER = {"type": "MPFileSystemTierManager", "module_path": "mptier.integrations.vllm"}
# Small pools start fast; the defaults are for real disks.
SMALL = {"n_load_workers": 1, "n_store_workers": 1, "prefault": False}
STEP_END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
_engines = iter(range(1 << 30))


def key(n: int, group: int = 0) -> OffloadKey:
    return make_offload_key(n.to_bytes(32, "big"), group)


def make_spec(*, root: str | None = None, events: bool = False, agnostic: bool = True,
              tp_size: int = 1, rank: int = 0, tiers: list | None = None
              ) -> TieringOffloadingSpec:
    """vLLM's real tiering spec for a small, made-up model (nothing is downloaded)."""
    extra: dict = {"cpu_bytes_to_use": ROWS * BLOCK}
    if tiers is not None:
        extra["secondary_tiers"] = tiers
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, group_id=0,
                                      layer_names=("model.layers.0.self_attn.attn",
                                                   "model.layers.1.self_attn.attn")),),
        worker_kv_bytes_per_block=BLOCK // tp_size,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id=f"mptier-test-{os.getpid()}-{next(_engines)}",
        model=OffloadingModelConfig(name="org/test-model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank, world_size=tp_size, tp_size=tp_size, pp_size=1, pcp_size=1,
            dcp_size=1, data_parallel_index=0, data_parallel_size=1,
            data_parallel_rank_local=None, is_parallelism_agnostic=agnostic),
    )
    return TieringOffloadingSpec(config)


@pytest.fixture
def primary() -> Iterator[Callable[[TieringOffloadingSpec], memoryview]]:
    """``primary(spec)`` -> the spec's scheduler-side view of vLLM's shared region in
    /dev/shm; every region is released at teardown and its file must be gone."""
    regions = []

    def factory(spec: TieringOffloadingSpec) -> memoryview:
        region = SharedOffloadRegion(
            engine_id=spec.config.engine_id, num_chunks=spec.num_chunks, rank=None,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
            cpu_page_size=spec.cpu_page_size_per_worker)
        regions.append(region)
        return region.create_kv_memoryview()

    yield factory
    gc.collect()  # tiers hold views of the region inside reference cycles
    for region in regions:
        region.cleanup()
        assert not os.path.exists(region.mmap_path)


@pytest.fixture
def make_tier() -> Iterator[Callable[..., SecondaryTierManager]]:
    """``make_tier(view, spec, type_config, **options)`` through vLLM's factory; every
    tier is shut down at teardown."""
    made = []

    def factory(view, spec, type_config=OUR_TIER, **options) -> SecondaryTierManager:
        tier = SecondaryTierFactory.create_secondary_tier(
            {**type_config, **options}, view, spec)
        made.append(tier)
        return tier

    yield factory
    for tier in made:
        tier.shutdown()


def finish(tier: SecondaryTierManager, job_ids) -> dict:
    """Wait for the jobs; each must be reported exactly once."""
    tier.drain_jobs()
    results: dict = {}
    for result in tier.get_finished_jobs():
        assert result.job_id not in results, f"job {result.job_id} reported twice"
        results[result.job_id] = result
    assert set(results) == set(job_ids)
    return results


def resolve(tier: SecondaryTierManager, keys, ctx: ReqContext, timeout: float = 10.0
            ) -> list[LookupResult]:
    """Look the keys up as vLLM does: ask, end the step, ask again until no RETRY."""
    deadline = time.monotonic() + timeout
    while True:
        results = [tier.lookup(k, ctx) for k in keys]
        if LookupResult.RETRY not in results:
            return results
        assert time.monotonic() < deadline, f"lookups still RETRY: {results}"
        tier.on_schedule_end(STEP_END)
        tier.get_finished_jobs()
        time.sleep(0.005)


def job(job_id: int, keys, rows, *, load: bool, ctx: ReqContext | None = None
        ) -> TransferJob:
    return TransferJob(job_id=job_id, keys=list(keys),
                       chunk_ids=np.array(rows, dtype=np.int32), is_promotion=load,
                       req_context=ctx or ReqContext(req_id="jobs"))


def fill(view: memoryview, rows, seed: int) -> None:
    rng = np.random.default_rng(seed)
    array = np.asarray(view)
    for row in rows:
        array[row] = rng.integers(-128, 128, size=array.shape[1], dtype=np.int8)


# -- construction ------------------------------------------------------------------------


def test_factory_builds_the_tier_from_module_path(tmp_path, primary, make_tier):
    spec = make_spec()
    tier = make_tier(primary(spec), spec, root_dir=str(tmp_path), locality="REMOTE",
                     backpressure={"backpressure_cls": "EMABackpressureDetector"}, **SMALL)
    assert isinstance(tier, MPFileSystemTierManager)
    assert tier.tier_type == "MPFileSystemTierManager"
    assert tier.locality is Locality.REMOTE
    assert tier.medium is Medium.STORAGE
    assert tier.cache_hit_source is CacheHitSource.DISK
    assert tier.bp_detector is not None
    assert tier.block_size_bytes == BLOCK
    assert tier.tier.config.n_load_workers == 1
    # vLLM's region is a shared file: the I/O runs in worker processes.
    assert tier.tier.stats()["mode"] == "processes"
    assert len(tier.tier.worker_pids()) == 2


@pytest.mark.parametrize(("options", "message"), [
    ({"locality": "local"}, "Locality"),
    ({"locality": ""}, "Locality"),
    ({"n_read_threads": 16}, "n_load_workers"),
    ({"enable_events": True}, "enable_kv_events"),
    ({"model_name": "other"}, "layout follows vLLM"),
    ({"bogus_option": 1}, "bogus_option"),
    ({"n_load_workers": -1}, "n_load_workers"),
])
def test_bad_options_fail_before_any_worker_starts(tmp_path, primary, options, message):
    spec = make_spec()
    view = primary(spec)
    with pytest.raises(ValueError, match=message):
        SecondaryTierFactory.create_secondary_tier(
            {**OUR_TIER, "root_dir": str(tmp_path), **options}, view, spec)


def test_unusable_root_dir_raises_oserror(primary):
    spec = make_spec()
    with pytest.raises(OSError):
        SecondaryTierFactory.create_secondary_tier(
            {**OUR_TIER, "root_dir": "/dev/null/kv", **SMALL}, primary(spec), spec)


# -- transfers ---------------------------------------------------------------------------


def test_store_lookup_load_round_trip(tmp_path, primary, make_tier):
    spec = make_spec()
    view = primary(spec)
    tier = make_tier(view, spec, root_dir=str(tmp_path), **SMALL)
    keys = [key(1), key(2), key(3, group=1)]
    fill(view, [0, 1, 2], seed=1)
    expected = np.asarray(view)[0:3].copy()

    tier.submit_store(job(1, keys, [0, 1, 2], load=False))
    (stored,) = finish(tier, [1]).values()
    assert stored.success and stored.successful_keys is None
    assert stored.transfer_bytes == 3 * BLOCK

    ctx = ReqContext(req_id="r1")
    assert tier.lookup(key(9), ctx) is LookupResult.RETRY  # nothing checked yet
    assert resolve(tier, [*keys, key(9)], ctx) == [LookupResult.HIT] * 3 + [LookupResult.MISS]

    np.asarray(view)[:] = 0
    tier.submit_load(job(2, keys, [7, 8, 9], load=True, ctx=ctx))
    (loaded,) = finish(tier, [2]).values()
    assert loaded.success
    assert np.array_equal(np.asarray(view)[7:10], expected)
    tier.on_request_finished(ctx)


def test_chunk_id_outside_the_buffer_is_refused_at_submit(tmp_path, primary, make_tier):
    spec = make_spec()
    tier = make_tier(primary(spec), spec, root_dir=str(tmp_path), **SMALL)
    with pytest.raises(ValueError, match="outside the primary buffer"):
        tier.submit_store(job(1, [key(1)], [ROWS], load=False))
    tier.drain_jobs()
    assert list(tier.get_finished_jobs()) == []


def test_partial_load_failure_keeps_the_loaded_keys(tmp_path, primary, make_tier):
    spec = make_spec(events=True)
    view = primary(spec)
    tier = make_tier(view, spec, root_dir=str(tmp_path), enable_kv_events=True, **SMALL)
    keys = [key(1), key(2), key(3)]
    tier.submit_store(job(1, keys, [0, 1, 2], load=False))
    assert finish(tier, [1])[1].success
    list(tier.take_events())

    ctx = ReqContext(req_id="r")
    assert resolve(tier, keys, ctx) == [LookupResult.HIT] * 3
    bad = tier.tier.mapper.path_for(key(3))
    with open(bad, "r+b") as f:  # a short file is a corrupt block
        f.truncate(100)

    tier.submit_load(job(2, keys, [4, 5, 6], load=True, ctx=ctx))
    result = finish(tier, [2])[2]
    assert not result.success
    assert tuple(result.successful_keys) == (key(1), key(2))
    assert not os.path.exists(bad)
    # Same request: the failed key is now a miss, the others stay hits, no re-check.
    assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.HIT, LookupResult.HIT,
                                                   LookupResult.MISS]
    removed = [e for e in tier.take_events() if e.removed]
    assert [e.keys for e in removed] == [[key(3)]]
    assert removed[0].medium is Medium.STORAGE
    # A new request checks the disk again.
    assert resolve(tier, keys, ReqContext(req_id="fresh")) == [
        LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]


def test_first_block_failing_reports_no_successful_keys(tmp_path, primary, make_tier):
    spec = make_spec()
    tier = make_tier(primary(spec), spec, root_dir=str(tmp_path), **SMALL)
    tier.submit_store(job(1, [key(2)], [1], load=False))
    assert finish(tier, [1])[1].success
    ctx = ReqContext(req_id="r")
    assert resolve(tier, [key(1), key(2)], ctx) == [LookupResult.MISS, LookupResult.HIT]

    tier.submit_load(job(2, [key(1), key(2)], [3, 4], load=True, ctx=ctx))
    result = finish(tier, [2])[2]
    assert not result.success
    assert result.successful_keys is None  # a batch stops at its first failure
    # Neither key was loaded, so neither may be promised to this request again.
    assert [tier.lookup(k, ctx) for k in (key(1), key(2))] == [LookupResult.MISS] * 2


def test_shutdown_reports_every_job_once(tmp_path, primary, make_tier):
    spec = make_spec()
    tier = make_tier(primary(spec), spec, root_dir=str(tmp_path), **SMALL)
    for i in range(12):
        tier.submit_store(job(i, [key(i)], [i % ROWS], load=False))
    tier.shutdown()
    results = list(tier.get_finished_jobs())
    assert sorted(r.job_id for r in results) == list(range(12))
    tier.shutdown()  # idempotent


# -- the shared cache --------------------------------------------------------------------


VLLM_FS = {"type": "fs", "n_read_threads": 2, "n_write_threads": 2}


@pytest.mark.parametrize("agnostic", [True, False], ids=["agnostic", "per-rank"])
@pytest.mark.parametrize("writer", ["mptier", "vllm"])
def test_cache_is_shared_with_vllms_fs_tier(tmp_path, primary, make_tier, writer,
                                            agnostic):
    spec = make_spec(agnostic=agnostic, tp_size=2, rank=1)
    view = primary(spec)
    root = str(tmp_path)
    ours = make_tier(view, spec, root_dir=root, **SMALL)
    theirs = make_tier(view, spec, VLLM_FS, root_dir=root)
    write, read = (ours, theirs) if writer == "mptier" else (theirs, ours)
    keys = [key(10), key(11)]
    fill(view, [0, 1], seed=7)
    expected = np.asarray(view)[0:2].copy()

    write.submit_store(job(1, keys, [0, 1], load=False))
    assert finish(write, [1])[1].success
    for k in keys:
        path = theirs.file_mapper.get_file_name(k)
        assert os.path.getsize(path) == BLOCK
        assert f"_r{0 if agnostic else 1}/" in path
    config_path = theirs.file_mapper.get_config_file_path()
    with open(config_path) as f:
        assert json.load(f) == theirs.file_mapper.get_run_config()
    assert ours.tier.mapper.base_path == theirs.file_mapper.base_path

    assert resolve(read, keys, ReqContext(req_id="reader")) == [LookupResult.HIT] * 2
    np.asarray(view)[:] = 0
    read.submit_load(job(2, keys, [5, 6], load=True))
    assert finish(read, [2])[2].success
    assert np.array_equal(np.asarray(view)[5:7], expected)


# -- events and metrics ------------------------------------------------------------------


@pytest.mark.parametrize(("tier_flag", "global_flag", "emitted"), [
    (True, True, True),
    (True, False, False),
    (False, True, False),
])
def test_stored_events_need_both_flags(tmp_path, primary, make_tier, caplog, tier_flag,
                                       global_flag, emitted):
    spec = make_spec(events=global_flag)
    with caplog.at_level(logging.WARNING, logger="mptier.integrations.vllm"):
        tier = make_tier(primary(spec), spec, root_dir=str(tmp_path), locality="LOCAL",
                         enable_kv_events=tier_flag, **SMALL)
    assert ("disabled globally" in caplog.text) == (tier_flag and not global_flag)
    keys = [key(1), key(2)]
    tier.submit_store(job(1, keys, [0, 1], load=False))
    assert finish(tier, [1])[1].success
    tier.submit_load(job(2, [key(1)], [3], load=True))  # loads never emit events
    assert finish(tier, [2])[2].success
    tier.on_schedule_end(STEP_END)
    events = list(tier.take_events())
    if emitted:
        assert len(events) == 1
        assert events[0].keys == keys and not events[0].removed
        assert events[0].medium is Medium.STORAGE and events[0].locality is Locality.LOCAL
    else:
        assert events == []
    assert list(tier.take_events()) == []
    assert tier.tier.take_events() == []  # nothing piles up underneath


def test_stats_use_only_declared_metrics(tmp_path, primary, make_tier):
    spec = make_spec()
    tier = make_tier(primary(spec), spec, root_dir=str(tmp_path), **SMALL)
    definitions = MPFileSystemTierManager.build_metric_definitions({**OUR_TIER})
    stats = tier.get_stats()
    assert stats is not None
    _, values = stats.metric_sections()
    assert set(values) <= set(definitions)
    for name, series in values.items():
        for labelvalues in series:
            assert len(labelvalues) == len(definitions[name].labelnames)
    assert tier.get_stats() is None  # at most once a second


# -- under vLLM's own tiering manager ----------------------------------------------------


def test_cascade_and_promotion_through_vllms_tiering_manager(tmp_path):
    """vLLM builds the tier from its config, cascades a store to it, and after the
    primary tier forgets the blocks promotes them back through mptier's workers."""
    spec = make_spec(events=True, tiers=[{**OUR_TIER, "root_dir": str(tmp_path),
                                          "enable_kv_events": True, **SMALL}])
    manager = spec.get_manager()
    region_path = f"/dev/shm/vllm_offload_{spec.config.engine_id}.mmap"
    try:
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, MPFileSystemTierManager)
        primary_rows = np.asarray(manager.primary_tier.get_kv_memoryview())
        keys = [key(1), key(2), key(3)]

        writer = ReqContext(req_id="writer")
        manager.on_new_request(writer)
        prepared = manager.prepare_store(keys, writer)
        for i, row in enumerate(prepared.store_spec.chunk_ids):
            primary_rows[row] = i + 1  # stands in for the GPU -> CPU copy
        manager.complete_store(keys, writer)  # cascades to every secondary tier
        storage_events = []
        deadline = time.monotonic() + 10
        while not storage_events:
            assert time.monotonic() < deadline, "the cascade never finished"
            manager.on_schedule_end(STEP_END)
            storage_events = [e for e in manager.take_events() if e.medium is Medium.STORAGE]
            time.sleep(0.005)
        assert set(storage_events[0].keys) == set(keys)
        manager.on_request_finished(writer)

        manager.reset_cache()  # the primary tier forgets; only mptier holds the blocks
        manager.on_reset_flushed()
        primary_rows[:] = 0
        reader = ReqContext(req_id="reader")
        manager.on_new_request(reader)
        deadline = time.monotonic() + 10
        while (results := [manager.lookup(k, reader) for k in keys]) != \
                [LookupResult.HIT] * 3:
            assert time.monotonic() < deadline, f"never promoted: {results}"
            assert LookupResult.MISS not in results
            manager.on_schedule_end(STEP_END)
            time.sleep(0.005)
        load_spec = manager.prepare_load(keys, reader)
        assert [int(primary_rows[row][0]) for row in load_spec.chunk_ids] == [1, 2, 3]
        manager.complete_load(keys, reader)
        manager.on_request_finished(reader)
        del primary_rows, tier
    finally:
        gc.collect()
        manager.shutdown()
    assert not os.path.exists(region_path)

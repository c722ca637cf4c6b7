"""Crashes, hangs and a dying engine, with real processes: nothing hangs, no job is lost,
the pool heals, nothing is left behind."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest
from conftest import fill_random, wait_for, wait_results

from mptier import LookupResult, MptierError, TransferJob, make_key

KB = 1 << 10


def keys_for(n: int, tag: int = 0) -> list[bytes]:
    return [make_key(os.urandom(31) + bytes([tag]), 0) for _ in range(n)]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def busy_worker(tier, role: str | None = None) -> dict:
    holder = {}

    def find() -> bool:
        for w in tier.stats()["workers"]:
            if w["state"] == "busy" and (role is None or w["role"] == role):
                holder.update(w)
                return True
        return False

    wait_for(find, timeout=10, what="a busy worker")
    return holder


# How long a test waits for a replacement worker to boot: a new process importing mptier
# has taken 10-20 s on this 2-core machine with a parallel suite and other work on it.
# Only a wait: nothing here asserts how fast a worker boots.
BOOT_WAIT_S = 60.0


def full_pool(tier, size: int) -> bool:
    workers = tier.stats()["workers"]
    return len(workers) == size and all(w["alive"] and w["ready"] for w in workers)


def test_sigkill_mid_store_retries_and_replaces(make_buffer, make_tier, monkeypatch):
    monkeypatch.setenv("MPTIER_FAULT_STALL", "store:0.3")
    block = 64 * KB
    buf = make_buffer(16, block)
    fill_random(buf.view, range(16))
    tier = make_tier(buf, n_load_workers=1, n_store_workers=2, task_bytes=2 * block)
    keys = keys_for(16)
    for j in range(4):
        tier.submit_store(TransferJob(j, keys[4 * j:4 * j + 4], list(range(4 * j, 4 * j + 4))))
    victim = busy_worker(tier)
    os.kill(victim["pid"], signal.SIGKILL)
    results = wait_results(tier, range(4))
    assert all(r.success for r in results.values()), results
    stats = tier.stats()
    assert stats["pool"]["deaths"] == 1 and stats["pool"]["tasks_retried"] == 1
    assert "killed by SIGKILL(-9)" in stats["pool"]["last_deaths"][0]
    wait_for(lambda: full_pool(tier, 3), BOOT_WAIT_S, what="the pool back at full size")
    assert victim["pid"] not in [w["pid"] for w in tier.stats()["workers"]]
    for key, block_id in zip(keys, range(16)):
        with open(tier.mapper.path_for(key), "rb") as f:
            assert f.read() == buf.view[block_id].tobytes()
    def leftovers() -> list[str]:  # removed by the supervisor's janitor process, soon
        return [n for _, _, files in os.walk(tier.mapper.blocks_dir) for n in files
                if not n.endswith(".bin")]

    wait_for(lambda: not leftovers(), timeout=10, what="the killed store's temporary file "
             "to be removed")


def test_sigkill_mid_load_fails_that_load_only(make_buffer, make_tier, root, monkeypatch):
    # Every load first sleeps 0.5 s, as on a slow mount: long enough to be killed in.
    monkeypatch.setenv("MPTIER_FAULT_STALL", "load:0.5")
    buf = make_buffer(8, 4 * KB)
    fill_random(buf.view, range(2))
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1)
    good, stuck = keys_for(2)
    tier.submit_store(TransferJob(1, [good, stuck], [0, 1]))
    wait_results(tier, [1])
    path = tier.mapper.path_for(stuck)
    tier.lookup(stuck, "req")
    tier.submit_load(TransferJob(2, [stuck], [5]))
    victim = busy_worker(tier)
    os.kill(victim["pid"], signal.SIGKILL)
    result = wait_results(tier, [2])[2]
    assert not result.success and result.errno == errno.EOWNERDEAD
    assert "killed by SIGKILL" in result.error
    tier.submit_load(TransferJob(3, [good], [6]))  # the pool still serves
    assert wait_results(tier, [3])[3].success
    assert np.array_equal(buf.view[6], buf.view[0])
    wait_for(lambda: full_pool(tier, 2), BOOT_WAIT_S, what="replacement worker")
    assert os.path.exists(path), "a failed load must leave the file alone"


def test_hung_task_times_out_and_others_keep_flowing(make_buffer, make_tier, monkeypatch):
    # A load sleeps 0.3 s first; the test stops the worker in it: a hung file system.
    monkeypatch.setenv("MPTIER_FAULT_STALL", "load:0.3")
    buf = make_buffer(16, 4 * KB)
    fill_random(buf.view, range(4))
    # Long enough that no healthy task of this test reaches it on a loaded machine (a
    # suite in parallel): only the stopped worker's task does.
    timeout_s = 5.0
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1, io_timeout_s=timeout_s)
    stuck = keys_for(1)[0]
    started = time.monotonic()
    tier.submit_load(TransferJob(1, [stuck], [8]))
    os.kill(busy_worker(tier)["pid"], signal.SIGSTOP)  # the supervisor's SIGKILL ends it
    others = keys_for(4, tag=1)
    for j, key in enumerate(others):  # keeps flowing on the other worker meanwhile
        tier.submit_store(TransferJob(10 + j, [key], [j]))
    stores = wait_results(tier, range(10, 14))
    assert all(r.success for r in stores.values())
    result = wait_results(tier, [1], timeout=15 + timeout_s)[1]
    waited = time.monotonic() - started
    assert not result.success and result.errno == errno.ETIMEDOUT
    assert "io_timeout_s" in result.error
    assert waited >= timeout_s
    stats = tier.stats()
    assert stats["pool"]["timeouts"] == 1
    wait_for(lambda: full_pool(tier, 2), BOOT_WAIT_S, what="replacement worker")
    tier.submit_load(TransferJob(2, others, [12, 13, 14, 15]))
    assert wait_results(tier, [2])[2].success
    assert np.array_equal(buf.view[12:16], buf.view[0:4])
    assert tier.lookup(stuck, "r") is LookupResult.RETRY


def test_workers_that_cannot_boot_make_the_constructor_fail(make_buffer, make_tier):
    buf = make_buffer(4, 4 * KB)
    with pytest.raises(MptierError, match="could not start"):
        make_tier(buf, n_load_workers=1, n_store_workers=0, worker_cpus=[4095])


ENGINE = textwrap.dedent("""
    import json, sys, time
    from mptier import FileSystemTier, SharedKVBuffer
    buf = SharedKVBuffer.create(8, 4096)
    tier = FileSystemTier(buf, root_dir=sys.argv[1], n_load_workers=2, n_store_workers=2,
                          prefault=False)
    print(json.dumps({"pids": tier.worker_pids(), "buffer": buf.name}), flush=True)
    time.sleep(60)
""")


def test_engine_sigkill_workers_leave_and_clean_up_after_it(root):
    """Idle workers of a SIGKILLed engine leave within their exit bound, and remove what
    the engine could not: its buffer in /dev/shm (its lock is free) -- nobody else calls
    ``cleanup_stale`` here. (Held stores: tests/test_engine_exit.py.)"""
    from mptier.workers.orphan import ORPHAN_EXIT_S

    engine = subprocess.Popen([sys.executable, "-c", ENGINE, root], stdout=subprocess.PIPE,
                              text=True)
    try:
        info = json.loads(engine.stdout.readline())
        assert len(info["pids"]) == 4 and all(not gone(p) for p in info["pids"])
        leftover = f"/dev/shm/{info['buffer']}"
        assert os.path.exists(leftover)
        engine.kill()
        engine.wait()
        wait_for(lambda: all(gone(p) for p in info["pids"]), timeout=ORPHAN_EXIT_S + 10,
                 what="workers to exit after their engine died")
        assert not os.path.exists(leftover), "the dead engine's buffer is still there"
    finally:
        engine.kill()
        engine.wait()
        engine.stdout.close()


FORGETFUL_ENGINE = textwrap.dedent("""
    import json, sys
    from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
    buf = SharedKVBuffer.create(8, 4096)
    tier = FileSystemTier(buf, root_dir=sys.argv[1], n_load_workers=1, n_store_workers=1,
                          prefault=False)
    tier.submit_store(TransferJob(1, [make_key(b"k" * 32, 0)], [0]))
    print(json.dumps({"pids": tier.worker_pids(), "buffer": buf.name}), flush=True)
    buf.unlink()
    # exits without shutdown(): the atexit hook must stop the workers cleanly
""")


def test_engine_exiting_without_shutdown_stops_workers(root):
    engine = subprocess.run([sys.executable, "-c", FORGETFUL_ENGINE, root],
                            capture_output=True, text=True, timeout=60)
    assert engine.returncode == 0, engine.stderr
    info = json.loads(engine.stdout.splitlines()[0])
    wait_for(lambda: all(gone(p) for p in info["pids"]), timeout=5, what="workers to exit")
    assert "Traceback" not in engine.stderr and "SIGKILL" not in engine.stderr


def test_store_fails_once_its_retries_are_used_up(make_buffer, make_tier, monkeypatch):
    monkeypatch.setenv("MPTIER_FAULT_STALL", "store:5")
    buf = make_buffer(4, 4 * KB)
    tier = make_tier(buf, n_load_workers=0, n_store_workers=1, max_task_retries=0)
    tier.submit_store(TransferJob(1, keys_for(1), [0]))
    victim = busy_worker(tier)
    os.kill(victim["pid"], signal.SIGKILL)
    result = wait_results(tier, [1])[1]
    assert not result.success and result.errno == errno.EOWNERDEAD
    assert tier.stats()["pool"]["tasks_retried"] == 0
    assert tier.stats()["pool"]["tasks_lost"] == 1

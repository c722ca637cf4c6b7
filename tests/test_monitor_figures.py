"""Figures: psutil readings of real processes, rates from counter deltas, stats() read
from another thread while the scheduler thread works."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import fill_random, wait_results

from mptier import TransferJob, make_key
from mptier.errors import MptierError
from mptier.monitor import Monitor, ProcessTable, Sampler, query, read_stats
from mptier.monitor.procstats import MIN_RATE_INTERVAL_S, NOTE_TMPFS


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _stats(pid: int, *, store_jobs=0, store_bytes=0, tasks=0, nbytes=0, busy=0.0,
           root="", state="idle") -> dict:
    return {
        "mode": "processes", "closed": False, "root": root, "queued_tasks": {"store": 3},
        "jobs_submitted": {"store": store_jobs, "load": 0},
        "jobs_failed": {"store": 0, "load": 0},
        "bytes_done": {"store": store_bytes, "load": 0}, "keys_checked": 0,
        "latency": {"store": {"p50_s": 0.01, "p99_s": 0.02, "count": 5}},
        "workers": [{"pid": pid, "role": "store", "slot": 7, "alive": True, "ready": True,
                     "state": state, "tasks_done": tasks, "bytes_done": nbytes,
                     "busy_s": busy, "tasks_failed": 1, "generation": 0,
                     "task_age_s": 0.5, "backend": "native"}],
    }


@pytest.fixture
def busy_child(tmp_path):
    """A real process that burns CPU and writes 4 MiB to a file, then waits."""
    code = ("import sys, time\n"
            "end = time.process_time() + 0.3\n"
            "while time.process_time() < end: pass\n"
            f"with open({str(tmp_path / 'out')!r}, 'wb') as f: f.write(bytes(4 << 20))\n"
            "print('done', flush=True)\n"
            "sys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    yield child
    child.kill()
    child.wait()
    child.stdin.close()
    child.stdout.close()


def test_rates_come_from_counter_deltas_over_the_interval():
    clock = FakeClock()
    sampler = Sampler(clock=clock)
    first = sampler.sample(_stats(os.getpid(), store_jobs=10, store_bytes=1 << 20))
    assert first["interval_s"] is None and first["rates"]["store_bytes_per_s"] is None
    clock.now += 2.0
    second = sampler.sample(_stats(os.getpid(), store_jobs=30, store_bytes=5 << 20,
                                   tasks=8, nbytes=4 << 20, busy=0.4))
    assert second["interval_s"] == 2.0
    assert second["rates"]["store_jobs_per_s"] == 10.0
    assert second["rates"]["store_bytes_per_s"] == 2 << 20
    assert second["rates"]["load_jobs_per_s"] == 0.0
    assert second["queues"] == {"store": 3}
    assert second["latency"]["store"] == {"p50_s": 0.01, "p99_s": 0.02, "count": 5}
    worker = second["workers"][0]
    assert (worker["slot"], worker["tasks_failed"], worker["task_age_s"]) == (7, 1, 0.5)
    assert worker["backend"] == "native"  # the pool's other fields are passed on
    # A counter that went backwards (a replaced worker starts at zero) gives no rate.
    clock.now += 1.0
    third = sampler.sample(_stats(os.getpid(), store_jobs=5))
    assert third["rates"]["store_jobs_per_s"] is None


def test_worker_readings_of_a_real_process(busy_child, tmp_path):
    assert busy_child.stdout.readline().strip() == "done"
    sampler = Sampler()
    first = sampler.sample(_stats(busy_child.pid, root=str(tmp_path)))["workers"][0]
    assert first["cpu_user_s"] + first["cpu_system_s"] >= 0.2  # it burned 0.3 s
    assert first["write_chars"] >= 4 << 20  # write() bytes, counted on any file system
    assert first["rss_bytes"] > 0 and first["private_bytes"] > 0
    assert first["uss_bytes"] > 0 and first["open_fds"] >= 3
    assert first["cpu_percent"] is None  # nothing to compare with yet
    time.sleep(2 * MIN_RATE_INTERVAL_S)  # a CPU % needs an interval to cover
    second = sampler.sample(_stats(busy_child.pid, tasks=1))["workers"][0]
    assert second["cpu_percent"] is not None and second["cpu_percent"] >= 0
    assert second["uss_bytes"] == first["uss_bytes"]  # cached: USS is costly
    assert second["uss_age_s"] > 0


def test_a_dead_or_threaded_worker_has_no_process_readings(busy_child):
    busy_child.kill()
    busy_child.wait()
    table = ProcessTable()
    assert table.read(busy_child.pid) is None
    figures = Sampler(table).sample(_stats(busy_child.pid))
    assert figures["workers"][0]["rss_bytes"] is None
    threaded = Sampler().sample(_stats(os.getpid(), state="thread"))["workers"][0]
    assert threaded["cpu_user_s"] is None  # a thread is not a process of its own


def test_disk_figures_name_the_file_system_and_flag_tmpfs(tmp_path):
    shm = Sampler().sample(_stats(os.getpid(), root="/dev/shm"))
    assert shm["disk"]["fs_type"] == "tmpfs" and NOTE_TMPFS in shm["notes"]
    local = Sampler().sample(_stats(os.getpid(), root=str(tmp_path)))
    st = os.statvfs(tmp_path)
    assert local["disk"]["total_bytes"] == st.f_blocks * st.f_frsize
    assert local["disk"]["fs_type"]
    missing = Sampler().sample(_stats(os.getpid(), root=str(tmp_path / "gone")))
    assert "statvfs" in missing["disk"]["error"]


def test_read_stats_retries_only_the_races_of_a_live_tier():
    attempts = []

    def racy():
        attempts.append(1)
        if len(attempts) < 3:
            raise RuntimeError("dictionary changed size during iteration")
        return {"ok": True}

    assert read_stats(racy) == {"ok": True} and len(attempts) == 3
    with pytest.raises(RuntimeError, match="other"):
        read_stats(lambda: (_ for _ in ()).throw(RuntimeError("other")))
    with pytest.raises(MptierError, match="kept changing"):
        read_stats(lambda: (_ for _ in ()).throw(RuntimeError("deque mutated")), tries=3)


def test_status_queries_while_the_scheduler_thread_works(make_buffer, make_tier):
    """The endpoint thread reads stats() while this thread submits and polls: every
    query answers, every job finishes exactly once."""
    buf = make_buffer(64, 64 << 10)
    fill_random(buf.view, range(64))
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1, task_bytes=64 << 10)
    assert tier.status_name == f"engine-{os.getpid()}"
    stop = threading.Event()
    replies, errors = [], []

    def ask():
        while not stop.is_set():
            try:
                replies.append(query(tier.status_name)["figures"])
            except Exception as exc:
                errors.append(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        for round_ in range(6):
            jobs = range(round_ * 8, round_ * 8 + 8)
            for j in jobs:
                keys = [make_key(os.urandom(32), 0) for _ in range(8)]
                tier.submit_store(TransferJob(j, keys, list(range(8 * (j % 8),
                                                                  8 * (j % 8) + 8))))
            assert all(r.success for r in wait_results(tier, jobs).values())
    finally:
        stop.set()
        asker.join()
    assert not errors, errors[:3]
    assert len(replies) >= 2
    last = query(tier.status_name)["figures"]
    assert last["totals"]["jobs_submitted"]["store"] == 48
    assert last["totals"]["bytes"]["store"] == 48 * 8 * (64 << 10)


def test_monitor_labels_figures_and_keeps_separate_intervals():
    stats = _stats(os.getpid())
    monitor = Monitor(lambda: stats, name="unit", kind="service")
    first = monitor.figures()
    assert (first["name"], first["kind"], first["pid"]) == ("unit", "service", os.getpid())
    monitor.scrape()
    second = monitor.figures()
    # The scrape in between did not become the status reader's previous sample.
    assert second["interval_s"] > 0 and second["interval_s"] >= \
        second["time"] - first["time"] - 0.01
    assert np.isfinite(second["interval_s"])


def test_a_service_shaped_source_keeps_its_own_figures():
    """A service's stats (the pool's: "counters", plus who is attached) come through."""
    stats = {"kind": "service", "name": "svc", "pid": 1, "root": "", "attached":
             "engine pid 42", "attaches": 3, "mode": "processes", "unavailable": "",
             "counters": {"spawned": 4, "deaths": 1}, "workers": []}
    figures = Monitor(lambda: stats, name="svc", kind="service").figures()
    assert figures["pool"] == {"spawned": 4, "deaths": 1}
    assert (figures["attached"], figures["attaches"]) == ("engine pid 42", 3)
    assert (figures["name"], figures["kind"], figures["pid"]) == ("svc", "service",
                                                                  os.getpid())
    assert "counters" not in figures


def test_an_attached_tier_does_not_read_the_services_pids_locally():
    """Those pids may be another PID namespace's: the service's own endpoint reads them."""
    stats = {**_stats(os.getpid()), "service": {"service": "svc", "service_pid": 1}}
    figures = Sampler().sample(stats)
    assert figures["workers"][0]["rss_bytes"] is None
    assert any("mptier status --name svc" in note for note in figures["notes"])
    assert Sampler().sample(_stats(os.getpid()))["workers"][0]["rss_bytes"] > 0


def test_tier_figures_carry_the_workers_process_readings(make_buffer, make_tier, tmp_path):
    """FileSystemTier.figures(): the status object, built in-process, with psutil's
    readings of each real worker process after real I/O."""
    buf = make_buffer(16, 64 << 10)
    fill_random(buf.view, range(16))
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1, status_socket="",
                     root_dir=str(tmp_path / "kv"))
    keys = [make_key(os.urandom(32), 0) for _ in range(16)]
    tier.submit_store(TransferJob(1, keys, list(range(16))))
    assert wait_results(tier, [1])[1].success
    figures = tier.figures()
    assert figures["kind"] == "engine" and figures["pid"] == os.getpid()
    pids = set(tier.worker_pids())
    workers = [w for w in figures["workers"] if w.get("pid") in pids]
    assert len(workers) == 2
    for w in workers:
        assert w["rss_bytes"] > 0 and w["open_fds"] > 0 and w["threads"] >= 1
    assert figures["totals"]["bytes"]["store"] == 16 * (64 << 10)

"""``mptier serve`` as a real subprocess, and engines attaching to it: round trips, one
engine at a time, the service dying and coming back, the engine dying, clean stops."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import psutil
import pytest
from conftest import fill_random, wait_for, wait_results

from mptier import FileSystemTier, LookupResult, MptierError, TransferJob, make_key
from mptier.workers.worker import ORPHAN_EXIT_S

KB = 1 << 10
BLOCK = 64 * KB


def keys_for(n: int, tag: int = 0) -> list[bytes]:
    return [make_key(os.urandom(31) + bytes([tag])) for _ in range(n)]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class ServiceProcess:
    def __init__(self, name: str, root: str, run_dir: str, *extra: str) -> None:
        self.name, self.root, self.run_dir = name, root, run_dir
        env = {k: v for k, v in os.environ.items() if k != "MPTIER_RUN_DIR"}
        self.proc = subprocess.Popen(  # --run-dir, while the engine's side uses the variable
            [sys.executable, "-m", "mptier.cli", "serve", "--name", name, "--root", root,
             "--run-dir", run_dir,
             "--set", "prefault=false", "--set", "n_load_workers=1",
             "--set", "n_store_workers=1", *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert "listening on" in line, line or self.proc.stderr.read()

    @property
    def socket(self) -> str:
        return os.path.join(self.run_dir, f"{self.name}.sock")

    def worker_pids(self) -> list[int]:
        return [c.pid for c in psutil.Process(self.proc.pid).children()]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.proc.stdout.close()
            self.proc.stderr.close()


@pytest.fixture
def start_service(run_dir, tmp_path):
    started: list[ServiceProcess] = []

    def start(name: str = "kv", *extra: str, root: str | None = None) -> ServiceProcess:
        service = ServiceProcess(name, root or str(tmp_path / "kv"), run_dir, *extra)
        started.append(service)
        return service

    yield start
    for service in started:
        pids = service.worker_pids() if service.proc.poll() is None else []
        service.stop(signal.SIGKILL)
        # A worker that holds a store finishes it first (bounded by ORPHAN_EXIT_S).
        wait_for(lambda p=pids: all(gone(x) for x in p), timeout=ORPHAN_EXIT_S + 20,
                 what="the service's workers to go")


@pytest.fixture
def attach(make_buffer):
    made: list[FileSystemTier] = []

    def attach_to(service: ServiceProcess, buf=None, **overrides) -> FileSystemTier:
        buf = buf if buf is not None else make_buffer(16, BLOCK)
        tier = FileSystemTier(buf, root_dir="/not/used/by/a/service", service=service.name,
                              **overrides)
        made.append(tier)
        return tier

    yield attach_to
    for tier in made:
        tier.shutdown()


def round_trip(tier, buf, keys, first_job: int = 1) -> None:
    n = len(keys)
    fill_random(buf.view, range(n), seed=first_job)
    tier.submit_store(TransferJob(first_job, keys, list(range(n))))
    assert wait_results(tier, [first_job])[first_job].success
    tier.submit_load(TransferJob(first_job + 1, keys, list(range(n, 2 * n))))
    assert wait_results(tier, [first_job + 1])[first_job + 1].success
    assert np.array_equal(buf.view[:n], buf.view[n:2 * n])


def test_engine_attaches_and_round_trips_through_the_service(start_service, attach,
                                                             make_buffer, tmp_path):
    service = start_service()
    buf = make_buffer(16, BLOCK)
    tier = attach(service, buf)
    keys = keys_for(8)
    round_trip(tier, buf, keys)
    stats = tier.stats()
    assert stats["mode"] == "service" and stats["service"]["service"] == "kv"
    assert stats["root"].startswith(str(tmp_path / "kv"))  # the service's root
    for key in keys:
        with open(tier.mapper.path_for(key), "rb") as f:
            assert len(f.read()) == BLOCK
    wait_for(lambda: len(tier.stats()["workers"]) == 2, what="the service's figures")
    assert {w["pid"] for w in tier.stats()["workers"]} == set(service.worker_pids())
    assert tier.worker_pids() and os.getpid() not in tier.worker_pids()


def test_the_service_process_runs_without_numpy(start_service, attach, make_buffer):
    """A service maps control blocks, never an engine's buffer: it starts without
    numpy (a quarter of a second of CPU, and its pages), also after serving an engine
    whose buffer its workers map. The engine (this process) has numpy, which shows
    the check sees it."""
    service = start_service()
    buf = make_buffer(8, BLOCK)
    tier = attach(service, buf)
    round_trip(tier, buf, keys_for(4))

    def maps_numpy(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as f:
            return any("/numpy/" in line for line in f)

    assert maps_numpy(os.getpid())
    assert not maps_numpy(service.proc.pid)


def test_sigterm_stops_cleanly_and_leaves_nothing(start_service, attach, make_buffer,
                                                 run_dir):
    service = start_service()
    tier = attach(service)
    round_trip(tier, tier._buffer, keys_for(4))
    tier.shutdown()
    workers = service.worker_pids()
    assert len(workers) == 2
    assert service.stop(signal.SIGTERM) == 0
    wait_for(lambda: all(gone(p) for p in workers), timeout=10, what="workers to leave")
    assert not os.path.exists(service.socket)
    assert [n for n in os.listdir(run_dir) if n.startswith("kv.")] == []
    theirs = {str(p) for p in (service.proc.pid, *workers)}
    assert [n for n in os.listdir("/dev/shm") if n.split(".")[1:2] and
            n.split(".")[1] in theirs] == []


def test_a_second_engine_is_refused_naming_the_holder(start_service, attach, make_buffer):
    service = start_service()
    attach(service)
    with pytest.raises(MptierError, match=rf"attached to engine pid {os.getpid()}"):
        FileSystemTier(make_buffer(4, BLOCK), root_dir="/x", service=service.name)


def test_root_dir_is_the_services_and_need_not_be_given(start_service, make_buffer,
                                                      tmp_path):
    service = start_service()
    buf = make_buffer(16, BLOCK)
    with FileSystemTier(buf, service=service.name) as tier:  # no root_dir at all
        round_trip(tier, buf, keys_for(3))
        assert tier.mapper.base_path.startswith(str(tmp_path / "kv"))
        assert tier.stats()["o_direct"] is tier.use_o_direct


def test_the_automatic_task_size_follows_the_service_s_root(start_service, attach,
                                                           make_buffer):
    """task_bytes = "auto" is settled by the roots the workers use: an engine whose own
    root_dir is on a disk, attached to a service whose root is in memory, cuts its jobs
    into the memory size of tasks, not the disk's."""
    from mptier.config import MEMORY_TASK_BYTES
    from mptier.fskind import MEMORY_FS_TYPES, fs_type

    engine_root = "/not/used/by/a/service"
    if fs_type(engine_root) in MEMORY_FS_TYPES:
        pytest.skip("/ is in memory here: nothing to tell apart")
    shm = tempfile.mkdtemp(prefix="mptier-test-service-", dir="/dev/shm")
    try:
        service = start_service("kv", root=shm)
        buf = make_buffer(16, BLOCK)
        tier = attach(service, buf)
        assert tier.config.root_dir == engine_root
        assert tier.stats()["blocks_per_task"] == MEMORY_TASK_BYTES // BLOCK
        round_trip(tier, buf, keys_for(4))
        tier.shutdown()
        assert service.stop() == 0
    finally:
        shutil.rmtree(shm)


def test_no_service_is_a_clear_error(run_dir, make_buffer):
    with pytest.raises(MptierError, match=r"no mptier service named 'nobody'.*mptier serve"):
        FileSystemTier(make_buffer(4, BLOCK), root_dir="/x", service="nobody",
                       worker_start_timeout_s=0.5)


def test_service_killed_mid_run_fails_in_flight_and_reattaches(start_service, attach,
                                                              make_buffer, monkeypatch):
    monkeypatch.setenv("MPTIER_FAULT_STALL", "store:0.5")
    service = start_service()
    buf = make_buffer(16, BLOCK)
    tier = attach(service, buf)
    keys = keys_for(6)
    fill_random(buf.view, range(6))
    for j in range(6):
        tier.submit_store(TransferJob(j, keys[j:j + 1], [j]))
    workers = service.worker_pids()
    time.sleep(0.2)  # the first stores are running
    service.stop(signal.SIGKILL)
    started = time.monotonic()
    results = wait_results(tier, range(6), timeout=30)
    slowest_call = time.monotonic() - started
    failed = [r for r in results.values() if not r.success]
    assert failed, "a killed service cannot have finished 6 stalled stores"
    assert all(r.errno == errno.ECONNRESET and "'kv' went away" in r.error for r in failed)
    wait_for(lambda: all(gone(p) for p in workers), timeout=10,
             what="the dead service's workers to go")
    # while it is away: new jobs fail at once, lookups miss, nothing blocks
    tier.submit_store(TransferJob(100, keys[:1], [0]))
    result = wait_results(tier, [100], timeout=5)[100]
    assert not result.success and "went away" in result.error
    assert tier.lookup(keys_for(1)[0], "r") is LookupResult.MISS
    assert slowest_call < 30
    # it comes back: the tier attaches again by itself
    monkeypatch.delenv("MPTIER_FAULT_STALL")
    start_service()
    wait_for(lambda: not tier.stats()["unavailable"], timeout=20,
             what="the tier to attach again")
    assert tier.stats()["service"]["reattaches"] == 1
    round_trip(tier, buf, keys_for(4), first_job=200)


@pytest.mark.xdist_group("stale-shm-sweep")  # sweeps stale objects (test_shm.py)
def test_engine_killed_leaves_the_service_ready_for_the_next(start_service, attach,
                                                            make_buffer, run_dir):
    service = start_service()
    workers = service.worker_pids()
    engine = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, sys, time
        from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
        buf = SharedKVBuffer.create(8, 65536)
        tier = FileSystemTier(buf, root_dir="/x", service="kv")
        tier.submit_store(TransferJob(1, [make_key(b"e" * 32)], [0]))
        tier.drain_jobs()
        print("attached", flush=True)
        time.sleep(60)
    """)], env={**os.environ, "MPTIER_RUN_DIR": run_dir}, stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout.readline().strip() == "attached"
        engine.kill()
        engine.wait()
    finally:
        engine.kill()
        engine.stdout.close()
    # the same workers serve the next engine
    buf = make_buffer(16, BLOCK)
    tier = attach(service, buf)
    round_trip(tier, buf, keys_for(4))
    assert sorted(service.worker_pids()) == sorted(workers)
    from mptier.shm import cleanup_stale

    cleanup_stale(min_age_s=0)  # the killed engine's buffer: nobody holds it any more


def test_status_request_answers_with_the_pools_figures(start_service):
    import socket

    from mptier import messages

    service = start_service()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(service.socket)
        messages.send(s, "status")
        reply, _ = messages.receive(s)
    figures = reply["figures"]
    assert reply["ok"] and figures["kind"] == "service" and figures["name"] == "kv"
    assert figures["attached"] is None and len(figures["workers"]) == 2
    assert json.dumps(figures)  # plain JSON all the way


def test_service_is_visible_to_status_and_serves_metrics(start_service, attach, make_buffer,
                                                         run_dir):
    import socket
    import urllib.request

    with socket.socket() as s:  # a free port on this host
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    service = start_service("kv", "--metrics-port", str(port))
    buf = make_buffer(16, BLOCK)
    tier = attach(service, buf)
    round_trip(tier, buf, keys_for(4))
    out = subprocess.run([sys.executable, "-m", "mptier.cli", "status", "--name", "kv",
                          "--json", "--interval", "0"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "MPTIER_RUN_DIR": run_dir})
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    figures = figures[0] if isinstance(figures, list) else figures
    assert figures["kind"] == "service" and figures["attached"] == f"engine pid {os.getpid()}"
    assert sorted(w["pid"] for w in figures["workers"]) == sorted(service.worker_pids())
    # The service's own task latency (it never sees the engine's job completions): the
    # round trip's store and load tasks, each within what the engine saw of its job.
    tasks = figures["task_latency"]
    job = tier.stats()["latency"]
    for kind in ("store", "load"):
        assert tasks[kind]["count"] >= 1, tasks
        assert 0 < tasks[kind]["p50_s"] <= 1.5 * job[kind]["p99_s"], (tasks, job)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    assert b"mptier_" in text
    assert b'mptier_task_latency_seconds{' in text and b'kind="load"' in text

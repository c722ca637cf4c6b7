"""Faults across the service boundary, with real ``mptier serve`` processes (complements
``tests/test_service.py``): the service killed while one of its workers is frozen
mid-copy, restarted again and again while the engine keeps submitting, the engine killed
while the service's workers are busy, and an engine attaching while no worker can serve.
The engine never hangs, no job is lost or reported twice, no wrong byte is served."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from reliability_kit import (
    ENGINE_CALL_BOUND_S,
    LATE_S,
    EngineCalls,
    JobBook,
    Service,
    Traffic,
    gone,
    stop_services,
    wait_until,
)

from mptier import FileSystemTier, LookupResult, make_key
from mptier.service import link
from mptier.shm import cleanup_stale
from mptier.workers.serving import STALL_ENV

KB = 1 << 10
BLOCK = 64 * KB
# A slot says "busy" for a moment after its task reported too: one busy this long is in
# a stalled task (MPTIER_FAULT_STALL), not at the end of a quick one.
BUSY_AFTER_S = 0.1


def keys_for(n: int, tag: bytes) -> list[bytes]:
    return [make_key(tag.ljust(28, b".") + i.to_bytes(4, "big")) for i in range(n)]


@pytest.fixture
def services(run_dir, tmp_path):
    """``services(name="kv", env=None, **settings)`` starts a service on the test's root;
    every one is SIGKILLed at teardown and its workers waited for."""
    started: list[Service] = []

    def start(name: str = "kv", env: dict | None = None, **settings) -> Service:
        service = Service(name, str(tmp_path / "kv"), run_dir, env=env, **settings)
        started.append(service)
        return service

    yield start
    stop_services(started)


@pytest.fixture
def engines(make_buffer):
    """``engines(service_name)`` attaches a tier in this process; shut down at teardown."""
    made: list[FileSystemTier] = []

    def attach(name: str = "kv", num_blocks: int = 32, **overrides) -> FileSystemTier:
        tier = FileSystemTier(make_buffer(num_blocks, BLOCK), root_dir="/unused",
                              service=name, **overrides)
        made.append(tier)
        return tier

    yield attach
    for tier in made:
        tier.shutdown()


def service_worker(tier, state: str, timeout: float = 15) -> dict:
    """A worker of the attached service in ``state``, from the figures the link
    refreshes every second."""
    return wait_until(lambda: next((w for w in tier.stats()["workers"]
                                    if w["state"] == state and (
                                        state != "busy" or w["task_age_s"] > BUSY_AFTER_S)),
                                   None),
                      timeout, f"a service worker in state {state!r}")


def round_trip(book: JobBook, keys: list[bytes], slots: list[int],
               targets: list[int]) -> None:
    stored = book.store(keys, slots)
    assert book.wait([stored], timeout=30)[stored].success
    loaded = book.load(keys, targets)
    assert book.wait([loaded], timeout=30)[loaded].success


@pytest.mark.slow
def test_service_killed_while_a_worker_is_frozen_mid_copy_then_back(
        services, engines, make_frozen_cgroup):
    stall = {STALL_ENV: "load:3"}  # time to see the worker busy, then freeze it
    service = services(env=stall)
    tier = engines()
    calls = EngineCalls(tier)
    book = JobBook(calls, tier._buffer)
    keys = keys_for(4, b"frozen-svc")
    book.wait([book.store(keys, [0, 1, 2, 3])])
    assert book.stored == set(keys)
    in_flight = book.load(keys[:1], [8])
    busy = service_worker(tier, "busy")
    cg = make_frozen_cgroup(version=1)
    cg.add(busy["pid"])
    cg.freeze()
    killed_at = time.monotonic()
    service.stop(signal.SIGKILL)
    result = book.wait([in_flight], timeout=LATE_S + 5)[in_flight]
    assert time.monotonic() - killed_at < LATE_S + 1
    assert not result.success and result.errno == errno.ECONNRESET
    assert "'kv' went away" in result.error
    # away: new jobs fail at once, lookups miss
    refused = book.store(keys_for(1, b"while away"), [4])
    assert refused in {r.job_id for r in book.collect()}
    assert not book.results[refused].success
    assert calls.lookup(keys[1], "away") is LookupResult.MISS
    assert not gone(busy["pid"]), "a frozen worker outlives its killed service"
    # a new service on the same name while the old worker is still frozen
    services(env=stall)
    wait_until(lambda: not calls.stats()["unavailable"], 20, "the tier to attach again",
               book.collect)
    assert tier.stats()["service"]["reattaches"] == 1
    round_trip(book, keys_for(2, b"after"), [4, 5], [12, 13])
    cg.thaw()  # its pending kill (the dead service's) ends it; it took nothing new
    wait_until(lambda: gone(busy["pid"]), 10, "the thawed worker to die")
    round_trip(book, keys_for(2, b"after thaw"), [6, 7], [14, 15])
    book.drain(30)
    assert not book.lost() and not book.twice and not book.wrong
    assert calls.slowest < ENGINE_CALL_BOUND_S, (calls.slowest, calls.slowest_call)


@pytest.mark.slow
def test_service_restarted_again_and_again_while_the_engine_keeps_submitting(
        services, engines, monkeypatch):
    monkeypatch.setattr(link, "RECONNECT_S", 0.2)
    current = services()
    tier = engines()
    calls = EngineCalls(tier)
    book = JobBook(calls, tier._buffer)
    keys = keys_for(16, b"restarts")
    book.wait([book.store(keys, list(range(16)))])
    restarts = 4
    failed_fast = 0
    work = Traffic(book, calls, keys).step  # what the engine does meanwhile

    for restart in range(restarts):
        work(20)
        sig = signal.SIGKILL if restart % 2 == 0 else signal.SIGTERM
        current.proc.send_signal(sig)  # the engine keeps going while it stops
        wait_until(lambda: calls.stats()["unavailable"], 15,
                   f"the engine to notice the service went away ({sig.name})", work)
        job = book.store([keys[0]], [0])  # while it is away: fails at once
        book.collect()
        failed_fast += job in book.results and not book.results[job].success
        wait_until(lambda old=current: old.proc.poll() is not None, 30,
                   "the old service to exit", work)
        current.stop()
        current = services()
        wait_until(lambda: not calls.stats()["unavailable"], 20,
                   "the tier to attach again", work)
        assert tier.stats()["service"]["reattaches"] == restart + 1
    work(20)
    book.drain(30)
    assert not book.lost(), book.lost()
    assert not book.twice and not book.wrong
    assert failed_fast == restarts
    ok = sum(r.success for r in book.results.values())
    assert ok >= restarts * 10, ok  # each time it came back, work went through again
    assert calls.slowest < ENGINE_CALL_BOUND_S, (calls.slowest, calls.slowest_call)


ENGINE = textwrap.dedent("""
    import json, sys, time
    from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
    buf = SharedKVBuffer.create(16, 65536)
    tier = FileSystemTier(buf, root_dir="/x", service="kv")
    keys = [make_key(bytes([i]) * 32) for i in range(8)]
    tier.submit_store(TransferJob(1, keys, list(range(8))))
    tier.drain_jobs()
    for j in range(8):
        tier.submit_load(TransferJob(10 + j, keys[j:j + 1], [8 + j]))
    print(json.dumps({"buffer": buf.name}), flush=True)
    time.sleep(60)
""")


def test_engine_killed_while_the_services_workers_are_busy(services, engines, run_dir):
    service = services(env={STALL_ENV: "load:1"})
    engine = subprocess.Popen([sys.executable, "-c", ENGINE],
                              env={**os.environ, "MPTIER_RUN_DIR": run_dir},
                              stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(engine.stdout.readline())
        time.sleep(0.3)  # both workers are in a stalled load
        engine.kill()
        engine.wait()
    finally:
        engine.kill()
        engine.wait()
        engine.stdout.close()
    started = time.monotonic()
    tier = engines()  # the next engine: attaches once the workers let go of the last
    attach_s = time.monotonic() - started
    assert attach_s < 8 + LATE_S, attach_s  # 8 stalled loads of 1 s on two workers
    book = JobBook(EngineCalls(tier), tier._buffer)
    round_trip(book, keys_for(4, b"next engine"), [0, 1, 2, 3], [4, 5, 6, 7])
    assert sorted(service.children()) == sorted(service.worker_pids), "workers replaced"
    dead_buffer_removed(info["buffer"])
    assert not book.twice and not book.wrong


@pytest.mark.slow
def test_an_engine_attaches_at_once_while_every_worker_is_stuck(
        services, engines, make_frozen_cgroup):
    """No worker can serve (both frozen past SIGKILL, no spare slot): a new engine still
    attaches at once -- not after worker_start_timeout_s -- its jobs fail fast naming
    the cause, and it is served as soon as the workers are back."""
    services(env={STALL_ENV: "load:3"}, io_timeout_s=1.5, max_stuck_workers=0,
             worker_start_timeout_s=60)
    first = engines()
    book = JobBook(EngineCalls(first), first._buffer)
    keys = keys_for(2, b"stuck-all")
    book.wait([book.store(keys, [0, 1])])
    cgroups = []
    for n, key in enumerate(keys):  # one stalled load per worker, frozen mid-copy
        book.load([key], [8 + n])
        worker = wait_until(lambda: next(
            (w for w in first.stats()["workers"] if w["state"] == "busy"
             and w["task_age_s"] > BUSY_AFTER_S
             and w["pid"] not in [c.pids()[0] for c in cgroups]), None),
            10, "a busy service worker")
        cg = make_frozen_cgroup(version=1)
        cg.add(worker["pid"])
        cg.freeze()
        cgroups.append(cg)
    wait_until(lambda: "not responding" in first.stats()["unavailable"], 15,
               "the pool to give up", book.collect)
    book.drain(10)
    first.shutdown()
    started = time.monotonic()
    second = engines()
    assert time.monotonic() - started < 5 + LATE_S
    assert "not responding" in second.stats()["unavailable"]
    calls = EngineCalls(second)
    book = JobBook(calls, second._buffer)
    refused = book.store(keys_for(1, b"refused"), [2])
    assert refused in {r.job_id for r in book.collect()}
    assert "not responding" in book.results[refused].error
    assert calls.lookup(keys[0], "r") is LookupResult.MISS
    for cg in cgroups:
        cg.thaw()
    wait_until(lambda: not calls.stats()["unavailable"], 15,
               "the pool serving again", book.collect)
    served = keys_for(2, b"served")  # loads stall past io_timeout_s here: stores, lookups
    stored = book.store(served, [3, 4])
    assert book.wait([stored], timeout=30)[stored].success
    assert calls.lookup(served[0], "after") is LookupResult.RETRY
    calls.on_schedule_end()
    wait_until(lambda: calls.lookup(served[0], "after") is LookupResult.HIT, 10,
               "a lookup answered by the workers that are back")
    assert not book.lost() and not book.twice and not book.wrong
    assert calls.slowest < ENGINE_CALL_BOUND_S, (calls.slowest, calls.slowest_call)


FROZEN_ENGINE = textwrap.dedent("""
    import json, sys, time
    from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
    buf = SharedKVBuffer.create(16, 65536)
    tier = FileSystemTier(buf, root_dir="/x", service="kv")
    keys = [make_key(bytes([i]) * 32) for i in range(2)]
    tier.submit_store(TransferJob(1, keys, [0, 1]))
    tier.drain_jobs()
    tier.submit_load(TransferJob(2, keys[:1], [8]))  # its task: the first of group 2
    print(json.dumps({"buffer": buf.name}), flush=True)
    time.sleep(60)
""")


@pytest.mark.slow
@pytest.mark.xdist_group("stale-shm-sweep")  # sweeps stale objects (test_shm.py)
def test_engine_killed_while_a_worker_hangs_the_next_engine_is_not_held_up_or_misled(
        services, engines, run_dir, make_frozen_cgroup):
    """The dead engine's last task hangs (its worker frozen): the next engine attaches
    without waiting for io_timeout_s to park that worker, and when it is killed, its
    task -- an id the next engine uses too -- is not reported to the next engine."""
    io_timeout_s = 3.0
    service = services(env={STALL_ENV: "load:2"}, io_timeout_s=io_timeout_s)
    engine = subprocess.Popen([sys.executable, "-c", FROZEN_ENGINE],
                              env={**os.environ, "MPTIER_RUN_DIR": run_dir},
                              stdout=subprocess.PIPE, text=True)
    hung = make_frozen_cgroup(version=1)
    try:
        info = json.loads(engine.stdout.readline())
        busy = wait_until(lambda: next((w for w in service_figures(run_dir)["workers"]
                                        if w["state"] == "busy"
                                        and w["task_age_s"] > BUSY_AFTER_S), None),
                          5, "the dead engine's load running")
        hung.add(busy["pid"])
        hung.freeze()
        states = {w["pid"]: w["state"] for w in service_figures(run_dir)["workers"]}
        assert states[busy["pid"]] == "busy", "froze after its task ended"
        engine.kill()
        engine.wait()
    finally:
        engine.kill()
        engine.wait()
        engine.stdout.close()
    frozen_at = time.monotonic()
    tier = engines()
    assert time.monotonic() - frozen_at < io_timeout_s, "waited for the hung worker"
    calls = EngineCalls(tier)
    book = JobBook(calls, tier._buffer)
    keys = keys_for(2, b"next engine")
    book.wait([book.store(keys, [0, 1])])  # the next engine's group 1
    # Hold the next engine's group 2 in its queue until the hung worker was killed:
    # the other worker is stopped for that long.
    other = next(p for p in service.children() if p != busy["pid"])
    held = make_frozen_cgroup(version=1)
    held.add(other)
    held.freeze()
    load = book.load(keys[:1], [8])  # its task id is the dead engine's hung one
    wait_until(lambda: tier.stats()["pool"].get("timeouts", 0) >= 1,
               io_timeout_s + LATE_S + 3, "the hung worker to be killed", book.collect)
    held.thaw()
    result = book.wait([load], timeout=30)[load]
    assert result.success, result
    hung.thaw()
    wait_until(lambda: gone(busy["pid"]), 10, "the thawed worker to die")
    dead_buffer_removed(info["buffer"])
    assert not book.lost() and not book.twice and not book.wrong
    assert calls.slowest < ENGINE_CALL_BOUND_S, (calls.slowest, calls.slowest_call)
    assert service.proc.poll() is None


def dead_buffer_removed(name: str) -> None:
    """A killed engine's buffer goes at a cleanup once no worker maps it any more (a
    mapping holds the lock too): the service's workers let go of it when they finish
    the dead engine's last task. Another test run's cleanup (sharing /dev/shm) may be
    the one that removes it."""
    def removed() -> bool:
        cleanup_stale(min_age_s=0)
        return not os.path.exists(f"/dev/shm/{name}")

    wait_until(removed, 10 + LATE_S, f"the dead engine's buffer {name} removed")


def service_figures(run_dir: str, name: str = "kv") -> dict:
    """The service's status figures, asked over its socket (what ``mptier status``
    does): for a test with no engine attached in this process."""
    import socket

    from mptier import messages

    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(os.path.join(run_dir, f"{name}.sock"))
        messages.send(s, "status")
        reply, _ = messages.receive(s)
    return reply["figures"]


def test_a_service_dying_while_an_engine_attaches_is_waited_for_then_used(
        services, engines):
    """The engine connected and sent its attach; the service dies before answering (it
    is stopped, then killed). Like a service not there yet, that is waited for (up to
    worker_start_timeout_s): the restarted one takes the engine."""
    service = services()
    os.kill(service.pid, signal.SIGSTOP)  # connects go to its backlog, nobody answers
    outcome: dict = {}

    def attach() -> None:
        try:
            outcome["tier"] = engines(worker_start_timeout_s=30)
        except Exception as exc:  # handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=attach)
    thread.start()
    time.sleep(0.5)  # the engine sits in its attach
    assert thread.is_alive()
    service.stop(signal.SIGKILL)
    services()  # restarted, as a supervisor (systemd) would
    thread.join(40)
    assert not thread.is_alive() and "error" not in outcome, outcome
    tier = outcome["tier"]
    book = JobBook(EngineCalls(tier), tier._buffer)
    round_trip(book, keys_for(2, b"attached late"), [0, 1], [2, 3])
    assert not book.twice and not book.wrong

"""Workers that SIGKILL cannot end, with real processes, cgroups and mounts (issue 9):

* frozen in a cgroup v1 freezer mid-task (a process stuck on a dead NFS server), more
  times than the pool has slots: each job fails within io_timeout_s, the tier serves
  other work meanwhile, stuck workers are listed and parked, past max_stuck_workers the
  tier fails I/O at once naming the cause, and thawing brings it back by itself;
* a real hung mount (the FUSE test file system): blocked reads fail the load in time
  while every engine call stays fast; a blocked open, stat or write parks its worker
  until the connection is aborted;
* a read that outlives its killed worker never lands in a slot the engine reused.
"""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pytest
from reliability_kit import (
    ENGINE_CALL_BOUND_S,
    LATE_S,
    EngineCalls,
    JobBook,
    busy_worker,
    content,
    wait_until,
    worker_state,
)
from support import mounts

from mptier import LookupResult, make_key, native
from mptier.workers import supervisor
from mptier.workers.serving import STALL_ENV

KB = 1 << 10
BLOCK = 16 * KB
# Every load sleeps this long before its I/O (MPTIER_FAULT_STALL): the window in which
# the test freezes the worker that runs it.
LOAD_STALL_S = 1.0
IO_TIMEOUT_S = 2.0


def keys_for(n: int, tag: bytes) -> list[bytes]:
    return [make_key(tag.ljust(28, b".") + i.to_bytes(4, "big")) for i in range(n)]


def full_pool(tier, size: int) -> bool:
    workers = [w for w in tier.stats()["workers"] if w["state"] != "stuck"]
    return len(workers) == size and all(w["alive"] and w["ready"] for w in workers)


def assert_failed_in_time(book: JobBook, job: int, io_timeout_s: float) -> None:
    result = book.results[job]
    took = book.latency[job]
    assert not result.success and result.errno == errno.ETIMEDOUT, result
    assert "io_timeout_s" in result.error, result.error
    assert io_timeout_s <= took <= io_timeout_s + supervisor.TICK_S + LATE_S, took


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_frozen_workers_are_parked_then_io_fails_fast_then_thawing_heals(
        make_buffer, make_tier, make_frozen_cgroup, monkeypatch):
    monkeypatch.setenv(STALL_ENV, f"load:{LOAD_STALL_S}")
    buf = make_buffer(32, BLOCK)
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1, io_timeout_s=IO_TIMEOUT_S,
                     max_stuck_workers=1)
    slots = 2 + 1  # workers + max_stuck_workers
    calls = EngineCalls(tier)
    book = JobBook(calls, buf)
    keys = keys_for(8, b"frozen")
    book.wait([book.store(keys, list(range(8)))])
    assert book.stored == set(keys)
    frozen: list[int] = []  # every worker frozen so far
    cgroups: list = []  # cgroups of this outage, thawed when it ends

    def freeze_one_mid_load(n: int) -> None:
        """Load a key, freeze the worker that runs it: the load fails in time and the
        worker is parked; with a worker left, the tier serves other work meanwhile."""
        job = book.load([keys[n % 8]], [16 + n % 8])
        worker = busy_worker(tier, exclude=frozen)
        cg = make_frozen_cgroup(version=1)
        cgroups.append(cg)
        cg.add(worker["pid"])
        cg.freeze()
        assert worker_state(tier, worker["pid"]) == "busy", "froze after its task ended"
        frozen.append(worker["pid"])
        if len(cgroups) == 1:  # one frozen, one free: a store still goes through
            other = book.store(keys_for(1, b"other%d" % n), [24 + n % 8])
            assert book.wait([other], timeout=IO_TIMEOUT_S)[other].success
            assert job not in book.results, "the frozen load finished"
        book.wait([job], timeout=IO_TIMEOUT_S + supervisor.TICK_S + LATE_S + 5)
        assert_failed_in_time(book, job, IO_TIMEOUT_S)
        wait_until(lambda: worker_state(tier, worker["pid"]) == "stuck",
                   supervisor.STUCK_AFTER_S + supervisor.TICK_S + LATE_S,
                   f"worker {worker['pid']} parked as stuck", book.collect)

    def fails_fast(outage: int) -> None:
        reason = tier.stats()["unavailable"]
        assert "is not responding" in reason and "max_stuck_workers=1" in reason, reason
        stuck = sorted(w["pid"] for w in tier.stats()["workers"] if w["state"] == "stuck")
        assert stuck == sorted(frozen[-len(cgroups):])
        for submit in (lambda: book.store(keys_for(1, b"refused%d" % outage), [30]),
                       lambda: book.load(keys[:1], [31])):
            job = submit()
            assert job in {r.job_id for r in book.collect()}, "not failed at once"
            result = book.results[job]
            assert not result.success and result.errno == errno.EHOSTDOWN
            assert "is not responding" in result.error
        assert calls.lookup(keys[1], f"outage {outage}") is LookupResult.MISS

    def thaw_and_heal() -> None:
        for cg in cgroups:
            cg.thaw()
        cgroups.clear()
        wait_until(lambda: not tier.stats()["unavailable"] and full_pool(tier, 2),
                   10 + LATE_S, "the tier serving again after the thaw", book.collect)
        assert not {w["pid"] for w in tier.stats()["workers"]} & set(frozen)
        assert tier.stats()["pool"]["stuck"] == 0
        job = book.load(keys[:4], [16, 17, 18, 19])
        assert book.wait([job], timeout=30)[job].success

    n = 0
    for outage in range(2):  # two outages: more freezes than the pool has slots
        while not tier.stats()["unavailable"]:
            freeze_one_mid_load(n)
            n += 1
        fails_fast(outage)
        thaw_and_heal()
    assert len(frozen) > slots, (frozen, slots)
    book.drain(30)
    assert not book.lost() and not book.twice and not book.wrong
    assert calls.slowest < ENGINE_CALL_BOUND_S, (calls.slowest, calls.slowest_call)


# -- a real hung mount --------------------------------------------------------------------

def fuse_tier(make_fuse_fs, make_buffer, make_tier, *, direct_io: bool = False,
              **overrides):
    fs = make_fuse_fs(direct_io=direct_io)
    buf = make_buffer(32, BLOCK)
    overrides.setdefault("io_timeout_s", IO_TIMEOUT_S)
    tier = make_tier(buf, root_dir=str(fs.path("kv")), n_load_workers=1,
                     n_store_workers=1, **overrides)
    return fs, buf, tier


# A late read lands within this long of the server's answer (the control test waits
# for it that long; the bounced test watches the slot as long).
LANDING_S = 2.0


def _after_kill(beside: int) -> tuple[str | None, ...]:
    """What a worker killed in a hung read becomes: stuck in it (the system-call loop),
    or -- with other reads in flight through io_uring, whose hung request the kernel
    finishes after the process is gone -- gone, or stuck too."""
    return ("stuck",) if beside == 0 else ("stuck", None)


def name_of(tier, key: bytes) -> str:
    """A FUSE rule pattern for the block file of ``key`` and its temporary names."""
    return f"*{os.path.basename(tier.mapper.path_for(key))}*"


@pytest.mark.fuse
@pytest.mark.parametrize("backend", ["native"], indirect=True)
@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "page_cache"])
def test_reads_hung_on_a_fuse_mount_fail_the_load_in_time_and_the_engine_stays_fast(
        make_fuse_fs, make_buffer, make_tier, o_direct):
    fs, buf, tier = fuse_tier(make_fuse_fs, make_buffer, make_tier, use_o_direct=o_direct)
    assert tier.use_o_direct is o_direct
    calls = EngineCalls(tier)
    book = JobBook(calls, buf)
    hung, *others = keys_for(5, b"hung-read")
    book.wait([book.store([hung, *others], [0, 1, 2, 3, 4])])
    assert book.stored == {hung, *others}
    rule = fs.block("read", name_of(tier, hung))
    job = book.load([hung], [8])
    fs.wait_blocked(rule)
    # Meanwhile the other worker keeps serving loads, stores and lookups.
    round_trips = 0
    while job not in book.results and round_trips < 20:
        more = keys_for(1, b"meanwhile%d" % round_trips)
        stored = book.store(more, [16 + round_trips % 8])
        loaded = book.load(others[round_trips % 4:][:1], [24 + round_trips % 8])
        assert calls.lookup(others[0], f"r{round_trips}") is not LookupResult.MISS
        calls.on_schedule_end()
        done = book.wait([stored, loaded], timeout=10)
        assert all(r.success for r in done.values()) and len(done) == 2, done
        round_trips += 1
    book.wait([job], timeout=IO_TIMEOUT_S + supervisor.TICK_S + LATE_S)
    assert_failed_in_time(book, job, IO_TIMEOUT_S)
    assert round_trips >= 1
    assert calls.lookup(hung, "after") is not LookupResult.HIT  # a failed load: a miss
    killed = tier.stats()["pool"]["last_deaths"][-1]
    pid = int(killed.split(" pid ")[1].split()[0])
    if o_direct:  # a direct read waits for the server whatever the signal: parked
        wait_until(lambda: worker_state(tier, pid) == "stuck", 5 + LATE_S,
                   "the worker in the hung read to be parked", book.collect)
    else:  # a page-cache read dies with its SIGKILL
        wait_until(lambda: worker_state(tier, pid) is None, 5 + LATE_S,
                   "the killed worker to be gone", book.collect)
        assert tier.stats()["pool"]["stuck"] == 0
    rule.release()
    wait_until(lambda: worker_state(tier, pid) is None and full_pool(tier, 2), 10 + LATE_S,
               "the released worker gone and the pool whole", book.collect)
    again = book.load([hung], [9])
    assert book.wait([again], timeout=30)[again].success
    book.drain(30)
    assert not book.lost() and not book.twice and not book.wrong
    assert calls.slowest < ENGINE_CALL_BOUND_S, (calls.slowest, calls.slowest_call)


@pytest.mark.fuse
@pytest.mark.parametrize("backend", ["native"], indirect=True)
@pytest.mark.parametrize("op", ["open", "getattr", "write"])
def test_a_blocked_open_stat_or_write_parks_its_worker_until_the_connection_is_aborted(
        make_fuse_fs, make_buffer, make_tier, op, capfd, caplog):
    """These calls wait in the kernel for the FUSE server whatever the signal: the
    worker is parked; the engine goes on; aborting the connection frees it."""
    fs, buf, tier = fuse_tier(make_fuse_fs, make_buffer, make_tier)
    calls = EngineCalls(tier)
    book = JobBook(calls, buf)
    key, other = keys_for(2, b"blocked-" + op.encode())
    book.wait([book.store([other], [1])])
    if op != "write":
        book.wait([book.store([key], [0])])
    rule = fs.block(op, name_of(tier, key), times=1)  # the retry of a store goes through
    if op == "open":
        job = book.load([key], [8])
    elif op == "write":
        job = book.store([key], [2])
    else:  # a lookup stats the block file
        assert calls.lookup(key, "r") is LookupResult.RETRY
        calls.on_schedule_end()
    fs.wait_blocked(rule)
    pid = busy_worker(tier, parked=True)["pid"]
    wait_until(lambda: worker_state(tier, pid) == "stuck",
               IO_TIMEOUT_S + supervisor.STUCK_AFTER_S + 2 * supervisor.TICK_S + LATE_S,
               f"the worker blocked in {op} to be parked", book.collect)
    if op == "getattr":  # the lost lookup answers MISS, never RETRY for ever
        answer = calls.lookup(key, "r")
        # ... unless the stat the rule caught was the caretaker's walk, made by the idle
        # worker (the walk lstats the block too): the lookup was then served by the other
        # worker, and the parked one was found hung while idle
        idle_hang = any(f"pid {pid} did not answer a heartbeat" in r.getMessage()
                        and "while idle" in r.getMessage() for r in caplog.records)
        assert answer is (LookupResult.HIT if idle_hang else LookupResult.MISS), idle_hang
    elif op == "open":
        assert_failed_in_time(book, job, IO_TIMEOUT_S)
    else:  # a store is idempotent: retried on the other worker, it succeeds
        assert book.wait([job], timeout=10)[job].success
        with open(tier.mapper.path_for(key), "rb") as f:
            assert np.array_equal(np.frombuffer(f.read(), np.uint8), content(key, BLOCK))
    # the tier serves on the other worker while one is stuck
    loaded = book.load([other], [9])
    assert book.wait([loaded], timeout=10)[loaded].success
    assert mounts.abort_fuse(fs.mountpoint)
    wait_until(lambda: worker_state(tier, pid) is None, 5 + LATE_S,
               "the stuck worker to exit once the connection is aborted", book.collect)
    assert tier.stats()["pool"]["stuck"] == 0
    # the mount is dead now: I/O fails at once with the file system's error, nothing hangs
    failed = book.store(keys_for(1, b"after-abort"), [3])
    result = book.wait([failed], timeout=10)[failed]
    assert not result.success and result.errno == errno.ENOTCONN, result
    book.drain(10)
    assert not book.lost() and not book.twice and not book.wrong
    assert calls.slowest < ENGINE_CALL_BOUND_S, (calls.slowest, calls.slowest_call)
    tier.shutdown()  # workers leave cleanly, though their root is dead (their leases too)
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.fuse
@pytest.mark.parametrize("backend", ["native", "python"], indirect=True)
@pytest.mark.parametrize("direct_io,o_direct", [(False, True), (True, False)],
                         ids=["o_direct-read", "direct_io-mount"])
@pytest.mark.parametrize("beside", [0, 2], ids=["one-block", "reads-in-flight"])
def test_a_read_that_outlives_its_worker_never_lands_in_a_reused_slot(
        make_fuse_fs, make_buffer, make_tier, direct_io, o_direct, beside, backend):
    """A direct read stuck in the kernel keeps the slot's pages as its target; when the
    server answers after the load was reported failed and the engine reused the slot,
    those bytes must not land there (mptier.workers.bounce). ``reads-in-flight``: the
    hung block is the first of three, so the native core's io_uring path runs, with the
    other reads in flight into the bounce buffer meanwhile."""
    fs, buf, tier = fuse_tier(make_fuse_fs, make_buffer, make_tier, direct_io=direct_io,
                              use_o_direct=o_direct)
    assert [r["bounce_loads"] for r in tier.stats()["roots"]] == [True]
    if beside and backend == "native":  # the ring runs wherever this process has it
        ring = native.get_backend("native").uring_available()
        assert [r["io_uring"] for r in tier.stats()["roots"]] == [ring]
    calls = EngineCalls(tier)
    book = JobBook(calls, buf)
    stale, fresh, *others = keys_for(2 + beside, b"late-read")
    book.wait([book.store([stale, fresh, *others], list(range(2 + beside)))])
    rule = fs.block("read", name_of(tier, stale))
    job = book.load([stale, *others], [5, *range(6, 6 + beside)])
    fs.wait_blocked(rule)
    pid = busy_worker(tier)["pid"]
    assert_failed_in_time(book, job, IO_TIMEOUT_S) if book.wait(
        [job], timeout=IO_TIMEOUT_S + supervisor.TICK_S + LATE_S) else pytest.fail("hung")
    wait_until(lambda: worker_state(tier, pid) in _after_kill(beside), 5 + LATE_S,
               "the worker in the direct read to be parked (or gone)", book.collect)
    reuse = book.load([fresh], [5])  # the engine reuses the slot at once
    assert book.wait([reuse], timeout=10)[reuse].success
    rule.release()  # the server answers the stale read now
    wait_until(lambda: worker_state(tier, pid) is None, 5 + LATE_S,
               "the stuck worker to exit", book.collect)
    # the control test below sees the stale bytes land within LANDING_S of the release
    deadline = time.monotonic() + LANDING_S
    while time.monotonic() < deadline:
        assert np.array_equal(buf.view[5], content(fresh, BLOCK)), \
            "the stale read landed in the reused slot"
        time.sleep(0.05)
    assert not book.wrong and not book.twice


@pytest.mark.fuse
@pytest.mark.parametrize("backend", ["native"], indirect=True)
@pytest.mark.parametrize("beside", [0, 2], ids=["one-block", "reads-in-flight"])
def test_without_the_bounce_buffer_the_late_read_lands_in_the_reused_slot(
        make_fuse_fs, make_buffer, make_tier, beside):
    """The control for the test above: with ``bounce_loads = false`` the same stale read
    overwrites the engine's new contents of the slot -- so the hazard is real, and the
    setting reaches the workers. With reads in flight (io_uring) the killed worker is
    gone at once, and the kernel still lands the read when the server answers."""
    fs, buf, tier = fuse_tier(make_fuse_fs, make_buffer, make_tier, use_o_direct=True,
                              bounce_loads=False)
    assert [r["bounce_loads"] for r in tier.stats()["roots"]] == [False]
    book = JobBook(EngineCalls(tier), buf)
    stale, fresh, *others = keys_for(2 + beside, b"late-read")
    book.wait([book.store([stale, fresh, *others], list(range(2 + beside)))])
    rule = fs.block("read", name_of(tier, stale))
    job = book.load([stale, *others], [5, *range(6, 6 + beside)])
    fs.wait_blocked(rule)
    pid = busy_worker(tier)["pid"]
    assert book.wait([job], timeout=IO_TIMEOUT_S + supervisor.TICK_S + LATE_S), "hung"
    wait_until(lambda: worker_state(tier, pid) in _after_kill(beside), 5 + LATE_S,
               "the worker in the direct read to be parked (or gone)", book.collect)
    reuse = book.load([fresh], [5])
    assert book.wait([reuse], timeout=10)[reuse].success
    assert np.array_equal(buf.view[5], content(fresh, BLOCK))
    rule.release()
    wait_until(lambda: worker_state(tier, pid) is None, 5 + LATE_S,
               "the stuck worker to exit", book.collect)
    wait_until(lambda: np.array_equal(buf.view[5], content(stale, BLOCK)), LANDING_S,
               "the stale read to land: did the switch not reach the worker, or does the "
               "kernel no longer copy into pinned pages after SIGKILL?")


@pytest.mark.fuse
@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_status_still_answers_while_the_root_hangs(make_fuse_fs, make_buffer, make_tier):
    """`mptier status` reads the root's disk use (statvfs): on a hung mount that call
    never returns, and status must answer all the same, saying why the figure is
    missing; the engine's calls stay fast."""
    import json
    import subprocess
    import sys

    fs, buf, tier = fuse_tier(make_fuse_fs, make_buffer, make_tier)
    rule = fs.block("statfs", "*")

    def status() -> dict:
        out = subprocess.run([sys.executable, "-m", "mptier.cli", "status", "--name",
                              tier.status_name, "--json", "--interval", "0"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        figures = json.loads(out.stdout)
        return figures[0] if isinstance(figures, list) else figures

    for _ in range(2):  # the second while the first statvfs is still stuck
        figures = status()
        assert "not responding" in figures["disk"]["error"], figures["disk"]
        assert figures["disk"]["total_bytes"] is None
    fs.wait_blocked(rule)
    calls = EngineCalls(tier)
    calls.stats()
    assert calls.slowest < ENGINE_CALL_BOUND_S
    rule.release()
    wait_until(lambda: status()["disk"]["total_bytes"], 10, "disk figures again")
    book = JobBook(calls, buf)
    job = book.store(keys_for(1, b"status"), [0])
    assert book.wait([job], timeout=10)[job].success


@pytest.mark.fuse
@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_a_sweep_during_a_store_leaves_the_live_writers_temporary_file(
        make_fuse_fs, make_buffer, make_tier):
    """`mptier gc` (the lease sweeper) while a store is writing its temporary file (a
    named one: FUSE has no O_TMPFILE): the writer's lease is held, so the file is kept
    and the store publishes; a dead writer's file is the only kind it removes."""
    import json
    import subprocess
    import sys

    from reliability_kit import temp_files

    # The write stays blocked while `mptier gc` starts and runs in another interpreter
    # (seconds on a loaded machine): the store must not be timed out meanwhile.
    fs, buf, tier = fuse_tier(make_fuse_fs, make_buffer, make_tier, io_timeout_s=120)
    book = JobBook(EngineCalls(tier), buf)
    key = keys_for(1, b"live temp")[0]
    rule = fs.block("write", name_of(tier, key))
    job = book.store([key], [0])
    fs.wait_blocked(rule)
    [live] = temp_files(fs.path("kv"))
    # A dry run: a real one that took the file for dead would wait in unlink behind the
    # blocked write (the file's lock) until the rule is released.
    gc = subprocess.run([sys.executable, "-m", "mptier.cli", "gc", str(fs.path("kv")),
                         "--older-than", "1000d", "--dry-run", "--json", "--no-progress"],
                        capture_output=True, text=True, timeout=60)
    assert gc.returncode == 0, gc.stderr
    report = json.loads(gc.stdout)
    assert report["locks_work"] and report["temps_removed"] == 0, report
    assert report["temps_kept"] == 1
    assert os.path.exists(live)
    rule.release()
    assert book.wait([job], timeout=10)[job].success
    with open(tier.mapper.path_for(key), "rb") as f:
        assert np.array_equal(np.frombuffer(f.read(), np.uint8), content(key, BLOCK))


@pytest.mark.fuse
@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_a_hung_writer_does_not_hang_the_rest_of_its_folder(make_fuse_fs, make_buffer,
                                                            make_tier):
    """A store hangs in write: its worker is parked, holding its temporary file's lock.
    That file is removed only once the writer exits -- an unlink would wait for the lock
    holding the folder's, and every other block of the folder would hang behind it."""
    import time

    from reliability_kit import temp_files

    fs, buf, tier = fuse_tier(make_fuse_fs, make_buffer, make_tier)
    calls = EngineCalls(tier)
    book = JobBook(calls, buf)
    hung = keys_for(1, b"hung writer")[0]
    neighbour = make_key(hung[:31] + bytes([hung[31] ^ 1]))  # same folder, other block
    folder = os.path.dirname(tier.mapper.path_for(hung))
    assert os.path.dirname(tier.mapper.path_for(neighbour)) == folder
    book.wait([book.store([neighbour], [1])])
    rule = fs.block("write", name_of(tier, hung), times=1)
    job = book.store([hung], [0])
    fs.wait_blocked(rule)
    pid = busy_worker(tier, parked=True)["pid"]
    wait_until(lambda: worker_state(tier, pid) == "stuck",
               IO_TIMEOUT_S + supervisor.STUCK_AFTER_S + 2 * supervisor.TICK_S + LATE_S,
               "the hung writer parked", book.collect)
    # its store, retried on the other worker, and the folder's other blocks go on --
    # also a new one, whose creation needs the folder's lock (given the janitor time)
    assert book.wait([job], timeout=IO_TIMEOUT_S + LATE_S)[job].success
    time.sleep(1.0)
    fresh = make_key(hung[:31] + bytes([hung[31] ^ 2]))
    stored = book.store([fresh], [2])
    result = book.wait([stored], timeout=IO_TIMEOUT_S + LATE_S).get(stored)
    assert result is not None and result.success, f"a new block of the folder: {result}"
    loaded = book.load([neighbour], [8])
    assert book.wait([loaded], timeout=IO_TIMEOUT_S + LATE_S)[loaded].success
    assert calls.lookup(neighbour, "r") is LookupResult.RETRY
    calls.on_schedule_end()
    wait_until(lambda: calls.lookup(neighbour, "r") is LookupResult.HIT, 10,
               "a lookup in the folder answered", book.collect)
    rule.release()  # the writer returns from its write and dies of its pending kill
    wait_until(lambda: worker_state(tier, pid) is None, 10, "the writer gone",
               book.collect)
    wait_until(lambda: not temp_files(fs.path("kv")), 10,
               "its temporary file removed after it exited", book.collect)
    assert not book.lost() and not book.twice and not book.wrong

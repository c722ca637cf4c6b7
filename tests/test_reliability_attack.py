"""A hostile operator or environment against the tier's promises (never hang the engine,
never lose or double-report a job, never serve wrong bytes, leak nothing), with real
processes, limits and mounts: an engine out of file descriptors, a full file system, a
root that disappears, SIGSTOP/SIGCONT storms, workers killed while an engine attaches
and detaches."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
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
    run_stop_storm,
    temp_files,
    tiny_tmpfs,
    wait_until,
)

from mptier import FileSystemTier, LookupResult, MptierError, make_key
from mptier.workers import spawning

KB = 1 << 10
BLOCK = 64 * KB


def keys_for(n: int, tag: bytes) -> list[bytes]:
    return [make_key(tag.ljust(28, b".") + i.to_bytes(4, "big")) for i in range(n)]


def full_pool(tier, size: int) -> bool:
    workers = [w for w in tier.stats()["workers"] if w["state"] != "stuck"]
    return len(workers) == size and all(w["alive"] and w["ready"] for w in workers)


# -- out of file descriptors --------------------------------------------------------------

OUT_OF_FDS = textwrap.dedent("""
    import json, os, resource, signal, sys, time
    from mptier.workers import spawning
    spawning.BOOT_COOLDOWN_S = 1.0  # the test waits for the cool-down to end
    from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key

    def say(**fields):
        print(json.dumps(fields), flush=True)

    buf = SharedKVBuffer.create(8, 65536)
    tier = FileSystemTier(buf, root_dir=sys.argv[1], n_load_workers=1, n_store_workers=1,
                          prefault=False)
    pids = tier.worker_pids()
    # The engine opens files until it has no descriptor left (its limit lowered to what
    # it holds now, plus a few): the pool cannot start a process any more.
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4,
                                                resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    hog = []
    try:
        while True:
            hog.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while not tier.stats()["unavailable"] and time.monotonic() < deadline:
        time.sleep(0.02)
    reason = tier.stats()["unavailable"]
    started = time.perf_counter()
    tier.submit_store(TransferJob(1, [make_key(b"e" * 32)], [0]))
    results = tier.get_finished_jobs()
    say(reason=reason, submit_s=time.perf_counter() - started,
        results=[[r.job_id, r.success, r.errno, r.error] for r in results])
    for fd in hog:
        os.close(fd)
    deadline = time.monotonic() + 30
    while (tier.stats()["unavailable"] or len(tier.worker_pids()) < 2
           or not all(w["ready"] for w in tier.stats()["workers"])) \\
            and time.monotonic() < deadline:
        time.sleep(0.05)
    tier.submit_store(TransferJob(2, [make_key(b"f" * 32)], [1]))
    deadline = time.monotonic() + 30
    done = []
    while not done and time.monotonic() < deadline:
        done = tier.get_finished_jobs()
        time.sleep(0.01)
    say(recovered=not tier.stats()["unavailable"],
        results=[[r.job_id, r.success, r.errno, r.error] for r in done])
    tier.shutdown()
    buf.close()
    buf.unlink()
""")


@pytest.mark.slow
def test_an_engine_out_of_descriptors_fails_jobs_naming_it_then_recovers(root):
    """Workers die while the engine has no descriptor left, so none can be started:
    the pool says so (jobs fail at once naming EMFILE) instead of going silent, and it
    comes back once descriptors are free again."""
    engine = subprocess.run([sys.executable, "-c", OUT_OF_FDS, root], capture_output=True,
                            text=True, timeout=120)
    assert engine.returncode == 0, engine.stderr[-3000:]
    lines = [json.loads(line) for line in engine.stdout.splitlines()]
    out_of_fds, after = lines
    assert "Too many open files" in out_of_fds["reason"], out_of_fds
    assert out_of_fds["submit_s"] < ENGINE_CALL_BOUND_S
    [[job, ok, err, error]] = out_of_fds["results"]  # failed at once, never silence
    assert job == 1 and not ok and err == errno.ECHILD and "Too many open files" in error
    assert after["recovered"], after
    assert [r[:2] for r in after["results"]] == [[2, True]], after


@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_a_worker_the_supervisor_cannot_watch_does_not_stop_supervision(
        make_buffer, make_tier, monkeypatch):
    """pidfd_open fails (the engine is out of descriptors at that moment: injected here,
    once, for the replacement of a killed worker). The supervisor must not wait for that
    worker to exit: it goes on replacing others, and still notices when it dies."""
    real = os.pidfd_open
    failures: list[int] = []

    def pidfd_open(pid: int, flags: int = 0) -> int:
        if len(failures) < 1 and tier_started.is_set():
            failures.append(pid)
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real(pid, flags)

    tier_started = threading.Event()
    monkeypatch.setattr(spawning.os, "pidfd_open", pidfd_open)
    buf = make_buffer(8, BLOCK)
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1)
    tier_started.set()
    first = tier.stats()["workers"][0]["pid"]
    os.kill(first, signal.SIGKILL)  # its replacement cannot be watched
    wait_until(lambda: failures and full_pool(tier, 2), 15 + LATE_S,
               "the unwatched replacement ready")
    unwatched = failures[0]
    other = next(w["pid"] for w in tier.stats()["workers"] if w["pid"] != unwatched)
    os.kill(other, signal.SIGKILL)  # supervision goes on
    wait_until(lambda: other not in tier.worker_pids() and full_pool(tier, 2), 15 + LATE_S,
               "the other worker replaced")
    os.kill(unwatched, signal.SIGKILL)  # and its death is noticed without a pidfd
    wait_until(lambda: unwatched not in tier.worker_pids() and full_pool(tier, 2),
               15 + LATE_S, "the unwatched worker's death noticed and replaced")
    book = JobBook(EngineCalls(tier), buf)
    job = book.store(keys_for(1, b"watched"), [0])
    assert book.wait([job])[job].success
    assert tier.stats()["pool"]["deaths"] == 3


# -- a full file system, a root that disappears ---------------------------------------------

@pytest.mark.parametrize("backend", ["native", "python"], indirect=True)
def test_a_full_file_system_fails_stores_by_name_leaves_no_temp_file_and_recovers(
        make_buffer, make_tier):
    with tiny_tmpfs(1 << 20) as point:  # room for three 256 KiB blocks and the folders
        block = 256 * KB
        buf = make_buffer(16, block)
        tier = make_tier(buf, root_dir=os.path.join(point, "kv"), n_load_workers=1,
                         n_store_workers=1)
        calls = EngineCalls(tier)
        book = JobBook(calls, buf)
        keys = keys_for(6, b"enospc")
        results = [book.wait([job])[job] for job in
                   (book.store([key], [n]) for n, key in enumerate(keys))]
        ok = [r.success for r in results]
        assert ok[:2] == [True, True] and not ok[-1], results
        full = [r for r in results if not r.success]
        assert all(r.errno == errno.ENOSPC and "No space left" in r.error for r in full)
        assert temp_files(point) == []  # a failed store leaves nothing behind
        stored = [key for key, good in zip(keys, ok) if good]
        os.unlink(tier.mapper.path_for(stored[0]))  # the operator frees some space
        again = book.store([keys[-1]], [5])
        assert book.wait([again])[again].success
        loaded = book.load([*stored[1:], keys[-1]], list(range(8, 8 + len(stored))))
        assert book.wait([loaded])[loaded].success
        assert not book.wrong and not book.twice and not book.lost()
        assert calls.slowest < ENGINE_CALL_BOUND_S
        tier.shutdown()  # before the mount goes


@pytest.mark.parametrize("backend", ["native", "python"], indirect=True)
def test_a_root_that_disappears_or_turns_into_a_file_fails_by_name_and_never_hangs(
        make_buffer, make_tier, tmp_path):
    root = tmp_path / "vanishing" / "kv"
    buf = make_buffer(16, BLOCK)
    tier = make_tier(buf, root_dir=str(root), n_load_workers=1, n_store_workers=1)
    calls = EngineCalls(tier)
    book = JobBook(calls, buf)
    keys = keys_for(4, b"vanishing")
    book.wait([book.store(keys[:2], [0, 1])])
    def wipe() -> None:  # the caretaker may be making its own files under the root
        wait_until(lambda: not shutil.rmtree(tmp_path / "vanishing", ignore_errors=True)
                   and not (tmp_path / "vanishing").exists(), 10, "the root wiped")

    wipe()  # e.g. an operator wiping the cache
    lost = book.load(keys[:1], [8])
    result = book.wait([lost])[lost]
    assert not result.success and result.errno == errno.ENOENT and str(root) in result.error
    assert calls.lookup(keys[1], "r") is LookupResult.RETRY
    calls.on_schedule_end()
    wait_until(lambda: calls.lookup(keys[1], "r") is LookupResult.MISS, 10,
               "the lookup of a vanished block to miss", book.collect)
    stored = book.store(keys[2:3], [2])  # a store makes its folders again
    assert book.wait([stored])[stored].success
    assert os.path.exists(tier.mapper.record_path)  # with the block-size record
    loaded = book.load(keys[2:3], [9])
    assert book.wait([loaded])[loaded].success
    wipe()  # a new folder behind the path got a fresh walk and lock probe meanwhile
    root.parent.mkdir()
    root.write_bytes(b"")  # a file where the root folder was
    for job in (book.store(keys[3:4], [3]), book.load(keys[2:3], [10])):
        result = book.wait([job])[job]
        # ESTALE: the root path no longer leads to a folder (roots are followed by
        # path: docs/storage.md); ENOTDIR where a path below it is walked again
        assert not result.success and result.errno in (errno.ESTALE, errno.ENOTDIR), result
        assert str(root) in result.error
    assert not book.wrong and not book.twice and not book.lost()
    assert calls.slowest < ENGINE_CALL_BOUND_S


# -- signal storms ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.xdist_group("storms")  # storms time workers: one at a time
@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_sigstop_sigcont_storm_loses_nothing_and_serves_no_wrong_byte(make_buffer, make_tier):
    """For 12 s a random worker is stopped for 0.1-2.5 s, then continued (a debugger, a
    throttled container, a swapping host), while the engine runs mixed jobs: stopped
    busy workers time out and are replaced, stopped idle ones miss heartbeats."""
    rng = random.Random(7)
    buf = make_buffer(48, BLOCK)
    tier = make_tier(buf, n_load_workers=2, n_store_workers=2, io_timeout_s=1.0,
                     heartbeat_s=0.5)
    calls = EngineCalls(tier)
    book = JobBook(calls, buf)
    keys = keys_for(24, b"stop-storm")
    book.wait([book.store(keys, list(range(24)))])
    run_stop_storm(calls, book, keys, rng, 12)
    book.drain(30)
    assert not book.lost() and not book.twice and not book.wrong
    assert sum(r.success for r in book.results.values()) > 20
    assert tier.stats()["pool"]["deaths"] >= 1  # the storm did hit
    wait_until(lambda: full_pool(tier, 4), 15, "the pool whole after the storm",
               book.collect)
    last = book.load(keys[:4], [24, 25, 26, 27])
    assert book.wait([last])[last].success and not book.wrong
    assert calls.slowest < ENGINE_CALL_BOUND_S, (calls.slowest, calls.slowest_call)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_workers_killed_while_tiers_attach_and_detach(make_buffer, backend, root):
    """A killer SIGKILLs a random worker every 0.1-0.4 s while tiers start, work and
    shut down in a row: each start either succeeds or says why; each shutdown returns
    in bounded time; every job is reported exactly once; nothing is left behind."""
    rng = random.Random(11)
    stop = threading.Event()
    kills = 0

    def killer() -> None:
        nonlocal kills
        while not stop.wait(rng.uniform(0.1, 0.4)):
            pids = [p for tier in live for p in tier.worker_pids()]
            if pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rng.choice(pids), signal.SIGKILL)
                    kills += 1

    live: list[FileSystemTier] = []
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    buf = make_buffer(16, BLOCK)
    started = refused = 0
    try:
        for cycle in range(6):
            try:
                tier = FileSystemTier(buf, root_dir=root, n_load_workers=1,
                                      n_store_workers=1, prefault=False,
                                      worker_start_timeout_s=20, native=True)
            except MptierError as exc:  # a start beaten by the killer says so
                refused += 1
                assert "workers" in str(exc)
                continue
            live.append(tier)
            started += 1
            book = JobBook(EngineCalls(tier), buf)
            keys = keys_for(4, b"cycle%d" % cycle)
            jobs = [book.store(keys, [0, 1, 2, 3]), book.load(keys[:2], [8, 9])]
            time.sleep(rng.uniform(0.2, 0.8))
            began = time.monotonic()
            tier.shutdown()  # with jobs in flight, while workers are being killed
            assert time.monotonic() - began < 30
            live.remove(tier)
            book.collect()
            assert set(book.results) == set(jobs) and not book.twice and not book.wrong
    finally:
        stop.set()
        thread.join()
        for tier in live:
            tier.shutdown()
    assert started >= 3 and kills >= 3, (started, refused, kills)


def test_the_scenario_runner_runs_and_writes_its_table(tmp_path):
    """tests/reliability_run.py (the report's figures) keeps working: two quick scenarios,
    one of which skips with its reason until its feature is on main."""
    out = tmp_path / "reliability.json"
    bench = os.path.join(os.path.dirname(__file__), "reliability_run.py")
    run = subprocess.run([sys.executable, bench, "--only", "pidns_buffer,hostile_entries",
                          "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["scenario"]: r for r in report["rows"]}
    assert set(rows) == {"pidns_buffer", "hostile_entries"}
    for row in rows.values():
        assert row["status"] in ("ran", "skipped"), row
        if row["status"] == "ran":
            assert row["jobs_lost"] == 0 and row["wrong_bytes"] == 0, row
            assert row["objects_leaked"] == 0, row
        else:
            assert row["notes"] and row["notes"][-1].startswith("skipped: "), row
    assert "| scenario | jobs run |" in out.with_suffix(".md").read_text()
    assert report["load_average_before"] and report["date"]


@pytest.mark.slow
def test_the_runners_lifecycle_scenarios_run_clean(tmp_path):
    """killed_at_start and root_moved (the runner's round-three scenarios; about 30 s) run
    and come out whole: killed_at_start once failed its live tier's start (a root refuses
    a tier whose block size differs from the one it records) and nothing else noticed."""
    out = tmp_path / "reliability.json"
    bench = os.path.join(os.path.dirname(__file__), "reliability_run.py")
    run = subprocess.run([sys.executable, bench, "--only", "killed_at_start,root_moved",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {r["scenario"]: r for r in json.loads(out.read_text())["rows"]}
    assert {name: row["status"] for name, row in rows.items()} == {
        "killed_at_start": "ran", "root_moved": "ran"}, rows
    assert all(row["objects_leaked"] == 0 for row in rows.values()), rows

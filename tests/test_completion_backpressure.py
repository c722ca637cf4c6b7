"""An engine that stops reading its completion pipe for a while (a long scheduler step, a
debugger, a swapping host) while workers finish tasks, and sometimes die.

The pipe is shrunk to one page (``F_SETPIPE_SZ`` on the tier's public ``fileno()``) so a
few hundred small jobs fill it, as tens of thousands would fill the real 1 MiB one.
Then: no healthy worker is taken for hung (``io_timeout_s`` measures I/O, not the wait
to report), no root is blamed, the supervisor keeps handling deaths and respawning, and
once the engine reads again every job is reported exactly once -- none dropped, none
doubled -- with the right bytes in every slot a load reported.

Also here: workers run the engine's own mptier, not one in the working folder.
"""

from __future__ import annotations

import array
import fcntl
import hashlib
import os
import random
import signal
import subprocess
import sys
import termios
import textwrap
import time

import pytest
from reliability_kit import LATE_S, EngineCalls, JobBook, wait_until

from mptier import make_key
from mptier.channels import F_SETPIPE_SZ
from mptier.jobs import MAX_COMPLETION_BYTES

PAGE = os.sysconf("SC_PAGE_SIZE")
# One test process runs these one after another (make test's --dist loadgroup): each
# fills pipes and pauses past io_timeout_s, and two at once double the load each sees.
pytestmark = pytest.mark.xdist_group("completion-backpressure")

BLOCK = 4096  # small jobs: the reports, not the copies, are what piles up
# The pauses below must outlast it, so the tests take about twice this; 3 s rather than 1
# because a healthy one-block task on a loaded machine (the suite runs in parallel) has
# been seen to take past 1 s, and a worker shot for that is the harm these tests look for.
IO_TIMEOUT_S = 3.0
# Several heartbeats in a pause (three), each answered by workers waiting to report. A
# worker at nice 10 on a 2-core machine under CI's load (the suite's test processes
# and the vLLM venvs building beside them) was seen unscheduled past 1 s: shot for it.
HEARTBEAT_S = 2.0
# Kept from polling this long: past io_timeout_s and several heartbeats, with the
# supervisor's tick and a loaded machine's lateness on top.
PAUSE_S = 2 * IO_TIMEOUT_S + LATE_S
STORM_TIMEOUT_S = 30.0


def keys_for(n: int, salt: str) -> list[bytes]:
    return [make_key(hashlib.sha256(f"{salt}-{i}".encode()).digest(), 0) for i in range(n)]


@pytest.fixture(params=[False, True], ids=["processes", "threads"])
def anonymous(request) -> bool:
    return request.param


def one_page_pipe(tier) -> None:
    """Shrink the tier's completion pipe to a page (it must be empty: a fresh tier)."""
    fcntl.fcntl(tier.fileno(), F_SETPIPE_SZ, PAGE)


def queued_bytes(tier) -> int:
    """Bytes waiting in the completion pipe (read by nobody: FIONREAD only looks)."""
    n = array.array("i", [0])
    fcntl.ioctl(tier.fileno(), termios.FIONREAD, n)
    return n[0]


def pipe_full(tier) -> bool:
    return queued_bytes(tier) > PAGE - MAX_COMPLETION_BYTES // 8


def reporting(tier) -> list[dict]:
    return [w for w in tier.stats()["workers"] if w["state"] == "reporting"]


def harm(tier) -> dict:
    """What would say a healthy worker was shot or a root blamed."""
    stats = tier.stats()
    pool = stats["pool"]
    return {"deaths": pool["deaths"], "timeouts": pool["timeouts"],
            "heartbeat_kills": pool["heartbeat_kills"],
            "root_failures": [(r["failures"], r["times_out"], r["in_rotation"])
                              for r in stats["roots"]]}


def test_an_engine_that_stops_polling_shoots_no_worker_and_gets_every_report(
        make_buffer, make_tier):
    """Stores and then loads of 300 one-block jobs while the engine does not poll for
    longer than io_timeout_s: workers wait with their reports (REPORTING, answering
    heartbeats); none is killed, no root blamed; then every job once, each a success,
    every loaded byte right."""
    n = 300
    buf = make_buffer(2 * n, BLOCK)
    tier = make_tier(buf, n_load_workers=2, n_store_workers=2, io_timeout_s=IO_TIMEOUT_S,
                     heartbeat_s=HEARTBEAT_S)
    one_page_pipe(tier)
    calls = EngineCalls(tier)
    book = JobBook(calls, buf)
    keys = keys_for(n, "pause")
    before, pids = harm(tier), set(tier.worker_pids())
    for phase in ("store", "load"):
        if phase == "store":
            jobs = [book.store([k], [i]) for i, k in enumerate(keys)]
        else:
            jobs = [book.load([k], [n + i]) for i, k in enumerate(keys)]
        # Not polling: the pipe fills, and workers wait with their reports.
        wait_until(lambda: reporting(tier), 30, "a worker waiting to report")
        assert pipe_full(tier), queued_bytes(tier)
        time.sleep(PAUSE_S)
        assert reporting(tier), tier.stats()["workers"]  # still waiting: not shot
        assert harm(tier) == before
        results = book.wait(jobs, timeout=120)
        assert len(results) == n, f"{phase}: {n - len(results)} job(s) never reported"
        failed = [(j, r.error) for j, r in results.items() if not r.success]
        assert not failed, f"{phase}: {failed[:3]}"
    book.collect()
    assert not book.twice and not book.wrong and not book.lost()
    assert harm(tier) == before
    assert set(tier.worker_pids()) == pids


@pytest.mark.slow
def test_a_crash_storm_while_the_engine_stops_polling_loses_and_doubles_nothing(
        make_buffer, make_tier):
    """1000 one-block stores, then loads of them (2000 jobs), a random worker (every
    other time one waiting to report, if any) SIGKILLed every ~50 ms for a few seconds
    each time, and the engine not polling
    meanwhile: the supervisor's RETRY/LOST reports wait for room too. Every job once;
    every store a success (retried as often as it takes); every byte a load reported
    right."""
    n = 1000
    buf = make_buffer(2 * n, BLOCK)
    # (io_timeout_s is not tight here: workers booting in a storm starve one another of
    # CPU, and a first task after boot may really take a second. The pause past a tight
    # one is the first test's.)
    tier = make_tier(buf, n_load_workers=2, n_store_workers=2, io_timeout_s=STORM_TIMEOUT_S,
                     heartbeat_s=HEARTBEAT_S, max_task_retries=100)
    one_page_pipe(tier)
    calls = EngineCalls(tier)
    book = JobBook(calls, buf)
    keys = keys_for(n, "storm")
    rng = random.Random(7)
    kills = 0
    most_waiting = 0
    for phase in ("store", "load"):
        if phase == "store":
            jobs = [book.store([k], [i]) for i, k in enumerate(keys)]
        else:
            jobs = [book.load([k], [n + i]) for i, k in enumerate(keys)]
        # The engine stopped reading: the pipe fills, then the storm begins.
        wait_until(lambda: pipe_full(tier), 30, "the completion pipe full")
        ends = time.monotonic() + 4.0
        while time.monotonic() < ends:  # no get_finished_jobs() in here
            stats = tier.stats()
            most_waiting = max(most_waiting, stats["pool"]["reports_waiting"])
            victims = [w["pid"] for w in stats["workers"] if w["alive"]]
            holding = [w["pid"] for w in stats["workers"] if w["state"] == "reporting"]
            if holding and rng.random() < 0.5:  # (booting ones hold no task to report)
                victims = holding
            if victims:
                try:
                    os.kill(rng.choice(victims), signal.SIGKILL)
                    kills += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        results = book.wait(jobs, timeout=180)
        assert len(results) == n, f"{phase}: {n - len(results)} job(s) never reported"
        if phase == "store":
            failed = [(j, r.error) for j, r in results.items() if not r.success]
            assert not failed, f"{len(failed)} store(s) failed: {failed[:3]}"
    book.collect()
    assert kills >= 20, kills
    assert most_waiting > 0, "the supervisor never had to wait for room: no test of it"
    assert not book.twice, f"reported twice: {book.twice[:5]}"
    assert not book.wrong, f"wrong bytes: {book.wrong[:3]}"
    assert not book.lost()
    loads = [r for j, r in book.results.items() if j > n]  # ids after the stores'
    assert any(r.success for r in loads), "no load succeeded: the bytes were never checked"
    assert tier.stats()["pool"]["reports_waiting"] == 0


def test_a_worker_killed_while_the_pipe_is_full_is_handled_and_replaced(
        make_buffer, make_tier):
    """With the pipe full and the engine not polling, SIGKILL a worker that waits to
    report: the supervisor does not block on its RETRY, a replacement boots and
    attaches meanwhile, and once the engine reads the store succeeds (run again)."""
    n = 200
    buf = make_buffer(n, BLOCK)
    tier = make_tier(buf, n_load_workers=1, n_store_workers=2, io_timeout_s=IO_TIMEOUT_S,
                     heartbeat_s=HEARTBEAT_S)
    one_page_pipe(tier)
    calls = EngineCalls(tier)
    book = JobBook(calls, buf)
    jobs = [book.store([k], [i]) for i, k in enumerate(keys_for(n, "respawn"))]
    victim = wait_until(lambda: reporting(tier), 30, "a worker waiting to report")[0]
    os.kill(victim["pid"], signal.SIGKILL)

    def replaced() -> bool:
        stats = tier.stats()
        pids = {w["pid"] for w in stats["workers"] if w["ready"] and w["state"] != "booting"}
        return stats["pool"]["spawned"] > 3 and victim["pid"] not in pids and len(pids) == 3

    wait_until(replaced, 30, "the killed worker's replacement")
    assert pipe_full(tier)  # all the while nobody read
    stats = tier.stats()
    assert stats["pool"]["deaths"] == 1 and stats["pool"]["tasks_retried"] == 1
    assert stats["pool"]["reports_waiting"] == 1  # its RETRY, kept until there is room
    results = book.wait(jobs, timeout=120)
    assert len(results) == n and all(r.success for r in results.values())
    assert not book.twice and not book.lost()
    assert tier.stats()["pool"]["reports_waiting"] == 0


def test_shutdown_with_the_pipe_full_reports_every_job_once(make_buffer, make_tier,
                                                             anonymous):
    """An engine that never polled shuts down with workers waiting to report (process
    workers, or the engine's own threads when its buffer is anonymous memory): shutdown
    returns (it reads while they detach), every job is reported exactly once, and each
    one that ran is reported as it ran."""
    import numpy as np

    from mptier import SharedKVBuffer

    n = 200
    if anonymous:
        buf = SharedKVBuffer.from_memoryview(np.zeros((n, BLOCK), dtype=np.uint8))
    else:
        buf = make_buffer(n, BLOCK)
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1, io_timeout_s=IO_TIMEOUT_S)
    assert tier.stats()["mode"] == ("threads" if anonymous else "processes")
    one_page_pipe(tier)
    book = JobBook(EngineCalls(tier), buf)
    jobs = [book.store([k], [i]) for i, k in enumerate(keys_for(n, "shutdown"))]
    wait_until(lambda: pipe_full(tier), 30, "the completion pipe full")
    tier.shutdown()
    book.collect()
    assert sorted(book.results) == jobs and not book.twice
    # Queued ones were cancelled; every one a worker had run was reported as it was
    # (a report dropped at the lifeline would fail its job "while the task was running").
    failed = [r.error for r in book.results.values() if not r.success]
    assert all("before the task ran" in e for e in failed), sorted(set(failed))[:3]
    assert len(failed) < n


ENGINE = """\
import sys
from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key

root, native = sys.argv[1], sys.argv[2] == "native"
with SharedKVBuffer.create(4, 4096) as buf:
    try:
        with FileSystemTier(buf, root_dir=root, n_load_workers=1, n_store_workers=1,
                            prefault=False, native=native, worker_start_timeout_s=30
                            ) as tier:
            buf.view[0] = 7
            key = make_key(bytes(range(16)), 0)
            tier.submit_store(TransferJob(1, [key], [0]))
            tier.drain_jobs()
            tier.submit_load(TransferJob(2, [key], [1]))
            tier.drain_jobs()
            results = {r.job_id: r.success for r in tier.get_finished_jobs()}
            assert results == {1: True, 2: True}, results
            assert bytes(buf.view[1]) == bytes([7]) * 4096
            backends = {w["backend"] for w in tier.stats()["workers"]}
            print("served", sorted(backends))
    finally:
        buf.unlink()
"""


def test_workers_run_the_engines_mptier_not_the_working_folders(tmp_path, backend):
    """An engine started from a folder that holds an ``mptier`` package (planted, or a
    source checkout): its workers boot and serve with the engine's own mptier, and the
    folder's is never imported."""
    cwd = tmp_path / "cwd"
    (cwd / "mptier" / "workers").mkdir(parents=True)
    marker = tmp_path / "imported"
    planted = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n" \
              "raise ImportError('the planted mptier was imported')\n"
    for init in ("mptier/__init__.py", "mptier/workers/__init__.py"):
        (cwd / init).write_text(planted)
    (cwd / "mptier" / "workers" / "worker.py").write_text(planted)
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    import mptier

    # The engine finds its mptier as installed, and only so: not through the folder.
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(mptier.__file__))}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "kv"), backend],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"served ['{backend}']" in done.stdout
    assert not marker.exists(), marker.read_text()
    # ...and the engine itself, told to look in the folder first, would have found it.
    probe = subprocess.run([sys.executable, "-c", "import mptier"], cwd=cwd, env=env,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and marker.exists(), textwrap.shorten(probe.stderr, 300)

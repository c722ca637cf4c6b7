"""A hostile operator or environment against the tier's promises (never hang the engine,
never lose or double-report a job, never serve wrong bytes, leak nothing), with real
processes, limits and mounts: an engine out of file descriptors, a full file system, a
root that disappears, SIGSTOP/SIGCONT storms, workers killed while an engine attaches
and detaches."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from reliability_kit import (
    ENGINE_CALL_BOUND_S,
    LATE_S,
    EngineCalls,
    JobBook,
    wait_until,
)

from mptier import make_key
from mptier.workers import supervisor

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
    from mptier.workers import supervisor
    supervisor.BOOT_COOLDOWN_S = 1.0  # the test waits for the cool-down to end
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
    monkeypatch.setattr(supervisor.os, "pidfd_open", pidfd_open)
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

"""Nothing lost when the engine dies (issue 18, item 4): an engine process -- a child
running a tier -- submits stores and is SIGKILLed while its workers hold some of them.
The workers finish the stores they hold (the buffer stays mapped in them), drop the ones
still queued, and leave within their exit bound, leaving nothing behind: no lease, no
temporary file, no status socket or lock in the run directory, no buffer in /dev/shm.
The same for an engine attached to ``mptier serve``.

The test process makes itself a child subreaper while it runs, so the dead engine's
workers become its children: their exit status says whether they left in order (0) or
were ended by the bound's timer (SIGALRM)."""

from __future__ import annotations

import contextlib
import ctypes
import glob
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
from conftest import mptier_objects, wait_for
from test_service import start_service  # noqa: F401  (a fixture)

from mptier.workers.orphan import ORPHAN_EXIT_S

BLOCK = 64 << 10
N_JOBS = 8
# Each store task sleeps this long once a worker holds it: the engine is killed while
# every worker holds one, and the rest wait in the queue.
STALL_S = 1.5
_PR_SET_CHILD_SUBREAPER = 36

# argv: root, jobs, native (1/0), workers per role, extra config as JSON. Prints its pid,
# its workers' pids and its layout once every worker holds a store, then waits.
ENGINE = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
    root, n, native, per_role = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", \\
        int(sys.argv[4])
    extra = json.loads(sys.argv[5])
    block = {block}
    buf = SharedKVBuffer.create(n, block)
    tier = FileSystemTier(buf, root_dir=root, n_load_workers=per_role,
                          n_store_workers=per_role, task_bytes=block, prefault=False,
                          native=native, **extra)
    for i in range(n):
        buf.view[i] = np.random.default_rng(i).integers(0, 256, block, dtype=np.uint8)
        tier.submit_store(TransferJob(i, [make_key(bytes([i]) * 32)], [i]))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        workers = tier.stats()["workers"]
        if workers and all(w["state"] == "busy" for w in workers):
            break
        time.sleep(0.01)
    print(json.dumps({{"pid": __import__("os").getpid(),
                      "workers": [w["pid"] for w in workers],
                      "base": tier.mapper.base_path}}), flush=True)
    time.sleep(600)
""").format(block=BLOCK)


def content(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def block_file(root: str, i: int) -> str:
    from mptier import make_key

    files = glob.glob(f"{root}/*_r0/**/{make_key(bytes([i]) * 32)[:32].hex()}.bin",
                      recursive=True)
    return files[0] if files else ""


@pytest.fixture
def subreaper():
    """This process adopts orphans (the dead engine's workers) while the test runs."""
    libc = ctypes.CDLL(None, use_errno=True)
    before = {child.pid for child in psutil.Process().children()}
    assert libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    yield
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    # Orphans adopted and gone but never waited for (the service's workers, say) would
    # stay zombies of this test process, seen by later tests as its children: reap them.
    for child in psutil.Process().children():
        if child.pid not in before:
            with contextlib.suppress(psutil.Error, ChildProcessError):
                if child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, 0)


def reap(pids: list[int], timeout: float) -> dict[int, int]:
    """Wait (bounded) for the adopted ``pids`` to exit: ``{pid: wait status}``."""
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(statuses) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in statuses:
                got, status = os.waitpid(pid, os.WNOHANG)
                if got:
                    statuses[pid] = status
        time.sleep(0.02)
    for pid in set(pids) - set(statuses):  # a hang: fail, but leave nothing running
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert len(statuses) == len(pids), f"workers still running after {timeout} s"
    return statuses


def start_engine(root: str, backend: str, per_role: int = 1, **extra) -> tuple:
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, root, str(N_JOBS), "1" if backend == "native" else "0",
         str(per_role), json.dumps(extra)], stdout=subprocess.PIPE, text=True)
    try:
        line = engine.stdout.readline()
        assert line, "the engine did not start"
        info = json.loads(line)
    except BaseException:
        engine.kill()
        engine.wait()
        raise
    finally:
        engine.stdout.close()
    return engine, info


def kill(engine: subprocess.Popen) -> None:
    engine.send_signal(signal.SIGKILL)
    engine.wait()


def test_engine_sigkilled_workers_finish_held_stores_drop_queued_and_leave_nothing(
        root, backend, run_dir, subreaper, monkeypatch):
    monkeypatch.setenv("MPTIER_FAULT_STALL", f"store:{STALL_S}")
    engine, info = start_engine(root, backend, per_role=1)
    workers = info["workers"]
    assert len(workers) == 2 and os.listdir(run_dir)  # its status socket and lock
    kill(engine)
    # The two workers held the first two stores (the queue is first in, first out).
    statuses = reap(workers, ORPHAN_EXIT_S + 20)
    assert all(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in statuses.values()), \
        {p: (os.WIFSIGNALED(s) and signal.Signals(os.WTERMSIG(s)).name) or
         os.WEXITSTATUS(s) for p, s in statuses.items()}  # none ended by the bound
    held = list(range(len(workers)))
    for i in held:
        path = block_file(root, i)
        assert path, f"block {i}, held by a worker when the engine died, is not on disk"
        with open(path, "rb") as f:
            assert f.read() == content(i), f"block {i} is not intact"
    queued = [i for i in range(len(workers), N_JOBS) if block_file(root, i)]
    assert not queued, f"stores still queued at the engine's death were run: {queued}"
    # Nothing stale: leases released, no temporary file, run directory and /dev/shm clean.
    assert not glob.glob(f"{root}/.mptier/leases/*")
    assert not glob.glob(f"{root}/**/*.tmp", recursive=True)
    assert os.listdir(run_dir) == []
    assert not mptier_objects({info["pid"]})


def test_a_store_held_past_the_exit_bound_ends_the_worker_at_the_bound(
        root, backend, run_dir, subreaper, monkeypatch):
    """io_timeout_s shorter than ORPHAN_EXIT_S is the bound: a held store stalled past
    it is ended by the worker's own timer (SIGALRM), not waited for."""
    monkeypatch.setenv("MPTIER_FAULT_STALL", "store:30")
    engine, info = start_engine(root, backend, per_role=1, io_timeout_s=1.0)
    kill(engine)
    statuses = reap(info["workers"], 25)  # well before the stall ends
    assert all(os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGALRM
               for s in statuses.values()), statuses
    assert not any(block_file(root, i) for i in range(N_JOBS))


def test_engine_attached_to_a_service_sigkilled_its_held_stores_still_land(
        start_service, root, tmp_path, run_dir, backend, monkeypatch):  # noqa: F811
    """In ``mptier serve`` the workers outlive the engine anyway: the stores they held
    finish, the queued ones are dropped, the workers give up their leases and serve the
    next engine; the service removes the dead engine's status socket and buffer."""
    monkeypatch.setenv("MPTIER_FAULT_STALL", f"store:{STALL_S}")
    service = start_service("kv", "--set", f"native={backend == 'native'}".lower())
    service_root = str(tmp_path / "kv")
    before = set(os.listdir(run_dir))
    engine, info = start_engine(root, backend, per_role=1, service="kv")
    assert len(info["workers"]) == 2 and set(os.listdir(run_dir)) - before
    kill(engine)
    held = [0, 1]
    wait_for(lambda: all(block_file(service_root, i) for i in held), 30,
             "the held stores on disk")
    for i in held:
        with open(block_file(service_root, i), "rb") as f:
            assert f.read() == content(i)
    wait_for(lambda: not glob.glob(f"{service_root}/.mptier/leases/*"), 30,
             "the workers' leases given up after the session")
    wait_for(lambda: set(os.listdir(run_dir)) == before, 30,
             "the dead engine's status socket and lock removed")
    wait_for(lambda: not mptier_objects({info["pid"]}), 30, "its buffer removed")
    assert not [i for i in range(2, N_JOBS) if block_file(service_root, i)]
    assert sorted(service.worker_pids()) == sorted(info["workers"])  # still serving


def test_a_service_killed_under_a_live_engine_abandons_its_held_stores(
        start_service, tmp_path, run_dir, backend, subreaper, make_buffer,  # noqa: F811
        monkeypatch):
    """The other orphan: ``mptier serve`` SIGKILLed while its workers hold stores of an
    engine that lives on. That engine fails the jobs (the service went away) and may
    reuse their slots, so the workers must not write them later: they end at once, as
    before, and the blocks are not published."""
    from mptier import FileSystemTier, TransferJob, make_key

    monkeypatch.setenv("MPTIER_FAULT_STALL", f"store:{STALL_S}")
    service = start_service("kv", "--set", f"native={backend == 'native'}".lower())
    service_root = str(tmp_path / "kv")
    buf = make_buffer(N_JOBS, BLOCK)
    tier = FileSystemTier(buf, root_dir="/not/used", service="kv")
    try:
        for i in range(N_JOBS):
            buf.view[i] = np.frombuffer(content(i), dtype=np.uint8)
            tier.submit_store(TransferJob(i, [make_key(bytes([i]) * 32)], [i]))
        wait_for(lambda: [w["state"] for w in tier.stats()["workers"]] == ["busy"] * 2,
                 30, "both service workers holding a store")
        workers = service.worker_pids()
        service.stop(signal.SIGKILL)
        statuses = reap(workers, 20)
        assert all(os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGKILL
                   for s in statuses.values()), statuses
        time.sleep(STALL_S)  # past the stall: a store still running would have landed
        assert not any(block_file(service_root, i) for i in range(N_JOBS))
    finally:
        tier.shutdown()

"""Worker processes run under SCHED_BATCH at the configured nice value: they keep their CPU
share but never preempt the engine's thread when its write of a task wakes them (the
first-submit tail in docs/performance.md). Checked on the real worker processes."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import fill_random, wait_results

from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="no SCHED_BATCH on this OS")
def test_workers_run_sched_batch_at_their_nice(tmp_path):
    with SharedKVBuffer.create(4, 4096) as buf, \
            FileSystemTier(buf, root_dir=str(tmp_path), n_load_workers=1, n_store_workers=1,
                           worker_nice=7) as tier:
        pids = tier.worker_pids()
        assert len(pids) == 2
        for pid in pids:
            assert os.sched_getscheduler(pid) == os.SCHED_BATCH
            assert os.getpriority(os.PRIO_PROCESS, pid) == 7
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the engine is left alone


def test_workers_are_named_after_their_role_and_slot(tmp_path):
    """``top``, ``pgrep`` and psutil's ``Process.name()`` show "mptier-load-0", not
    "python" (``/proc/PID/comm``); the command line stays the launcher's."""
    psutil = pytest.importorskip("psutil")
    with SharedKVBuffer.create(4, 4096) as buf, \
            FileSystemTier(buf, root_dir=str(tmp_path), n_load_workers=1,
                           n_store_workers=2) as tier:
        workers = tier.stats()["workers"]
        assert len(workers) == 3
        names = set()
        for w in workers:
            with open(f"/proc/{w['pid']}/comm") as f:
                comm = f.read().strip()
            assert comm == psutil.Process(w["pid"]).name()
            names.add(comm)
    assert names == {"mptier-load-0", "mptier-store-1", "mptier-store-2"}, names


def _maps_numpy(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("/numpy/" in line for line in f)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_native_worker_runs_without_numpy(tmp_path, native):
    """numpy costs a worker a fifth of a second of CPU at every start (and its pages):
    a worker of the native core never imports it, not even to check the blocks it
    loads. The pure-Python backend computes CRC32C with numpy and does (which shows the
    check sees an import)."""
    n = 4
    with SharedKVBuffer.create(2 * n, 4096) as buf, \
            FileSystemTier(buf, root_dir=str(tmp_path), n_load_workers=1, n_store_workers=1,
                           native=native, checksum_blocks=True) as tier:
        fill_random(buf.view, range(n), seed=3)
        keys = [make_key(os.urandom(32), 1) for _ in range(n)]
        tier.submit_store(TransferJob(1, keys, list(range(n))))
        assert wait_results(tier, [1])[1].success
        tier.submit_load(TransferJob(2, keys, list(range(n, 2 * n))))
        assert wait_results(tier, [2])[2].success
        assert np.array_equal(buf.view[:n], buf.view[n:])
        pids = tier.worker_pids()
        assert len(pids) == 2
        # (Either worker may have run both tasks: an idle worker takes the other queue.)
        assert any(_maps_numpy(pid) for pid in pids) == (not native)

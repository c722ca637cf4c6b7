"""Worker processes run under SCHED_BATCH at the configured nice value: they keep their CPU
share but never preempt the engine's thread when its write of a task wakes them (the
first-submit tail in docs/performance.md). Checked on the real worker processes."""

from __future__ import annotations

import os

import pytest

from mptier import FileSystemTier, SharedKVBuffer


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

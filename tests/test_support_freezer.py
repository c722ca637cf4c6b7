"""Frozen processes (tests/support/freezer.py): a process frozen in a cgroup v1 freezer
does not die on SIGKILL until thawed - the stuck worker of issue 9 - and the cgroup is
always thawed and removed, even when the test fails inside."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from support import freezer
from support.fixtures import skip_unless

BUSY = "import time\nwhile True: time.sleep(0.01)"


def _busy_child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUSY])


def test_frozen_process_survives_sigkill_until_thawed(make_frozen_cgroup):
    cg = make_frozen_cgroup(version=1)
    assert cg.sigkill_proof
    child = _busy_child()
    try:
        cg.add(child.pid)
        assert cg.pids() == [child.pid]
        cg.freeze()
        assert cg.frozen
        child.kill()
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(1.0)  # SIGKILL is pending, but a frozen task does not run to die
        cg.thaw()
        assert child.wait(10) == -signal.SIGKILL
    finally:
        cg.close()
        child.kill()
        child.wait()
    assert not os.path.exists(cg.path)


def test_v2_freeze_stops_a_process_but_sigkill_still_ends_it(make_frozen_cgroup):
    reason = freezer.freezer_unavailable_reason()
    if reason is None and freezer.v2_root() is None:
        reason = "no cgroup v2 hierarchy here"
    if reason:
        pytest.skip(reason)
    cg = make_frozen_cgroup(version=2)
    assert not cg.sigkill_proof
    child = _busy_child()
    try:
        cg.add(child.pid)
        cg.freeze()
        ticks = _cpu_ticks(child.pid)
        assert not _runs_within(child.pid, ticks, 0.5)
        child.kill()
        assert child.wait(10) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _runs_within(pid: int, ticks: int, seconds: float) -> bool:
    time.sleep(seconds)
    return _cpu_ticks(pid) != ticks


def test_context_manager_thaws_and_removes_even_on_error():
    skip_unless(freezer.freezer_unavailable_reason())
    child = _busy_child()
    try:
        with pytest.raises(RuntimeError, match="inside"), freezer.FrozenCgroup() as cg:
            cg.add(child.pid)
            cg.freeze()
            raise RuntimeError("failure inside the with block")
        assert not os.path.exists(cg.path)
        with open(f"/proc/{child.pid}/cgroup") as f:
            assert freezer.PREFIX not in f.read()  # moved back out
        child.kill()
        assert child.wait(10) == -signal.SIGKILL  # thawed: SIGKILL works at once
    finally:
        child.kill()
        child.wait()


def test_stale_cgroup_of_a_dead_run_is_reaped_and_a_live_ones_kept(make_frozen_cgroup):
    live = make_frozen_cgroup()
    dead_owner = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                capture_output=True, text=True, check=True)
    stale = live.parent / f"{freezer.PREFIX}{dead_owner.stdout.strip()}-1-0"
    stale.mkdir()
    try:
        removed = freezer.reap_stale_cgroups()
        assert str(stale) in removed
        assert not stale.exists()
        assert live.path.exists()
    finally:
        if stale.exists():
            stale.rmdir()


def test_bad_version_is_refused():
    with pytest.raises(ValueError, match="must be 1, 2 or None"):
        freezer.FrozenCgroup(version=3)

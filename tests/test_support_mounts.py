"""Mount bookkeeping (tests/support/mounts.py) and the leak checks built on it: a crashed
run's mounts are reaped while a live run's are kept, odd mountpoint names are read right,
and a test that leaves a mount or a freezer cgroup behind fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
from conftest import wait_for
from support import freezer, mounts
from support.fixtures import skip_unless


def _root_reason() -> str | None:
    return None if os.geteuid() == 0 else "mounting tmpfs needs root"


def _mount_tmpfs(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "mptier-test", str(path)],
                   check=True)


def test_reap_detaches_a_dead_runs_mount_and_keeps_a_live_ones():
    skip_unless(_root_reason())
    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                  capture_output=True, text=True, check=True).stdout)
    dead = mounts.MOUNTS_BASE / f"{dead_pid}-1" / "x"
    live = mounts.mount_root() / "live"
    _mount_tmpfs(dead)
    _mount_tmpfs(live)
    try:
        assert str(dead) in mounts.reap_stale_mounts()
        assert not mounts.is_mounted(dead)
        assert not dead.parent.exists()
        assert mounts.is_mounted(live)
    finally:
        for point in (dead, live):
            mounts.unmount(point)
        live.rmdir()


def test_mountpoints_with_spaces_are_read_right(tmp_path):
    skip_unless(_root_reason())
    odd = tmp_path / "a b\tc"
    _mount_tmpfs(odd)
    try:
        assert mounts.mounts_under(tmp_path) == {str(odd)}
        assert mounts.is_mounted(odd)
    finally:
        mounts.unmount(odd)
    assert not mounts.is_mounted(odd)


def test_a_test_that_leaves_a_mount_or_a_cgroup_fails(tmp_path):
    """Run a small suite under this conftest whose tests leak; it must fail naming them,
    and clean up even a frozen child (thawed first, then killed)."""
    skip_unless(_root_reason() or freezer.freezer_unavailable_reason())
    leaky = tmp_path / "test_leaky.py"
    leaky.write_text(textwrap.dedent("""
        import subprocess
        from support import freezer

        def test_leaves_a_mount(tmp_path):
            (tmp_path / "m").mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "x", str(tmp_path / "m")], check=True)

        def test_leaves_a_cgroup():
            freezer.FrozenCgroup()

        def test_leaves_a_frozen_child():
            child = subprocess.Popen(["sleep", "600"])
            cg = freezer.FrozenCgroup()
            cg.add(child.pid)
            cg.freeze()
            print("FROZEN_CHILD", child.pid)
    """))
    cgroups_before = freezer.cgroup_dirs()
    tests_dir = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": str(tests_dir)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "conftest",
                          "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(leaky)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 1, run.stdout[-3000:]
    assert "mounts left behind" in run.stdout, run.stdout[-3000:]
    assert "freezer cgroups left behind" in run.stdout, run.stdout[-3000:]
    assert "child processes left behind" in run.stdout, run.stdout[-3000:]
    assert "3 passed, 3 errors" in run.stdout, run.stdout[-3000:]
    frozen_child = int(run.stdout.split("FROZEN_CHILD ")[1].split()[0])
    # thawed, then killed (its zombie goes once init reaps it): nothing cascades
    wait_for(lambda: not psutil.pid_exists(frozen_child), 10, "the frozen child to go")
    # The check detached the leaked mount (so one leak does not cascade); the leaked
    # cgroup outlives its run, and the reaper removes it as its owner is gone.
    assert not mounts.mounts_under(tmp_path)
    freezer.reap_stale_cgroups()
    assert freezer.cgroup_dirs() <= cgroups_before

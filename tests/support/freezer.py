"""Frozen processes for tests: put a pid into a freezer cgroup of its own.

    with FrozenCgroup() as cg:          # mkdir /sys/fs/cgroup/freezer/mptier-test-...
        cg.add(worker_pid)
        cg.freeze()                     # the worker stops where it stands
        os.kill(worker_pid, SIGKILL)    # v1: it does NOT die ...
        cg.thaw()                       # ... until thawed; then it does
    # on exit: thawed, tasks moved back, cgroup removed - whatever happened inside

cgroup v1's freezer (``freezer.state``) is preferred: a task frozen there does not run, so a
pending SIGKILL does not end it until it is thawed - the state of a process stuck in
uninterruptible I/O on a dead NFS server (``cg.sigkill_proof`` is True). cgroup v2's
``cgroup.freeze`` is the fallback; there SIGKILL *does* end a frozen task
(``sigkill_proof`` False), so it models a hung process, not an unkillable one.

Cgroup names are ``mptier-test-<pid>-<start ticks>-<n>`` (the creating test process), so
the leak check finds ours and :func:`reap_stale_cgroups` can clean a crashed run's
without touching a live run's. Not thread-safe per object.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/freezer")
PREFIX = "mptier-test-"
# Freezing is asynchronous (FREEZING until every task stopped); a task in an
# uninterruptible sleep may take a while. Past this the freeze is reported as failed.
FREEZE_TIMEOUT_S = 10.0
_counter = itertools.count()


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def v2_root() -> Path | None:
    """Mountpoint of the cgroup v2 hierarchy (unified or hybrid), or None."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[0] == "cgroup2":
                return Path(left.split()[4])
    return None


def _v2_own_cgroup() -> str:
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            if line.startswith("0::"):
                return line[3:].strip()
    return "/"


def freezer_unavailable_reason(require_sigkill_proof: bool = False) -> str | None:
    """Why a freezer cgroup cannot be made here (None when it can). With
    ``require_sigkill_proof``, only a v1 freezer (where SIGKILL waits for the thaw) will do."""
    if os.geteuid() != 0:
        return "freezing processes in a cgroup needs root"
    if (V1_ROOT / "cgroup.procs").exists():
        return None
    if require_sigkill_proof:
        return ("no cgroup v1 freezer at /sys/fs/cgroup/freezer: only cgroup v2, where "
                "SIGKILL ends a frozen process")
    root = v2_root()
    if root is None:
        return "no cgroup v1 freezer and no cgroup v2 hierarchy mounted"
    if not (root / "cgroup.procs").exists():
        return f"cgroup v2 at {root} has no cgroup.procs"
    return None


def cgroup_dirs(owner_pid: int | None = None) -> set[str]:
    """Freezer cgroups named by this module (of ``owner_pid`` only, if given)."""
    found = set()
    tag = PREFIX if owner_pid is None else f"{PREFIX}{owner_pid}-"
    roots = [V1_ROOT]
    v2 = v2_root()
    if v2 is not None:
        roots.append(v2)
    for root in roots:
        with contextlib.suppress(OSError):
            found.update(str(root / n) for n in os.listdir(root) if n.startswith(tag))
    return found


class FrozenCgroup:
    """A freezer cgroup of its own; :meth:`close` (or leaving the ``with``) thaws it, moves
    its live tasks back, and removes it, even after an error in the test."""

    def __init__(self, version: int | None = None) -> None:
        if version not in (None, 1, 2):
            raise ValueError(f"cgroup version must be 1, 2 or None (pick), got {version!r}")
        reason = freezer_unavailable_reason(require_sigkill_proof=version == 1)
        if reason:
            raise RuntimeError(f"cannot make a freezer cgroup: {reason}")
        if version is None:
            version = 1 if (V1_ROOT / "cgroup.procs").exists() else 2
        self.version = version
        pid = os.getpid()
        name = f"{PREFIX}{pid}-{_start_ticks(pid) or 0}-{next(_counter)}"
        if version == 1:
            self.parent = V1_ROOT
        else:
            root = v2_root()
            assert root is not None
            self.parent = root
        self.path = self.parent / name
        # v2: tasks go back to the cgroup this test process is in (v1: to the root).
        self._home = (self.parent / _v2_own_cgroup().lstrip("/")) if version == 2 else V1_ROOT
        self.path.mkdir()

    @property
    def sigkill_proof(self) -> bool:
        """True when a frozen task survives SIGKILL until thawed (cgroup v1)."""
        return self.version == 1

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into this cgroup."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        text = (self.path / "cgroup.procs").read_text()
        return [int(p) for p in text.split()]

    def freeze(self, timeout: float = FREEZE_TIMEOUT_S) -> None:
        """Freeze every task in the cgroup; returns once all are frozen. Raises
        ``TimeoutError`` naming the state if that takes longer than ``timeout``."""
        self._write_state(True)
        deadline = time.monotonic() + timeout
        while not self.frozen:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path} did not freeze within {timeout} s "
                                   f"(state {self._state()!r})")
            time.sleep(0.005)

    def thaw(self) -> None:
        """Let every task run again (a pending SIGKILL then takes effect)."""
        self._write_state(False)

    @property
    def frozen(self) -> bool:
        if self.version == 1:
            return self._state() == "FROZEN"
        return "frozen 1" in (self.path / "cgroup.events").read_text()

    def close(self) -> None:
        """Thaw, move live tasks back, remove the cgroup. Idempotent."""
        if not self.path.exists():
            return
        with contextlib.suppress(OSError):
            self.thaw()
        deadline = time.monotonic() + FREEZE_TIMEOUT_S
        while True:
            try:
                for pid in self.pids():
                    with contextlib.suppress(OSError):  # it may have just exited
                        (self._home / "cgroup.procs").write_text(str(pid))
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                # EBUSY: a task is still leaving (a dying one exits its cgroup last).
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def __enter__(self) -> FrozenCgroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _state(self) -> str:
        return (self.path / "freezer.state").read_text().strip()

    def _write_state(self, frozen: bool) -> None:
        if self.version == 1:
            (self.path / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
        else:
            (self.path / "cgroup.freeze").write_text("1" if frozen else "0")


def remove_cgroup(path: str | os.PathLike) -> None:
    """Thaw a cgroup made by this module, move its live tasks out, and remove it."""
    cg = FrozenCgroup.__new__(FrozenCgroup)
    cg.path = Path(path)
    cg.parent = cg.path.parent
    cg.version = 1 if cg.parent == V1_ROOT else 2
    cg._home = cg.parent  # v1: the root; v2: the hierarchy's root
    cg.close()


def reap_stale_cgroups() -> list[str]:
    """Thaw and remove cgroups of this module whose creating process is gone (a crashed
    run). Returns the paths removed; live runs' cgroups are never touched."""
    removed = []
    for path in sorted(cgroup_dirs()):
        parts = Path(path).name[len(PREFIX):].split("-")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            continue
        pid, ticks = int(parts[0]), int(parts[1])
        if _start_ticks(pid) == ticks:
            continue
        with contextlib.suppress(OSError):
            remove_cgroup(path)
            removed.append(path)
    return removed

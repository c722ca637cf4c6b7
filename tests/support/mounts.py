"""Mount bookkeeping shared by the FUSE and JuiceFS helpers and the leak check.

Every mount a helper makes lives under :func:`mount_root`, a folder named after this test
process (pid and start time, like mptier's shared-memory names), so

* the leak check can tell our mounts from anyone else's on a shared machine
  (:func:`mounts_under`), and
* a later run can detach what a crashed run left (:func:`reap_stale_mounts`) without ever
  touching the mounts of a test run that is still alive.

Nothing here blocks on a hung file system except :func:`unmount`, which escalates from a
plain unmount to aborting the FUSE connection and a lazy detach, each bounded in time.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

#: Parent of every test run's mount folder (one per user: /tmp is shared).
MOUNTS_BASE = Path(tempfile.gettempdir()) / f"mptier-test-mounts-{os.getuid()}"
FUSE_CONNECTIONS = Path("/sys/fs/fuse/connections")
# A clean unmount of an idle FUSE mount takes milliseconds; more means the file system is
# busy or hung, and we go on to abort it rather than hang the test run.
UNMOUNT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Mount:
    mount_id: int
    major_minor: str
    mountpoint: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    out, i = [], 0
    while i < len(field):
        code = field[i + 1:i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts() -> list[Mount]:
    """Mounts of this mount namespace, from ``/proc/self/mountinfo``."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            found.append(Mount(int(fields[0]), fields[2], _unescape(fields[4]),
                               tail[0], _unescape(tail[1]) if len(tail) > 1 else ""))
    return found


def mounts_under(*roots: str | os.PathLike) -> set[str]:
    """Mountpoints at or below any of ``roots``."""
    prefixes = [os.path.realpath(r).rstrip("/") for r in roots]
    return {m.mountpoint for m in mounts()
            if any(m.mountpoint == p or m.mountpoint.startswith(p + "/") for p in prefixes)}


def is_mounted(path: str | os.PathLike) -> bool:
    real = os.path.realpath(path)
    return any(m.mountpoint == real for m in mounts())


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def mount_root() -> Path:
    """This process's folder for mounts, ``MOUNTS_BASE/<pid>-<start ticks>`` (made on use)."""
    pid = os.getpid()
    root = MOUNTS_BASE / f"{pid}-{_start_ticks(pid) or 0}"
    root.mkdir(parents=True, exist_ok=True)
    return root


def new_mount_dir(prefix: str) -> Path:
    """A fresh empty folder under :func:`mount_root` to mount on."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=mount_root()))


def _ensure_fusectl() -> None:
    """Mount the FUSE control file system where it is missing (root only). systemd mounts
    it at boot; minimal machines and containers often do not, and without it a hung FUSE
    connection cannot be aborted. It is left mounted: it is the system's, not a test's."""
    if any(m.fstype == "fusectl" for m in mounts()) or not FUSE_CONNECTIONS.is_dir():
        return
    _run(["mount", "-t", "fusectl", "fusectl", str(FUSE_CONNECTIONS)], UNMOUNT_TIMEOUT_S)


def fuse_connection(mountpoint: str | os.PathLike) -> Path | None:
    """The ``/sys/fs/fuse/connections/<n>`` folder of a FUSE mount, or None."""
    _ensure_fusectl()
    for m in mounts():
        if m.mountpoint == os.path.realpath(mountpoint) and m.fstype.startswith("fuse"):
            minor = m.major_minor.split(":")[1]
            conn = FUSE_CONNECTIONS / minor
            return conn if conn.exists() else None
    return None


def abort_fuse(mountpoint: str | os.PathLike) -> bool:
    """Abort a FUSE mount's connection: every waiting caller gets ENOTCONN at once, so no
    process stays stuck in it. Returns whether a connection was aborted."""
    conn = fuse_connection(mountpoint)
    if conn is None:
        return False
    try:
        (conn / "abort").write_text("1")
    except OSError:
        return False
    return True


def _run(cmd: list[str], timeout: float) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def unmount(mountpoint: str | os.PathLike, timeout: float = UNMOUNT_TIMEOUT_S) -> None:
    """Detach ``mountpoint`` whatever state its file system is in; never hangs for long.

    Order: a plain unmount; if that fails (busy or hung), abort the FUSE connection so
    nobody stays blocked in it, then a lazy detach. Raises ``RuntimeError`` only if the
    mount is still there after all of that.
    """
    path = os.path.realpath(mountpoint)
    if not is_mounted(path):
        return
    detached = (shutil.which("fusermount3") and _run(["fusermount3", "-u", path], timeout)
                ) or _run(["umount", path], timeout)
    if not detached:
        abort_fuse(path)
        if not _run(["umount", "-l", path], timeout):
            _run(["fusermount3", "-u", "-z", path], timeout)
    deadline = time.monotonic() + timeout
    while is_mounted(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"could not unmount {path}; detach it with 'umount -l {path}'")
        time.sleep(0.02)


def reap_stale_mounts() -> list[str]:
    """Detach mounts left under the mount folders of test processes that no longer exist
    (a crashed or killed run), and remove those folders. Returns the mountpoints
    detached. Folders of live test processes are never touched."""
    detached: list[str] = []
    if not MOUNTS_BASE.is_dir():
        return detached
    for entry in MOUNTS_BASE.iterdir():
        pid_s, _, ticks_s = entry.name.partition("-")
        if not (pid_s.isdigit() and ticks_s.isdigit()):
            continue
        if _start_ticks(int(pid_s)) == int(ticks_s):
            continue  # its owner is alive
        for point in sorted(mounts_under(entry), key=len, reverse=True):
            with contextlib.suppress(RuntimeError):
                unmount(point)
                detached.append(point)
        if not mounts_under(entry):
            shutil.rmtree(entry, ignore_errors=True)
    return detached

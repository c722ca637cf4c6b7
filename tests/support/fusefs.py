"""A real FUSE file system for tests: a passthrough to a backing folder, served by its own
process, whose operations a test can make *hang* or *fail* on chosen paths.

    fs = FuseFS(backing, mountpoint).start()
    rule = fs.block("read", "*.bin")      # reads of *.bin now sit in the kernel ...
    ... start a reader ...
    fs.wait_blocked(rule)                 # ... until one is parked there
    rule.release()                        # then they complete with the real bytes
    fs.fail(["open", "create"], errno.EIO, "/kv/*", times=1)
    fs.close()                            # releases everything, unmounts, ends the process

Semantics (see docs/test-filesystems.md for what the kernel does around them):

* ``ops`` are FUSE operation names (:data:`OPERATIONS`); ``"*"`` means all of them.
* ``pattern`` is an :func:`fnmatch.fnmatchcase` pattern matched against the path inside the
  mount, which starts with ``/`` (``*`` also crosses ``/``; a pattern given without a
  leading ``/`` or ``*`` gets a ``/``). ``rename`` and ``link`` match either name.
* The first matching rule wins. ``times=N`` applies a rule to the next N matching calls
  only; ``None`` to all until released.
* A *blocked* caller is a real thread (or process) inside a system call on the mount; it
  returns when its rule is released: then the operation goes through (or fails with the
  ``errno`` given to :meth:`FuseRule.release`).
* Kernel caches are off by default (attribute, entry and negative lookups time out at 0 s),
  and the page cache is dropped at every open, so the first read after an open always
  reaches the file system. ``direct_io=True`` sends every read and write through it.

Threads: every method may be called from any thread; calls to the file system process
are serialised by one lock. Nothing here blocks on a blocked operation itself.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import importlib.util
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from . import mounts

SERVER = Path(__file__).with_name("_fusefs_server.py")

#: Operation names a rule can name (the server gates each of these).
OPERATIONS = frozenset({
    "getattr", "access", "chmod", "chown", "utimens", "truncate", "statfs",
    "readdir", "opendir", "mkdir", "rmdir", "unlink", "rename", "link", "symlink",
    "readlink", "mknod", "open", "create", "read", "write", "flush", "fsync",
    "setxattr", "getxattr", "listxattr", "removexattr",
})
# Mounting and libfuse's start take ~0.2 s here; a loaded 2-core machine can take seconds.
READY_TIMEOUT_S = 30.0
# The server exits by itself once unmounted; past this it is killed.
EXIT_TIMEOUT_S = 10.0


def fuse_unavailable_reason() -> str | None:
    """Why a FUSE test file system cannot run here, or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel or container)"
    if os.geteuid() != 0:
        # Checked only as root (mounting directly, allow_other, aborting connections
        # through /sys/fs/fuse); CI and the dev machines run as root.
        return "the FUSE test file system mounts as root; run the tests as root"
    if importlib.util.find_spec("mfusepy") is None:
        return "the FUSE binding mfusepy is not installed (pip install -e '.[test]')"
    if not (ctypes.util.find_library("fuse3") or ctypes.util.find_library("fuse")):
        return "libfuse is not installed (scripts/ci-deps.sh, or apt-get install fuse3)"
    return None


class FuseRule:
    """A rule installed in a :class:`FuseFS`; release it to free its blocked callers."""

    def __init__(self, fs: FuseFS, rule_id: int, action: str, ops: list[str], pattern: str):
        self.fs, self.id, self.action, self.ops, self.pattern = fs, rule_id, action, ops, pattern

    def release(self, errno: int = 0) -> None:
        """Remove the rule; its blocked callers proceed (or fail with ``errno`` if given)."""
        self.fs.release(self, errno)

    @property
    def waiting(self) -> int:
        """Callers now blocked in this rule (0 once it is released)."""
        return self.fs._rule_status(self.id)["waiting"]

    @property
    def hits(self) -> int:
        """Calls this rule has applied to so far (0 once it is released, or once a
        ``fail``/``delay`` rule has used up its ``times``)."""
        return self.fs._rule_status(self.id)["hits"]

    def __repr__(self) -> str:
        return f"FuseRule({self.id}, {self.action} {self.ops} on {self.pattern!r})"


class FuseFS:
    """A passthrough FUSE mount of ``backing`` at ``mountpoint`` with fault controls.

    :meth:`start` mounts (raises ``RuntimeError`` with the server's output if it cannot);
    :meth:`close` always leaves no mount and no process, whatever state the file system is
    in. Usable as a context manager.
    """

    def __init__(self, backing: str | os.PathLike, mountpoint: str | os.PathLike, *,
                 direct_io: bool = False, cache_timeout: float = 0.0) -> None:
        self.backing = Path(backing)
        self.mountpoint = Path(mountpoint)
        self.direct_io = direct_io
        if cache_timeout < 0:
            raise ValueError(f"cache_timeout must be >= 0 seconds, got {cache_timeout}")
        self.cache_timeout = cache_timeout
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._reader = None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._log_path: Path | None = None

    # -- life cycle -------------------------------------------------------------------
    def start(self) -> FuseFS:
        reason = fuse_unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot start a FUSE file system: {reason}")
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        ours, theirs = socket.socketpair()
        self._log_path = self.mountpoint.parent / f"{self.mountpoint.name}.log"
        cmd = [sys.executable, str(SERVER), "--backing", str(self.backing),
               "--mountpoint", str(self.mountpoint), "--control-fd", str(theirs.fileno()),
               "--cache-timeout", str(self.cache_timeout)]
        if self.direct_io:
            cmd.append("--direct-io")
        with open(self._log_path, "wb") as log:
            self._proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT)
        theirs.close()
        self._sock = ours
        self._sock.settimeout(READY_TIMEOUT_S)
        self._reader = ours.makefile("r", encoding="utf-8")
        try:
            line = self._reader.readline()
            if json.loads(line or "{}").get("event") != "ready":
                raise RuntimeError("no ready message")
        except (OSError, ValueError, RuntimeError) as exc:
            output = self._log_tail()  # before close() removes the log
            self.close()
            raise RuntimeError(f"FUSE test file system did not start at {self.mountpoint}: "
                               f"{exc}; server output: {output}") from exc
        return self

    def close(self) -> None:
        """Release every rule, unmount, and end the server. Idempotent; never leaves a
        mount behind (escalates to aborting the connection and a lazy unmount)."""
        if self._sock is not None:
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                self._request({"cmd": "release", "rule_id": None})
        try:
            mounts.unmount(self.mountpoint)
        finally:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
            if self._sock is not None:
                self._sock.close()  # EOF tells the server to stop, should it still run
                self._sock = None
            if self._proc is not None:
                try:
                    self._proc.wait(EXIT_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
                self._proc = None
            if self._log_path is not None:
                with contextlib.suppress(OSError):
                    self._log_path.unlink()

    def __enter__(self) -> FuseFS:
        return self.start() if self._proc is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        """The file-system server's pid (None when not running)."""
        return self._proc.pid if self._proc is not None else None

    def path(self, *parts: str) -> Path:
        """A path inside the mount."""
        return self.mountpoint.joinpath(*parts)

    # -- rules ------------------------------------------------------------------------
    def block(self, ops: str | Iterable[str], pattern: str = "*", *,
              times: int | None = None) -> FuseRule:
        """Make matching operations wait inside the file system until released."""
        return self._add("block", ops, pattern, times)

    def fail(self, ops: str | Iterable[str], errno: int, pattern: str = "*", *,
             times: int | None = None) -> FuseRule:
        """Make matching operations fail with ``errno`` (e.g. ``errno.EIO``)."""
        if not isinstance(errno, int) or errno <= 0:
            raise ValueError(f"errno must be a positive errno number such as errno.EIO, "
                             f"got {errno!r}")
        return self._add("fail", ops, pattern, times, errno=errno)

    def delay(self, ops: str | Iterable[str], seconds: float, pattern: str = "*", *,
              times: int | None = None) -> FuseRule:
        """Make matching operations take ``seconds`` longer (a slow server)."""
        if seconds < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {seconds}")
        return self._add("delay", ops, pattern, times, seconds=seconds)

    def release(self, rule: FuseRule | None = None, errno: int = 0) -> int:
        """Remove ``rule`` (every rule if None), waking its blocked callers; they fail with
        ``errno`` if one is given. Returns the number of rules removed."""
        reply = self._request({"cmd": "release", "rule_id": None if rule is None else rule.id,
                               "errno": errno})
        return reply["released"]

    def wait_blocked(self, rule: FuseRule, count: int = 1, timeout: float = 10.0) -> None:
        """Return once at least ``count`` callers sit blocked in ``rule``; raise
        ``AssertionError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            waiting = self._rule_status(rule.id)["waiting"]
            if waiting >= count:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{count} caller(s) never blocked in {rule} within "
                                     f"{timeout} s ({waiting} did)")
            time.sleep(0.01)

    def calls(self, op: str | None = None) -> int | dict[str, int]:
        """How many times operation ``op`` reached the file system (all ops: a dict)."""
        counts = self._request({"cmd": "status"})["calls"]
        return counts if op is None else counts.get(op, 0)

    # -- internals --------------------------------------------------------------------
    def _add(self, action: str, ops, pattern: str, times: int | None, **extra) -> FuseRule:
        names = [ops] if isinstance(ops, str) else list(ops)
        unknown = [n for n in names if n != "*" and n not in OPERATIONS]
        if not names or unknown:
            raise ValueError(f"unknown FUSE operation(s) {unknown or names}; "
                             f"choose from {sorted(OPERATIONS)} or '*'")
        if times is not None and times < 1:
            raise ValueError(f"times must be None (no limit) or >= 1, got {times}")
        if not pattern.startswith(("/", "*")):
            pattern = "/" + pattern
        rule_id = next(self._ids)
        self._request({"cmd": "add", "rule": {"id": rule_id, "action": action, "ops": names,
                                              "pattern": pattern, "times": times, **extra}})
        return FuseRule(self, rule_id, action, names, pattern)

    def _rule_status(self, rule_id: int) -> dict:
        rules = self._request({"cmd": "status"})["rules"]
        return rules.get(str(rule_id), {"waiting": 0, "hits": 0})

    def _request(self, request: dict) -> dict:
        with self._lock:
            if self._sock is None or self._reader is None:
                raise RuntimeError(f"the FUSE file system at {self.mountpoint} is not running")
            try:
                self._sock.sendall((json.dumps(request) + "\n").encode())
                line = self._reader.readline()
            except OSError as exc:
                raise RuntimeError(f"FUSE test server at {self.mountpoint} is not answering: "
                                   f"{exc}; output: {self._log_tail()}") from exc
        if not line:
            raise RuntimeError(f"FUSE test server at {self.mountpoint} exited; "
                               f"output: {self._log_tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"FUSE test server refused {request}: {reply.get('error')}")
        return reply

    def _log_tail(self, limit: int = 2000) -> str:
        try:
            text = self._log_path.read_text(errors="replace") if self._log_path else ""
        except OSError:
            return "(no output)"
        return text[-limit:].strip() or "(no output)"


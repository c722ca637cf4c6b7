"""The FUSE file system process behind :mod:`support.fusefs` (run as a script, never imported
by tests).

    test process (FuseFS)                      this process
    ---------------------                      ------------
    socketpair end  <-- JSON lines -->  control thread: rules, releases, status
                                                  |  (shared Rules object, one lock)
    os.read(mnt/f)  --> kernel FUSE --> libfuse worker thread --> Passthrough.read
                                                  |  gate(): block on an Event / raise errno
                                                  v
                                          os.pread(backing fd)

Every operation is a passthrough to a backing directory; before doing its work each one
calls ``gate(op, paths)``, which applies the first rule that matches: *block* (the libfuse
thread waits on an Event until the test releases the rule, so the caller sits in the kernel
exactly as on a hung NFS mount), *fail* (the call returns ``-errno``), or *delay*.

Life cycle: the parent passes one end of a socketpair as ``--control-fd``. When that socket
reaches EOF (the test process ended, however it ended) every blocked call is released and
the mount is detached lazily, so a crashed test run leaves no hung mount behind.
"""

from __future__ import annotations

import argparse
import errno
import fnmatch
import json
import os
import socket
import subprocess
import sys
import threading
import time
from stat import S_ISDIR

import mfusepy as fuse

# libfuse runs each request on a worker thread and caps the pool (``max_threads``, 10 by
# default in libfuse 3.12+). Blocked requests hold their thread, so a test that parks many
# calls would starve the rest of the file system (measured: with 64 threads the 65th
# parked read left every other operation hanging). 256 is far more than a test parks.
MAX_THREADS = 256


class Rules:
    """Fault rules, shared by the libfuse threads and the control thread (one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rules: list[dict] = []  # in priority order: first match wins
        self.calls: dict[str, int] = {}
        self.closing = False

    def add(self, rule: dict) -> None:
        rule["event"] = threading.Event()
        rule["waiting"] = 0  # callers now sitting in this rule
        rule["hits"] = 0
        rule["release_errno"] = 0
        with self.lock:
            if self.closing:
                rule["event"].set()
            self.rules.append(rule)

    def release(self, rule_id: int | None, err: int = 0) -> int:
        """Remove rule ``rule_id`` (all rules if None) and wake its waiters; returns how many
        rules were removed."""
        with self.lock:
            chosen = [r for r in self.rules if rule_id is None or r["id"] == rule_id]
            for rule in chosen:
                self.rules.remove(rule)
                rule["release_errno"] = err
                rule["event"].set()
            return len(chosen)

    def close(self) -> None:
        with self.lock:
            self.closing = True
        self.release(None)

    def status(self) -> dict:
        with self.lock:
            return {
                "rules": {r["id"]: {"waiting": r["waiting"], "hits": r["hits"]}
                          for r in self.rules},
                "calls": dict(self.calls),
            }

    def gate(self, op: str, *paths: str | None) -> None:
        """Apply the first matching rule to operation ``op`` on ``paths``: returns to let the
        passthrough proceed, or raises the rule's errno. Blocks while a block rule holds."""
        with self.lock:
            self.calls[op] = self.calls.get(op, 0) + 1
            rule = self._match(op, paths)
            if rule is None:
                return
            rule["hits"] += 1
            if rule["times"] is not None:
                rule["times"] -= 1
                if rule["times"] <= 0 and rule["action"] != "block":
                    self.rules.remove(rule)
            if rule["action"] == "block":
                rule["waiting"] += 1
        action = rule["action"]
        if action == "fail":
            raise fuse.FuseOSError(rule["errno"])
        if action == "delay":
            time.sleep(rule["seconds"])
            return
        # block: a rule whose count ran out stays listed (its callers still wait on it) but
        # matches no new call; release() removes it.
        rule["event"].wait()
        with self.lock:
            rule["waiting"] -= 1
        if rule["release_errno"]:
            raise fuse.FuseOSError(rule["release_errno"])

    def _match(self, op: str, paths) -> dict | None:
        for rule in self.rules:
            if rule["event"].is_set() or (rule["times"] is not None and rule["times"] <= 0):
                continue
            if op not in rule["ops"] and "*" not in rule["ops"]:
                continue
            if any(p is not None and fnmatch.fnmatchcase(p, rule["pattern"]) for p in paths):
                return rule
        return None


class Passthrough(fuse.Operations):
    """Every operation mirrors the backing directory; ``fh`` is the backing file's fd."""

    use_ns = True

    def __init__(self, backing: str, rules: Rules, on_init) -> None:
        self.backing = backing
        self.rules = rules
        self.on_init = on_init

    def _real(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def init(self, path):
        self.on_init()

    # -- metadata ---------------------------------------------------------------------
    def getattr(self, path, fh=None):
        self.rules.gate("getattr", path)
        st = os.fstat(fh) if fh is not None else os.lstat(self._real(path))
        keys = ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks",
                "st_atime_ns", "st_mtime_ns", "st_ctime_ns")
        out = {k: getattr(st, k) for k in keys}
        for k in ("st_atime", "st_mtime", "st_ctime"):
            out[k] = out.pop(k + "_ns")
        return out

    def access(self, path, amode):
        self.rules.gate("access", path)
        if not os.access(self._real(path), amode, follow_symlinks=False):
            raise fuse.FuseOSError(errno.EACCES)
        return 0

    def chmod(self, path, mode):
        self.rules.gate("chmod", path)
        os.chmod(self._real(path), mode)
        return 0

    def chown(self, path, uid, gid):
        self.rules.gate("chown", path)
        os.chown(self._real(path), uid, gid, follow_symlinks=False)
        return 0

    def utimens(self, path, times=None):
        self.rules.gate("utimens", path)
        if times is None:
            os.utime(self._real(path), follow_symlinks=False)
        else:
            os.utime(self._real(path), ns=tuple(times), follow_symlinks=False)
        return 0

    def truncate(self, path, length, fh=None):
        self.rules.gate("truncate", path)
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._real(path), length)
        return 0

    def statfs(self, path):
        self.rules.gate("statfs", path)
        sv = os.statvfs(self._real(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files",
                "f_flag", "f_frsize", "f_namemax")
        return {k: getattr(sv, k) for k in keys}

    # -- names ------------------------------------------------------------------------
    def readdir(self, path, fh):
        self.rules.gate("readdir", path)
        # Entries carry their inode: with use_ino, a bare name would get inode 0, and
        # readdir(3) skips entries whose inode is 0.
        out = []
        with os.scandir(self._real(path)) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                out.append((entry.name, {"st_mode": st.st_mode, "st_ino": st.st_ino}, 0))
        here = os.lstat(self._real(path))
        parent = os.lstat(os.path.dirname(self._real(path).rstrip("/")) or "/")
        return [(".", {"st_mode": here.st_mode, "st_ino": here.st_ino}, 0),
                ("..", {"st_mode": parent.st_mode, "st_ino": parent.st_ino}, 0), *out]

    def opendir(self, path):
        self.rules.gate("opendir", path)
        if not S_ISDIR(os.lstat(self._real(path)).st_mode):
            raise fuse.FuseOSError(errno.ENOTDIR)
        return 0

    def mkdir(self, path, mode):
        self.rules.gate("mkdir", path)
        os.mkdir(self._real(path), mode)
        return 0

    def rmdir(self, path):
        self.rules.gate("rmdir", path)
        os.rmdir(self._real(path))
        return 0

    def unlink(self, path):
        self.rules.gate("unlink", path)
        os.unlink(self._real(path))
        return 0

    def rename(self, old, new):
        self.rules.gate("rename", old, new)
        os.rename(self._real(old), self._real(new))
        return 0

    def link(self, target, source):
        # mfusepy's order: ``target`` is the new name, ``source`` the existing file.
        self.rules.gate("link", source, target)
        os.link(self._real(source), self._real(target), follow_symlinks=False)
        return 0

    def symlink(self, target, source):
        # ``target`` is the new link's path, ``source`` the text it points to.
        self.rules.gate("symlink", target)
        os.symlink(source, self._real(target))
        return 0

    def readlink(self, path):
        self.rules.gate("readlink", path)
        return os.readlink(self._real(path))

    def mknod(self, path, mode, dev):
        self.rules.gate("mknod", path)
        os.mknod(self._real(path), mode, dev)
        return 0

    # -- data -------------------------------------------------------------------------
    def open(self, path, flags):
        self.rules.gate("open", path)
        # O_DIRECT belongs to the kernel side of the mount; the backing file is opened
        # without it (its alignment rules are not the caller's).
        return os.open(self._real(path), flags & ~(os.O_DIRECT | os.O_CREAT | os.O_EXCL))

    def create(self, path, mode, flags):
        self.rules.gate("create", path)
        return os.open(self._real(path), (flags & ~os.O_DIRECT) | os.O_CREAT, mode)

    def read(self, path, size, offset, fh):
        self.rules.gate("read", path)
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        self.rules.gate("write", path)
        return os.pwrite(fh, data, offset)

    def flush(self, path, fh):
        self.rules.gate("flush", path)
        return 0

    def fsync(self, path, datasync, fh):
        self.rules.gate("fsync", path)
        if datasync:
            os.fdatasync(fh)
        else:
            os.fsync(fh)
        return 0

    def release(self, path, fh):
        # Not gated: release is asynchronous in the kernel (nobody waits on it), so
        # blocking it only leaks a libfuse thread.
        os.close(fh)
        return 0

    # -- extended attributes ----------------------------------------------------------
    def setxattr(self, path, name, value, options, position=0):
        self.rules.gate("setxattr", path)
        os.setxattr(self._real(path), name, value, options, follow_symlinks=False)
        return 0

    def getxattr(self, path, name, position=0):
        self.rules.gate("getxattr", path)
        return os.getxattr(self._real(path), name, follow_symlinks=False)

    def listxattr(self, path):
        self.rules.gate("listxattr", path)
        return os.listxattr(self._real(path), follow_symlinks=False)

    def removexattr(self, path, name):
        self.rules.gate("removexattr", path)
        os.removexattr(self._real(path), name, follow_symlinks=False)
        return 0


def detach(mountpoint: str) -> None:
    """Lazily unmount ``mountpoint`` (the fs loop then ends by itself)."""
    for cmd in (["fusermount3", "-u", "-z", mountpoint], ["umount", "-l", mountpoint]):
        try:
            if subprocess.run(cmd, capture_output=True, timeout=20).returncode == 0:
                return
        except (OSError, subprocess.TimeoutExpired):
            continue


def control_loop(sock: socket.socket, rules: Rules, mountpoint: str) -> None:
    """Serve the parent's requests (one JSON object per line, one reply each) until EOF."""
    reader = sock.makefile("r", encoding="utf-8")
    try:
        for line in reader:
            request = json.loads(line)
            cmd = request["cmd"]
            if cmd == "add":
                rules.add(request["rule"])
                reply = {"ok": True}
            elif cmd == "release":
                n = rules.release(request.get("rule_id"), request.get("errno", 0))
                reply = {"ok": True, "released": n}
            elif cmd == "status":
                reply = {"ok": True, **rules.status()}
            else:
                reply = {"ok": False, "error": f"unknown command {cmd!r}"}
            sock.sendall((json.dumps(reply) + "\n").encode())
    except (OSError, ValueError):
        pass
    # EOF: the test process is gone or done with us. Free every parked caller, then detach.
    rules.close()
    detach(mountpoint)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backing", required=True)
    parser.add_argument("--mountpoint", required=True)
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--direct-io", action="store_true")
    parser.add_argument("--cache-timeout", type=float, default=0.0)
    args = parser.parse_args()

    sock = socket.socket(fileno=args.control_fd)
    rules = Rules()

    def on_init() -> None:
        sock.sendall(b'{"event": "ready"}\n')
        threading.Thread(target=control_loop, args=(sock, rules, args.mountpoint),
                         name="control", daemon=True).start()

    options = {
        "foreground": True,
        "fsname": "mptier-testfs",
        "subtype": "mptier-testfs",
        # Unlinking an open file must not leave libfuse's ".fuse_hidden*" names in the
        # backing directory (sweepers under test would see them); ops use fh instead.
        "hard_remove": True,
        "use_ino": True,
        "default_permissions": True,
        # Other users' processes (e.g. workers that dropped privileges) may use the mount.
        "allow_other": True,
        # Zero caches by default: every getattr/lookup reaches this process, so a rule on
        # them is deterministic (the kernel does not answer from its own cache).
        "attr_timeout": args.cache_timeout,
        "entry_timeout": args.cache_timeout,
        "negative_timeout": args.cache_timeout,
        "max_threads": MAX_THREADS,
    }
    if args.direct_io:
        options["direct_io"] = True
    fuse.FUSE(Passthrough(args.backing, rules, on_init), args.mountpoint, **options)
    return 0


if __name__ == "__main__":
    sys.exit(main())

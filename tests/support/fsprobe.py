"""Probes of what a file system really does, for the facts table in
docs/test-filesystems.md and for tests that must know before they rely on a feature.

Each probe works in a folder it is given (and, for cross-mount probes, the same folder seen
through a second mount), cleans up its files, and returns a plain value: ``"ok"`` or the
errno name for feature probes, a bool for lock probes, seconds for visibility delays.

    python tests/support/fsprobe.py DIR_A [DIR_B]    # prints the facts as a table
    python tests/support/fsprobe.py --all /tmp       # ... for every test file system

Locks are probed from a separate process: locks held by the probing process itself never
conflict with each other (flock on one open file, POSIX locks per process).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

AT_FDCWD = -100
AT_SYMLINK_FOLLOW = 0x400
# O_DIRECT needs buffers and sizes aligned to the logical block size; 4 KiB suits every
# device and FUSE.
DIRECT_ALIGN = 4096
_libc = ctypes.CDLL(None, use_errno=True)


def _name(prefix: str) -> str:
    return f".probe-{prefix}-{uuid.uuid4().hex[:8]}"


def _errname(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno, str(exc.errno))


def o_direct(folder: str | os.PathLike) -> str:
    """Write and read back an aligned block with O_DIRECT: "ok" or the errno name."""
    path = Path(folder) / _name("direct")
    buf = mmap.mmap(-1, DIRECT_ALIGN)  # page-aligned
    buf.write(os.urandom(DIRECT_ALIGN))
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        try:
            os.pwritev(fd, [buf], 0)
        finally:
            os.close(fd)
        back = mmap.mmap(-1, DIRECT_ALIGN)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [back], 0)
        finally:
            os.close(fd)
        return "ok" if back[:] == buf[:] else "wrong bytes"
    except OSError as exc:
        return _errname(exc)
    finally:
        path.unlink(missing_ok=True)


def linkat_follow(fd: int, dest: str | os.PathLike) -> None:
    """Give the unnamed file ``fd`` (from O_TMPFILE) the name ``dest``.

    Note: ``os.link("/proc/self/fd/N", dest)`` calls link(2), which does not follow the
    magic link and fails with EXDEV on every file system; linkat(2) with
    AT_SYMLINK_FOLLOW is what publishes the file."""
    if _libc.linkat(AT_FDCWD, f"/proc/self/fd/{fd}".encode(), AT_FDCWD,
                    os.fsencode(dest), AT_SYMLINK_FOLLOW) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(dest))


def o_tmpfile(folder: str | os.PathLike, other_view: str | os.PathLike | None = None,
              settle_s: float = 2.0) -> str:
    """Write an unnamed file (O_TMPFILE), link it into place, close it, and check for
    ``settle_s`` seconds that its name still leads to the bytes (through ``other_view``
    if given). Returns "ok", the errno name of the step that failed, or "lost after
    close" when the published name stops resolving (JuiceFS 1.4 deletes the inode at
    close: see docs/test-filesystems.md). The wait covers kernel entry caches (1 s by
    default on FUSE mounts), which keep a lost name resolving for a while."""
    dest_name = _name("tmpfile")
    dest = Path(folder) / dest_name
    data = os.urandom(8192)
    try:
        fd = os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o600)
    except OSError as exc:
        return _errname(exc)
    try:
        os.write(fd, data)
        linkat_follow(fd, dest)
    except OSError as exc:
        return _errname(exc)
    finally:
        os.close(fd)
    seen = Path(other_view or folder) / dest_name
    try:
        deadline = time.monotonic() + settle_s
        while True:
            if seen.read_bytes() != data:
                return "wrong bytes"
            if time.monotonic() > deadline:
                return "ok"
            time.sleep(0.05)
    except FileNotFoundError:
        return "lost after close"
    finally:
        with contextlib.suppress(OSError):
            dest.unlink()


def xattr(folder: str | os.PathLike, other_view: str | os.PathLike | None = None) -> str:
    """Set ``user.vllm.kv_crc32c`` on a file and read it back (through ``other_view`` if
    given): "ok" or the errno name."""
    name = _name("xattr")
    path = Path(folder) / name
    path.write_bytes(b"x")
    try:
        os.setxattr(path, "user.vllm.kv_crc32c", b"\x12\x34\x56\x78")
        seen = os.getxattr(Path(other_view or folder) / name, "user.vllm.kv_crc32c")
        return "ok" if seen == b"\x12\x34\x56\x78" else "wrong value"
    except OSError as exc:
        return _errname(exc)
    finally:
        path.unlink(missing_ok=True)


_TRY_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    (fcntl.flock if sys.argv[2] == "flock" else fcntl.lockf)(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    print("busy")
else:
    print("got")
"""


def try_lock_elsewhere(path: str | os.PathLike, kind: str) -> str:
    """From another process, try to take an exclusive ``kind`` ("flock" or "posix") lock
    on ``path`` without waiting: "busy" or "got" (an error raises)."""
    if kind not in ("flock", "posix"):
        raise ValueError(f"lock kind must be 'flock' or 'posix', got {kind!r}")
    out = subprocess.run([sys.executable, "-c", _TRY_LOCK, str(path), kind],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def lock_seen(folder: str | os.PathLike, kind: str,
              other_view: str | os.PathLike | None = None) -> bool:
    """Does an exclusive ``kind`` lock held here block another process locking the same
    file (through ``other_view`` if given), and is it free again once released?"""
    name = _name("lock")
    path = Path(folder) / name
    path.write_bytes(b"x")
    fd = os.open(path, os.O_RDWR)
    take = fcntl.flock if kind == "flock" else fcntl.lockf
    try:
        take(fd, fcntl.LOCK_EX)
        there = Path(other_view or folder) / name
        held = try_lock_elsewhere(there, kind) == "busy"
        take(fd, fcntl.LOCK_UN)
        freed = try_lock_elsewhere(there, kind) == "got"
        return held and freed
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def wait_visible(check, timeout: float = 10.0, step: float = 0.002) -> float | None:
    """Seconds until ``check()`` is true (polled), or None after ``timeout``."""
    start = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - start
        except OSError:
            pass
        if time.monotonic() - start > timeout:
            return None
        time.sleep(step)


def visibility(view_a: str | os.PathLike, view_b: str | os.PathLike) -> dict[str, float | None]:
    """Seconds until a change made through ``view_a`` shows through ``view_b`` (the same
    folder through another mount), for: a new file (after b looked it up and missed),
    a size change, an unlink (after b had seen the file), an explicit atime."""
    a, b = Path(view_a), Path(view_b)
    name = _name("vis")
    out: dict[str, float | None] = {}
    if (b / name).exists():  # b now caches this miss, if it caches misses
        raise AssertionError(f"{b / name} exists before it was made")
    (a / name).write_bytes(b"1" * 100)
    out["create"] = wait_visible(lambda: (b / name).read_bytes() == b"1" * 100)
    with open(a / name, "ab") as f:
        f.write(b"2" * 100)
    out["size"] = wait_visible(lambda: (b / name).stat().st_size == 200)
    atime = 1_000_000_000_123_456_789
    os.utime(a / name, ns=(atime, (a / name).stat().st_mtime_ns))
    out["atime"] = wait_visible(lambda: (b / name).stat().st_atime_ns == atime)
    (b / name).stat()
    (a / name).unlink()
    out["unlink"] = wait_visible(lambda: not (b / name).exists())
    return out


def atime_after_read(folder: str | os.PathLike) -> bool:
    """Does reading a file move its atime (set far in the past first)?"""
    path = Path(folder) / _name("atime")
    path.write_bytes(b"x" * 4096)
    try:
        os.utime(path, ns=(1_000_000_000, path.stat().st_mtime_ns))
        path.read_bytes()
        return path.stat().st_atime_ns != 1_000_000_000
    finally:
        path.unlink(missing_ok=True)


def rename_link_semantics(folder: str | os.PathLike) -> dict[str, str]:
    """rename(2) over an existing name, link(2) onto one, renameat2(RENAME_NOREPLACE)."""
    f = Path(folder)
    src, dst, third = (f / _name(n) for n in ("src", "dst", "third"))
    out = {}
    try:
        src.write_bytes(b"new")
        dst.write_bytes(b"old")
        third.write_bytes(b"3")
        try:
            os.link(third, dst)
            out["link onto existing"] = "ok"
        except OSError as exc:
            out["link onto existing"] = _errname(exc)
        rc = _libc.renameat2(AT_FDCWD, os.fsencode(third), AT_FDCWD, os.fsencode(dst), 1)
        out["renameat2 NOREPLACE onto existing"] = (
            "ok" if rc == 0 else errno.errorcode.get(ctypes.get_errno(), "?"))
        os.rename(src, dst)
        out["rename onto existing"] = "replaced" if dst.read_bytes() == b"new" else "kept"
    finally:
        for p in (src, dst, third):
            p.unlink(missing_ok=True)
    return out


def throughput(view_a: str | os.PathLike, view_b: str | os.PathLike | None = None,
               file_mib: int = 2, files: int = 32) -> tuple[float, float]:
    """MiB/s writing ``files`` files of ``file_mib`` MiB through ``view_a`` (each closed, as
    a published block would be), and reading them back through ``view_b``. A rough
    figure: one run, on a shared machine."""
    a, b = Path(view_a), Path(view_b or view_a)
    data = os.urandom(file_mib << 20)
    names = [_name(f"tp{i}") for i in range(files)]
    try:
        start = time.monotonic()
        for n in names:
            with open(a / n, "wb") as f:
                f.write(data)
        wrote = time.monotonic() - start
        start = time.monotonic()
        for n in names:
            if (b / n).read_bytes() != data:
                raise AssertionError(f"{b / n} read back wrong bytes")
        read = time.monotonic() - start
    finally:
        for n in names:
            (a / n).unlink(missing_ok=True)
    total = file_mib * files
    return total / wrote, total / read


def stat_rate(folder: str | os.PathLike, seconds: float = 0.5) -> float:
    """stat(2) calls per second on one existing file for ``seconds`` (what a lookup of a
    cached block costs; with kernel attribute caches on, most never leave the kernel)."""
    path = Path(folder) / _name("stat")
    path.write_bytes(b"x")
    try:
        n, start = 0, time.monotonic()
        while time.monotonic() - start < seconds:
            for _ in range(50):
                os.stat(path)
            n += 50
        return n / (time.monotonic() - start)
    finally:
        path.unlink(missing_ok=True)


def facts(view_a: str | os.PathLike, view_b: str | os.PathLike | None = None) -> dict:
    """Every probe above on ``view_a`` (and across to ``view_b`` when given)."""
    out: dict = {
        "O_DIRECT": o_direct(view_a),
        "O_TMPFILE + linkat": o_tmpfile(view_a, view_b),
        "user xattr": xattr(view_a, view_b),
        "flock seen by another process": lock_seen(view_a, "flock", view_b),
        "POSIX lock seen by another process": lock_seen(view_a, "posix", view_b),
        "read moves atime": atime_after_read(view_a),
        **rename_link_semantics(view_a),
    }
    if view_b is not None:
        out.update({f"visible on b after {k} (s)": v
                    for k, v in visibility(view_a, view_b).items()})
    out["stat calls/s"] = round(stat_rate(view_a))
    w, r = throughput(view_a, view_b)
    out["2 MiB files: write MiB/s"] = round(w)
    out["2 MiB files: read MiB/s" + (" (via b)" if view_b else "")] = round(r)
    return out


def measure_all(local_dir: str | os.PathLike) -> dict[str, dict]:
    """:func:`facts` for a local folder and for each test file system this package makes
    (mounted here and removed again): the table of docs/test-filesystems.md."""
    import tempfile

    from . import fusefs, juicefs, mounts

    table = {"local (" + _fstype(local_dir) + ")": facts(local_dir)}
    if fusefs.fuse_unavailable_reason() is None:
        for label, opts in (("FUSE test fs", {}), ("FUSE test fs, direct_io", {"direct_io": True})):
            with tempfile.TemporaryDirectory(dir=local_dir) as backing, fusefs.FuseFS(
                    backing, mounts.new_mount_dir("fuse-"), **opts) as fs:
                table[label] = facts(fs.mountpoint)
            fs.mountpoint.rmdir()
    if juicefs.juicefs_unavailable_reason() is None:
        volume = juicefs.JuiceFSVolume(tempfile.mkdtemp(dir=mounts.mount_root())).format()
        try:
            for label, opts in (("JuiceFS, default caches", {}),
                                ("JuiceFS, caches off (COHERENT)", juicefs.COHERENT)):
                tag = "c" if opts else "d"
                a, b = volume.mount(f"a{tag}", **opts), volume.mount(f"b{tag}", **opts)
                folder = Path(tempfile.mkdtemp(dir=a.path))
                table[label] = facts(folder, b.path / folder.name)
                a.umount()
                b.umount()
        finally:
            volume.close()
    return table


def _fstype(path: str | os.PathLike) -> str:
    out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "-" if value is None else str(value)


if __name__ == "__main__":
    # Run as a script: make ``support`` importable (tests/ on the path).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if len(sys.argv) == 3 and sys.argv[1] == "--all":
        from support import fsprobe as probe  # the package's copy (relative imports)

        results = probe.measure_all(sys.argv[2])
        names = list(results)
        print("| | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
        keys = list(dict.fromkeys(k for r in results.values() for k in r))
        for key in keys:
            print(f"| {key} | " + " | ".join(_cell(results[n].get(key)) for n in names) + " |")
    elif len(sys.argv) in (2, 3):
        for key, value in facts(*sys.argv[1:]).items():
            print(f"| {key} | {_cell(value)} |")
    else:
        sys.exit("usage: fsprobe.py DIR_A [DIR_B]   (DIR_B: the same folder via another mount)\n"
                 "       fsprobe.py --all LOCAL_DIR (mounts each test file system, probes it)")

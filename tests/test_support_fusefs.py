"""The FUSE fault file system (tests/support/fusefs.py) does what tests will rely on: a
blocked operation really holds its caller in the kernel until released, an injected errno
really surfaces, data really round-trips to the backing folder, and teardown really leaves
no mount and no process - also when the test process that made the mount is killed."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import wait_for
from support import fsprobe, mounts
from support.fixtures import skip_unless
from support.fusefs import FuseFS, fuse_unavailable_reason

pytestmark = pytest.mark.fuse

BLOCK = 2 << 20  # a 2 MiB file: the size of a typical KV block


def _reader(path: Path, out: dict, flags: int = 0) -> threading.Thread:
    def run():
        try:
            fd = os.open(path, os.O_RDONLY | flags)
            try:
                out["data"] = os.read(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
        except OSError as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2:].split()[0].decode()


@pytest.mark.parametrize("direct_io", [False, True], ids=["page-cache", "direct-io"])
def test_blocked_read_waits_until_released_then_returns_the_bytes(make_fuse_fs, direct_io):
    fs = make_fuse_fs(direct_io=direct_io)
    data = os.urandom(BLOCK)
    fs.path("blob").write_bytes(data)
    rule = fs.block("read", "/blob")
    out: dict = {}
    thread = _reader(fs.path("blob"), out)
    fs.wait_blocked(rule)
    thread.join(0.5)
    assert thread.is_alive() and not out, "the reader returned while its read was blocked"
    os.stat(fs.path("blob"))  # the rest of the file system still answers
    rule.release()
    thread.join(10)
    assert not thread.is_alive()
    assert out.get("data") == data, out.get("error")
    assert rule.waiting == 0


def test_release_with_errno_fails_the_parked_call(make_fuse_fs):
    # direct_io: in page-cache mode the kernel retries a failed readahead with a plain
    # read, which (the rule gone) succeeds - see the facts document.
    fs = make_fuse_fs(direct_io=True)
    fs.path("blob").write_bytes(b"x" * 4096)
    rule = fs.block("read", "*blob")
    out: dict = {}
    thread = _reader(fs.path("blob"), out)
    fs.wait_blocked(rule)
    rule.release(errno.ETIMEDOUT)
    thread.join(10)
    assert out["error"].errno == errno.ETIMEDOUT


@pytest.mark.parametrize(("op", "err", "call"), [
    ("open", errno.EIO, lambda p: p.read_bytes()),
    ("read", errno.EIO, lambda p: p.read_bytes()),
    ("write", errno.ENOSPC, lambda p: p.write_bytes(b"y" * 10)),
    ("getattr", errno.ESTALE, lambda p: p.stat()),
    ("unlink", errno.EACCES, lambda p: p.unlink()),
    ("rename", errno.EXDEV, lambda p: p.rename(p.with_name("renamed"))),
    ("setxattr", errno.EDQUOT, lambda p: os.setxattr(p, "user.k", b"v")),
    ("create", errno.EROFS, lambda p: p.with_name("new").write_bytes(b"n")),
])
def test_injected_errno_surfaces_as_that_errno(fuse_fs, op, err, call):
    target = fuse_fs.path("f")
    target.write_bytes(b"x" * 100)
    rule = fuse_fs.fail(op, err, "/*")
    with pytest.raises(OSError) as caught:
        call(target)
    assert caught.value.errno == err, f"{op}: {caught.value!r}"
    assert rule.hits >= 1
    rule.release()
    call(target)  # released: the call goes through


def test_times_limits_a_rule_to_that_many_calls(fuse_fs):
    fuse_fs.path("f").write_bytes(b"x")
    fuse_fs.fail("open", errno.EIO, "/f", times=2)
    for _ in range(2):
        with pytest.raises(OSError, match="Input/output error"):
            fuse_fs.path("f").read_bytes()
    assert fuse_fs.path("f").read_bytes() == b"x"


@pytest.mark.parametrize(("op", "err", "call"), [
    ("read", errno.EIO, lambda p: p.read_bytes()),
    ("getattr", errno.ESTALE, lambda p: p.stat()),
])
def test_fact_the_kernel_retries_some_one_off_errors(fuse_fs, op, err, call):
    """A failed page-cache readahead is retried with a plain read, and ESTALE makes the
    VFS redo the lookup: a single injected failure of these never reaches the caller."""
    fuse_fs.path("f").write_bytes(b"x" * 100)
    fuse_fs.fail(op, err, "/f", times=1)
    call(fuse_fs.path("f"))
    assert fuse_fs.calls(op) >= 2


def test_rule_matches_only_its_paths_and_ops(fuse_fs):
    (fuse_fs.path("kv")).mkdir()
    fuse_fs.path("kv", "a.bin").write_bytes(b"a")
    fuse_fs.path("other.bin").write_bytes(b"o")
    rule = fuse_fs.fail("open", errno.EIO, "/kv/*.bin")
    with pytest.raises(OSError):
        fuse_fs.path("kv", "a.bin").read_bytes()
    assert fuse_fs.path("other.bin").read_bytes() == b"o"
    assert fuse_fs.path("kv", "a.bin").stat().st_size == 1  # getattr is not open
    assert rule.hits == 1
    rule.release()
    assert fuse_fs.path("kv", "a.bin").read_bytes() == b"a"


def test_delay_slows_the_operation(fuse_fs):
    fuse_fs.path("f").write_bytes(b"x")
    fuse_fs.delay("getattr", 0.3, "/f", times=1)
    start = time.monotonic()
    fuse_fs.path("f").stat()
    assert time.monotonic() - start >= 0.3  # a lower bound only: sleeping is never faster


def test_bad_rules_are_refused_with_the_fix(fuse_fs):
    with pytest.raises(ValueError, match=r"unknown FUSE operation.*choose from"):
        fuse_fs.block("reed")
    with pytest.raises(ValueError, match="positive errno"):
        fuse_fs.fail("read", 0)
    with pytest.raises(ValueError, match="times"):
        fuse_fs.block("read", times=0)


def test_passthrough_round_trip_of_a_2mib_file(fuse_fs):
    data = os.urandom(BLOCK)
    fuse_fs.path("dir").mkdir()
    tmp = fuse_fs.path("dir", "blk.tmp")
    with open(tmp, "wb") as f:
        f.write(data[:BLOCK // 2])
        f.write(data[BLOCK // 2:])
    os.setxattr(tmp, "user.vllm.kv_crc32c", b"\x01\x02\x03\x04")
    tmp.rename(fuse_fs.path("dir", "blk"))
    os.link(fuse_fs.path("dir", "blk"), fuse_fs.path("dir", "blk.link"))
    backing = fuse_fs.backing / "dir" / "blk"
    assert backing.read_bytes() == data  # really stored in the backing folder
    assert fuse_fs.path("dir", "blk").read_bytes() == data
    assert os.getxattr(fuse_fs.path("dir", "blk"), "user.vllm.kv_crc32c") == b"\x01\x02\x03\x04"
    st = fuse_fs.path("dir", "blk").stat()
    assert (st.st_size, st.st_nlink) == (BLOCK, 2)
    assert st.st_ino == fuse_fs.path("dir", "blk.link").stat().st_ino == backing.stat().st_ino
    assert sorted(os.listdir(fuse_fs.path("dir"))) == ["blk", "blk.link"]
    fuse_fs.path("dir", "blk.link").unlink()
    fuse_fs.path("dir", "blk").unlink()
    fuse_fs.path("dir").rmdir()
    assert os.listdir(fuse_fs.backing) == []


def test_unlinking_an_open_file_leaves_no_hidden_name(fuse_fs):
    fuse_fs.path("f").write_bytes(b"abc")
    with open(fuse_fs.path("f"), "rb") as f:
        fuse_fs.path("f").unlink()
        assert os.listdir(fuse_fs.backing) == []  # no .fuse_hidden* in the backing folder
        assert f.read() == b"abc"


def test_close_with_a_parked_reader_unmounts_and_frees_it(tmp_path):
    skip_unless(fuse_unavailable_reason())
    fs = FuseFS(tmp_path / "backing", mounts.new_mount_dir("fuse-")).start()
    try:
        fs.path("f").write_bytes(b"z" * 4096)
        rule = fs.block("read", "/f")
        out: dict = {}
        thread = _reader(fs.path("f"), out)
        fs.wait_blocked(rule)
        server = psutil.Process(fs.pid)
    finally:
        fs.close()
    thread.join(10)
    assert not thread.is_alive(), "the parked reader is still stuck after close()"
    assert not mounts.is_mounted(fs.mountpoint)
    assert not server.is_running()
    fs.close()  # idempotent
    fs.mountpoint.rmdir()


def test_mount_goes_away_when_the_test_process_is_killed(tmp_path):
    """A test process SIGKILLed while it holds a mount with a parked call: the server sees
    its control socket close, frees the call, detaches the mount and exits."""
    skip_unless(fuse_unavailable_reason())
    script = textwrap.dedent(f"""
        import os, sys, threading
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from support.fusefs import FuseFS
        from support import mounts
        fs = FuseFS({str(tmp_path / "backing")!r}, mounts.new_mount_dir("fuse-")).start()
        fs.path("f").write_bytes(b"q")
        rule = fs.block("read", "/f")
        threading.Thread(target=lambda: fs.path("f").read_bytes(), daemon=True).start()
        fs.wait_blocked(rule)
        print(fs.pid, fs.mountpoint, flush=True)
        threading.Event().wait()
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server_pid, mountpoint = owner.stdout.readline().split()
    server = psutil.Process(int(server_pid))
    assert mounts.is_mounted(mountpoint)
    owner.kill()
    owner.wait(10)  # returns: its parked reader thread did not pin it in the kernel
    owner.stdout.close()
    wait_for(lambda: not mounts.is_mounted(mountpoint), 20, "the orphaned mount to go")
    wait_for(lambda: not server.is_running() or server.status() == psutil.STATUS_ZOMBIE, 20,
             "the orphaned server to exit")
    mounts.reap_stale_mounts()  # removes the dead owner's mount folder
    assert not Path(mountpoint).parent.exists()


# -- facts other engineers build on (docs/test-filesystems.md) ----------------------------
def _blocked_child(fs: FuseFS, op: str, code: str) -> tuple[subprocess.Popen, object]:
    """A child process whose ``code`` (with ``P`` = the file's path) sits in ``op``."""
    fs.path("f").write_bytes(os.urandom(1 << 20))
    rule = fs.block(op, "/f")
    child = subprocess.Popen([sys.executable, "-c",
                              f"import mmap, os; P = {str(fs.path('f'))!r}; {code}"])
    fs.wait_blocked(rule)
    return child, rule


READ = "os.preadv(os.open(P, os.O_RDONLY | {flags}), [mmap.mmap(-1, 1 << 20)], 0)"


def test_fact_sigkill_ends_a_reader_blocked_in_a_page_cache_read(fuse_fs):
    child, rule = _blocked_child(fuse_fs, "read", READ.format(flags=0))
    child.kill()
    assert child.wait(10) == -signal.SIGKILL  # it waits on a page lock, killably
    rule.release()


@pytest.mark.parametrize(("direct_io", "op", "code"), [
    (True, "read", READ.format(flags=0)),
    (False, "read", READ.format(flags="os.O_DIRECT")),
    (False, "open", "open(P, 'rb')"),
    (False, "getattr", "os.stat(P)"),
    (False, "write", "open(P, 'r+b').write(b'y' * 10)"),
], ids=["read-direct_io-mount", "read-O_DIRECT", "open", "getattr", "write"])
def test_fact_sigkill_does_not_end_a_caller_blocked_in_a_request(make_fuse_fs, direct_io, op,
                                                                  code):
    """A call waiting for the server's answer (request_wait_answer) takes only fatal
    signals, and once the request is with the server not even those: after SIGKILL the
    process stays in D state until the server answers - the unkillable hung-NFS worker of
    issue 9. Only page-cache reads (above) differ."""
    fs = make_fuse_fs(direct_io=direct_io)
    child, rule = _blocked_child(fs, op, code)
    child.kill()
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(1.0)
    assert _state(child.pid) == "D"
    rule.release()
    assert child.wait(10) == -signal.SIGKILL


def test_aborting_the_connection_frees_an_unkillable_caller(fuse_fs):
    child, _ = _blocked_child(fuse_fs, "getattr", "os.stat(P)")
    child.kill()
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.5)
    assert mounts.abort_fuse(fuse_fs.mountpoint)
    assert child.wait(10) == -signal.SIGKILL
    with pytest.raises(OSError) as caught:
        os.stat(fuse_fs.mountpoint / "f")
    assert caught.value.errno == errno.ENOTCONN  # the fixture still unmounts it


def test_fact_feature_table(fuse_fs):
    root = fuse_fs.mountpoint
    assert fsprobe.o_direct(root) == "ok"
    assert fsprobe.o_tmpfile(root) == errno.errorcode[errno.EOPNOTSUPP]
    assert fsprobe.xattr(root) == "ok"
    assert fsprobe.lock_seen(root, "flock")  # the kernel keeps the locks of this mount
    assert fsprobe.lock_seen(root, "posix")
    assert fsprobe.rename_link_semantics(root) == {
        "link onto existing": "EEXIST",
        "renameat2 NOREPLACE onto existing": "EEXIST",
        "rename onto existing": "replaced",
    }
    path = fuse_fs.path("t")
    path.write_bytes(b"t")
    os.utime(path, ns=(1_000_000_000_123, 2_000_000_000_456))
    assert path.stat().st_atime_ns == 1_000_000_000_123  # an explicit atime sticks
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # and a lock on the mount is a lock in the kernel
        assert fsprobe.try_lock_elsewhere(path, "flock") == "busy"
    finally:
        os.close(fd)

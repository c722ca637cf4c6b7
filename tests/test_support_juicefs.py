"""JuiceFS helpers (tests/support/juicefs.py): two mounts of one volume really behave as two
nodes sharing a file system - bytes, locks, xattrs and times cross between them - and
teardown leaves no mount and no daemon. The facts asserted here are the ones
docs/test-filesystems.md reports."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time

import pytest
from support import fsprobe, juicefs, mounts

pytestmark = pytest.mark.dfs

BLOCK = 2 << 20


def test_file_written_via_a_reads_byte_exact_via_b(dfs_dirs):
    data = os.urandom(BLOCK)
    (dfs_dirs.a / "blk").write_bytes(data)
    assert (dfs_dirs.b / "blk").read_bytes() == data
    assert os.listdir(dfs_dirs.b) == ["blk"]


def test_the_two_mounts_are_separate_fuse_mounts_of_one_volume(juicefs_pair):
    a, b = juicefs_pair
    assert a.mounted and b.mounted
    assert os.stat(a.path).st_dev != os.stat(b.path).st_dev
    assert set(a.daemon_pids()).isdisjoint(b.daemon_pids())
    assert a.daemon_pids() and b.daemon_pids()


def test_files_below_reads_one_folder_tree_from_the_metadata(juicefs_volume, dfs_dirs):
    (dfs_dirs.a / "x" / "y").mkdir(parents=True)
    (dfs_dirs.a / "x" / "one.bin").write_bytes(b"1" * 1000)
    (dfs_dirs.b / "x" / "y" / "two.bin").write_bytes(b"2" * 3000)
    (dfs_dirs.a / "x" / "gone.bin").write_bytes(b"3" * 5)
    (dfs_dirs.a / "x" / "y" / "t.tmp").write_bytes(b"4" * 7)
    (dfs_dirs.a / "outside.bin").write_bytes(b"5" * 11)
    os.unlink(dfs_dirs.b / "x" / "gone.bin")
    os.rename(dfs_dirs.a / "x" / "y" / "t.tmp", dfs_dirs.a / "x" / "y" / "three.bin")
    for via in (dfs_dirs.a / "x", dfs_dirs.b / "x"):
        assert sorted(juicefs_volume.files_below(via)) == [
            ("one.bin", 1000), ("three.bin", 7), ("two.bin", 3000)]
    assert sorted(juicefs_volume.files_below(dfs_dirs.a / "x" / "y")) == [
        ("three.bin", 7), ("two.bin", 3000)]


@pytest.mark.parametrize("kind", ["flock", "posix"])
def test_lock_held_via_a_is_seen_via_b(dfs_dirs, kind):
    path_a, path_b = dfs_dirs.a / "lease", dfs_dirs.b / "lease"
    path_a.write_bytes(b"")
    take = fcntl.flock if kind == "flock" else fcntl.lockf
    fd = os.open(path_a, os.O_RDWR)
    try:
        take(fd, fcntl.LOCK_EX)
        assert fsprobe.try_lock_elsewhere(path_b, kind) == "busy"
        take(fd, fcntl.LOCK_UN)
        assert fsprobe.try_lock_elsewhere(path_b, kind) == "got"
        take(fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)  # closing the last descriptor drops the lock ...
    assert fsprobe.try_lock_elsewhere(path_b, kind) == "got"  # ... on the other node too


def test_a_lock_waiter_on_b_wakes_when_a_releases(dfs_dirs):
    (dfs_dirs.a / "lease").write_bytes(b"")
    fd_a = os.open(dfs_dirs.a / "lease", os.O_RDWR)
    fd_b = os.open(dfs_dirs.b / "lease", os.O_RDWR)
    got = threading.Event()
    try:
        fcntl.flock(fd_a, fcntl.LOCK_EX)

        def wait_on_b():
            fcntl.flock(fd_b, fcntl.LOCK_EX)
            got.set()

        waiter = threading.Thread(target=wait_on_b, daemon=True)
        waiter.start()
        assert not got.wait(0.5)
        fcntl.flock(fd_a, fcntl.LOCK_UN)
        assert got.wait(20), "the waiter on mount b never got the lock released on a"
        waiter.join(5)
    finally:
        os.close(fd_a)
        os.close(fd_b)


def test_fact_feature_table(dfs_dirs):
    a, b = dfs_dirs
    assert fsprobe.o_direct(a) == "ok"
    assert fsprobe.xattr(a, b) == "ok"
    assert fsprobe.atime_after_read(a) is False  # JuiceFS mounts noatime by default
    assert fsprobe.rename_link_semantics(a) == {
        "link onto existing": "EEXIST",
        "renameat2 NOREPLACE onto existing": "EEXIST",
        "rename onto existing": "replaced",
    }


def test_fact_o_tmpfile_opens_but_a_linked_tmpfile_is_lost_at_close(dfs_dirs):
    """JuiceFS 1.4.2 accepts O_TMPFILE and linkat(2) gives the file a name, but closing the
    descriptor deletes the file's inode anyway: the name is left dangling (lookups say
    ENOENT, readdir hides it, its folder can no longer be removed). Never publish blocks
    with O_TMPFILE on JuiceFS; a tier must probe publish-then-close, not just the open."""
    a, b = dfs_dirs
    assert fsprobe.o_tmpfile(a, b) == "lost after close"
    sub = a / "probe"
    sub.mkdir()
    fd = os.open(sub, os.O_TMPFILE | os.O_WRONLY, 0o600)  # the open itself succeeds
    try:
        os.write(fd, b"block")
        fsprobe.linkat_follow(fd, sub / "blk")
    finally:
        os.close(fd)
    # gone within the other mount's 1 s entry cache, and for good
    assert fsprobe.wait_visible(lambda: not (b / "probe" / "blk").exists(), 5) is not None
    assert fsprobe.wait_visible(lambda: (b / "probe" / "blk").exists(), 1.5) is None
    assert os.listdir(b / "probe") == []
    with pytest.raises(OSError) as caught:
        (b / "probe").rmdir()
    assert caught.value.errno == errno.ENOTEMPTY  # the dangling name still counts
    # The folder stays (nothing through the mounts removes it now) until the session's
    # volume is deleted; dfs_dirs' teardown tolerates that.


def test_fact_default_caches_delay_what_b_sees_by_at_most_about_a_second(dfs_dirs):
    seen = fsprobe.visibility(dfs_dirs.a, dfs_dirs.b)
    assert all(v is not None for v in seen.values()), seen  # everything arrives ...
    # ... and no later than the 1 s attribute/entry caches plus slack for a loaded machine
    assert all(v < 5 for v in seen.values()), seen


def test_fact_a_name_replaced_on_a_gives_enoent_on_b_until_its_entry_cache_expires(dfs_dirs):
    a, b = dfs_dirs
    (a / "blk").write_bytes(b"old")
    assert (b / "blk").read_bytes() == b"old"  # b caches name -> old inode
    (a / "blk.tmp").write_bytes(b"new")
    started = time.monotonic()
    os.rename(a / "blk.tmp", a / "blk")  # the old inode is deleted
    try:
        seen = (b / "blk").read_bytes()
    except FileNotFoundError:
        seen = None
    # ENOENT, unless this machine stalled past the 1 s entry cache between the two calls
    assert seen is None or time.monotonic() - started > 0.9, seen
    assert fsprobe.wait_visible(lambda: (b / "blk").read_bytes() == b"new", 5) is not None


def test_coherent_mount_sees_every_change_at_once(dfs_dirs, juicefs_pair, make_juicefs_mount):
    c = make_juicefs_mount("coherent", **juicefs.COHERENT)
    name = dfs_dirs.a.name
    seen_a, seen_c = dfs_dirs.a, c.path / name
    (seen_a / "f").write_bytes(b"1")
    assert (seen_c / "f").read_bytes() == b"1"
    os.utime(seen_a / "f", ns=(123_000_000_000, 456_000_000_000))
    assert (seen_c / "f").stat().st_atime_ns == 123_000_000_000  # no wait: no attr cache
    (seen_a / "g").write_bytes(b"2")
    os.rename(seen_a / "g", seen_a / "f")
    assert (seen_c / "f").read_bytes() == b"2"  # the replaced name resolves afresh
    (seen_a / "f").unlink()
    assert not (seen_c / "f").exists()  # no wait: no entry cache
    with pytest.raises(FileNotFoundError):
        os.stat(seen_c / "f")


def test_umount_leaves_no_mount_and_no_daemon(make_juicefs_mount):
    extra = make_juicefs_mount("short-lived")
    pids = extra.daemon_pids()
    assert pids and mounts.is_mounted(extra.path)
    (extra.path / "busy").write_bytes(b"x")
    held = os.open(extra.path / "busy", os.O_RDONLY)  # a busy mount still goes (forced)
    try:
        extra.umount()
    finally:
        try:
            os.close(held)
        except OSError as exc:
            # the connection was aborted under it
            assert exc.errno in (errno.EIO, errno.ENOTCONN, errno.ECONNABORTED), exc
    assert not mounts.is_mounted(extra.path)
    assert not extra.daemon_pids()
    extra.umount()  # idempotent

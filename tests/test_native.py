"""Tests of mptier.native, the batch block I/O layer: round trips, store and load rules,
O_DIRECT, argument checks, fault injection, the two backends agreeing.

The ``io`` fixture runs each test on the compiled core with openat2 resolution, on the
compiled core forced onto its O_NOFOLLOW walk, and on the pure-Python twin. CI runs as
root, so permission errors are injected (MPTIER_FAULT_ERRNO / set_fault) rather than made
with chmod; O_DIRECT refusals come from an LD_PRELOAD shim (native_shim.c). Checksums,
hostile entries and publishing have suites of their own (test_native_*.py).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import mmap
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from native_support import (  # noqa: F401  (fixtures)
    ALIGN,
    BLOCK,
    aligned,
    assert_not_loaded_after,
    block_paths,
    child_env,
    files_under,
    io_fixture,
    make_io,
    no_fault_fixture,
    offsets,
    run_python,
    run_with_shim,
    shim_fixture,
    temp_files,
    write_file,
)

from mptier import native
from mptier.errors import BatchIOError

# --- round trips ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 5, 64])
def test_round_trip_into_other_slots(io, tmp_path, n):
    buf = aligned(2 * max(n, 1) * BLOCK, seed=n)
    original = buf.copy()
    paths = block_paths(n)
    io.batch_store(tmp_path, paths, buf, offsets(range(n)), BLOCK)
    io.batch_load(tmp_path, paths, buf, offsets(range(2 * n - 1, n - 1, -1)), BLOCK)
    for i in range(n):
        slot = 2 * n - 1 - i
        want = bytes(original[i * BLOCK : (i + 1) * BLOCK])
        assert bytes(buf[slot * BLOCK : (slot + 1) * BLOCK]) == want, f"block {i}"
        assert (tmp_path / paths[i]).read_bytes() == want
    assert len(files_under(tmp_path)) == n
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("block_bytes, first", [(5000, 1), (BLOCK, 512), (ALIGN, 100)])
def test_unaligned_offsets_round_trip(io, tmp_path, block_bytes, first):
    n = 4
    buf = aligned(first + 2 * n * block_bytes, seed=7)
    src = [first + i * block_bytes for i in range(n)]
    dst = [first + (n + i) * block_bytes for i in range(n)]
    expect = [bytes(buf[o : o + block_bytes]) for o in src]
    paths = block_paths(n)
    io.batch_store(tmp_path, paths, buf, src, block_bytes)
    io.batch_load(tmp_path, paths, buf, dst, block_bytes)
    assert [bytes(buf[o : o + block_bytes]) for o in dst] == expect
    assert all((tmp_path / p).stat().st_size == block_bytes for p in paths)


def test_buffered_round_trip_with_o_direct_off(io, tmp_path):
    buf = aligned(8 * BLOCK, seed=3)
    paths = block_paths(4)
    io.batch_store(tmp_path, paths, buf, offsets(range(4)), BLOCK, o_direct=False)
    io.batch_load(tmp_path, paths, buf, offsets(range(4, 8)), BLOCK, o_direct=False)
    assert bytes(buf[: 4 * BLOCK]) == bytes(buf[4 * BLOCK :])


def test_root_as_fd_or_path_and_bare_names(io, tmp_path):
    buf = aligned(4 * BLOCK, seed=5)
    fd = native.open_root(tmp_path)
    try:
        io.batch_store(fd, ["top.bin", "a/b.bin"], buf, [0, BLOCK], BLOCK)
        io.batch_load(str(tmp_path), ["top.bin", "a/b.bin"], buf, [2 * BLOCK, 3 * BLOCK],
                      BLOCK)
        assert io.batch_lookup(fd, ["top.bin", "a/b.bin", "c.bin"], BLOCK) == [
            native.LOOKUP_PRESENT, native.LOOKUP_PRESENT, native.LOOKUP_ABSENT]
    finally:
        os.close(fd)
    assert bytes(buf[2 * BLOCK :]) == bytes(buf[: 2 * BLOCK])
    assert sorted(files_under(tmp_path)) == ["a/b.bin", "top.bin"]


@pytest.mark.parametrize("kind", ["bytearray", "mmap", "ctypes", "memoryview", "float16-2d"])
def test_any_writable_buffer_and_release_after(io, tmp_path, kind):
    nbytes = 4 * BLOCK
    if kind == "bytearray":
        buf = bytearray(nbytes)
    elif kind == "mmap":
        buf = mmap.mmap(-1, nbytes)
    elif kind == "ctypes":
        buf = (ctypes.c_char * nbytes)()
    elif kind == "memoryview":
        buf = memoryview(bytearray(nbytes))
    else:
        buf = np.zeros((4, BLOCK // 2), np.float16)
    flat = memoryview(buf).cast("B")
    flat[: 2 * BLOCK] = os.urandom(2 * BLOCK)
    paths = block_paths(2)
    io.batch_store(tmp_path, paths, buf, [0, BLOCK], BLOCK, checksum=True)
    io.batch_load(tmp_path, paths, buf, [3 * BLOCK, 2 * BLOCK], BLOCK, checksum=True)
    assert flat[3 * BLOCK :] == flat[:BLOCK]
    assert flat[2 * BLOCK : 3 * BLOCK] == flat[BLOCK : 2 * BLOCK]
    flat.release()
    # Nothing may keep the buffer exported after a call returns.
    if kind == "bytearray":
        buf.extend(b"x")
    elif kind == "mmap":
        buf.close()


# --- store rules ---------------------------------------------------------------------

def test_store_leaves_an_existing_whole_block_untouched(io, tmp_path):
    paths = block_paths(3)
    old = bytes(range(256)) * (BLOCK // 256)  # the right size, other bytes
    write_file(tmp_path / paths[1], old)
    os.utime(tmp_path / paths[1], ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    before = os.stat(tmp_path / paths[1])
    io.batch_store(tmp_path, paths, aligned(3 * BLOCK, seed=1), offsets(range(3)), BLOCK)
    after = os.stat(tmp_path / paths[1])
    assert (tmp_path / paths[1]).read_bytes() == old
    assert (after.st_mtime_ns, after.st_atime_ns, after.st_ino) == (
        before.st_mtime_ns, before.st_atime_ns, before.st_ino)
    assert all((tmp_path / p).stat().st_size == BLOCK for p in paths)


@pytest.mark.parametrize("flags", [0, native.O_DIRECT | native.CHECKSUM | native.TMPFILE],
                         ids=["buffered", "direct-checksum-tmpfile"])
def test_store_says_which_blocks_it_found_already_there(io, tmp_path, flags):
    """The errno layer's ``found``: what a worker counts as skipped instead of written
    when it made no existence check of its own (rootio, no budget)."""
    paths = block_paths(5)
    write_file(tmp_path / paths[1], bytes(BLOCK))  # whole: kept, found
    write_file(tmp_path / paths[3], bytes(BLOCK // 2))  # short: replaced, not found
    os.makedirs((tmp_path / paths[4]).parent, exist_ok=True)
    os.symlink(tmp_path / paths[1], tmp_path / paths[4])  # a symlink: removed, written
    encoded = [p.encode() for p in paths]
    buf = aligned(5 * BLOCK, seed=9)
    fd = native.open_root(tmp_path)
    try:
        found = bytearray(b"\x07" * 6)  # stale flags are cleared; the extra one is left
        assert io.store(fd, encoded, buf, offsets(range(5)), BLOCK, flags,
                        b"0123456789abcdef", found) == (0, 5, 5, 0)
        assert list(found) == [0, 1, 0, 0, 0, 7]
        assert not os.path.islink(tmp_path / paths[4])
        assert all((tmp_path / p).stat().st_size == BLOCK for p in paths)
        again = bytearray(5)
        assert io.store(fd, encoded, buf, offsets(range(5)), BLOCK, flags,
                        b"0123456789abcdef", again)[0] == 0
        assert list(again) == [1] * 5
        # a failed batch answers for the blocks done before the failure
        fresh = block_paths(3, tag="fresh")
        write_file(tmp_path / fresh[0], bytes(BLOCK))
        native.set_fault(f"store:2:{errno.EACCES}")
        partly = bytearray(3)
        assert io.store(fd, [p.encode() for p in fresh], buf, offsets(range(3)), BLOCK,
                        flags, b"0123456789abcdef", partly) == (-errno.EACCES, 2, 2, 0)
        assert list(partly[:2]) == [1, 0]
    finally:
        native.set_fault(None)
        os.close(fd)


def test_store_creates_missing_subfolders(io, tmp_path):
    paths = ["x/y/z/deep.bin", *block_paths(2)]
    io.batch_store(tmp_path, paths, aligned(3 * BLOCK, seed=2), offsets(range(3)), BLOCK)
    assert all((tmp_path / p).stat().st_size == BLOCK for p in paths)


def test_unusable_root_names_the_path(io, tmp_path):
    root = tmp_path / "root"
    root.write_bytes(b"a file where a directory should be")
    buf = aligned(2 * BLOCK, seed=4)
    with pytest.raises(NotADirectoryError) as info:
        io.batch_store(root, block_paths(2), buf, offsets(range(2)), BLOCK)
    assert info.value.filename == str(root)
    with pytest.raises(FileNotFoundError):
        native.open_root(tmp_path / "missing")
    assert root.read_bytes() == b"a file where a directory should be"
    assert sorted(os.listdir(tmp_path)) == ["root"]
    for probe in (io.probe_o_direct, io.probe_xattr, io.probe_o_tmpfile):
        assert probe(root) is False


WRITER = """
    import json, mmap, random, sys
    from native_support import IO
    io, root, paths = IO(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    seed, tmpfile = int(sys.argv[4]), sys.argv[5] == "1"
    buf = mmap.mmap(-1, len(paths) * 8192)  # page-aligned: the O_DIRECT path
    buf[:] = random.Random(seed).randbytes(len(buf))
    print("ready", flush=True)
    sys.stdin.readline()  # all writers start together
    io.batch_store(root, paths, buf, [i * 8192 for i in range(len(paths))], 8192,
                   checksum=True, tmpfile=tmpfile)
"""


@pytest.mark.parametrize("tmpfile", [False, True], ids=["named", "tmpfile"])
def test_processes_storing_same_keys_publish_whole_files(io, tmp_path, tmpfile):
    n, writers, seed = 32, 3, 11
    paths = block_paths(n)
    expect = np.frombuffer(random.Random(seed).randbytes(n * BLOCK), np.uint8)
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), io.variant,
                               str(tmp_path), json.dumps(paths), str(seed), str(int(tmpfile))],
                              env=child_env(), text=True, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
             for _ in range(writers)]
    seen_partial = []
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.close()
        # Read while they write: a final name must never show a partial file.
        slot = aligned(BLOCK)
        while any(p.poll() is None for p in procs):
            for i, path in enumerate(paths):
                try:
                    io.batch_load(tmp_path, [path], slot, [0], BLOCK, checksum=True)
                except BatchIOError as e:
                    if e.errno != errno.ENOENT:
                        seen_partial.append((i, e.errno))
                    continue
                if bytes(slot) != bytes(expect[i * BLOCK : (i + 1) * BLOCK]):
                    seen_partial.append((i, "wrong bytes"))
    finally:
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
    assert [p.returncode for p in procs] == [0] * writers
    assert seen_partial == []
    for i, path in enumerate(paths):
        assert (tmp_path / path).read_bytes() == bytes(expect[i * BLOCK : (i + 1) * BLOCK])
    assert temp_files(tmp_path) == []
    assert len(files_under(tmp_path)) == n


@pytest.mark.parametrize("tmpfile", [False, True], ids=["named", "tmpfile"])
def test_failed_write_removes_temp_file(io, tmp_path, tmpfile):
    # A real mid-write failure: the file-size limit lets 4096 bytes through (a short
    # write), then the next write fails with EFBIG.
    paths = block_paths(3)
    write_file(tmp_path / paths[0], b"s" * 16384)  # whole: skipped
    code = """
        import json, mmap, resource, signal, sys
        from native_support import IO
        from mptier.errors import BatchIOError
        io, root, paths = IO(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
        direct, tmpfile = sys.argv[4] == "1", sys.argv[5] == "1"
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        buf = mmap.mmap(-1, 3 * 16384)
        try:
            io.batch_store(root, paths, buf, [0, 16384, 32768], 16384, o_direct=direct,
                           tmpfile=tmpfile, checksum=True)
        except BatchIOError as e:
            print(json.dumps([e.errno, e.index, e.n_done, e.filename]))
    """
    for direct in ("1", "0"):
        out = run_python(code, io.variant, str(tmp_path), json.dumps(paths), direct,
                         str(int(tmpfile))).stdout
        assert json.loads(out) == [errno.EFBIG, 1, 1, str(tmp_path / paths[1])], direct
        assert temp_files(tmp_path) == []
        assert not (tmp_path / paths[1]).exists() and not (tmp_path / paths[2]).exists()


# --- load rules ----------------------------------------------------------------------

def test_short_file_is_deleted_and_reported(io, tmp_path):
    n = 4
    buf = aligned(2 * n * BLOCK, seed=5)
    paths = block_paths(n)
    io.batch_store(tmp_path, paths, buf, offsets(range(n)), BLOCK)
    os.truncate(tmp_path / paths[2], BLOCK // 2)
    buf[n * BLOCK :] = 0xAB
    with pytest.raises(BatchIOError) as info:
        io.batch_load(tmp_path, paths, buf, offsets(range(n, 2 * n)), BLOCK)
    e = info.value
    full = str(tmp_path / paths[2])
    assert (e.errno, e.index, e.n_done, e.path, e.filename) == (
        errno.ENODATA, 2, 2, full, full)
    assert full in str(e) and "shorter than a block" in e.strerror
    assert not (tmp_path / paths[2]).exists()
    assert (tmp_path / paths[3]).exists()
    assert bytes(buf[n * BLOCK : (n + 2) * BLOCK]) == bytes(buf[: 2 * BLOCK])
    stored = [bytes(buf[k * BLOCK:(k + 1) * BLOCK]) for k in range(n)]
    assert_not_loaded_after(io, buf, 3, range(n, 2 * n), 0xAB, stored)


def test_missing_file_fails_only_from_that_block_on(io, tmp_path):
    n = 4
    buf = aligned(2 * n * BLOCK, seed=6)
    paths = block_paths(n)
    io.batch_store(tmp_path, paths, buf, offsets(range(n)), BLOCK)
    os.remove(tmp_path / paths[1])
    buf[n * BLOCK :] = 0xCD
    with pytest.raises(BatchIOError) as info:
        io.batch_load(tmp_path, paths, buf, offsets(range(n, 2 * n)), BLOCK)
    e = info.value
    assert (e.errno, e.index, e.n_done, e.filename) == (
        errno.ENOENT, 1, 1, str(tmp_path / paths[1]))
    assert bytes(buf[n * BLOCK : (n + 1) * BLOCK]) == bytes(buf[:BLOCK])
    assert set(buf[(n + 1) * BLOCK : (n + 2) * BLOCK].tolist()) == {0xCD}  # missing
    stored = [bytes(buf[k * BLOCK:(k + 1) * BLOCK]) for k in range(n)]
    assert_not_loaded_after(io, buf, 2, range(n, 2 * n), 0xCD, stored)
    assert all((tmp_path / p).exists() for p in (paths[0], paths[2], paths[3]))


def test_symlink_loop_at_a_block_is_removed(io, tmp_path):
    paths = block_paths(2)
    buf = aligned(4 * BLOCK, seed=8)
    io.batch_store(tmp_path, paths[:1], buf, [0], BLOCK)
    link = tmp_path / paths[1]
    link.parent.mkdir(parents=True, exist_ok=True)
    other = str(link) + ".other"
    os.symlink(other, link)
    os.symlink(link, other)
    with pytest.raises(BatchIOError) as info:
        io.batch_load(tmp_path, paths, buf, offsets([2, 3]), BLOCK)
    e = info.value
    assert (e.errno, e.index, e.n_done) == (errno.ELOOP, 1, 1)
    assert "symlink" in e.strerror and "removed" in e.strerror
    assert not os.path.lexists(link) and os.path.islink(other)
    assert bytes(buf[2 * BLOCK : 3 * BLOCK]) == bytes(buf[:BLOCK])
    assert io.batch_lookup(tmp_path, paths, BLOCK) == [native.LOOKUP_PRESENT,
                                                       native.LOOKUP_ABSENT]


def test_lookup_statuses(io, tmp_path):
    paths = block_paths(6)
    io.batch_store(tmp_path, [paths[0], paths[3]], aligned(2 * BLOCK), [0, BLOCK], BLOCK)
    os.makedirs(tmp_path / paths[4])  # a directory is not a block
    write_file(tmp_path / paths[5], b"short")
    assert io.batch_lookup(tmp_path, paths, BLOCK) == [
        native.LOOKUP_PRESENT, native.LOOKUP_ABSENT, native.LOOKUP_ABSENT,
        native.LOOKUP_PRESENT, native.LOOKUP_BAD, native.LOOKUP_SHORT]
    assert (tmp_path / paths[5]).read_bytes() == b"short"  # lookup removes no file
    assert io.batch_lookup(tmp_path, [], BLOCK) == []
    assert io.batch_lookup(tmp_path, ["missing/deeper.bin"], BLOCK) == [native.LOOKUP_ABSENT]
    # the same size asked differently: lookup judges against the size it is given
    assert io.batch_lookup(tmp_path, paths[:1], BLOCK // 2) == [native.LOOKUP_BAD]


# --- O_DIRECT ------------------------------------------------------------------------

def test_probes_leave_nothing(io, tmp_path):
    for probe in (io.probe_o_direct, io.probe_xattr, io.probe_o_tmpfile):
        result = probe(tmp_path)
        assert isinstance(result, bool)
        assert probe(tmp_path) is result
        assert os.listdir(tmp_path) == []
        assert probe(tmp_path / "missing") is False
        assert not (tmp_path / "missing").exists()
    # this machine's ext4 and tmpfs have all three; a root without them is tested in
    # test_native_checksum.py (ramfs) and test_native_publish.py (shim)
    assert io.probe_xattr(tmp_path) and io.probe_o_tmpfile(tmp_path)


@pytest.mark.parametrize("mode", ["open", "io"])
def test_o_direct_einval_falls_back_to_buffered(io, tmp_path, shim, mode):
    if io.probe_o_direct(tmp_path) is False:
        pytest.skip(f"O_DIRECT does not work in {tmp_path} anyway")
    if mode == "open" and not io.walk and io.name == "native":
        pytest.skip("openat2 is a raw syscall: the shim cannot refuse its opens "
                    "(the walk variant covers O_DIRECT refused at open)")
    if io.uring:
        pytest.skip("the io_uring path reads and writes inside the kernel, out of the "
                    "shim's reach; test_native_uring.py refuses O_DIRECT with a ramfs")
    root = tmp_path / "root"
    root.mkdir()
    paths = block_paths(4)
    code = """
        import json, mmap, os, sys
        from native_support import IO
        io, paths, root = IO(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
        buf = mmap.mmap(-1, 8 * 8192)  # page-aligned: every block is O_DIRECT-eligible
        buf[: 4 * 8192] = os.urandom(4 * 8192)
        for tmpfile in (False, True):
            io.batch_store(root, paths[:2] if tmpfile else paths[2:], buf,
                           [0, 8192] if tmpfile else [16384, 24576], 8192, tmpfile=tmpfile,
                           checksum=True)
        io.batch_load(root, paths, buf, [57344, 49152, 40960, 32768], 8192, checksum=True)
        same = all(buf[i * 8192 : (i + 1) * 8192] == buf[(7 - i) * 8192 : (8 - i) * 8192]
                   for i in range(4))
        print(json.dumps({"same": same, "probe": io.probe_o_direct(root)}))
    """
    proc, hits, _ = run_with_shim(shim, mode, tmp_path / "shim.log", code,
                                  io.variant, json.dumps(paths), str(root))
    assert json.loads(proc.stdout) == {"same": True, "probe": False}
    assert hits >= 9  # every block's O_DIRECT store and load was refused, and the probe's
    assert all((root / p).stat().st_size == BLOCK for p in paths)
    assert temp_files(root) == []
    assert [n for n in os.listdir(root) if n.startswith(".")] == []  # no probe file


# --- argument checks ----------------------------------------------------------------

def _bad_args(case: str):
    paths = block_paths(2)
    buf = aligned(4 * BLOCK)
    offs, bb = [0, BLOCK], BLOCK
    if case == "length mismatch":
        offs = [0]
    elif case == "negative offset":
        offs = [0, -4096]
    elif case == "past the end":
        offs = [0, 3 * BLOCK + 1]
    elif case == "read-only bytes":
        buf = bytes(4 * BLOCK)
    elif case == "read-only numpy":
        buf.flags.writeable = False
    elif case == "zero block_bytes":
        bb = 0
    elif case == "not contiguous":
        buf = np.zeros(8 * BLOCK, np.uint8)[::2]
    elif case == "empty path":
        paths = ["", paths[1]]
    elif case == "absolute path":
        paths = [paths[0], "/etc/" + paths[1]]
    elif case == "dot-dot":
        paths = ["../escape.bin", paths[1]]
    elif case == "dot-dot inside":
        paths = [paths[0], "a/../../b.bin"]
    elif case == "dot":
        paths = ["./a.bin", paths[1]]
    elif case == "empty component":
        paths = ["a//b.bin", paths[1]]
    elif case == "trailing slash":
        paths = ["a/", paths[1]]
    return paths, buf, offs, bb


@pytest.mark.parametrize("op", ["batch_store", "batch_load"])
@pytest.mark.parametrize("case, message", [
    ("length mismatch", r"2 paths but 1 offsets"),
    ("negative offset", r"offsets\[1\] = -4096 is negative"),
    ("past the end", rf"offsets\[1\] = {3 * BLOCK + 1}: .* past the buffer's {4 * BLOCK} bytes"),
    ("read-only bytes", r"read-only"),
    ("read-only numpy", r"read-only"),
    ("zero block_bytes", r"block_bytes must be positive, got 0"),
    ("not contiguous", r"not C-contiguous"),
    ("empty path", r"paths\[0\]"),
    ("absolute path", r"paths\[1\] = b'/etc/.*must be relative to the root"),
    ("dot-dot", r"paths\[0\] = b'../escape.bin'.*'\.\.'"),
    ("dot-dot inside", r"paths\[1\] = b'a/../../b.bin'.*'\.\.'"),
    ("dot", r"paths\[0\].*'\.'"),
    ("empty component", r"paths\[0\] = b'a//b.bin'.*empty"),
    ("trailing slash", r"paths\[0\] = b'a/'.*empty"),
])
def test_bad_arguments_raise_before_any_io(io, tmp_path, op, case, message):
    root = tmp_path / "root"
    root.mkdir()
    paths, buf, offs, bb = _bad_args(case)
    if op == "batch_load":  # files exist, so a load that ran would change the buffer
        io.batch_store(root, block_paths(2), aligned(2 * BLOCK, seed=9), [0, BLOCK], BLOCK)
    before = files_under(tmp_path)
    snapshot = np.array(buf, copy=True) if isinstance(buf, np.ndarray) else bytes(buf)
    with pytest.raises(ValueError, match=message):
        getattr(io, op)(root, paths, buf, offs, bb)
    assert files_under(tmp_path) == before
    assert np.array_equal(buf, snapshot) if isinstance(buf, np.ndarray) else buf == snapshot


@pytest.mark.parametrize("tag", ["short", "UPPERCASE0123456", "0123456789abcdef0",
                                 "0123456789abcde.", b"0123456789abcd\xff\xfe"])
def test_bad_tag(io, tmp_path, tag):
    with pytest.raises(ValueError, match=r"tag=.*16 characters of \[0-9a-z\]"):
        io.batch_store(tmp_path, block_paths(1), aligned(BLOCK), [0], BLOCK, tag=tag)
    assert os.listdir(tmp_path) == []


def test_bad_root_type_and_lookup_paths(io, tmp_path):
    with pytest.raises(TypeError, match="root must be a directory path or an fd"):
        io.batch_load(3.5, block_paths(1), aligned(BLOCK), [0], BLOCK)
    with pytest.raises(ValueError, match="must be relative"):
        io.batch_lookup(tmp_path, ["/etc/passwd"], BLOCK)
    with pytest.raises(ValueError, match="block_bytes must be positive"):
        io.batch_lookup(tmp_path, ["a.bin"], -1)


# --- fault injection -----------------------------------------------------------------

# --- blocks outside the buffer (the errno layer: what a service's workers call) ----------

N_SLOTS = 3
# Offsets of a block that does not lie wholly inside a buffer of N_SLOTS blocks: past
# the end, straddling it, negative, and too large for 64 bits (a block id a hostile
# engine put in a task record, times the block size).
OUTSIDE = {"past the end": N_SLOTS * BLOCK, "straddling the end": N_SLOTS * BLOCK - 1,
           "far past": 1 << 40, "negative": -BLOCK, "past 64 bits": 1 << 70}


def _guarded(seed: int):
    """A buffer of N_SLOTS blocks that is the first part of a larger array: the bytes
    after it (the guard) stand for the worker's other memory."""
    whole = aligned((N_SLOTS + 2) * BLOCK, seed=seed)
    return whole, whole[:N_SLOTS * BLOCK]


@pytest.mark.parametrize("where", list(OUTSIDE))
def test_store_of_a_block_outside_the_buffer_is_refused(io, tmp_path, where):
    whole, buf = _guarded(seed=11)
    paths = block_paths(3, "outside-store")
    fd = native.open_root(tmp_path)
    try:
        got = io.store(fd, [p.encode() for p in paths], buf,
                       [0, OUTSIDE[where], 2 * BLOCK], BLOCK, 0, b"0123456789abcdef")
    finally:
        os.close(fd)
    assert got == (-errno.EINVAL, 1, 1, 0)
    # the block before it is stored, byte for byte; nothing of it or after it anywhere
    assert files_under(tmp_path) == {paths[0]: bytes(buf[:BLOCK])}
    assert temp_files(tmp_path) == []
    guard = bytes(whole[N_SLOTS * BLOCK:])
    assert not any(guard[:64] in data for data in files_under(tmp_path).values())


@pytest.mark.parametrize("where", list(OUTSIDE))
def test_load_into_a_block_outside_the_buffer_is_refused(io, tmp_path, where):
    stored = aligned(2 * BLOCK, seed=12)
    paths = block_paths(2, "outside-load")
    io.batch_store(tmp_path, paths, stored, offsets(range(2)), BLOCK)
    whole, buf = _guarded(seed=13)
    before = bytes(whole)
    fd = native.open_root(tmp_path)
    try:
        got = io.load(fd, [p.encode() for p in paths], buf, [BLOCK, OUTSIDE[where]], BLOCK, 0)
    finally:
        os.close(fd)
    assert got == (-errno.EINVAL, 1, 1)
    after = bytes(whole)
    assert after[BLOCK:2 * BLOCK] == bytes(stored[:BLOCK])  # the block before it loaded
    assert after[:BLOCK] == before[:BLOCK] and after[2 * BLOCK:] == before[2 * BLOCK:]
    assert sorted(files_under(tmp_path)) == sorted(paths)  # refusing removed nothing


def test_a_block_larger_than_the_buffer_is_refused_at_once(io, tmp_path):
    fd = native.open_root(tmp_path)
    try:
        small = aligned(BLOCK)
        assert io.store(fd, [b"a.bin"], small, [0], 2 * BLOCK, 0, b"0123456789abcdef") \
            == (-errno.EINVAL, 0, 0, 0)
        assert io.load(fd, [b"a.bin"], small, [0], 2 * BLOCK, 0) == (-errno.EINVAL, 0, 0)
    finally:
        os.close(fd)
    assert files_under(tmp_path) == {}


def test_injected_store_fault(io, tmp_path):
    paths = block_paths(3)
    native.set_fault(f"store:1:{errno.EACCES}")
    with pytest.raises(BatchIOError) as info:
        io.batch_store(tmp_path, paths, aligned(3 * BLOCK, seed=1), offsets(range(3)), BLOCK)
    e = info.value
    assert (e.errno, e.index, e.n_done, e.filename) == (
        errno.EACCES, 1, 1, str(tmp_path / paths[1]))
    assert "injected" in str(e)
    assert [(tmp_path / p).exists() for p in paths] == [True, False, False]
    assert temp_files(tmp_path) == []
    io.batch_store(tmp_path, paths[:1], aligned(BLOCK), [0], BLOCK)  # shorter: unaffected
    # the errno layer (what workers call) is faulted the same way
    fd = native.open_root(tmp_path)
    try:
        assert io.store(fd, [p.encode() for p in paths], aligned(3 * BLOCK), offsets(range(3)),
                        BLOCK, 0, b"0123456789abcdef") == (-errno.EACCES, 1, 1, 0)
    finally:
        os.close(fd)
    native.set_fault(None)
    io.batch_store(tmp_path, paths, aligned(3 * BLOCK, seed=1), offsets(range(3)), BLOCK)
    assert all((tmp_path / p).exists() for p in paths)


def test_injected_load_fault(io, tmp_path):
    paths = block_paths(4)
    buf = aligned(8 * BLOCK, seed=2)
    io.batch_store(tmp_path, paths, buf, offsets(range(4)), BLOCK)
    buf[4 * BLOCK :] = 0xEE
    native.set_fault("load:2:EIO")
    with pytest.raises(BatchIOError) as info:
        io.batch_load(tmp_path, paths, buf, offsets(range(4, 8)), BLOCK)
    e = info.value
    assert (e.errno, e.index, e.n_done, e.filename) == (
        errno.EIO, 2, 2, str(tmp_path / paths[2]))
    assert bytes(buf[4 * BLOCK : 6 * BLOCK]) == bytes(buf[: 2 * BLOCK])
    assert set(buf[6 * BLOCK :].tolist()) == {0xEE}
    assert all((tmp_path / p).exists() for p in paths)  # an injected error deletes nothing


@pytest.mark.parametrize("spec", ["load", "load:1", "read:1:5", "load:-1:5", "load:x:5",
                                  "load:1:0", "load:1:ENOTANERRNO"])
def test_malformed_fault_spec(spec):
    with pytest.raises(ValueError, match=native.FAULT_ENV):
        native.set_fault(spec)


def test_environment_picks_backend_and_fault(tmp_path):
    paths = block_paths(2)
    native.get_backend("python").batch_store(tmp_path, paths, aligned(2 * BLOCK), [0, BLOCK],
                                             BLOCK)
    code = """
        import json, sys
        from mptier import native
        from mptier.errors import BatchIOError
        try:
            native.batch_load(sys.argv[1], json.loads(sys.argv[2]), bytearray(16384),
                              [0, 8192], 8192)
        except BatchIOError as e:
            print(native.BACKEND, e.errno, e.index)
    """
    env = {"MPTIER_NATIVE": "0", native.FAULT_ENV: "load:1:13"}
    out = run_python(code, str(tmp_path), json.dumps(paths), env=env).stdout
    assert out.split() == ["python", "13", "1"]
    bad = run_python(code, str(tmp_path), json.dumps(paths), env={native.FAULT_ENV: "bogus"},
                     check=False)
    assert bad.returncode != 0 and native.FAULT_ENV in bad.stderr
    if native.HAS_NATIVE:
        out = run_python("from mptier import native; print(native.BACKEND)").stdout
        assert out.strip() == "native"


# --- the backends ----------------------------------------------------------------------

def test_get_backend():
    assert native.get_backend().name == native.BACKEND
    assert native.get_backend("python").name == "python"
    with pytest.raises(ValueError, match="unknown"):
        native.get_backend("fortran")
    if native.HAS_NATIVE:
        assert native.get_backend("native").name == "native"
        assert native.get_backend("native").resolver() in ("openat2", "walk")
    else:
        with pytest.raises(ImportError, match="not available"):
            native.get_backend("native")
    assert native.get_backend("python").resolver() == "walk"


def test_constants_are_one_set():
    flags = [native.O_DIRECT, native.CHECKSUM, native.TOUCH, native.TMPFILE,
             native.NO_OPENAT2, native.URING]
    assert sorted(flags) == [1, 2, 4, 8, 16, 32]
    statuses = [native.LOOKUP_ABSENT, native.LOOKUP_PRESENT, native.LOOKUP_SYMLINK,
                native.LOOKUP_BAD, native.LOOKUP_SHORT]
    assert sorted(statuses) == list(range(5))
    longest_suffix = f".{'z' * 16}.{2**64 - 1}.tmp"
    assert len(longest_suffix) == native.TEMP_SUFFIX_MAX_BYTES
    assert native.XATTR_NAME == "user.vllm.kv_crc32c"
    tag = native.new_tag()
    assert len(tag) == native.TAG_LEN and tag.isalnum() and tag == tag.lower()


def _scenario(io, root: Path) -> dict:
    """Everything observable from one fixed sequence of calls, with paths relative."""
    result: dict = {}

    def record(name, fn, *args, **kw):
        try:
            out = fn(*args, **kw)
            result[name] = "ok" if out is None else out
        except BatchIOError as e:
            result[name] = (e.errno, e.index, e.n_done,
                            os.path.relpath(e.filename, root), type(e).__name__)
            if fn == io.batch_load:  # slots from the failing block on are undefined
                for off in args[3][e.index:]:
                    args[2][off:off + args[4]] = 0xEE

    n = 6
    buf = aligned(2 * n * BLOCK + 5000 * 3 + 1, seed=42)
    paths = [f"blocks/{p}" for p in block_paths(n)]
    record("store", io.batch_store, root, paths, buf, offsets(range(n)), BLOCK, checksum=True)
    record("store unaligned", io.batch_store, root, [f"odd/{p}" for p in block_paths(3, "u")],
           buf, [2 * n * BLOCK + 1 + 5000 * i for i in range(3)], 5000)
    os.truncate(root / paths[3], 100)
    record("load short", io.batch_load, root, paths, buf, offsets(range(n, 2 * n)), BLOCK)
    os.remove(root / paths[5])
    record("load missing", io.batch_load, root, [paths[4], paths[5], paths[0]], buf,
           offsets([n, n + 1, n + 2]), BLOCK, o_direct=False)
    os.setxattr(root / paths[1], native.XATTR_NAME, b"\0\0\0\0")
    record("load bad record", io.batch_load, root, paths[:2], buf, offsets([n, n + 1]), BLOCK,
           checksum=True)
    (root / "file").write_bytes(b"x")
    record("store notdir", io.batch_store, root, ["file/a.bin"], buf, [0], BLOCK)
    os.mkfifo(root / "fifo.bin")
    os.symlink(root / paths[0], root / "link.bin")
    record("load fifo", io.batch_load, root, ["fifo.bin"], buf, [0], BLOCK)
    native.set_fault("store:0:28")
    record("store injected", io.batch_store, root, block_paths(2, "inj"), buf, [0, 1], BLOCK)
    native.set_fault(None)
    record("lookup", io.batch_lookup, root,
           [*paths, "file", "nope", "fifo.bin", "link.bin", "file/a.bin"], BLOCK)
    result["files"] = {k: hashlib.sha256(v).hexdigest() for k, v in files_under(root).items()}
    result["entries"] = sorted(os.path.relpath(os.path.join(d, x), root)
                               for d, dirs, names in os.walk(root) for x in dirs + names)
    result["buffer"] = hashlib.sha256(buf.tobytes()).hexdigest()
    return result


def test_backends_agree(tmp_path):
    results = {}
    variants = ["native", "native-walk", "python"]
    if native.HAS_NATIVE and native.get_backend("native").uring_available():
        variants.append("native-uring")
    for variant in variants:
        (tmp_path / variant).mkdir()
        results[variant] = _scenario(make_io(variant), tmp_path / variant)
    for variant in variants:
        assert results[variant] == results["python"], variant
    got = results["python"]
    assert got["load short"][0] == errno.ENODATA  # the scenario did hit its errors
    assert got["load bad record"][:3] == (errno.EBADMSG, 1, 1)
    assert got["load fifo"][0] == errno.EMEDIUMTYPE and got["store notdir"][0] == errno.ENOTDIR


def test_native_call_releases_the_gil(tmp_path):
    io = make_io("native")
    # Many small stores make one long C call; the main thread must keep running
    # beside it. With the GIL held, its longest pause would be the whole call.
    n = 800
    buf = np.zeros(n * 4096, np.uint8)
    paths = block_paths(n)
    worker = threading.Thread(target=io.batch_store,
                              args=(tmp_path, paths, buf, [i * 4096 for i in range(n)], 4096),
                              kwargs={"checksum": True})
    start = last = time.perf_counter()
    longest = 0.0
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    duration = last - start
    assert all((tmp_path / p).exists() for p in paths)
    assert duration > 0.02, "the batch was too quick to tell"
    assert longest < duration / 3, (longest, duration)

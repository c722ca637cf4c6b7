"""Publishing a block: O_TMPFILE or a named temporary file, the writer's tag in the name,
a temporary file that cannot be removed reported, atime set by TOUCH, and many writers
at once never exposing a partial file. Every backend and resolution path."""

from __future__ import annotations

import errno
import json
import os
import re
import threading
import time

import pytest
from native_support import (  # noqa: F401  (fixtures)
    BLOCK,
    aligned,
    block_paths,
    files_under,
    io_fixture,
    no_fault_fixture,
    offsets,
    run_with_shim,
    shim_fixture,
    temp_files,
    write_file,
)

from mptier import native
from mptier.errors import BatchIOError

TAG = "0a1b2c3d4e5f6g7h"
HOUR_NS = 3600 * 10**9

STORE_UNDER_SHIM = """
    import json, sys, warnings
    from native_support import IO, aligned
    from mptier.errors import BatchIOError
    io, root, paths = IO(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    tmpfile, tag = sys.argv[4] == "1", sys.argv[5]
    n = len(paths)
    buf = aligned(2 * n * 8192, seed=3)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            io.batch_store(root, paths, buf, [i * 8192 for i in range(n)], 8192,
                           tmpfile=tmpfile, tag=tag, checksum=True)
            io.batch_load(root, paths, buf, [(n + i) * 8192 for i in range(n)], 8192,
                          checksum=True)
            out["same"] = buf[: n * 8192].tobytes() == buf[n * 8192 :].tobytes()
        except BatchIOError as e:
            out["error"] = [e.errno, e.index, e.n_done]
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    print(json.dumps(out))
"""


def store_under_shim(shim_so, modes, tmp_path, io, paths, tmpfile, tag=TAG):
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    proc, hits, lines = run_with_shim(shim_so, modes, tmp_path / "shim.log", STORE_UNDER_SHIM,
                                      io.variant, str(root), json.dumps(paths),
                                      str(int(tmpfile)), tag)
    return root, json.loads(proc.stdout), hits, lines


def _ring_opens_unseen(io) -> None:
    if io.uring:
        pytest.skip("the io_uring path opens files inside the kernel (IORING_OP_OPENAT), "
                    "where an LD_PRELOAD shim cannot see or refuse them; its temporary "
                    "names are checked at publication (renameat is a libc call there)")


@pytest.mark.parametrize("tmpfile", [False, True], ids=["named", "tmpfile"])
def test_publishing_names_only_the_tagged_temp_or_none(io, tmp_path, shim, tmpfile):
    paths = block_paths(3)
    root, out, _, lines = store_under_shim(shim, "log,publish", tmp_path, io, paths, tmpfile)
    assert out == {"same": True, "warnings": []}
    # io_uring opens in the kernel, out of the shim's sight: there the temporary names
    # come from the renames that published them (a libc call in both paths)
    made_by = "rename " if io.uring else "excl "
    created = [line.split(" ")[1] for line in lines if line.startswith(made_by)]
    created = [c for c in created if ".mpt_probe." not in c]
    if tmpfile:  # nothing named ever existed: each block went through an unnamed file
        assert created == []
        assert len([line for line in lines if line.startswith("link ")]) == 3
        if not io.uring:
            assert len([line for line in lines if line.startswith("tmpfile ")]) == 3
    else:
        assert len(created) == 3
        for path, made in zip(paths, created):
            m = re.fullmatch(re.escape(f"{root}/{path}") + r"\.([0-9a-z]{16})\.(\d{1,20})\.tmp",
                             made)
            assert m and m.group(1) == TAG, made
    assert sorted(files_under(root)) == sorted(paths)
    assert temp_files(root) == []


def test_o_tmpfile_refused_falls_back_to_a_named_temp(io, tmp_path, shim):
    _ring_opens_unseen(io)  # test_native_uring.py refuses O_TMPFILE with a real fs
    paths = block_paths(3)
    root, out, hits, lines = store_under_shim(shim, "notmpfile,log", tmp_path, io, paths, True)
    assert out == {"same": True, "warnings": []}
    assert hits == 3  # each block tried O_TMPFILE first
    created = [line.split(" ", 1)[1] for line in lines if line.startswith("excl ")]
    assert [c.rsplit(".", 3)[0] for c in created] == [f"{root}/{p}" for p in paths]
    assert all(f".{TAG}." in c for c in created)
    assert sorted(files_under(root)) == sorted(paths) and temp_files(root) == []


def test_temp_file_that_cannot_be_removed_is_reported(io, tmp_path, shim):
    """The shim fails the rename (EIO) and then the temporary file's removal (EBUSY)."""
    paths = block_paths(2)
    root, out, _, _ = store_under_shim(shim, "untmp", tmp_path, io, paths, False)
    assert out["error"] == [errno.EIO, 0, 0]
    assert len(out["warnings"]) == 1 and out["warnings"][0].startswith("ResourceWarning")
    assert "could not be removed" in out["warnings"][0] and "EBUSY" in out["warnings"][0]
    left = temp_files(root)
    # the one the shim kept; with io_uring block 1's temporary was written meanwhile, and
    # its removal fails the same way (the loop never got to block 1)
    assert len(left) == (2 if io.uring else 1) and all(f".{TAG}." in x for x in left)
    for name in left:
        os.unlink(root / name)
    # the errno layer hands the same errno back to its caller (a worker logs it)
    code = """
        import json, sys
        from native_support import IO, aligned
        from mptier import native
        io, root, paths = IO(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
        fd = native.open_root(root)
        print(json.dumps(io.store(fd, [p.encode() for p in paths], aligned(2 * 8192),
                                  [0, 8192], 8192, 0, b"0123456789abcdef")))
    """
    proc, _, _ = run_with_shim(shim, "untmp", tmp_path / "shim2.log", code, io.variant,
                               str(root), json.dumps(paths))
    assert json.loads(proc.stdout) == [-errno.EIO, 0, 0, errno.EBUSY]
    for name in temp_files(root):
        os.unlink(root / name)


def test_longest_name_that_fits(io, tmp_path):
    fits = "f" * (255 - native.TEMP_SUFFIX_MAX_BYTES)
    # a final name NAME_MAX allows, whose temporary name cannot fit (counter of 1 digit)
    too_long = "t" * (256 - len(f".{TAG}.0.tmp"))
    buf = aligned(2 * BLOCK, seed=8)
    io.batch_store(tmp_path, [f"d/{fits}"], buf, [0], BLOCK, tag=TAG)
    assert (tmp_path / "d" / fits).stat().st_size == BLOCK
    with pytest.raises(BatchIOError) as info:
        io.batch_store(tmp_path, [f"d/{too_long}"], buf, [BLOCK], BLOCK, tag=TAG)
    assert info.value.errno == errno.ENAMETOOLONG
    assert sorted(os.listdir(tmp_path / "d")) == [fits]


def _age(path) -> None:
    """mtime two hours ago, atime one hour ago: a plain read leaves that atime alone on
    relatime mounts, so only an explicit touch moves it to now."""
    now = time.time_ns()
    os.utime(path, ns=(now - HOUR_NS, now - 2 * HOUR_NS))


def test_touch_sets_atime_on_load_and_on_a_found_block(io, tmp_path):
    paths = block_paths(2)
    buf = aligned(4 * BLOCK, seed=9)
    io.batch_store(tmp_path, paths, buf, offsets(range(2)), BLOCK)
    for p in paths:
        _age(tmp_path / p)
    before = [os.stat(tmp_path / p) for p in paths]

    io.batch_store(tmp_path, paths[:1], buf, [0], BLOCK)  # found, not touched
    assert os.stat(tmp_path / paths[0]).st_atime_ns == before[0].st_atime_ns

    start = time.time_ns() - 10**9  # the file system's clock may run a tick behind
    io.batch_load(tmp_path, paths[:1], buf, [2 * BLOCK], BLOCK, touch=True)
    io.batch_store(tmp_path, paths[1:], buf, [BLOCK], BLOCK, touch=True)
    for p, old in zip(paths, before):
        st = os.stat(tmp_path / p)
        assert st.st_atime_ns >= start > old.st_atime_ns, p
        assert st.st_mtime_ns == old.st_mtime_ns  # the content's age is kept
    assert bytes(buf[2 * BLOCK : 3 * BLOCK]) == bytes(buf[:BLOCK])


def test_failed_load_does_not_touch(io, tmp_path):
    buf = aligned(2 * BLOCK, seed=10)
    write_file(tmp_path / "long.bin", bytes(BLOCK + 1))
    _age(tmp_path / "long.bin")
    old = os.stat(tmp_path / "long.bin").st_atime_ns
    with pytest.raises(BatchIOError):
        io.batch_load(tmp_path, ["long.bin"], buf, [BLOCK], BLOCK, touch=True)
    assert os.stat(tmp_path / "long.bin").st_atime_ns == old


@pytest.mark.parametrize("tmpfile", [False, True], ids=["named", "tmpfile"])
def test_threads_storing_the_same_keys_never_show_a_partial_file(io, tmp_path, tmpfile):
    n, writers, rounds = 24, 6, 3
    paths = block_paths(n)
    src = aligned(n * BLOCK, seed=12)
    expect = [bytes(src[i * BLOCK : (i + 1) * BLOCK]) for i in range(n)]
    problems: list = []
    done = threading.Event()

    def writer(k: int) -> None:
        try:
            for r in range(rounds):
                order = list(range(n))[k % n :] + list(range(n))[: k % n]  # collide
                io.batch_store(tmp_path, [paths[i] for i in order], src,
                               offsets(order), BLOCK, checksum=True, tmpfile=tmpfile,
                               tag=native.new_tag())
                if r < rounds - 1 and k == 0:  # remove some, so stores race again
                    for p in paths[::3]:
                        os.unlink(tmp_path / p)
        except Exception as e:  # reported below
            problems.append(("writer", k, repr(e)))

    def reader() -> None:
        slot = aligned(BLOCK)
        while not done.is_set():
            for i, p in enumerate(paths):
                try:
                    io.batch_load(tmp_path, [p], slot, [0], BLOCK, checksum=True)
                except BatchIOError as e:
                    if e.errno != errno.ENOENT:
                        problems.append(("reader", i, e.errno))
                    continue
                if bytes(slot) != expect[i]:
                    problems.append(("reader", i, "wrong bytes"))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(writers)]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers + threads:
        t.start()
    for t in threads:
        t.join(120)
    done.set()
    for t in readers:
        t.join(120)
    assert problems == []
    assert {p: (tmp_path / p).read_bytes() for p in paths} == dict(zip(paths, expect))
    assert temp_files(tmp_path) == []

"""The C core's io_uring path (flag ``URING``): several blocks in flight, the loop's results.

The suites of test_native*.py already run every rule on the "native-uring" variant beside
the loop and the pure twin. Here: what only the ring path has -- blocks really in flight at
once (seen from a FUSE file system's side), kernel refusals that happen *inside* the ring
(a FUSE file system failing one operation, a ramfs refusing O_DIRECT, O_TMPFILE refused),
each compared with the loop and the twin on the same file system; batches longer than the
ring; a forked child and several threads, each with a ring of its own; no descriptor left
behind; and the cases that take the loop (one block, overlapping load slots, NO_OPENAT2).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import threading

import pytest
from native_support import (  # noqa: F401  (fixtures)
    BLOCK,
    aligned,
    assert_shim_child_passed,
    block_paths,
    descriptors,
    files_under,
    make_io,
    no_fault_fixture,
    offsets,
    run_python,
    run_with_shim,
    shim_fixture,
    temp_files,
)

from mptier import native
from mptier.errors import BatchIOError


@pytest.fixture(name="ring")
def ring_fixture():
    """The native-uring variant (skipped, saying why, where io_uring is refused)."""
    return make_io("native-uring")


def _variants() -> list:
    """The loop, the ring and the twin, each of which must give the same answers."""
    return [make_io(v) for v in ("native", "native-uring", "python")]


def _outcome(fn, *args, **kw):
    try:
        fn(*args, **kw)
        return "ok"
    except BatchIOError as e:
        return [e.errno, e.index, e.n_done]


def _ring_fds() -> int:
    return sum(t == "anon_inode:[io_uring]" for t in descriptors().values())


# -- in flight at once --------------------------------------------------------------------

def test_blocks_are_in_flight_at_once(ring, make_fuse_fs, tmp_path):
    """Reads of every block park in the FUSE daemon at the same moment: the ring put
    them all at the file system before the first one finished. The loop, given the same
    parked file system, never has more than one there."""
    fs = make_fuse_fs()
    n = 4
    buf = aligned(2 * n * BLOCK, seed=21)
    paths = block_paths(n)
    ring.batch_store(fs.mountpoint, paths, buf, offsets(range(n)), BLOCK, o_direct=False)
    for io, expect in ((ring, n), (make_io("native"), 1)):
        rule = fs.block("read", "*.bin")
        done: list = []
        reader = threading.Thread(target=lambda io=io, done=done: done.append(_outcome(
            io.batch_load, fs.mountpoint, paths, buf, offsets(range(n, 2 * n)), BLOCK,
            o_direct=False)))
        reader.start()
        try:
            fs.wait_blocked(rule, count=expect)
            if expect == 1:  # the loop: nothing else reaches the file system meanwhile
                for _ in range(20):
                    threading.Event().wait(0.01)
                    assert rule.waiting == 1
        finally:
            rule.release()
            reader.join(30)
        assert done == ["ok"] and bytes(buf[n * BLOCK:]) == bytes(buf[:n * BLOCK])


# -- refusals inside the ring, against the loop and the twin ----------------------------

_FUSE_CASES = {
    # name: (op, FUSE operations failed, errno, which block's files)
    "load: read fails": ("load", ["read"], errno.EIO, 2),
    "load: open fails": ("load", ["open"], errno.EACCES, 1),
    "store: temp create fails": ("store", ["create"], errno.ENOSPC, 1),
    "store: write fails": ("store", ["write"], errno.EIO, 2),
    "store: rename fails": ("store", ["rename"], errno.EIO, 1),
    "store: folder fails": ("store", ["mkdir"], errno.EDQUOT, 2),
}


@pytest.mark.parametrize("case", list(_FUSE_CASES))
def test_a_refusal_inside_the_ring_ends_the_batch_as_the_loop_does(case, make_fuse_fs):
    """A real file system (FUSE) refuses one operation of one block: the ring, the loop
    and the twin report the same errno, index and prefix, leave the same files and no
    temporary one. (FUSE has no O_TMPFILE: the stores also take the named fallback.)"""
    op, ops, err, victim = _FUSE_CASES[case]
    fs = make_fuse_fs()
    n = 5
    results = {}
    for io in _variants():
        root = fs.path(io.variant)
        root.mkdir()
        buf = aligned(2 * n * BLOCK, seed=22)
        paths = block_paths(n, io.variant)  # its own names: rules match one block only
        if op == "load":
            io.batch_store(root, paths, buf, offsets(range(n)), BLOCK, o_direct=False)
        leaf = os.path.basename(paths[victim])
        folder = os.path.dirname(paths[victim])
        pattern = f"*/{folder}" if ops == ["mkdir"] else f"*{leaf}*"
        rule = fs.fail(ops, err, pattern)
        try:
            if op == "load":
                got = _outcome(io.batch_load, root, paths, buf, offsets(range(n, 2 * n)),
                               BLOCK, o_direct=False, checksum=True)
                same = bytes(buf[n * BLOCK:(n + victim) * BLOCK]) == \
                    bytes(buf[:victim * BLOCK])
            else:
                got = _outcome(io.batch_store, root, paths, buf, offsets(range(n)), BLOCK,
                               o_direct=False, tmpfile=True, checksum=True)
                same = True
        finally:
            rule.release()
        published = sorted(paths.index(p) for p in files_under(root))
        results[io.variant] = (got, same, published, temp_files(root))
    expected = results["python"]
    assert expected[0] == [err, victim, victim], expected
    if op == "store":
        assert expected[2] == list(range(victim))  # nothing after the failing block
    for variant, got in results.items():
        assert got == expected, variant


def _in_ramfs(code: str, *args: str):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a ramfs privately")
    import tempfile
    mnt = tempfile.mkdtemp(prefix="mptier-ramfs-")
    try:
        proc = run_python(code, mnt, *args, prefix=[
            "unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t ramfs none "$0" && exec "$@"', mnt], check=False)
        if proc.returncode != 0 and "mount" in proc.stderr and "Traceback" not in proc.stderr:
            pytest.skip(f"cannot mount a ramfs here: {proc.stderr.strip()}")
        assert proc.returncode == 0, proc.stderr
        assert os.listdir(mnt) == []  # the mount was the child's alone
        return json.loads(proc.stdout)
    finally:
        os.rmdir(mnt)


def test_o_direct_refused_inside_the_ring_goes_buffered(ring):
    """ramfs refuses O_DIRECT at open (EINVAL) -- for the ring's O_TMPFILE, named and
    read opens alike: every block is redone buffered, as the loop does, and the
    results are the loop's."""
    out = _in_ramfs("""
        import json, os, sys
        from native_support import IO, aligned, block_paths, files_under
        root = sys.argv[1]
        res = {}
        for variant in ("native", "native-uring", "python"):
            io = IO(variant)
            folder = os.path.join(root, variant)
            os.mkdir(folder)
            buf = aligned(12 * 8192, seed=23)
            paths = block_paths(6)
            io.batch_store(folder, paths, buf, [i * 8192 for i in range(6)], 8192,
                           o_direct=True, tmpfile=True)
            io.batch_load(folder, paths, buf, [(6 + i) * 8192 for i in range(6)], 8192,
                          o_direct=True)
            res[variant] = [buf[:6 * 8192].tobytes() == buf[6 * 8192:].tobytes(),
                            sorted(files_under(folder)) == sorted(paths)]
        print(json.dumps(res))
    """)
    assert out == {v: [True, True] for v in ("native", "native-uring", "python")}


# -- long batches, processes, threads, descriptors ------------------------------------

def test_a_lookup_s_keys_reach_the_file_system_together(ring, make_fuse_fs):
    """A lookup's opens are in the ring at once: the FUSE daemon holds the lookups of
    every key at the same moment (a cold key is a read or two of metadata on a disk, one
    after another in the loop). The loop, on the same parked file system, has one
    there at a time, and so has the ring's lookup with LOOP_LOOKUP (``ring_lookups =
    false``). All answer every key."""
    fs = make_fuse_fs()
    n = 4
    paths = block_paths(n)
    ring.batch_store(fs.mountpoint, paths, aligned(n * BLOCK, seed=23), offsets(range(n)),
                     BLOCK, o_direct=False)

    def raw(flags):
        def lookup():
            fd = os.open(fs.mountpoint, os.O_RDONLY | os.O_DIRECTORY)
            try:
                encoded = [p.encode() for p in paths]
                return list(ring.backend.lookup(fd, encoded, BLOCK, flags))
            finally:
                os.close(fd)
        return lookup

    for lookup, expect in ((raw(native.URING), n),
                           (raw(native.URING | native.LOOP_LOOKUP), 1),
                           (lambda: make_io("native").batch_lookup(fs.mountpoint, paths,
                                                                   BLOCK), 1)):
        rule = fs.block("getattr", "*.bin")
        answers: list = []
        looker = threading.Thread(target=lambda lookup=lookup, answers=answers:
                                  answers.append(lookup()))
        looker.start()
        try:
            fs.wait_blocked(rule, count=expect)
            if expect == 1:
                for _ in range(20):
                    threading.Event().wait(0.01)
                    assert rule.waiting == 1
        finally:
            rule.release()
            looker.join(30)
        assert answers == [[native.LOOKUP_PRESENT] * n]


def test_a_lookup_longer_than_the_ring_answers_as_the_loop_does(tmp_path):
    """80 keys, more than the ring holds, every kind of entry among them: the ring, the
    loop and the twin give the same answers, and each removes the symlinks (at a leaf,
    at a folder) as the loop does; no descriptor is left open."""
    n = 80
    paths = block_paths(n)
    kinds = ["present", "absent", "short", "folder", "long", "leaf link", "folder link"]
    answers = {}
    for io in _variants():
        if io.uring and not io.backend.uring_available():
            pytest.skip(io.backend.uring_status())
        root = tmp_path / io.variant
        root.mkdir()
        buf = aligned(n * BLOCK, seed=27)
        present = [p for i, p in enumerate(paths) if kinds[i % len(kinds)] == "present"]
        io.batch_store(root, present, buf, offsets(range(len(present))), BLOCK)
        for i, p in enumerate(paths):
            kind, where = kinds[i % len(kinds)], root / p
            if kind in ("short", "long", "folder", "leaf link"):
                where.parent.mkdir(parents=True, exist_ok=True)
            if kind in ("short", "long"):
                where.write_bytes(b"x" * (BLOCK // 2 if kind == "short" else BLOCK + 1))
            elif kind == "folder":
                where.mkdir()
            elif kind == "leaf link":
                os.symlink(root / present[0], where)
            elif kind == "folder link":
                where.parent.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(root, where.parent)
        before = len(descriptors())
        answers[io.variant] = io.batch_lookup(root, paths, BLOCK)
        assert len(descriptors()) == before
        links = [p for i, p in enumerate(paths) if kinds[i % len(kinds)].endswith("link")]
        assert not any(os.path.islink(root / p) or os.path.islink((root / p).parent)
                       for p in links), io.variant
    assert answers["native-uring"] == answers["native"] == answers["python"]
    assert {kinds[i % len(kinds)]: a for i, a in enumerate(answers["native"])} == {
        "present": native.LOOKUP_PRESENT, "absent": native.LOOKUP_ABSENT,
        "short": native.LOOKUP_SHORT, "folder": native.LOOKUP_BAD,
        "long": native.LOOKUP_BAD, "leaf link": native.LOOKUP_SYMLINK,
        "folder link": native.LOOKUP_SYMLINK}


def test_batch_longer_than_the_ring(ring, tmp_path):
    n = 100  # the ring holds 32 blocks at a time: slots are reused as blocks finish
    buf = aligned(2 * n * BLOCK, seed=24)
    paths = block_paths(n)
    ring.batch_store(tmp_path, paths, buf, offsets(range(n)), BLOCK, checksum=True,
                     tmpfile=True)
    assert sorted(files_under(tmp_path)) == sorted(paths)
    os.remove(tmp_path / paths[70])
    with pytest.raises(BatchIOError) as info:
        ring.batch_load(tmp_path, paths, buf, offsets(range(n, 2 * n)), BLOCK, checksum=True)
    assert (info.value.errno, info.value.index, info.value.n_done) == (errno.ENOENT, 70, 70)
    assert bytes(buf[n * BLOCK:(n + 70) * BLOCK]) == bytes(buf[:70 * BLOCK])
    ring.batch_store(tmp_path, paths, buf, offsets(range(n)), BLOCK)  # heals block 70
    buf[n * BLOCK:] = 0
    ring.batch_load(tmp_path, paths, buf, offsets(range(n, 2 * n)), BLOCK, checksum=True)
    assert bytes(buf[n * BLOCK:]) == bytes(buf[:n * BLOCK])


def test_the_ring_path_is_taken_and_the_loop_where_it_must(ring, tmp_path):
    """In a fresh process: a URING batch makes this thread's ring (an io_uring file
    descriptor appears); one-block batches, NO_OPENAT2 and loads into overlapping slots
    run the loop (none appears) -- with the loop's results."""
    out = run_python("""
        import json, os, sys
        from native_support import IO, aligned, block_paths
        from test_native_uring import _ring_fds
        root = sys.argv[1]
        ring, walk = IO("native-uring"), IO("native-walk")
        buf = aligned(8 * 8192, seed=25)
        paths = block_paths(3)
        seen = [_ring_fds()]
        ring.batch_store(root, paths[:1], buf, [0], 8192)            # one block: loop
        ring.batch_store(root, paths, buf, [0, 8192, 16384], 8192, no_openat2=True)
        buf[5 * 8192:] = 0
        ring.batch_load(root, [paths[0], paths[1]], buf, [5 * 8192, 5 * 8192], 8192)
        same_slot = buf[5 * 8192:6 * 8192].tobytes() == buf[8192:2 * 8192].tobytes()
        seen.append(_ring_fds())
        ring.batch_load(root, paths, buf, [3 * 8192, 4 * 8192, 5 * 8192], 8192)
        seen.append(_ring_fds())
        ring.batch_load(root, paths, buf, [3 * 8192, 4 * 8192, 5 * 8192], 8192)
        seen.append(_ring_fds())  # one ring per thread, kept
        print(json.dumps([seen, same_slot,
                          buf[:3 * 8192].tobytes() == buf[3 * 8192:6 * 8192].tobytes()]))
    """, str(tmp_path))
    assert json.loads(out.stdout) == [[0, 0, 1, 1], True, True]


def test_forked_child_and_threads_each_get_a_ring(ring, tmp_path):
    n = 8
    buf = aligned(2 * n * BLOCK, seed=26)
    paths = block_paths(n)
    ring.batch_store(tmp_path, paths, buf, offsets(range(n)), BLOCK)  # the parent's ring
    pid = os.fork()
    if pid == 0:  # the child inherits the parent's ring: it must not use it
        code = 1
        try:
            child = aligned(2 * n * BLOCK, seed=26)
            ring.batch_load(tmp_path, paths, child, offsets(range(n, 2 * n)), BLOCK)
            ring.batch_store(tmp_path, block_paths(n, "child"), child, offsets(range(n)),
                             BLOCK)
            code = 0 if bytes(child[n * BLOCK:]) == bytes(child[:n * BLOCK]) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(files_under(tmp_path)) == 2 * n
    errors: list = []

    def worker(k: int) -> None:
        try:
            mine = aligned(2 * n * BLOCK, seed=27 + k)
            names = block_paths(n, f"t{k}")
            for _ in range(5):
                ring.batch_store(tmp_path, names, mine, offsets(range(n)), BLOCK,
                                 checksum=True)
                ring.batch_load(tmp_path, names, mine, offsets(range(n, 2 * n)), BLOCK,
                                checksum=True)
                assert bytes(mine[n * BLOCK:]) == bytes(mine[:n * BLOCK])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    ring.batch_load(tmp_path, paths, buf, offsets(range(n, 2 * n)), BLOCK)  # still works
    assert bytes(buf[n * BLOCK:]) == bytes(buf[:n * BLOCK])


def test_failed_batches_leave_no_descriptor_or_temporary_file(ring, tmp_path):
    n = 40
    buf = aligned(2 * n * BLOCK, seed=28)
    paths = block_paths(n)
    ring.batch_store(tmp_path, paths, buf, offsets(range(n)), BLOCK, checksum=True)
    ring.batch_load(tmp_path, paths, buf, offsets(range(n, 2 * n)), BLOCK)  # ring made
    os.truncate(tmp_path / paths[10], 10)   # short: removed, ENODATA
    os.remove(tmp_path / paths[20])         # missing
    (tmp_path / "file").write_bytes(b"x")   # a file where a folder must be
    # The descriptor table is the process's, and other threads of a test worker open and
    # close their own meanwhile: conftest's pid sampler holds /proc/<pid>/task (or a
    # task's children file) open for a moment every 0.1 s, at the lowest free number,
    # next to the batches' own (twice in CI: open in the listing before, gone after). So:
    # no descriptor under tmp_path or of a ring may be new (a leak), and sentinels --
    # descriptors this test owns and the batches do not, next to theirs in number --
    # must be the same after.
    sentinels = [os.pipe() for _ in range(4)]
    try:
        before = descriptors()
        for _ in range(3):
            with pytest.raises(BatchIOError):
                ring.batch_load(tmp_path, paths, buf, offsets(range(n, 2 * n)), BLOCK,
                                checksum=True)
            with pytest.raises(BatchIOError):
                ring.batch_store(tmp_path, [*block_paths(5, "x"), "file/a.bin",
                                            *block_paths(30, "y")], buf,
                                 offsets(range(36)), BLOCK, tmpfile=False)
        after = descriptors()
        here = os.path.realpath(tmp_path)
        assert {fd: t for fd, t in after.items() if fd not in before and (
            t == "anon_inode:[io_uring]" or t == here or t.startswith(here + "/"))} == {}
        for fd in (fd for pair in sentinels for fd in pair):
            assert after.get(fd) == before[fd], (fd, before[fd], after.get(fd))
        os.write(sentinels[0][1], b"still open")
        assert os.read(sentinels[0][0], 16) == b"still open"
    finally:
        for fd in (fd for pair in sentinels for fd in pair):
            with contextlib.suppress(OSError):
                os.close(fd)
    assert temp_files(tmp_path) == []
    assert not any(p in files_under(tmp_path) for p in block_paths(30, "y"))
    assert ring.batch_lookup(tmp_path, [paths[10], paths[20]], BLOCK) == [
        native.LOOKUP_ABSENT, native.LOOKUP_ABSENT]


def test_a_ring_that_fails_mid_batch_hands_nothing_to_the_next(ring, shim, tmp_path):
    """io_uring_enter failing (the kernel out of memory for it) at any point of a batch
    that also fails on its own: the batch fails, the thread takes the loop from then on,
    and its later batches store and load every block right. Before, a failure while the
    failed batch waited out its requests left them in the ring, and the next batch took
    their completions for its own blocks: a folder's mkdir result 0 taken for a
    descriptor closed the process's descriptor 0. Each try runs on a new thread (a ring
    of its own), with stdin and more pipes as sentinels. (``ring``: skipped where
    io_uring is refused.)"""
    proc, hits, _ = run_with_shim(shim, "", tmp_path / "shim.log", """
        import ctypes, os, sys
        from native_support import (BLOCK, aligned, run_attempts_and_exit, block_paths,
                                    closed_sentinels, make_io, offsets)
        from mptier.errors import BatchIOError
        root, tries = sys.argv[1], int(sys.argv[2])
        HUNG_S = 10  # a try takes milliseconds
        arm = ctypes.CDLL(None).shim_fail_enter_after
        r, w = os.pipe(); os.dup2(r, 0); os.close(r)  # descriptor 0: a sentinel pipe
        sentinels = [0, w, *(fd for _ in range(4) for fd in os.pipe())]
        owned = {fd: os.fstat(fd).st_ino for fd in sentinels}
        io, n = make_io("native-uring"), 40
        with open(os.path.join(root, "file"), "wb") as f:
            f.write(b"x")  # a file where the failing batch needs a folder
        wrong = []

        def attempt(k):
            buf = aligned(2 * n * BLOCK, seed=k)
            arm(k)  # the k-th io_uring_enter from here fails
            try:
                io.batch_store(root, [*block_paths(5, f"x{k}-"), "file/a.bin",
                                      *block_paths(30, f"y{k}-")], buf, offsets(range(36)),
                               BLOCK, tmpfile=False)
                wrong.append((k, "the failing batch succeeded"))
            except BatchIOError:
                pass
            arm(0)
            names = block_paths(n, f"z{k}-")
            try:
                io.batch_store(root, names, buf, offsets(range(n)), BLOCK, checksum=True)
                io.batch_load(root, names, buf, offsets(range(n, 2 * n)), BLOCK,
                              checksum=True)
                if bytes(buf[n * BLOCK:]) != bytes(buf[:n * BLOCK]):
                    wrong.append((k, "loaded bytes differ"))
            except BatchIOError as exc:
                wrong.append((k, f"a later batch failed: {exc}"))
            for fd in closed_sentinels(owned):
                wrong.append((k, f"descriptor {fd} of the process was closed"))

        run_attempts_and_exit(attempt, tries, HUNG_S, wrong)
    """, str(tmp_path), "48", check=False)
    assert_shim_child_passed(proc, hits, 30)


def test_a_lookup_near_the_descriptor_limit_answers_as_the_loop_does(ring, tmp_path):
    """With only a few descriptors to spare, the ring's opens of a 64-key lookup fail
    with EMFILE; those keys are redone one at a time, so every present key still
    answers PRESENT (before: 50 of 64 answered ABSENT), as the loop's do."""
    out = run_python("""
        import json, os, resource, sys
        from native_support import BLOCK, aligned, block_paths, make_io, offsets
        root = sys.argv[1]
        ring, loop = make_io("native-uring"), make_io("native")
        names = block_paths(64)
        ring.batch_store(root, names, aligned(64 * BLOCK, seed=9), offsets(range(64)), BLOCK)
        ring.batch_lookup(root, names[:2], BLOCK)  # the thread's ring, made now
        fds = os.listdir("/proc/self/fd")
        top = max(int(fd) for fd in fds)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1 + 6, hard))
        answers = [ring.batch_lookup(root, names, BLOCK), loop.batch_lookup(root, names, BLOCK)]
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        print(json.dumps(answers))
    """, str(tmp_path))
    ring_answers, loop_answers = json.loads(out.stdout)
    assert ring_answers == loop_answers == [native.LOOKUP_PRESENT] * 64


def test_a_ring_that_fails_mid_lookup_still_answers_every_key(ring, shim, tmp_path):
    """io_uring_enter failing at any point of a lookup: every key is still answered
    right (the ring's opens are waited out, the rest answered by the loop), no
    descriptor the ring handed back is left open or closes one of the process's, and
    the thread's later lookups answer right."""
    proc, hits, _ = run_with_shim(shim, "", tmp_path / "shim.log", """
        import ctypes, os, sys
        from native_support import (BLOCK, aligned, run_attempts_and_exit, block_paths,
                                    closed_sentinels, descriptors, make_io, offsets)
        from mptier import native
        root, tries = sys.argv[1], int(sys.argv[2])
        HUNG_S = 10  # a try takes milliseconds
        arm = ctypes.CDLL(None).shim_fail_enter_after
        io, n = make_io("native-uring"), 40
        names = block_paths(n)
        io.batch_store(root, names[::2], aligned(n * BLOCK, seed=5), offsets(range(n // 2)),
                       BLOCK)
        want = [native.LOOKUP_PRESENT, native.LOOKUP_ABSENT] * (n // 2)
        sentinels = [fd for _ in range(4) for fd in os.pipe()]
        owned = {fd: os.fstat(fd).st_ino for fd in sentinels}
        wrong = []

        def files():  # the thread's own ring is made at its first lookup, and kept
            return sorted(t for t in descriptors().values() if t != "anon_inode:[io_uring]")

        def attempt(k):
            before = files()
            arm(k)  # the k-th io_uring_enter from here fails
            got = io.batch_lookup(root, names, BLOCK)
            arm(0)
            if got != want:
                wrong.append((k, "wrong answers", got))
            if io.batch_lookup(root, names, BLOCK) != want:
                wrong.append((k, "a later lookup answered wrong"))
            if files() != before:
                wrong.append((k, "descriptors left open", files()))
            for fd in closed_sentinels(owned):
                wrong.append((k, f"descriptor {fd} of the process was closed"))

        run_attempts_and_exit(attempt, tries, HUNG_S, wrong)
    """, str(tmp_path), "6", check=False)
    assert_shim_child_passed(proc, hits, 2)


def test_a_ring_that_keeps_failing_is_waited_out_before_the_batch_returns(ring, shim,
                                                                          tmp_path):
    """io_uring_enter failing many times in a row, past the drain's quick retries
    (MPT_DRAIN_TRIES), while a batch's reads are in the ring: the batch fails, but only
    once every request it put in the ring has ended -- a read still in flight when the
    caller hears of the batch could land in memory the caller hands out again (a bounce
    slot, an engine's slot). Before, the drain gave up after its retries and returned
    with the requests still in the ring. The failures left over say which: the batch
    that waits them out uses them all. Later batches on the thread take the loop and
    load every block right."""
    proc, hits, _ = run_with_shim(shim, "", tmp_path / "shim.log", """
        import ctypes, os, sys
        from native_support import (BLOCK, aligned, run_attempts_and_exit, block_paths,
                                    make_io, offsets)
        from mptier.errors import BatchIOError
        root, tries, streak = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        HUNG_S = 20  # a try takes well under a second
        shim = ctypes.CDLL(None)
        io, n = make_io("native-uring"), 24
        names = block_paths(n, "a-")
        source = aligned(2 * n * BLOCK, seed=7)
        io.batch_store(root, names, source, offsets(range(n)), BLOCK, checksum=True)
        wrong = []

        def attempt(k):
            buf = aligned(2 * n * BLOCK, seed=k)
            shim.shim_fail_enters(k, streak)  # the k-th enter from here and those after
            try:
                io.batch_load(root, names, buf, offsets(range(n)), BLOCK, checksum=True)
                wrong.append((k, "the batch succeeded through failing enters"))
            except BatchIOError:
                pass
            left = shim.shim_enter_failures_left()
            shim.shim_fail_enters(0, 0)
            if left:
                wrong.append((k, f"the batch returned with {left} of {streak} failing "
                                 "enters still to come: its requests were in the ring"))
            try:
                io.batch_load(root, names, buf, offsets(range(n, 2 * n)), BLOCK,
                              checksum=True)
                if bytes(buf[n * BLOCK:]) != bytes(source[:n * BLOCK]):
                    wrong.append((k, "a later batch loaded wrong bytes"))
            except BatchIOError as exc:
                wrong.append((k, f"a later batch failed: {exc}"))

        run_attempts_and_exit(attempt, tries, HUNG_S, wrong)
    """, str(tmp_path), "4", "30", check=False)
    assert_shim_child_passed(proc, hits, 4 * 30)


# -- the tier ---------------------------------------------------------------------------

@pytest.mark.parametrize("uring", [True, False], ids=["io_uring", "loop"])
def test_tier_reports_only_the_prefix_of_a_failed_load(ring, tmp_path, uring):
    """With the ring, blocks after a missing one are read while the task runs; the job
    still reports exactly the blocks before it as loaded."""
    import numpy as np

    from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key

    block = 16 << 10
    n = 8
    keys = [make_key(os.urandom(32), 0) for _ in range(n)]
    with SharedKVBuffer.create(2 * n, block) as buf, \
            FileSystemTier(buf, root_dir=str(tmp_path), n_load_workers=1,
                           n_store_workers=1, io_uring=uring, prefault=False) as tier:
        assert tier.stats()["io_uring"] is uring
        buf.view[:n] = np.random.default_rng(29).integers(0, 256, (n, block), np.uint8)
        tier.submit_store(TransferJob(1, keys, list(range(n))))
        tier.drain_jobs()
        assert [r.success for r in tier.get_finished_jobs()] == [True]
        os.unlink(tier.mapper.path_for(keys[3]))
        tier.submit_load(TransferJob(2, keys, list(range(n, 2 * n))))
        tier.drain_jobs()
        (result,) = tier.get_finished_jobs()
        assert (result.success, result.errno) == (False, errno.ENOENT)
        assert result.successful_keys == tuple(keys[:3])
        assert result.transfer_bytes == 3 * block
        assert np.array_equal(buf.view[n:n + 3], buf.view[:3])

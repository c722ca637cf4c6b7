"""Tests of mptier.native, the batch block I/O layer, run against both backends.

The ``io`` fixture yields the "native" and the "python" backend in turn; the native run
is skipped (saying why) only when the compiled core is not built. CI runs as root, so
permission errors are injected (MPTIER_FAULT_ERRNO / set_fault) rather than made with
chmod; O_DIRECT refusals are made by an LD_PRELOAD shim compiled on the spot.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mptier import native
from mptier.errors import BatchIOError

BLOCK = 8192  # two pages: aligned blocks take the O_DIRECT path
ALIGN = 4096
SRC_ROOT = str(Path(native.__file__).resolve().parents[2])  # for child interpreters


@pytest.fixture(params=["native", "python"])
def io(request):
    try:
        return native.get_backend(request.param)
    except ImportError as e:
        pytest.skip(str(e))


@pytest.fixture(autouse=True)
def _no_fault():
    native.set_fault(None)
    yield
    native.set_fault(None)


def aligned(nbytes: int, seed: int | None = None) -> np.ndarray:
    """A 4096-aligned uint8 array, random if ``seed`` is given, else zeros."""
    raw = np.zeros(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    arr = raw[start : start + nbytes]
    if seed is not None:
        arr[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return arr


def block_paths(root, n: int, tag: str = "") -> list[str]:
    """Paths shaped like the real layout: <root>/<h[:3]>/<h[3:5]>_g0/<h>.bin."""
    out = []
    for i in range(n):
        h = hashlib.sha256(f"{tag}{i}".encode()).hexdigest()
        out.append(os.path.join(root, h[:3], f"{h[3:5]}_g0", f"{h}.bin"))
    return out


def offsets(slots) -> list[int]:
    return [s * BLOCK for s in slots]


def files_under(root) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, root)] = f.read()
    return out


def temp_files(root) -> list[str]:
    return [p for p in files_under(root) if p.endswith(".tmp")]


def run_python(code: str, *args: str, env: dict[str, str] | None = None,
               check: bool = True) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.pop(native.FAULT_ENV, None)
    full_env.pop(native.NATIVE_ENV, None)  # CI runs the suite again with MPTIER_NATIVE=0
    full_env["PYTHONPATH"] = os.pathsep.join(
        [SRC_ROOT, *filter(None, [full_env.get("PYTHONPATH")])])
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          env=full_env, capture_output=True, text=True, timeout=60)
    if check:
        assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


# --- round trips ---------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 2, 5, 64])
def test_round_trip_into_other_slots(io, tmp_path, n):
    buf = aligned(2 * max(n, 1) * BLOCK, seed=n)
    original = buf.copy()
    paths = block_paths(tmp_path / "root", n)
    io.batch_store(paths, buf, offsets(range(n)), BLOCK)
    io.batch_load(paths, buf, offsets(range(2 * n - 1, n - 1, -1)), BLOCK)  # reversed
    for i in range(n):
        slot = 2 * n - 1 - i
        assert bytes(buf[slot * BLOCK : (slot + 1) * BLOCK]) == bytes(
            original[i * BLOCK : (i + 1) * BLOCK]), f"block {i}"
        with open(paths[i], "rb") as f:
            assert f.read() == bytes(original[i * BLOCK : (i + 1) * BLOCK])
    assert len(files_under(tmp_path)) == n
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("block_bytes, first", [(5000, 1), (BLOCK, 512), (ALIGN, 100)])
def test_unaligned_offsets_round_trip(io, tmp_path, block_bytes, first):
    n = 4
    buf = aligned(first + 2 * n * block_bytes, seed=7)
    src = [first + i * block_bytes for i in range(n)]
    dst = [first + (n + i) * block_bytes for i in range(n)]
    expect = [bytes(buf[o : o + block_bytes]) for o in src]
    paths = block_paths(tmp_path, n)
    io.batch_store(paths, buf, src, block_bytes)
    io.batch_load(paths, buf, dst, block_bytes)
    assert [bytes(buf[o : o + block_bytes]) for o in dst] == expect
    assert all(os.path.getsize(p) == block_bytes for p in paths)


def test_buffered_round_trip_with_o_direct_off(io, tmp_path):
    buf = aligned(8 * BLOCK, seed=3)
    paths = block_paths(tmp_path, 4)
    io.batch_store(paths, buf, offsets(range(4)), BLOCK, use_o_direct=False)
    io.batch_load(paths, buf, offsets(range(4, 8)), BLOCK, use_o_direct=False)
    assert bytes(buf[: 4 * BLOCK]) == bytes(buf[4 * BLOCK :])


@pytest.mark.parametrize("kind", ["bytearray", "mmap", "ctypes", "memoryview", "float16-2d"])
def test_any_writable_buffer_and_release_after(io, tmp_path, kind):
    import ctypes

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
    paths = block_paths(tmp_path, 2)
    io.batch_store(paths, buf, [0, BLOCK], BLOCK)
    io.batch_load(paths, buf, [3 * BLOCK, 2 * BLOCK], BLOCK)
    assert flat[3 * BLOCK :] == flat[:BLOCK]
    assert flat[2 * BLOCK : 3 * BLOCK] == flat[BLOCK : 2 * BLOCK]
    flat.release()
    # Nothing may keep the buffer exported after a call returns.
    if kind == "bytearray":
        buf.extend(b"x")
    elif kind == "mmap":
        buf.close()


# --- store semantics -----------------------------------------------------------------

def test_store_skips_existing_file_untouched(io, tmp_path):
    paths = block_paths(tmp_path, 3)
    os.makedirs(os.path.dirname(paths[1]))
    with open(paths[1], "wb") as f:
        f.write(b"old" * 10)
    os.utime(paths[1], ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    before = os.stat(paths[1])
    buf = aligned(3 * BLOCK, seed=1)
    io.batch_store(paths, buf, offsets(range(3)), BLOCK)
    after = os.stat(paths[1])
    with open(paths[1], "rb") as f:
        assert f.read() == b"old" * 10
    assert (after.st_mtime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ino)
    assert os.path.getsize(paths[0]) == os.path.getsize(paths[2]) == BLOCK


def test_store_creates_missing_root(io, tmp_path):
    root = tmp_path / "not" / "yet" / "there"
    paths = block_paths(root, 3)
    io.batch_store(paths, aligned(3 * BLOCK, seed=2), offsets(range(3)), BLOCK)
    assert all(os.path.getsize(p) == BLOCK for p in paths)


def test_unusable_root_names_the_path(io, tmp_path):
    root = tmp_path / "root"
    root.write_bytes(b"a file where a directory should be")
    paths = block_paths(root, 2)
    buf = aligned(2 * BLOCK, seed=4)
    with pytest.raises(BatchIOError) as info:
        io.batch_store(paths, buf, offsets(range(2)), BLOCK)
    e = info.value
    assert (e.errno, e.index, e.n_succeeded, e.filename) == (errno.ENOTDIR, 0, 0, paths[0])
    assert paths[0] in str(e) and "not a directory" in str(e).lower()
    with pytest.raises(BatchIOError) as info:
        io.batch_load(paths, buf, offsets(range(2)), BLOCK)
    assert (info.value.errno, info.value.filename) == (errno.ENOTDIR, paths[0])
    assert root.read_bytes() == b"a file where a directory should be"
    assert sorted(os.listdir(tmp_path)) == ["root"]
    assert io.batch_exists(paths) == [False, False]
    assert io.probe_o_direct(root) is False


WRITER = """
    import json, mmap, random, sys
    from mptier import native
    io, paths, seed = native.get_backend(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    buf = mmap.mmap(-1, len(paths) * 8192)  # page-aligned: the O_DIRECT path
    buf[:] = random.Random(seed).randbytes(len(buf))
    print("ready", flush=True)
    sys.stdin.readline()  # all writers start together
    io.batch_store(paths, buf, [i * 8192 for i in range(len(paths))], 8192)
"""


def test_processes_storing_same_keys_publish_whole_files(io, tmp_path):
    n, writers, seed = 32, 3, 11
    paths = block_paths(tmp_path, n)
    expect = np.frombuffer(random.Random(seed).randbytes(n * BLOCK), np.uint8)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [SRC_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop(native.FAULT_ENV, None)
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), io.name,
                               json.dumps(paths), str(seed)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
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
                    io.batch_load([path], slot, [0], BLOCK)
                except BatchIOError as e:
                    if e.errno != errno.ENOENT:
                        seen_partial.append((i, e.errno))
                    continue
                if bytes(slot) != bytes(expect[i * BLOCK : (i + 1) * BLOCK]):
                    seen_partial.append((i, "wrong bytes"))
    finally:
        for p in procs:
            if p.poll() is None and p.stdin.closed is False:
                p.stdin.close()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
    assert [p.returncode for p in procs] == [0] * writers
    assert seen_partial == []
    for i, path in enumerate(paths):
        with open(path, "rb") as f:
            assert f.read() == bytes(expect[i * BLOCK : (i + 1) * BLOCK])
    assert temp_files(tmp_path) == []
    assert len(files_under(tmp_path)) == n


def test_failed_write_removes_temp_file(io, tmp_path):
    # A real mid-write failure: the file-size limit lets 4096 bytes through (a short
    # write), then the next write fails with EFBIG.
    paths = block_paths(tmp_path, 3)
    os.makedirs(os.path.dirname(paths[0]))
    Path(paths[0]).write_bytes(b"already stored")
    code = """
        import json, mmap, resource, signal, sys
        from mptier import native
        from mptier.errors import BatchIOError
        backend, paths, direct = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        buf = mmap.mmap(-1, 3 * 16384)
        try:
            native.get_backend(backend).batch_store(
                paths, buf, [0, 16384, 32768], 16384, use_o_direct=direct)
        except BatchIOError as e:
            print(json.dumps([e.errno, e.index, e.n_succeeded, e.filename]))
    """
    for direct in ("1", "0"):
        out = run_python(code, io.name, json.dumps(paths), direct).stdout
        assert json.loads(out) == [errno.EFBIG, 1, 1, paths[1]], direct
        assert temp_files(tmp_path) == []
        assert not os.path.exists(paths[1]) and not os.path.exists(paths[2])


# --- load semantics ------------------------------------------------------------------

def test_short_file_is_deleted_and_reported(io, tmp_path):
    n = 4
    buf = aligned(2 * n * BLOCK, seed=5)
    paths = block_paths(tmp_path, n)
    io.batch_store(paths, buf, offsets(range(n)), BLOCK)
    os.truncate(paths[2], BLOCK // 2)
    buf[n * BLOCK :] = 0xAB
    with pytest.raises(BatchIOError) as info:
        io.batch_load(paths, buf, offsets(range(n, 2 * n)), BLOCK)
    e = info.value
    assert (e.errno, e.index, e.n_succeeded, e.path, e.filename) == (
        errno.ENODATA, 2, 2, paths[2], paths[2])
    assert paths[2] in str(e)
    assert not os.path.exists(paths[2])
    assert os.path.exists(paths[3])
    assert bytes(buf[n * BLOCK : (n + 2) * BLOCK]) == bytes(buf[: 2 * BLOCK])
    assert set(buf[(n + 3) * BLOCK :].tolist()) == {0xAB}  # block 3 never attempted


def test_missing_file_fails_only_from_that_block_on(io, tmp_path):
    n = 4
    buf = aligned(2 * n * BLOCK, seed=6)
    paths = block_paths(tmp_path, n)
    io.batch_store(paths, buf, offsets(range(n)), BLOCK)
    os.remove(paths[1])
    buf[n * BLOCK :] = 0xCD
    with pytest.raises(BatchIOError) as info:
        io.batch_load(paths, buf, offsets(range(n, 2 * n)), BLOCK)
    e = info.value
    assert (e.errno, e.index, e.n_succeeded, e.filename) == (errno.ENOENT, 1, 1, paths[1])
    assert bytes(buf[n * BLOCK : (n + 1) * BLOCK]) == bytes(buf[:BLOCK])
    assert set(buf[(n + 1) * BLOCK :].tolist()) == {0xCD}
    assert all(os.path.exists(p) for p in (paths[0], paths[2], paths[3]))


def test_symlink_loop_fails_load_and_stays(io, tmp_path):
    paths = block_paths(tmp_path, 2)
    buf = aligned(4 * BLOCK, seed=8)
    io.batch_store(paths[:1], buf, [0], BLOCK)
    os.makedirs(os.path.dirname(paths[1]), exist_ok=True)
    other = paths[1] + ".other"
    os.symlink(other, paths[1])
    os.symlink(paths[1], other)
    with pytest.raises(BatchIOError) as info:
        io.batch_load(paths, buf, offsets([2, 3]), BLOCK)
    e = info.value
    assert (e.errno, e.index, e.n_succeeded, e.filename) == (errno.ELOOP, 1, 1, paths[1])
    assert os.path.islink(paths[1]) and os.readlink(paths[1]) == other
    assert bytes(buf[2 * BLOCK : 3 * BLOCK]) == bytes(buf[:BLOCK])
    assert io.batch_exists(paths) == [True, False]


def test_batch_exists_mixed(io, tmp_path):
    paths = block_paths(tmp_path, 5)
    io.batch_store([paths[0], paths[3]], aligned(2 * BLOCK), [0, BLOCK], BLOCK)
    os.makedirs(paths[4])  # a directory exists too
    assert io.batch_exists(paths) == [True, False, False, True, True]
    assert io.batch_exists([]) == []
    assert io.batch_exists([str(tmp_path / "missing" / "deeper.bin")]) == [False]


# --- O_DIRECT ------------------------------------------------------------------------

def test_probe_o_direct_leaves_nothing(io, tmp_path):
    result = io.probe_o_direct(tmp_path)
    assert isinstance(result, bool)
    assert io.probe_o_direct(tmp_path) is result
    assert os.listdir(tmp_path) == []
    assert io.probe_o_direct(tmp_path / "missing") is False
    assert not (tmp_path / "missing").exists()


SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

/* SHIM_MODE=open: an O_DIRECT open fails with EINVAL (after creating the file, as the
 *                 kernel may); SHIM_MODE=io: read/write/readv on an O_DIRECT fd fail
 *                 with EINVAL; SHIM_MODE=log: O_CREAT|O_EXCL opens are logged.
 * SHIM_LOG receives "excl <path>" lines and "hits <n>" (refusals) at exit. */
static int mode;
static long hits;

static int is_direct(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    return fl >= 0 && (fl & O_DIRECT);
}

static void note(const char *what, const char *text)
{
    const char *log = getenv("SHIM_LOG");
    int (*real_open)(const char *, int, ...) = dlsym(RTLD_NEXT, "open");
    char line[8192];
    int fd, len;
    if (log == NULL)
        return;
    len = snprintf(line, sizeof line, "%s %s\n", what, text);
    fd = real_open(log, O_WRONLY | O_APPEND | O_CREAT, 0644);
    if (fd >= 0) {
        if (write(fd, line, (size_t)len) < 0) {}
        close(fd);
    }
}

__attribute__((constructor)) static void shim_init(void)
{
    const char *m = getenv("SHIM_MODE");
    mode = m == NULL ? 0 : !strcmp(m, "open") ? 1 : !strcmp(m, "io") ? 2
         : !strcmp(m, "log") ? 3 : 0;
}

__attribute__((destructor)) static void shim_fini(void)
{
    char n[32];
    snprintf(n, sizeof n, "%ld", hits);
    note("hits", n);
}

static int shim_open(const char *sym, const char *path, int flags, mode_t m)
{
    int (*real)(const char *, int, ...) = dlsym(RTLD_NEXT, sym);
    if (mode == 1 && (flags & O_DIRECT)) {
        __atomic_add_fetch(&hits, 1, __ATOMIC_RELAXED);
        if (flags & O_CREAT) {
            int fd = real(path, flags & ~O_DIRECT, m);
            if (fd < 0)
                return -1;
            close(fd);
        }
        errno = EINVAL;
        return -1;
    }
    if (mode == 3 && (flags & O_CREAT) && (flags & O_EXCL))
        note("excl", path);
    return real(path, flags, m);
}

#define OPEN_WRAPPER(name)                                  \
    int name(const char *path, int flags, ...)              \
    {                                                       \
        mode_t m = 0;                                       \
        if (flags & O_CREAT) {                              \
            va_list ap;                                     \
            va_start(ap, flags);                            \
            m = (mode_t)va_arg(ap, unsigned int);           \
            va_end(ap);                                     \
        }                                                   \
        return shim_open(#name, path, flags, m);            \
    }
OPEN_WRAPPER(open)
OPEN_WRAPPER(open64)

static int refuse(int fd)
{
    if (mode == 2 && is_direct(fd)) {
        __atomic_add_fetch(&hits, 1, __ATOMIC_RELAXED);
        errno = EINVAL;
        return 1;
    }
    return 0;
}

ssize_t write(int fd, const void *buf, size_t n)
{
    static ssize_t (*real)(int, const void *, size_t);
    if (real == NULL)
        real = dlsym(RTLD_NEXT, "write");
    return refuse(fd) ? -1 : real(fd, buf, n);
}

ssize_t read(int fd, void *buf, size_t n)
{
    static ssize_t (*real)(int, void *, size_t);
    if (real == NULL)
        real = dlsym(RTLD_NEXT, "read");
    return refuse(fd) ? -1 : real(fd, buf, n);
}

ssize_t readv(int fd, const struct iovec *iov, int cnt)
{
    static ssize_t (*real)(int, const struct iovec *, int);
    if (real == NULL)
        real = dlsym(RTLD_NEXT, "readv");
    return refuse(fd) ? -1 : real(fd, iov, cnt);
}
"""


@pytest.fixture(scope="session")
def o_direct_shim(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the LD_PRELOAD shim")
    d = tmp_path_factory.mktemp("shim")
    (d / "shim.c").write_text(SHIM_C)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "shim.so"), str(d / "shim.c"),
                    "-ldl"], check=True, capture_output=True)
    return str(d / "shim.so")


def run_with_shim(shim: str, mode: str, log: Path, code: str, *args: str):
    proc = run_python(code, *args, env={"LD_PRELOAD": shim, "SHIM_MODE": mode,
                                        "SHIM_LOG": str(log)})
    lines = log.read_text().splitlines()
    hits = [int(x.split()[1]) for x in lines if x.startswith("hits ")]
    return proc, hits[-1], [x[5:] for x in lines if x.startswith("excl ")]


@pytest.mark.parametrize("mode", ["open", "io"])
def test_o_direct_einval_falls_back_to_buffered(io, tmp_path, o_direct_shim, mode):
    if io.probe_o_direct(tmp_path) is False:
        pytest.skip(f"O_DIRECT does not work in {tmp_path} anyway")
    root = tmp_path / "root"
    paths = block_paths(root, 4)
    code = """
        import json, mmap, os, sys
        from mptier import native
        io, paths, root = native.get_backend(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
        buf = mmap.mmap(-1, 8 * 8192)  # page-aligned: every block is O_DIRECT-eligible
        buf[: 4 * 8192] = os.urandom(4 * 8192)
        io.batch_store(paths, buf, [0, 8192, 16384, 24576], 8192)
        io.batch_load(paths, buf, [57344, 49152, 40960, 32768], 8192)
        same = all(buf[i * 8192 : (i + 1) * 8192] == buf[(7 - i) * 8192 : (8 - i) * 8192]
                   for i in range(4))
        print(json.dumps({"same": same, "probe": io.probe_o_direct(root)}))
    """
    proc, hits, _ = run_with_shim(o_direct_shim, mode, tmp_path / "shim.log", code,
                                  io.name, json.dumps(paths), str(root))
    assert json.loads(proc.stdout) == {"same": True, "probe": False}
    assert hits >= 8  # every block's O_DIRECT attempt was refused, and the probe's
    assert all(os.path.getsize(p) == BLOCK for p in paths)
    assert temp_files(root) == []
    assert [n for n in os.listdir(root) if n.startswith(".")] == []  # no probe file


def test_temp_name_carries_pid_and_thread(io, tmp_path, o_direct_shim):
    paths = block_paths(tmp_path / "root", 2)
    code = """
        import json, os, sys, threading
        from mptier import native
        io, paths = native.get_backend(sys.argv[1]), json.loads(sys.argv[2])
        buf = bytearray(2 * 8192)
        io.batch_store(paths[:1], buf, [0], 8192)
        t = threading.Thread(target=io.batch_store, args=(paths[1:], buf, [8192], 8192))
        t.start()
        t.join()
        print(os.getpid(), t.native_id)
    """
    proc, _, created = run_with_shim(o_direct_shim, "log", tmp_path / "shim.log", code,
                                     io.name, json.dumps(paths))
    pid, thread_tid = map(int, proc.stdout.split())
    seen: dict[str, set] = {}  # a first try may fail (ENOENT) and be retried
    for path in created:
        m = re.fullmatch(r"(.*)\.(\d+)\.(\d+)\.(\d+)\.tmp", path)
        assert m, path
        seen.setdefault(m.group(1), set()).add((int(m.group(2)), int(m.group(3))))
    assert seen == {paths[0]: {(pid, pid)}, paths[1]: {(pid, thread_tid)}}
    assert thread_tid != pid


# --- validation ----------------------------------------------------------------------

def _bad_args(case: str, root):
    paths = block_paths(root, 2)
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
])
def test_bad_arguments_raise_before_any_io(io, tmp_path, op, case, message):
    root = tmp_path / "root"
    paths, buf, offs, bb = _bad_args(case, root)
    if op == "batch_load":  # files exist, so a load that ran would change the buffer
        io.batch_store(block_paths(root, 2), aligned(2 * BLOCK, seed=9), [0, BLOCK], BLOCK)
    before = files_under(tmp_path)
    snapshot = np.array(buf, copy=True) if isinstance(buf, np.ndarray) else bytes(buf)
    with pytest.raises(ValueError, match=message):
        getattr(io, op)(paths, buf, offs, bb)
    assert files_under(tmp_path) == before
    assert np.array_equal(buf, snapshot) if isinstance(buf, np.ndarray) else buf == snapshot


# --- fault injection -----------------------------------------------------------------

def test_injected_store_fault(io, tmp_path):
    paths = block_paths(tmp_path, 3)
    native.set_fault(f"store:1:{errno.EACCES}")
    with pytest.raises(BatchIOError) as info:
        io.batch_store(paths, aligned(3 * BLOCK, seed=1), offsets(range(3)), BLOCK)
    e = info.value
    assert (e.errno, e.index, e.n_succeeded, e.filename) == (errno.EACCES, 1, 1, paths[1])
    assert "injected" in str(e)
    assert [os.path.exists(p) for p in paths] == [True, False, False]
    assert temp_files(tmp_path) == []
    io.batch_store(paths[:1], aligned(BLOCK), [0], BLOCK)  # shorter batch: unaffected
    native.set_fault(None)
    io.batch_store(paths, aligned(3 * BLOCK, seed=1), offsets(range(3)), BLOCK)
    assert all(os.path.exists(p) for p in paths)


def test_injected_load_fault(io, tmp_path):
    paths = block_paths(tmp_path, 4)
    buf = aligned(8 * BLOCK, seed=2)
    io.batch_store(paths, buf, offsets(range(4)), BLOCK)
    buf[4 * BLOCK :] = 0xEE
    native.set_fault("load:2:EIO")
    with pytest.raises(BatchIOError) as info:
        io.batch_load(paths, buf, offsets(range(4, 8)), BLOCK)
    e = info.value
    assert (e.errno, e.index, e.n_succeeded, e.filename) == (errno.EIO, 2, 2, paths[2])
    assert bytes(buf[4 * BLOCK : 6 * BLOCK]) == bytes(buf[: 2 * BLOCK])
    assert set(buf[6 * BLOCK :].tolist()) == {0xEE}
    assert all(os.path.exists(p) for p in paths)  # an injected error deletes nothing


@pytest.mark.parametrize("spec", ["load", "load:1", "read:1:5", "load:-1:5", "load:x:5",
                                  "load:1:0", "load:1:ENOTANERRNO"])
def test_malformed_fault_spec(spec):
    with pytest.raises(ValueError, match=native.FAULT_ENV):
        native.set_fault(spec)


def test_environment_picks_backend_and_fault(tmp_path):
    paths = block_paths(tmp_path, 2)
    native.get_backend("python").batch_store(paths, aligned(2 * BLOCK), [0, BLOCK], BLOCK)
    code = """
        import json, sys
        from mptier import native
        from mptier.errors import BatchIOError
        try:
            native.batch_load(json.loads(sys.argv[1]), bytearray(16384), [0, 8192], 8192)
        except BatchIOError as e:
            print(native.BACKEND, e.errno, e.index)
    """
    env = {"MPTIER_NATIVE": "0", native.FAULT_ENV: "load:1:13"}
    assert run_python(code, json.dumps(paths), env=env).stdout.split() == ["python", "13", "1"]
    bad = run_python(code, json.dumps(paths), env={native.FAULT_ENV: "bogus"}, check=False)
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
    else:
        with pytest.raises(ImportError, match="not available"):
            native.get_backend("native")


def _scenario(io, root: Path) -> dict:
    """Everything observable from one fixed sequence of calls, with paths relative."""
    result: dict = {}

    def record(name, fn, *args, **kw):
        try:
            fn(*args, **kw)
            result[name] = "ok"
        except BatchIOError as e:
            result[name] = (e.errno, e.index, e.n_succeeded,
                            os.path.relpath(e.filename, root), type(e).__name__)

    n = 6
    buf = aligned(2 * n * BLOCK + 5000 * 3 + 1, seed=42)
    paths = block_paths(root / "blocks", n)
    record("store", io.batch_store, paths, buf, offsets(range(n)), BLOCK)
    record("store unaligned", io.batch_store, block_paths(root / "odd", 3, "u"), buf,
           [2 * n * BLOCK + 1 + 5000 * i for i in range(3)], 5000)
    os.truncate(paths[3], 100)
    record("load short", io.batch_load, paths, buf, offsets(range(n, 2 * n)), BLOCK)
    os.remove(paths[5])
    record("load missing", io.batch_load, [paths[4], paths[5], paths[0]], buf,
           offsets([n, n + 1, n + 2]), BLOCK, use_o_direct=False)
    (root / "file").write_bytes(b"x")
    record("store notdir", io.batch_store, [str(root / "file" / "a.bin")], buf, [0], BLOCK)
    native.set_fault("store:0:28")
    record("store injected", io.batch_store, block_paths(root / "inj", 2), buf, [0, 1], BLOCK)
    native.set_fault(None)
    result["exists"] = io.batch_exists([*paths, str(root / "file"), str(root / "nope")])
    result["files"] = {k: hashlib.sha256(v).hexdigest() for k, v in files_under(root).items()}
    result["buffer"] = hashlib.sha256(buf.tobytes()).hexdigest()
    return result


def test_backends_agree(tmp_path):
    if not native.HAS_NATIVE:
        pytest.skip(f"mptier native backend is not available ({native.NATIVE_IMPORT_ERROR})")
    results = {}
    for name in ("native", "python"):
        (tmp_path / name).mkdir()
        results[name] = _scenario(native.get_backend(name), tmp_path / name)
    assert results["native"] == results["python"]
    assert results["python"]["load short"][0] == errno.ENODATA  # the scenario hit errors


def test_native_call_releases_the_gil(tmp_path):
    try:
        io = native.get_backend("native")
    except ImportError as e:
        pytest.skip(str(e))
    # Many small stores make one long C call; the main thread must keep running
    # beside it. With the GIL held, its longest pause would be the whole call.
    n = 800
    buf = np.zeros(n * 4096, np.uint8)
    paths = block_paths(tmp_path, n)
    worker = threading.Thread(target=io.batch_store,
                              args=(paths, buf, [i * 4096 for i in range(n)], 4096))
    start = last = time.perf_counter()
    longest = 0.0
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    duration = last - start
    assert all(os.path.exists(p) for p in paths)
    assert duration > 0.02, "the batch was too quick to tell"
    assert longest < duration / 3, (longest, duration)

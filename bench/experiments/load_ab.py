"""Two builds of the native core side by side (ctypes): loads of the same blocks with
mpt_batch_load_via (bounce) and mpt_batch_load (direct), O_DIRECT + checksums + io_uring,
interleaved rounds. Build each as a plain shared library first, e.g.
``gcc -O2 -shared -fPIC -o /tmp/perfwork/libnew.so mptier/native/*.c -lpthread`` (and the
old sources from ``git show main:...`` into /tmp/perfwork/old/libold.so).

    python bench/experiments/load_ab.py 2M 4 128 6     # block size, blocks per call, blocks, rounds
"""

import ctypes
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

from mptier import native
from mptier.config import parse_bytes
from mptier.native import _checks

bb = parse_bytes(sys.argv[1])
task = int(sys.argv[2])
n = int(sys.argv[3])
rounds = int(sys.argv[4])
libs = {
    "old": ctypes.CDLL("/tmp/perfwork/old/libold.so"),
    "new": ctypes.CDLL("/tmp/perfwork/libnew.so"),
}
be = native.get_backend("native")
folder = tempfile.mkdtemp(dir="/var/tmp", prefix="ab-")
rootfd = native.open_root(folder)
src = mmap.mmap(-1, n * bb)
sv = memoryview(src)
for i in range(0, n * bb, 4096):
    src[i] = (i // 4096) % 251
paths = [f"{i:03x}/{i:02x}_g0/{i:064x}.bin".encode() for i in range(n)]
flags = _checks.flags(True, True, True, True, False, True)
tag = _checks.tag(None)
for s in range(0, n, task):
    assert (
        be.store(
            rootfd,
            paths[s : s + task],
            sv,
            [i * bb for i in range(s, min(n, s + task))],
            bb,
            flags,
            tag,
        )[0]
        == 0
    )
dst = mmap.mmap(-1, n * bb)
dst[:] = bytes(n * bb)
dptr = ctypes.addressof(ctypes.c_char.from_buffer(dst))
bounce = mmap.mmap(-1, 16 << 20)
bounce[:] = bytes(16 << 20)
bptr = ctypes.addressof(ctypes.c_char.from_buffer(bounce))
blobs = []
for s in range(0, n, task):
    ps = paths[s : s + task]
    blob = b"".join(p + b"\0" for p in ps)
    offs = (ctypes.c_uint64 * len(ps))(*[i * bb for i in range(s, s + len(ps))])
    blobs.append((blob, len(ps), offs))


def drop():
    for p in paths:
        fd = os.open(os.path.join(folder, p.decode()), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def run(lib, via):
    nd = ctypes.c_size_t()
    fi = ctypes.c_size_t()
    for blob, k, offs in blobs:
        if via:
            rc = lib.mpt_batch_load_via(
                rootfd,
                blob,
                ctypes.c_size_t(k),
                ctypes.c_void_p(dptr),
                ctypes.c_size_t(n * bb),
                offs,
                ctypes.c_size_t(bb),
                flags,
                ctypes.c_void_p(bptr),
                ctypes.c_size_t((16 << 20) // bb),
                ctypes.byref(nd),
                ctypes.byref(fi),
            )
        else:
            rc = lib.mpt_batch_load(
                rootfd,
                blob,
                ctypes.c_size_t(k),
                ctypes.c_void_p(dptr),
                ctypes.c_size_t(n * bb),
                offs,
                ctypes.c_size_t(bb),
                flags,
                ctypes.byref(nd),
                ctypes.byref(fi),
            )
        assert rc == 0, rc


ways = [(lib, v) for v in (1, 0) for lib in ("old", "new")]
res = {w: [] for w in ways}
for r in range(rounds):
    for w in ways if r % 2 == 0 else ways[::-1]:
        drop()
        c0 = time.thread_time()
        t0 = time.perf_counter()
        run(libs[w[0]], w[1])
        t = time.perf_counter() - t0
        c = time.thread_time() - c0
        res[w].append((n * bb / t / 1e9, c / (n * bb / 1e9)))
        assert dst[bb * 3 + 8192] == src[bb * 3 + 8192]
for w, v in res.items():
    print(
        f"{bb >> 10}K x{task} {w[0]} {'bounce' if w[1] else 'direct'}"
        f"  GB/s {statistics.median(x[0] for x in v):.2f}"
        f"  cpu s/GB {statistics.median(x[1] for x in v):.3f}  {[round(x[0], 2) for x in v]}"
    )
os.close(rootfd)
shutil.rmtree(folder)

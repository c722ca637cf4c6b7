"""CPU per GB of reading 256 MiB of blocks from /var/tmp four ways, one block at a time,
cold page cache every round: O_DIRECT, buffered, buffered with RWF_DONTCACHE (preadv2),
buffered with POSIX_FADV_DONTNEED after each block.

    python bench/experiments/read_ways.py 2097152
"""

import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

bb = int(sys.argv[1])
n = (256 << 20) // bb
d = tempfile.mkdtemp(dir="/var/tmp", prefix="dc-")
src = os.urandom(bb)
paths = [f"{d}/b{i}" for i in range(n)]
for p in paths:
    with open(p, "wb") as f:
        f.write(src)
os.sync()
m = mmap.mmap(-1, bb)
m[:] = bytes(bb)
mv = memoryview(m)
RWF_DONTCACHE = 0x80


def drop():
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def run(way):
    for p in paths:
        fl = os.O_RDONLY | (os.O_DIRECT if way == "direct" else 0)
        fd = os.open(p, fl)
        if way == "dontcache":
            got = os.preadv(fd, [mv], 0, RWF_DONTCACHE)
        else:
            got = os.preadv(fd, [mv], 0)
        if way == "fadvise":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        assert got == bb


res = {w: [] for w in ("direct", "buffered", "dontcache", "fadvise")}
for r in range(4):
    for w in list(res) if r % 2 == 0 else list(res)[::-1]:
        drop()
        c0 = time.thread_time()
        t0 = time.perf_counter()
        run(w)
        t = time.perf_counter() - t0
        c = time.thread_time() - c0
        res[w].append((n * bb / t / 1e9, c / (n * bb / 1e9)))
for w, v in res.items():
    print(
        f"{bb >> 10}K {w:10s} GB/s {statistics.median(x[0] for x in v):.2f}"
        f"  cpu s/GB {statistics.median(x[1] for x in v):.3f}"
    )
shutil.rmtree(d)

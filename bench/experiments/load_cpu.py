"""Wall time and thread CPU time per GB of worker-like native loads, several ways side by
side (interleaved rounds, odd ones reversed): O_DIRECT into the slots ("direct"), through
a bounce buffer ("bounce"), buffered ("buffered"), each with checksums or without
("-nocrc") and with the atime touch or without ("-notouch"). Stores the blocks first, in
the tier's layout; evicts them from the page cache before every round.

    python bench/experiments/load_cpu.py --root /var/tmp --block-bytes 2M --blocks 128 --task 4
    python bench/experiments/load_cpu.py --root /dev/shm --uring 0 --ways direct,direct-nocrc
"""

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time

from mptier import native
from mptier.config import parse_bytes
from mptier.native import _checks
from mptier.workers.bounce import Bounce

ap = argparse.ArgumentParser()
ap.add_argument("--root", default="/var/tmp")
ap.add_argument("--block-bytes", default="2M")
ap.add_argument("--blocks", type=int, default=256)
ap.add_argument("--task", type=int, default=4)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--ways", default="direct,bounce,bounce-nocrc,direct-nocrc")
ap.add_argument("--uring", type=int, default=1)
ap.add_argument("--store-ways", default="")
a = ap.parse_args()
bb = parse_bytes(a.block_bytes)
n = a.blocks
be = native.get_backend()
folder = tempfile.mkdtemp(dir=a.root, prefix="micro-")
rootfd = native.open_root(folder)
buf = mmap.mmap(-1, n * bb)
mem = memoryview(buf)
for i in range(0, n * bb, 4096):
    buf[i] = (i // 4096) % 251
paths = [f"{i:03x}/{i:02x}_g0/{i:064x}.bin".encode() for i in range(n)]
offs = [i * bb for i in range(n)]
tag = _checks.tag(None)


def fl(direct=True, crc=True, uring=bool(a.uring), touch=True):
    return _checks.flags(direct, crc, touch, True, False, uring)


t0 = time.perf_counter()
for s in range(0, n, a.task):
    rc, d, ix, te = be.store(
        rootfd, paths[s : s + a.task], mem, offs[s : s + a.task], bb, fl(), tag
    )
    assert rc == 0, rc
print(f"stored {n}x{bb} in {time.perf_counter() - t0:.2f}s")
dst = mmap.mmap(-1, n * bb)
dmem = memoryview(dst)
dmem[:] = bytes(len(dmem))
bounce = Bounce(bb)


def drop():
    for p in paths:
        fd = os.open(os.path.join(folder, p.decode()), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def way(name):
    crc = "nocrc" not in name
    direct = "buffered" not in name
    f = fl(direct=direct, crc=crc, touch="notouch" not in name)
    for s in range(0, n, a.task):
        if name.startswith("bounce"):
            rc, d, ix = bounce.load(
                be, rootfd, paths[s : s + a.task], dmem, offs[s : s + a.task], f
            )
        else:
            rc, d, ix = be.load(rootfd, paths[s : s + a.task], dmem, offs[s : s + a.task], bb, f)
        assert rc == 0, (name, rc, d, ix)


res = {w: [] for w in a.ways.split(",")}
for r in range(a.rounds):
    order = list(res) if r % 2 == 0 else list(res)[::-1]
    for w in order:
        drop()
        c0 = time.thread_time()
        t0 = time.perf_counter()
        way(w)
        t = time.perf_counter() - t0
        c = time.thread_time() - c0
        res[w].append((n * bb / t / 1e9, c / (n * bb / 1e9)))
        assert dmem[bb * 7 + 4096 * 3] == buf[bb * 7 + 4096 * 3]
for w, v in res.items():
    print(
        f"{w:14s} GB/s {statistics.median(x[0] for x in v):6.2f}"
        f"  cpu s/GB {statistics.median(x[1] for x in v):6.3f}"
        f"  rounds {[round(x[0], 2) for x in v]}"
    )
os.close(rootfd)
shutil.rmtree(folder)

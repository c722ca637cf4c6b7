"""One thread's CPU per block of 256 KiB loads from tmpfs: the native core's batch load
(16-block batches, as a task) with and without checksums and the atime touch, against a
Python loop of open + preadv + close (the copy and the three system calls every reader
pays). Thread CPU time, 7 interleaved rounds, medians.

    python bench/experiments/load_micro.py --root /dev/shm --ways py,core,core-nocrc
"""

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time

from mptier import native
from mptier.native import _checks

ap = argparse.ArgumentParser()
ap.add_argument("--root", default="/dev/shm")
ap.add_argument("--block", type=int, default=256 << 10)
ap.add_argument("--blocks", type=int, default=4096)
ap.add_argument("--ways", default="py,core,core-nocrc,core-nocrc-notouch")
a = ap.parse_args()
bb, n, task = a.block, a.blocks, 16
be = native.get_backend()
folder = tempfile.mkdtemp(dir=a.root, prefix="load-micro-")
root_fd = native.open_root(folder)
src = mmap.mmap(-1, n * bb)
for i in range(0, n * bb, 4096):
    src[i] = (i // 4096) % 251
paths = [f"{h[:3]}/{h[3:5]}_g0/{h}.bin".encode()
         for h in (os.urandom(32).hex() for _ in range(n))]
offsets = [i * bb for i in range(n)]
tag = _checks.tag(None)
for s in range(0, n, task):
    rc, *_ = be.store(root_fd, paths[s:s + task], memoryview(src), offsets[s:s + task], bb,
                      _checks.flags(True, True, True, True, False, False), tag)
    assert rc == 0, rc
dst = mmap.mmap(-1, n * bb)
dst[:] = b"\1" * (n * bb)  # mapped: no first touch in the rounds
dmem = memoryview(dst)
ways = a.ways.split(",")
results = {way: [] for way in ways}
for rnd in range(7):
    for way in (ways if rnd % 2 == 0 else ways[::-1]):
        flags = _checks.flags(True, "nocrc" not in way, "notouch" not in way, True, False,
                              False)
        c0 = time.thread_time()
        if way == "py":
            for i in range(n):
                fd = os.open(f"{folder}/{paths[i].decode()}", os.O_RDONLY)
                os.preadv(fd, [dmem[i * bb:(i + 1) * bb]], 0)
                os.close(fd)
        else:
            for s in range(0, n, task):
                rc, _, _ = be.load(root_fd, paths[s:s + task], dmem, offsets[s:s + task], bb,
                                   flags)
                assert rc == 0, rc
        results[way].append((time.thread_time() - c0) / (n * bb / 1e9))
os.close(root_fd)
shutil.rmtree(folder)
for way, values in results.items():
    m = statistics.median(values)
    print(f"{way:20s} CPU {m:.4f} s/GB = {m * bb / 1e9 * 1e6:5.1f} us a block")

"""Loads or stores through a real tier as the bench's light scheduler drives one (16-block
jobs, 16 in flight, an optional lookup of every key first), ways interleaved in rounds
(odd ones reversed): GB/s, and CPU seconds per GB of the worker processes and of this
(the engine's) process, from psutil. The destination half of the buffer is written
before the tiers start, as an engine's buffer is, so no load pays a first touch.

    python bench/experiments/tier_loop.py --root /dev/shm --blocks 8192 --ways crc,nocrc
    python bench/experiments/tier_loop.py --op store --blocks 4096 --ways crc
"""

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile

import psutil
from tier_jobs import drive

from mptier import FileSystemTier, SharedKVBuffer, make_key

ap = argparse.ArgumentParser()
ap.add_argument("--root", default="/dev/shm")
ap.add_argument("--block", type=int, default=256 << 10)
ap.add_argument("--blocks", type=int, default=8192)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--ways", default="crc,nocrc", help="crc: checksums on; nocrc: off")
ap.add_argument("--op", choices=("load", "store"), default="load")
ap.add_argument("--lookups", type=int, default=0, help="1: look every key up first")
a = ap.parse_args()
JOB, INFLIGHT = 16, 16
n = a.blocks
buf = SharedKVBuffer.create(2 * n, a.block)
buf.view[:n] = 7
buf.view[n:] = 1
keys = [make_key(hashlib.sha256(b"k%d" % i).digest(), 0) for i in range(n)]
me = psutil.Process()


def cpu(procs):
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def run(tier, op, base_keys, slots):
    workers = [psutil.Process(p) for p in tier.worker_pids()]
    w0, e0 = cpu(workers), cpu([me])
    wall = drive(tier, op, base_keys, slots, JOB, INFLIGHT, bool(a.lookups))
    gb = len(base_keys) * a.block / 1e9
    return gb / wall, (cpu(workers) - w0) / gb, (cpu([me]) - e0) / gb


results = {way: [] for way in a.ways.split(",")}
tiers = {}
for way in results:
    root = tempfile.mkdtemp(dir=a.root, prefix=f"tier-loop-{way}-")
    tiers[way] = (FileSystemTier(buf, root_dir=root, checksum_blocks=way != "nocrc"), root)
    if a.op == "load":
        run(tiers[way][0], "store", keys, list(range(n)))
for rnd in range(a.rounds):
    for way in (list(results) if rnd % 2 == 0 else list(results)[::-1]):
        tier = tiers[way][0]
        if a.op == "store":
            fresh = [make_key(hashlib.sha256(b"r%d-%d" % (rnd, i)).digest(), 0)
                     for i in range(n)]
            results[way].append(run(tier, "store", fresh, list(range(n))))
        else:
            results[way].append(run(tier, "load", keys, list(range(n, 2 * n))))
for tier, root in tiers.values():
    tier.shutdown()
    shutil.rmtree(root)
buf.close()
buf.unlink()
print(f"{a.op}, {a.block >> 10} KiB blocks, {n} per round, load average "
      f"{os.getloadavg()[0]:.1f}")
for way, rows in results.items():
    print(f"  {way:8s} GB/s {statistics.median(r[0] for r in rows):.2f} "
          f"({' '.join(f'{r[0]:.2f}' for r in rows)})  workers CPU s/GB "
          f"{statistics.median(r[1] for r in rows):.3f}  engine CPU s/GB "
          f"{statistics.median(r[2] for r in rows):.3f}")

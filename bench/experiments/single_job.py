"""One 64-block load job alone, 30 times per way, timed from its submit to the
completion that select() on the tier's pipe sees (the bench's figure includes up to one
step of its scheduler's 0.5 ms sleep): checksums on and off, smaller tasks.

    python bench/experiments/single_job.py --root /dev/shm --block 256K
"""

import argparse
import hashlib
import select
import shutil
import statistics
import tempfile
import time

from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
from mptier.config import parse_bytes

ap = argparse.ArgumentParser()
ap.add_argument("--root", default="/dev/shm")
ap.add_argument("--block", default="256K")
a = ap.parse_args()
bb, nb, reps = parse_bytes(a.block), 64, 30
buf = SharedKVBuffer.create(2 * nb, bb)
buf.view[:] = 3
root = tempfile.mkdtemp(dir=a.root, prefix="single-job-")
ways = {"crc": {}, "nocrc": {"checksum_blocks": False}, "task4M": {"task_bytes": 4 << 20},
        "task2M": {"task_bytes": 2 << 20}}
out = {}
for way, options in ways.items():
    tier = FileSystemTier(buf, root_dir=f"{root}/{way}", **options)
    latencies = []
    for rep in range(reps):
        keys = [make_key(hashlib.sha256(f"{way}{rep}-{i}".encode()).digest(), 0)
                for i in range(nb)]
        tier.submit_store(TransferJob(2 * rep, keys, list(range(nb))))
        tier.drain_jobs()
        tier.get_finished_jobs()
        t0 = time.perf_counter_ns()
        tier.submit_load(TransferJob(2 * rep + 1, keys, list(range(nb, 2 * nb))))
        done = []
        while not done:
            select.select([tier.fileno()], [], [], 1.0)
            done = tier.get_finished_jobs()
        latencies.append((time.perf_counter_ns() - t0) / 1e6)
        assert done[0].success, done[0].error
    out[way] = latencies
    tier.shutdown()
shutil.rmtree(root)
buf.close()
buf.unlink()
for way, latencies in out.items():
    print(f"{way:8s} 64-block load alone: p50 {statistics.median(latencies):.2f} ms, "
          f"min {min(latencies):.2f}")

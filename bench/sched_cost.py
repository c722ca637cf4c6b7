"""Scheduler-side cost of the tier's calls on an idle machine, in microseconds.

    python bench/sched_cost.py [--block-bytes 2M] [--calls 2000]

Times, on the calling thread: ``submit_store`` of a 16-block job, ``get_finished_jobs()``
with nothing finished, and ``lookup()`` per key; prints median and p99. The same calls
measured while I/O runs at full speed are part of ``mptier bench``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
from mptier.config import parse_bytes


def percentiles(fn, n: int) -> tuple[float, float]:
    samples = []
    for i in range(n):
        start = time.perf_counter_ns()
        fn(i)
        samples.append(time.perf_counter_ns() - start)
    samples.sort()
    return samples[n // 2] / 1e3, samples[int(n * 0.99)] / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-bytes", default="2M")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    block = parse_bytes(args.block_bytes)
    jobs = 64
    root = tempfile.mkdtemp(prefix="mptier-cost-")
    try:
        with SharedKVBuffer.create(16 * jobs, block) as buf, \
                FileSystemTier(buf, root_dir=root, prefault=False) as tier:
            keys = [make_key(os.urandom(32), 0) for _ in range(16 * jobs)]
            print(f"empty get_finished_jobs  p50/p99 µs: "
                  f"{percentiles(lambda i: tier.get_finished_jobs(), args.calls)}")
            results = []
            for rnd in range(4):  # submit every slot once per round, then let it drain
                results.append(percentiles(lambda i, r=rnd: tier.submit_store(TransferJob(
                    r * jobs + i, keys[16 * i:16 * i + 16], list(range(16 * i, 16 * i + 16)))),
                    jobs))
                tier.drain_jobs()
                tier.get_finished_jobs()
            print(f"submit_store (16 blocks) p50/p99 µs, per round: {results}")
            print(f"lookup per key           p50/p99 µs: "
                  f"{percentiles(lambda i: tier.lookup(keys[i % len(keys)], i // 16), args.calls)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Sweep pool shapes and task sizes side by side in one run (the source of the defaults
in configs/default.toml).

    python bench/sweep.py --root /var/tmp/mptier-sweep --block-bytes 2M --total 1G

For each (workers, task_bytes) pair it measures, on the same files: store and load GB/s
with ``--inflight`` 16-block jobs in flight, and the time of one 64-block job alone.
Configurations run interleaved, several rounds, and medians are reported, because disk
throughput here swings 2x from minute to minute.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import time

import numpy as np

from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
from mptier.config import parse_bytes


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_phase(tier, kind: str, keys, slots, job_blocks: int, inflight: int) -> float:
    submit = tier.submit_store if kind == "store" else tier.submit_load
    jobs = [(keys[i:i + job_blocks], slots[i:i + job_blocks])
            for i in range(0, len(keys), job_blocks)]
    start = time.perf_counter()
    pending, next_job, job_id = 0, 0, 0
    while next_job < len(jobs) or pending:
        while pending < inflight and next_job < len(jobs):
            job_id += 1
            submit(TransferJob(job_id, *jobs[next_job]))
            next_job += 1
            pending += 1
        finished = tier.get_finished_jobs()
        for result in finished:
            assert result.success, result
        pending -= len(finished)
        if not finished:
            time.sleep(0.0005)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="/var/tmp/mptier-sweep")
    parser.add_argument("--block-bytes", default="2M")
    parser.add_argument("--total", default="1G")
    parser.add_argument("--inflight", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pools", default="2+2,4+4")
    parser.add_argument("--task-bytes", default="2M,4M,8M,16M,32M")
    args = parser.parse_args()
    block = parse_bytes(args.block_bytes)
    n = parse_bytes(args.total) // block
    pools = [tuple(map(int, p.split("+"))) for p in args.pools.split(",")]
    task_sizes = [parse_bytes(t) for t in args.task_bytes.split(",")]
    configs = [(p, t) for p in pools for t in task_sizes]
    figures: dict = {c: {"store": [], "load": [], "single64": []} for c in configs}
    with SharedKVBuffer.create(2 * n, block) as buf:
        rng = np.random.default_rng(0)
        for i in range(n):
            buf.view[i] = rng.integers(0, 256, block, dtype=np.uint8)
        for rnd in range(args.rounds):
            for (loads, stores), task_bytes in configs:
                shutil.rmtree(args.root, ignore_errors=True)
                keys = [make_key(os.urandom(32), 0) for _ in range(n)]
                with FileSystemTier(buf, root_dir=args.root, n_load_workers=loads,
                                    n_store_workers=stores, task_bytes=task_bytes) as tier:
                    t = run_phase(tier, "store", keys, list(range(n)), 16, args.inflight)
                    figures[((loads, stores), task_bytes)]["store"].append(n * block / t / 1e9)
                    drop_caches()
                    t = run_phase(tier, "load", keys, list(range(n, 2 * n)), 16,
                                  args.inflight)
                    figures[((loads, stores), task_bytes)]["load"].append(n * block / t / 1e9)
                    drop_caches()
                    t = run_phase(tier, "load", keys[:64], list(range(n, n + 64)), 64, 1)
                    figures[((loads, stores), task_bytes)]["single64"].append(t * 1e3)
                print(f"round {rnd + 1}/{args.rounds} {loads}+{stores} "
                      f"task {task_bytes >> 20} MiB done", flush=True)
    shutil.rmtree(args.root, ignore_errors=True)
    print(f"\nblock {block >> 20} MiB, {n} blocks, {args.inflight} x 16-block jobs in flight,"
          f" medians of {args.rounds} interleaved rounds")
    print(f"{'pool':>6} {'task MiB':>8} {'store GB/s':>10} {'load GB/s':>10} "
          f"{'64-block job ms':>16}")
    for (pool, task_bytes), fig in figures.items():
        print(f"{pool[0]}+{pool[1]:<4} {task_bytes >> 20:>8} "
              f"{statistics.median(fig['store']):>10.2f} {statistics.median(fig['load']):>10.2f}"
              f" {statistics.median(fig['single64']):>16.1f}")


if __name__ == "__main__":
    main()

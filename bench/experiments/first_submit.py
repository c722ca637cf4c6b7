"""The first submit_store calls after a tier starts, 50 ms apart (an idle tier).

    python bench/experiments/first_submit.py [--runs 3]

Prints each call's wall and thread CPU time and its CLOCK_MONOTONIC start, so a run
under ``perf record -k CLOCK_MONOTONIC -e sched:sched_switch -e sched:sched_wakeup -a``
can be matched against the scheduler's events.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    block = 2 << 20
    for run in range(args.runs):
        folder = tempfile.mkdtemp(dir="/dev/shm", prefix="perf-first-")
        try:
            with SharedKVBuffer.create(64, block) as buf:
                buf.view[:] = 1
                with FileSystemTier(buf, root_dir=folder) as tier:
                    keys = [make_key(os.urandom(32), 0) for _ in range(64)]
                    time.sleep(0.2)
                    for j in range(4):
                        t0 = time.monotonic()
                        c0 = time.thread_time()
                        tier.submit_store(TransferJob(j, keys[16 * j:16 * j + 16],
                                                      list(range(16 * j, 16 * j + 16))))
                        wall = (time.monotonic() - t0) * 1e6
                        cpu = (time.thread_time() - c0) * 1e6
                        print(f"run {run} call {j} at {t0:.6f}: wall {wall:.0f} µs, cpu "
                              f"{cpu:.0f} µs (tid {threading.get_native_id()})", flush=True)
                        time.sleep(0.05)
                    tier.drain_jobs()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

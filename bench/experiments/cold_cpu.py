"""How much slower the same Python code runs right after the thread slept.

    python bench/experiments/cold_cpu.py [--calls 60]

Times mptier.jobs.encode_job of a 16-block job (wall and thread CPU, medians) called
back to back, and after sleeps of 0.5, 5 and 50 ms. The harness's light scheduler sleeps
0.5 ms between steps, so its scheduler-call figures are "after a sleep" figures; on a VM
whose idle vCPU the host gives away, caches and TLBs are cold when the thread returns.
"""

from __future__ import annotations

import argparse
import array
import os
import statistics
import sys
import time

from mptier.jobs import TaskKind, encode_job
from mptier.keys import make_key


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=60)
    args = p.parse_args()
    keys = [make_key(os.urandom(32), 0) for _ in range(16)]
    ids = array.array("q", range(16))
    print(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}")
    for gap in (0.0, 0.0005, 0.005, 0.05):
        rows = []
        for _ in range(args.calls):
            if gap:
                time.sleep(gap)
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            encode_job(TaskKind.STORE, 1, keys, ids, 4)
            rows.append((time.perf_counter_ns() - t0, time.thread_time_ns() - c0))
        print(f"after a {gap * 1e3:4.1f} ms sleep: encode_job wall p50 "
              f"{statistics.median(r[0] for r in rows) / 1e3:6.1f} µs, thread CPU p50 "
              f"{statistics.median(r[1] for r in rows) / 1e3:6.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""submit_store tails with the workers under SCHED_BATCH (mptier's default) or SCHED_OTHER.

    python bench/experiments/worker_policy.py [--root /dev/shm] [--runs 10] [--jobs 200]

Each run starts a tier (2 MiB blocks, defaults), sets every thread of every worker to
the policy under test (batch: as the workers set themselves; normal: back to
SCHED_OTHER, as before), waits 0.3 s, then

* first: three submit_store calls 50 ms apart on the idle tier (the first one wakes a
  worker that slept since the start);
* steady: ``--jobs`` 16-block jobs, 16 in flight, a 500 µs sleep between polls (the
  bench's light scheduler), I/O at full speed.

Around each submit_store it reads the wall time and the time the thread waited runnable
for a CPU (/proc/thread-self/schedstat). Policies alternate run by run. Prints, per
policy: the first calls' wall times, and the steady calls' p50 / p99 / max and how many
took over 1 ms, with the run-queue wait of the slowest.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key


def run_queue_us(f) -> int:
    f.seek(0)
    return int(f.read().split()[1]) // 1000


def set_policy(tier: FileSystemTier, policy: int) -> None:
    for pid in tier.worker_pids():
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))


def one_run(root: str, policy: int, jobs: int, sched) -> tuple[list[int], list[tuple]]:
    block = 2 << 20
    folder = tempfile.mkdtemp(dir=root, prefix="perf-policy-")
    try:
        with SharedKVBuffer.create(256, block) as buf:
            buf.view[:] = 1
            with FileSystemTier(buf, root_dir=folder) as tier:
                set_policy(tier, policy)
                keys = [make_key(os.urandom(32), 0) for _ in range(16 * (jobs + 3))]
                time.sleep(0.3)
                first = []
                for j in range(3):
                    t0 = time.perf_counter_ns()
                    tier.submit_store(TransferJob(j, keys[16 * j:16 * j + 16],
                                                  list(range(16 * j, 16 * j + 16))))
                    first.append((time.perf_counter_ns() - t0) // 1000)
                    time.sleep(0.05)
                tier.drain_jobs()
                tier.get_finished_jobs()
                steady = []
                pending, nxt = 0, 3
                while nxt < jobs + 3 or pending:
                    while pending < 16 and nxt < jobs + 3:
                        q0, t0 = run_queue_us(sched), time.perf_counter_ns()
                        tier.submit_store(TransferJob(nxt, keys[16 * nxt:16 * nxt + 16],
                                                      [(16 * nxt + i) % 256
                                                       for i in range(16)]))
                        steady.append(((time.perf_counter_ns() - t0) // 1000,
                                       run_queue_us(sched) - q0))
                        pending += 1
                        nxt += 1
                    time.sleep(0.0005)
                    pending -= len(tier.get_finished_jobs())
                return first, steady
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/dev/shm")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--jobs", type=int, default=200)
    args = p.parse_args()
    policies = {"batch": os.SCHED_BATCH, "normal": os.SCHED_OTHER}
    first: dict[str, list[int]] = {k: [] for k in policies}
    steady: dict[str, list[tuple]] = {k: [] for k in policies}
    print(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}", flush=True)
    with open("/proc/thread-self/schedstat") as sched:
        for run in range(args.runs):
            names = list(policies) if run % 2 == 0 else list(policies)[::-1]
            for name in names:
                f, s = one_run(args.root, policies[name], args.jobs, sched)
                first[name].append(f[0])
                steady[name] += s
    print(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}")
    for name in policies:
        walls = sorted(w for w, _ in steady[name])
        worst = max(steady[name])
        print(f"{name:6s} first call µs {sorted(first[name])}")
        print(f"{name:6s} steady: p50 {statistics.median(walls):.0f} µs, p99 "
              f"{walls[int(0.99 * len(walls))]} µs, max {walls[-1]} µs (run-queue wait "
              f"{worst[1]} µs), {sum(w > 1000 for w in walls)} of {len(walls)} over 1 ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

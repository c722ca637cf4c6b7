"""What makes a single ``submit_store`` take milliseconds while I/O runs.

    python bench/experiments/tails.py [--root /dev/shm] [--block 2M] [--jobs 400]
                                      [--set worker_nice=19 ...]

Drives a tier like the bench's light scheduler (16-block jobs, 16 in flight, a 500 µs
GIL-free sleep between polls) and, around every submit_store, reads this thread's
counters: wall time, thread CPU time, time spent runnable but waiting for a CPU
(/proc/thread-self/schedstat, second field), voluntary and involuntary context switches
and minor faults (getrusage(RUSAGE_THREAD)). A call slow because the thread was
preempted shows run-queue wait and an involuntary switch; one that waited for the GIL
or blocked in the kernel shows a voluntary switch and no CPU; one that computed shows
CPU time (and how much of it the cyclic garbage collector took, from gc.callbacks);
page faults show as faults. Run it under ``perf record -e sched:sched_switch -a`` to
see which task took the CPU (bench/experiments/sched_preemptions.py reads that).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
from mptier.config import parse_bytes

RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", 1)


def probe_cpu_ns() -> int:
    """Thread CPU time of a fixed piece of pure-Python work (about 10 µs when idle):
    compared idle and under I/O, it shows how much slower the CPU itself got."""
    c0 = time.thread_time_ns()
    total = 0
    for i in range(300):
        total += i
    return time.thread_time_ns() - c0


def run_delay_ns(f) -> int:
    f.seek(0)
    return int(f.read().split()[1])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/dev/shm")
    p.add_argument("--block", default="2M")
    p.add_argument("--jobs", type=int, default=400)
    p.add_argument("--job-blocks", type=int, default=16)
    p.add_argument("--inflight", type=int, default=16)
    p.add_argument("--slow-us", type=float, default=200.0)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--busy-us", type=int, default=0,
                   help="after each 500 µs sleep, spin this long in pure Python (the bench's "
                        "busy scheduler) and report how that work fared")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the parts of submit_store (ledger, encoding, pipe write)")
    args = p.parse_args()
    block = parse_bytes(args.block)
    overrides = {}
    for item in args.set:
        k, _, v = item.partition("=")
        overrides[k] = int(v) if v.lstrip("-").isdigit() else v
    region = min(args.jobs * args.job_blocks, (1 << 30) // block)
    folder = tempfile.mkdtemp(prefix="perf-tails-", dir=args.root)
    print(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f} {overrides}", flush=True)
    rows = []
    steps: list[tuple[int, ...]] = []
    from mptier.bench.measure import spin
    idle_iters, idle_ns = spin(200_000_000)
    idle_probe = statistics.median(probe_cpu_ns() for _ in range(2000))
    busy_probe: list[int] = []
    gc_ns = [0]  # time spent in the cyclic garbage collector so far, this thread
    gc_start = [0]

    def on_gc(phase, info):
        if phase == "start":
            gc_start[0] = time.perf_counter_ns()
        else:
            gc_ns[0] += time.perf_counter_ns() - gc_start[0]

    gc.callbacks.append(on_gc)
    parts: dict[str, list[int]] = {}
    if args.breakdown:
        import mptier.manager as manager
        from mptier.channels import TaskQueue
        from mptier.ledger import JobLedger

        def timed(owner, name, label):
            original = getattr(owner, name)

            def wrapper(*a, **k):
                c0 = time.thread_time_ns()
                try:
                    return original(*a, **k)
                finally:
                    parts.setdefault(label, []).append(time.thread_time_ns() - c0)
            setattr(owner, name, wrapper)
            return original

        timed(manager, "encode_job", "encode_job")
        timed(JobLedger, "add_job", "ledger.add_job")
        timed(TaskQueue, "put_records", "queue.put_records (pipe write)")
    try:
        with SharedKVBuffer.create(region, block) as buf:
            buf.view[:] = np.random.default_rng(0).integers(0, 256, (1, block), dtype=np.uint8)
            with FileSystemTier(buf, root_dir=folder, **overrides) as tier, \
                    open("/proc/thread-self/schedstat") as sched:
                keys = [make_key(os.urandom(32), 0) for _ in range(args.jobs * args.job_blocks)]
                jobs = [TransferJob(j + 1, keys[j * args.job_blocks:(j + 1) * args.job_blocks],
                                    [(j * args.job_blocks + i) % region
                                     for i in range(args.job_blocks)])
                        for j in range(args.jobs)]
                pending = nxt = 0
                while nxt < len(jobs) or pending:
                    while pending < args.inflight and nxt < len(jobs):
                        d0 = run_delay_ns(sched)
                        g0 = gc_ns[0]
                        r0 = resource.getrusage(RUSAGE_THREAD)
                        c0 = time.thread_time_ns()
                        t0 = time.perf_counter_ns()
                        tier.submit_store(jobs[nxt])
                        t1 = time.perf_counter_ns()
                        c1 = time.thread_time_ns()
                        r1 = resource.getrusage(RUSAGE_THREAD)
                        d1 = run_delay_ns(sched)
                        rows.append((t1 - t0, c1 - c0, d1 - d0, r1.ru_nvcsw - r0.ru_nvcsw,
                                     r1.ru_nivcsw - r0.ru_nivcsw, r1.ru_minflt - r0.ru_minflt,
                                     gc_ns[0] - g0, nxt))
                        nxt += 1
                        pending += 1
                    done = tier.get_finished_jobs()
                    pending -= len(done)
                    assert all(r.success for r in done)
                    tier.on_schedule_end()
                    busy_probe.append(probe_cpu_ns())
                    d0 = run_delay_ns(sched)  # before the sleep: waking up counts too
                    r0 = resource.getrusage(RUSAGE_THREAD)
                    begin = time.perf_counter_ns()
                    time.sleep(0.0005)
                    if args.busy_us:
                        c0 = time.thread_time_ns()
                        due = begin + 500_000
                        iterations, _ = spin(args.busy_us * 1000)
                        t1 = time.perf_counter_ns()
                        r1 = resource.getrusage(RUSAGE_THREAD)
                        steps.append((t1 - due, time.thread_time_ns() - c0,
                                      run_delay_ns(sched) - d0, r1.ru_nvcsw - r0.ru_nvcsw,
                                      r1.ru_nivcsw - r0.ru_nivcsw, iterations))
    finally:
        gc.callbacks.remove(on_gc)
        shutil.rmtree(folder, ignore_errors=True)
    wall = sorted(r[0] for r in rows)
    print(f"submit_store: n {len(rows)}, p50 {wall[len(wall) // 2] / 1e3:.1f} µs, "
          f"p99 {wall[int(len(wall) * 0.99)] / 1e3:.1f} µs, max {wall[-1] / 1e3:.1f} µs")
    print(f"  the same pure-Python work took {statistics.median(busy_probe) / idle_probe:.2f}x "
          f"the thread CPU time it takes idle ({idle_probe / 1e3:.1f} µs idle)")
    for label, values in parts.items():
        print(f"  inside submit_store: {label} median thread CPU "
              f"{statistics.median(values) / 1e3:.1f} µs")
    if steps:
        rate = sum(s[5] for s in steps) / (sum(s[0] for s in steps) / 1e9)
        med = [statistics.median(s[i] for s in steps) / 1e3 for i in range(3)]
        print(f"  busy loop: rate {rate / (idle_iters / (idle_ns / 1e9)):.2f} of idle over "
              f"{len(steps)} steps; per step median: counted {med[0]:.0f} µs, cpu "
              f"{med[1]:.0f} µs, run-queue wait {med[2]:.0f} µs; steps (sleep included) "
              f"with a voluntary switch {sum(s[3] > 0 for s in steps)}, an involuntary one "
              f"{sum(s[4] > 0 for s in steps)}; in all: counted "
              f"{sum(s[0] for s in steps) / 1e6:.0f} ms, cpu {sum(s[1] for s in steps) / 1e6:.0f}"
              f" ms, run-queue wait {sum(s[2] for s in steps) / 1e6:.0f} ms")
    slow = [r for r in rows if r[0] > args.slow_us * 1e3]
    fast = [r for r in rows if r[0] <= args.slow_us * 1e3]
    for name, group in ((f"slow (> {args.slow_us:g} µs)", slow), ("the rest", fast)):
        if not group:
            print(f"  {name}: none")
            continue
        n = len(group)
        print(f"  {name}: {n} calls; median wall {statistics.median(r[0] for r in group) / 1e3:.1f}"
              f" µs, cpu {statistics.median(r[1] for r in group) / 1e3:.1f} µs, run-queue wait "
              f"{statistics.median(r[2] for r in group) / 1e3:.1f} µs; calls with an involuntary "
              f"switch {sum(r[4] > 0 for r in group)}, a voluntary switch "
              f"{sum(r[3] > 0 for r in group)}, a page fault {sum(r[5] > 0 for r in group)}, "
              f"a garbage collection {sum(r[6] > 0 for r in group)}")
        unexplained = [r[0] - r[1] - r[2] for r in group]
        gc_in = [r[6] for r in group if r[6]]
        if gc_in:
            print(f"    garbage collection inside calls: median "
                  f"{statistics.median(gc_in) / 1e3:.1f} µs, max {max(gc_in) / 1e3:.1f} µs")
        print(f"    wall - cpu - run-queue wait: median {statistics.median(unexplained) / 1e3:.1f}"
              f" µs, max {max(unexplained) / 1e3:.1f} µs")
    for r in sorted(rows, reverse=True)[:8]:
        print(f"    wall {r[0] / 1e3:8.1f} µs  cpu {r[1] / 1e3:7.1f}  runq {r[2] / 1e3:8.1f}  "
              f"vcsw {r[3]} ivcsw {r[4]} minflt {r[5]}  gc {r[6] / 1e3:.1f}  call #{r[7]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

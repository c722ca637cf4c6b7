"""What writing a job's task records costs the engine when the write wakes a worker.

    python bench/experiments/pipe_wake.py [--records 4] [--n 2000] [--nice 10]

A child process waits in epoll (EPOLLEXCLUSIVE, as mptier's workers) on a pipe and
reads what arrives; the parent writes RECORDS x 4 KiB into it (one write, as
submit_store does) and times that write (wall and thread CPU), then sleeps so the child
is waiting again. The same write into a pipe nobody waits on is the comparison.
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import sys
import time


def child(fd: int) -> None:
    ep = select.epoll()
    ep.register(fd, select.EPOLLIN | getattr(select, "EPOLLEXCLUSIVE", 0))
    os.set_blocking(fd, False)
    while True:
        ep.poll()
        try:
            if not os.read(fd, 1 << 20):
                return
        except BlockingIOError:
            pass


def timed_writes(fd: int, blob: bytes, n: int, drain: int | None) -> tuple[float, float]:
    wall, cpu = [], []
    for _ in range(n):
        time.sleep(0.001)
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        os.write(fd, blob)
        wall.append(time.perf_counter_ns() - t0)
        cpu.append(time.thread_time_ns() - c0)
        if drain is not None:
            os.read(drain, len(blob))
    return statistics.median(wall) / 1e3, statistics.median(cpu) / 1e3


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=4)
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--nice", type=int, default=10)
    args = p.parse_args()
    blob = bytes(4096 * args.records)
    print(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        os.nice(args.nice)
        child(r)
        os._exit(0)
    os.close(r)
    r2, w2 = os.pipe()
    for rnd in range(2):
        woke = timed_writes(w, blob, args.n, None)
        idle = timed_writes(w2, blob, args.n, r2)
        print(f"round {rnd}: write of {args.records} x 4 KiB waking a waiting worker: wall "
              f"{woke[0]:.1f} µs, cpu {woke[1]:.1f} µs; into a pipe nobody waits on: wall "
              f"{idle[0]:.1f} µs, cpu {idle[1]:.1f} µs")
    os.close(w)
    os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

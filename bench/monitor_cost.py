"""What monitoring costs the engine: building the figures, and the scheduler loop's rate
while status requests come in.

    python bench/monitor_cost.py [--blocks 256] [--block-bytes 2M] [--seconds 3] [--reps 4]

Prints the time to build one tier's figures (without and with USS readings), a status
round trip, and the rate of a scheduler-thread loop of ``get_finished_jobs()`` calls with
the endpoint idle and with a client asking every 1 s and every 0.1 s (interleaved runs,
so the machine's other load falls on every case alike).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time

from mptier import FileSystemTier, SharedKVBuffer
from mptier.config import parse_bytes
from mptier.monitor import Monitor, query


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return sorted(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-bytes", default="2M")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="mptier-moncost-", dir="/var/tmp")
    try:
        with SharedKVBuffer.create(args.blocks, parse_bytes(args.block_bytes)) as buf, \
                FileSystemTier(buf, root_dir=root) as tier:
            plain = Monitor(tier.stats, name="bench")
            plain.figures()
            t = timed(plain.figures, 50)
            print(f"figures(), USS not due:  median {statistics.median(t) * 1e3:.2f} ms, "
                  f"p90 {t[int(0.9 * len(t))] * 1e3:.2f} ms")
            with_uss = Monitor(tier.stats, name="bench-uss", uss_interval_s=0)
            t = timed(with_uss.figures, 20)
            print(f"figures(), USS each time ({len(tier.worker_pids())} workers, "
                  f"{buf.nbytes >> 20} MiB buffer): median {statistics.median(t) * 1e3:.2f} ms")
            t = timed(lambda: query(tier.status_name), 30)
            print(f"status round trip:       median {statistics.median(t) * 1e3:.2f} ms")

            def loop_rate() -> float:
                n = 0
                end = time.perf_counter() + args.seconds
                while time.perf_counter() < end:
                    tier.get_finished_jobs()
                    n += 1
                return n / args.seconds

            def asking(period: float) -> float:
                stop = threading.Event()

                def ask() -> None:
                    while not stop.wait(period):
                        query(tier.status_name)

                thread = threading.Thread(target=ask)
                thread.start()
                try:
                    return loop_rate()
                finally:
                    stop.set()
                    thread.join()

            cases = {"endpoint idle": loop_rate, "query every 1 s": lambda: asking(1.0),
                     "query every 0.1 s": lambda: asking(0.1)}
            results: dict[str, list[float]] = {name: [] for name in cases}
            for _ in range(args.reps):
                for name, run in cases.items():
                    results[name].append(run())
            for name, rates in results.items():
                print(f"loop calls/s, {name:>17}: {[round(r / 1e3) for r in rates]} k "
                      f"(median {statistics.median(rates) / 1e3:.0f} k)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""io_uring against the C core's system-call loop, interleaved in one run.

    cc -O2 -o /tmp/budget bench/experiments/budget.c
    python bench/experiments/uring_vs_loop.py [--roots /dev/shm,/var/tmp] [--rounds 3]

For each root and block size, round after round, in alternating order: the syscall
loop (``store``/``load``), io_uring with per-block linked chains (``*-uring``), and
io_uring with the buffer registered once (``*-uring-fixed``), each on a fresh folder
(page cache dropped before every load). Prints µs per block, the median over rounds,
and each design's ratio to the loop; also the loop's per-step budget (median µs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from mptier.native import probe_o_direct

VARIANTS = [("loop", "", "0"), ("uring", "-uring", "0"), ("uring-fixed", "-uring", "1")]


def drop() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--binary", default="/tmp/budget")
    p.add_argument("--roots", default="/dev/shm,/var/tmp")
    p.add_argument("--blocks", default="2097152,262144")
    p.add_argument("--bytes", type=int, default=256 << 20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--direct", choices=["auto", "0", "1"], default="auto")
    p.add_argument("--procs", type=int, default=1,
                   help="processes at once (as the tier's workers), each on its share of "
                        "the blocks; then the figure is aggregate µs per block")
    args = p.parse_args()
    print(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}", flush=True)
    for root in args.roots.split(","):
        direct = int(probe_o_direct(root)) if args.direct == "auto" else int(args.direct)
        for block in (int(b) for b in args.blocks.split(",")):
            n = args.bytes // block
            res: dict[str, list[float]] = {}
            steps: dict[str, dict[str, list[float]]] = {}
            for rnd in range(args.rounds):
                order = VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]
                for name, suffix, fixed in order:
                    folder = tempfile.mkdtemp(prefix="perf-uring-", dir=root)
                    try:
                        for op in ("store", "load"):
                            if op == "load":
                                drop()
                            for k in range(args.procs):
                                os.makedirs(f"{folder}/{k}", exist_ok=True)
                            t0 = time.perf_counter()
                            procs = [subprocess.Popen(
                                [args.binary, op + suffix, f"{folder}/{k}", str(block),
                                 str(n // args.procs), str(direct), str(args.batch), fixed],
                                stdout=subprocess.PIPE, text=True)
                                for k in range(args.procs)]
                            outs = [proc.communicate()[0] for proc in procs]
                            wall = time.perf_counter() - t0
                            if any(proc.returncode for proc in procs):
                                raise RuntimeError(f"{op}{suffix} failed")
                            r = json.loads(outs[0])
                            res.setdefault(f"{op} {name}", []).append(
                                r["us_per_block"] if args.procs == 1 else wall / n * 1e6)
                            if "steps" in r:
                                for step, (med, _mean) in r["steps"].items():
                                    steps.setdefault(op, {}).setdefault(step, []).append(med)
                    finally:
                        shutil.rmtree(folder, ignore_errors=True)
            print(f"\n{root} {block >> 10} KiB x {n}, O_DIRECT {bool(direct)}, batch "
                  f"{args.batch}, {args.procs} process(es), {args.rounds} rounds: µs per "
                  "block (median; per round)")
            for op in ("store", "load"):
                base = statistics.median(res[f"{op} loop"])
                for name, _, _ in VARIANTS:
                    vals = res[f"{op} {name}"]
                    med = statistics.median(vals)
                    print(f"  {op:5s} {name:12s} {med:8.1f}  x{base / med:5.2f} of loop speed"
                          f"   {' '.join(f'{v:.1f}' for v in vals)}")
                print(f"  {op} loop steps, median µs: " + ", ".join(
                    f"{k} {statistics.median(v):.1f}" for k, v in steps[op].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

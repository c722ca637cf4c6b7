"""tmpfs store speed against the state of the machine's free memory, interleaved.

    python bench/experiments/store_warmth.py [--rounds 3] [--gib 1]

A filled GIB-byte /dev/shm source buffer; per run, mptier.native.batch_store of it in
2 MiB blocks to fresh files on /dev/shm (the files are removed afterwards), after one of:

  cold  -- first allocate and hold --eat GiB of anonymous memory (takes the free pages
           the host still backs), so the file system gets pages the host has dropped;
  warm  -- first allocate and free GIB * 1.25 of anonymous memory right before (what the
           bench's warm-up does): the file system reuses those pages;
  as-is -- nothing.

Prints GB/s, system CPU per 4 KiB page stored (host faults show up as guest CPU time,
not as steal), and the kernel's count of memory reported to the host meanwhile.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import shutil
import time

from mptier import native

REPORTED = "/sys/module/page_reporting/parameters/reported_kib"
FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0x8000)


def reported() -> int:
    try:
        with open(REPORTED) as f:
            return int(f.read())
    except OSError:
        return -1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--eat", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    block = 2 << 20
    n = int(args.gib * (1 << 30)) // block
    src = mmap.mmap(-1, n * block)
    src.write(os.urandom(1 << 20) * (n * block >> 20))
    root = f"/dev/shm/perf-exp-warmth-{os.getpid()}"
    print(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}", flush=True)
    try:
        for rnd in range(args.rounds):
            states = ["cold", "warm", "as-is"]
            for state in states if rnd % 2 == 0 else states[::-1]:
                held = None
                t_prep = time.perf_counter()
                if state == "cold":
                    held = mmap.mmap(-1, int(args.eat * (1 << 30)), flags=FLAGS)
                elif state == "warm":
                    mmap.mmap(-1, int(args.gib * 1.25 * (1 << 30)), flags=FLAGS).close()
                t_prep = time.perf_counter() - t_prep
                os.makedirs(root)
                paths = [f"{i}.bin" for i in range(n)]
                rep0 = reported()
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.perf_counter()
                native.batch_store(root, paths, src, [i * block for i in range(n)], block)
                t = time.perf_counter() - t0
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                shutil.rmtree(root)
                if held is not None:
                    held.close()
                pages = n * block // 4096
                print(f"round {rnd} {state:>5}: {n * block / t / 1e9:5.2f} GB/s, sys "
                      f"{(r1.ru_stime - r0.ru_stime) / pages * 1e6:5.2f} µs/page, "
                      f"prep {t_prep:5.2f} s, reported during store {reported() - rep0} KiB",
                      flush=True)
                time.sleep(1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""How much a first touch of a freshly allocated page costs, depending on how long ago
the memory was freed (free page reporting hands idle free memory back to the host).

    python bench/experiments/page_warmth.py [--mib 1024] [--waits 0,0.5,1,2,3,5,8]

Allocates and touches MIB of anonymous memory (one fault per 4 KiB page), frees it,
waits, allocates and touches again; prints µs per page, the kernel's count of memory
reported to the host during the wait and during the touch, and sys CPU time.

    python bench/experiments/page_warmth.py --chunks 6

instead touches 6 GiB in 128 MiB steps and prints µs per page of each step: the first
steps reuse recently freed (host-backed) pages, the later ones take pages the host has
taken back.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import resource
import time

REPORTED = "/sys/module/page_reporting/parameters/reported_kib"


def reported() -> int:
    try:
        with open(REPORTED) as f:
            return int(f.read())
    except OSError:
        return -1


def touch(nbytes: int) -> tuple[float, float, int]:
    m = mmap.mmap(-1, nbytes)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    ctypes.memset(addr, 1, nbytes)
    t = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    m.close()
    return t, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--waits", default="0,0.5,1,2,3,5,8")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--chunks", type=float, default=0.0, metavar="GIB",
                   help="touch GIB in 128 MiB steps and print µs per page of each step")
    args = p.parse_args()
    if args.chunks:
        total, step = int(args.chunks * (1 << 30)), 128 << 20
        m = mmap.mmap(-1, total)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        rep0 = reported()
        costs = []
        for pos in range(0, total - step + 1, step):
            t0 = time.perf_counter()
            ctypes.memset(addr + pos, 1, step)
            costs.append((time.perf_counter() - t0) / (step // mmap.PAGESIZE) * 1e6)
        print("µs per page, 128 MiB steps:", " ".join(f"{c:.1f}" for c in costs),
              f"| reported meanwhile {reported() - rep0} KiB")
        m.close()
        return
    nbytes = args.mib << 20
    pages = nbytes // mmap.PAGESIZE
    waits = [float(x) for x in args.waits.split(",")]
    rep0 = reported()
    t, st, flt = touch(nbytes)
    print(f"first touch      : {t / pages * 1e6:6.2f} µs/page  sys {st:.2f} s  faults {flt}"
          f"  reported during touch {reported() - rep0} KiB", flush=True)
    for _ in range(args.repeat):
        for wait in waits:
            rep0 = reported()
            time.sleep(wait)
            rep1 = reported()
            t, st, flt = touch(nbytes)
            print(f"after {wait:4.1f} s free: {t / pages * 1e6:6.2f} µs/page  sys {st:.2f} s  "
                  f"faults {flt}  reported while waiting {rep1 - rep0:>8} KiB, "
                  f"during touch {reported() - rep1:>8} KiB", flush=True)


if __name__ == "__main__":
    main()

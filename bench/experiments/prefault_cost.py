"""What pre-faulting a mapping of an already allocated /dev/shm buffer costs and buys.

    python bench/experiments/prefault_cost.py [--gib 2]

Allocates a GIB-byte /dev/shm file once (filled), then for each mode maps it afresh
(a new mapping starts with no page-table entries, like a worker's) and times: the
pre-fault itself, then a write pass (memset, as loads write slots) and a read pass (a
sum over one byte per 64, as stores read slots) over the whole mapping, with this
process's minor faults in each. Also times mincore() over the mapping and shows that
neither populate mode allocates anything here (Shmem in /proc/meminfo stays put).
Finally maps a 256 MiB *sparse* file and shows that either advice allocates its holes.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import resource
import time

import numpy as np

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
MODES = {"none": None, "populate_read": 22, "populate_write": 23}


def shmem_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1])
    return -1


def timed(fn):
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    fn()
    t = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return t, r1.ru_minflt - r0.ru_minflt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=2)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    n = int(args.gib * (1 << 30))
    pages = n // 4096
    path = f"/dev/shm/perf-exp-cost.{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.unlink(path)
    os.ftruncate(fd, n)
    with mmap.mmap(fd, n) as m:
        m.write(b"\1" * (1 << 20) * (n >> 20))
    for rnd in range(args.rounds):
        for mode, advice in MODES.items():
            m = mmap.mmap(fd, n)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            before = shmem_kib()
            t_pre, f_pre = timed(lambda a=addr, v=advice: v and libc.madvise(a, n, v))
            grew = shmem_kib() - before
            arr = np.frombuffer(m, dtype=np.uint8)
            t_w, f_w = timed(lambda a=arr: a.fill(2))
            del arr
            m2 = mmap.mmap(fd, n)  # read pass on another fresh mapping with the same mode
            addr2 = ctypes.addressof(ctypes.c_char.from_buffer(m2))
            if advice:
                libc.madvise(addr2, n, advice)
            arr2 = np.frombuffer(m2, dtype=np.uint8)
            t_r, f_r = timed(lambda a=arr2: int(a[::64].sum()))
            vec = (ctypes.c_ubyte * pages)()
            t_mc, _ = timed(lambda a=addr2, v=vec: libc.mincore(a, n, v))
            del arr2
            m2.close()
            m.close()
            print(f"round {rnd} {mode:>14}: prefault {t_pre * 1e3:7.1f} ms ({f_pre:>7} faults,"
                  f" {t_pre / pages * 1e9:5.0f} ns/page, shmem +{grew} KiB) | write pass "
                  f"{t_w * 1e3:6.1f} ms {f_w:>7} faults | read pass {t_r * 1e3:6.1f} ms "
                  f"{f_r:>6} faults | mincore {t_mc * 1e3:.1f} ms", flush=True)
    os.close(fd)
    holes = 256 << 20
    for mode in ("populate_read", "populate_write"):
        path = f"/dev/shm/perf-exp-holes.{os.getpid()}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.unlink(path)
        os.ftruncate(fd, holes)
        m = mmap.mmap(fd, holes)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        before = shmem_kib()
        libc.madvise(addr, holes, MODES[mode])
        print(f"{mode} over a 256 MiB hole: Shmem +{shmem_kib() - before} KiB, file now "
              f"{os.fstat(fd).st_blocks * 512 >> 20} MiB allocated")
        m.close()
        os.close(fd)


if __name__ == "__main__":
    main()

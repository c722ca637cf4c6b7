"""Issue 13's one-process reproduction of the tmpfs store swing, with counters.

    python bench/experiments/prefault_repro.py --mode populate_write --passes 3

Maps a fresh BUFFER-byte /dev/shm file (MAP_SHARED), prepares it per --mode, then
stores N x BLOCK from it to fresh files on /dev/shm with mptier.native.batch_store,
pass after pass (each pass into a new folder; the folder of the pass before is removed
first unless --keep). Per pass it prints GB/s and the deltas of: this process's minor
and major faults and user/system CPU, /proc/vmstat counters, the page-reporting
module's reported_kib, and the machine's steal time.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import resource
import shutil
import sys
import time

from mptier import native

MADV = {"populate_write": 23, "populate_read": 22, "willneed": 3}
VMSTAT_KEYS = ("pgfault", "pgmajfault", "pgalloc_normal", "pgalloc_dma32", "pgfree",
               "pgactivate", "pgdeactivate", "pgsteal_kswapd", "pgsteal_direct",
               "pgscan_kswapd", "pgscan_direct", "pswpin", "pswpout", "thp_fault_alloc",
               "workingset_refault_file", "pgreuse", "pglazyfree", "nr_free_pages",
               "compact_stall", "pgmigrate_success", "nr_shmem", "nr_zspages",
               "pgpromote_success", "pgdemote_kswapd", "numa_hint_faults", "pgrotated",
               "zone_reclaim_failed", "damon_migrate", "pgscan_khugepaged")
REPORTED = "/sys/module/page_reporting/parameters/reported_kib"

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def vmstat() -> dict[str, int]:
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            k, v = line.split()
            out[k] = int(v)
    return out


def steal() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def reported() -> int:
    try:
        with open(REPORTED) as f:
            return int(f.read())
    except OSError:
        return -1


class Counters:
    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.ru = resource.getrusage(resource.RUSAGE_SELF)
        self.vm = vmstat()
        self.steal = steal()
        self.rep = reported()

    def delta(self, before: Counters) -> dict[str, float]:
        d = {"s": self.t - before.t,
             "minflt": self.ru.ru_minflt - before.ru.ru_minflt,
             "majflt": self.ru.ru_majflt - before.ru.ru_majflt,
             "utime": self.ru.ru_utime - before.ru.ru_utime,
             "stime": self.ru.ru_stime - before.ru.ru_stime,
             "steal_ticks": self.steal - before.steal,
             "reported_kib": self.rep - before.rep}
        for k in VMSTAT_KEYS:
            if k in self.vm:
                v = self.vm[k] - before.vm.get(k, 0)
                if v:
                    d[k] = v
        return d


def show(label: str, d: dict[str, float], nbytes: int | None = None) -> None:
    rate = f" {nbytes / d['s'] / 1e9:6.2f} GB/s" if nbytes else ""
    rest = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in d.items() if k != "s")
    print(f"{label:>14}: {d['s']:7.3f} s{rate} | {rest}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="populate_write",
                   choices=["none", "populate_write", "populate_read", "willneed", "memset",
                            "fill"])
    p.add_argument("--buffer", type=int, default=2 << 30)
    p.add_argument("--block", type=int, default=2 << 20)
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--dest", default="/dev/shm")
    p.add_argument("--keep", action="store_true", help="keep each pass's files")
    p.add_argument("--o-direct", action="store_true")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds between passes")
    args = p.parse_args()

    path = f"/dev/shm/perf-exp-buf.{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.unlink(path)
    os.ftruncate(fd, args.buffer)
    mm = mmap.mmap(fd, args.buffer)
    os.close(fd)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    root = f"{args.dest}/perf-exp-{os.getpid()}"
    os.makedirs(root)
    try:
        before = Counters()
        if args.mode in MADV:
            if libc.madvise(addr, args.buffer, MADV[args.mode]) != 0:
                print("madvise failed", ctypes.get_errno(), file=sys.stderr)
        elif args.mode == "memset":
            ctypes.memset(addr, 0, args.buffer)
        elif args.mode == "fill":
            chunk = os.urandom(1 << 20)
            for pos in range(0, args.buffer, len(chunk)):
                mm[pos:pos + len(chunk)] = chunk
        show(f"prep {args.mode}", Counters().delta(before))
        stride = max(args.block, args.buffer // args.blocks // args.block * args.block)
        offsets = [(i * stride) % (args.buffer - args.block + 1) for i in range(args.blocks)]
        prev = None
        for k in range(args.passes):
            if prev and not args.keep:
                t0 = time.perf_counter()
                shutil.rmtree(prev)
                print(f"{'':>14}  removed pass {k - 1} in {time.perf_counter() - t0:.3f} s")
            if args.sleep:
                time.sleep(args.sleep)
            folder = f"{root}/p{k}"
            os.makedirs(folder)
            paths = [f"{i}.bin" for i in range(args.blocks)]
            before = Counters()
            native.batch_store(folder, paths, mm, offsets, args.block, o_direct=args.o_direct)
            show(f"pass {k}", Counters().delta(before), args.blocks * args.block)
            prev = folder
    finally:
        shutil.rmtree(root, ignore_errors=True)
        mm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

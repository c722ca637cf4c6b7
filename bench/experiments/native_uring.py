"""The native core's batch calls with and without ``URING``, interleaved in one run.

    python bench/experiments/native_uring.py [--roots /var/tmp,/dev/shm] [--procs 1,4]

For each root, block size and process count, round after round in alternating order:
``batch_store`` of ``--bytes`` into a fresh folder in the tier's layout (tasks of
``--batch`` blocks, each process on its share), then -- after the page cache is dropped
(root only; skipped otherwise, said so) -- ``batch_load`` of the same blocks, with the
syscall loop ("loop") and with io_uring ("uring"). Flags as the tier sets them on that
root (O_DIRECT where the probe says so, TOUCH, TMPFILE where it works, CHECKSUM with
``--checksum``). Prints GB/s, the median over rounds and each round, and uring / loop.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from mptier import native

VARIANTS = [("loop", 0), ("uring", native.URING)]
CPU: list[float] = []  # CPU seconds of the last run, all its processes and threads
# --threads N adds "threads": one process, N threads each running the loop on its share
# (the in-process reference pool on the native calls, design c of mptier bench).


def paths_for(n: int, salt: str) -> list[bytes]:
    out = []
    for i in range(n):
        h = hashlib.sha256(f"{salt}{i}".encode()).hexdigest()
        out.append(f"{h[:3]}/{h[3:5]}_g0/{h}.bin".encode())
    return out


def disk_stat(root: str) -> list[int] | None:
    """/sys/block/<dev>/stat of the disk under root (None for a memory fs)."""
    dev = os.stat(root).st_dev
    try:
        name = os.path.basename(os.path.realpath(
            f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))
        with open(f"/sys/class/block/{name}/stat") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return None


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def worker(op: str, folder: str, paths: list[bytes], block: int, batch: int, flags: int,
           slots: int, start, done) -> None:
    buf = np.full(slots * block + 4096, 0x5A, np.uint8)
    off0 = (-buf.ctypes.data) % 4096
    be = native.get_backend("native")
    fd = native.open_root(folder)
    tag = native.new_tag().encode()
    start.wait()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    try:
        for first in range(0, len(paths), batch):
            part = paths[first:first + batch]
            offs = [off0 + ((first + k) % slots) * block for k in range(len(part))]
            if op == "store":
                rc = be.store(fd, part, buf, offs, block, flags, tag)[0]
            else:
                rc = be.load(fd, part, buf, offs, block, flags)[0]
            if rc:
                raise OSError(-rc, f"{op} failed: {os.strerror(-rc)}")
    finally:
        os.close(fd)
    r1 = resource.getrusage(resource.RUSAGE_SELF)  # every thread, the ring's io-wq too
    done.put((time.perf_counter(), r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime))


def run_threads(op: str, folder: str, paths: list[bytes], block: int, batch: int,
                flags: int, threads: int) -> float:
    import queue
    import threading

    start, done = threading.Barrier(threads + 1), queue.Queue()
    share = -(-len(paths) // threads)
    ts = [threading.Thread(target=worker, args=(op, folder, paths[k * share:(k + 1) * share],
                                                block, batch, flags, 64, start, done))
          for k in range(threads)]
    for t in ts:
        t.start()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    start.wait()
    t0 = time.perf_counter()
    ends = [done.get()[0] for _ in ts]
    for t in ts:
        t.join()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    CPU.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
    return len(paths) * block / (max(ends) - t0) / 1e9


def run(op: str, folder: str, paths: list[bytes], block: int, batch: int, flags: int,
        procs: int) -> float:
    ctx = mp.get_context("fork")
    start, done = ctx.Barrier(procs + 1), ctx.Queue()
    share = -(-len(paths) // procs)
    ps = [ctx.Process(target=worker, args=(op, folder, paths[k * share:(k + 1) * share],
                                           block, batch, flags, 64, start, done))
          for k in range(procs)]
    for p in ps:
        p.start()
    start.wait()
    t0 = time.perf_counter()
    got = [done.get() for _ in ps]
    ends = [g[0] for g in got]
    CPU.append(sum(g[1] for g in got))
    for p in ps:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{op} worker failed")
    return len(paths) * block / (max(ends) - t0) / 1e9


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--roots", default="/var/tmp,/dev/shm")
    p.add_argument("--blocks", default="2097152,262144")
    p.add_argument("--bytes", type=int, default=512 << 20)
    p.add_argument("--batch", type=int, default=0,
                   help="blocks per call (default: the tier's 8 MiB tasks)")
    p.add_argument("--procs", default="1,4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--checksum", action="store_true")
    p.add_argument("--no-touch", action="store_true", help="without TOUCH (atime)")
    p.add_argument("--disk", action="store_true",
                   help="also print the disk's mean requests in flight and busy share")
    p.add_argument("--threads", type=int, default=0,
                   help="also run N threads of the loop in one process (0: not)")
    args = p.parse_args()
    variants = VARIANTS + ([("threads", 0)] if args.threads else [])
    be = native.get_backend("native")
    print(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}; "
          f"{be.uring_status()}", flush=True)
    for root in args.roots.split(","):
        base = dict(o_direct=be.probe_o_direct(root), tmpfile=be.probe_o_tmpfile(root))
        flags = ((native.O_DIRECT if base["o_direct"] else 0)
                 | (0 if args.no_touch else native.TOUCH)
                 | (native.TMPFILE if base["tmpfile"] else 0)
                 | (native.CHECKSUM if args.checksum else 0))
        for block in (int(b) for b in args.blocks.split(",")):
            batch = args.batch or max(1, (8 << 20) // block)
            n = args.bytes // block
            for procs in (int(x) for x in args.procs.split(",")):
                res: dict[str, list[float]] = {}
                disk: dict[str, list[tuple[float, float]]] = {}
                cpu: dict[str, list[float]] = {}
                dropped = True
                for rnd in range(args.rounds):
                    order = variants if rnd % 2 == 0 else variants[::-1]
                    for name, extra in order:
                        go = (lambda *a: run_threads(*a[:-1], args.threads)) \
                            if name == "threads" else run
                        folder = tempfile.mkdtemp(prefix="perf-nu-", dir=root)
                        try:
                            paths = paths_for(n, f"{rnd}{name}")
                            for op in ("store", "load"):
                                if op == "load":
                                    dropped &= drop_caches()
                                d0, t0 = disk_stat(root), time.perf_counter()
                                res.setdefault(f"{op} {name}", []).append(
                                    go(op, folder, paths, block, batch, flags | extra,
                                       procs))
                                cpu.setdefault(f"{op} {name}", []).append(CPU[-1] / n * 1e6)
                                d1, wall = disk_stat(root), time.perf_counter() - t0
                                if d0 and d1:  # time_in_queue, io_ticks (ms)
                                    disk.setdefault(f"{op} {name}", []).append(
                                        ((d1[10] - d0[10]) / 1e3 / wall,
                                         (d1[9] - d0[9]) / 1e3 / wall))
                        finally:
                            shutil.rmtree(folder, ignore_errors=True)
                print(f"\n{root} {block >> 10} KiB x {n}, {batch} per call, {procs} "
                      f"process(es), flags {flags}, {args.rounds} rounds"
                      f"{'' if dropped else ' (page cache NOT dropped: not root)'}:")
                for op in ("store", "load"):
                    med = {name: statistics.median(res[f"{op} {name}"]) for name, _ in variants}
                    for name, _ in variants:
                        vals = " ".join(f"{v:.2f}" for v in res[f"{op} {name}"])
                        dd = disk.get(f"{op} {name}") if args.disk else None
                        note = "" if not dd else "   disk: in flight " + " ".join(
                            f"{q:.1f}" for q, _ in dd) + ", busy " + " ".join(
                            f"{b:.0%}" for _, b in dd)
                        us = statistics.median(cpu[f"{op} {name}"])
                        print(f"  {op:5s} {name:7s} {med[name]:6.2f} GB/s   ({vals}), CPU "
                              f"{us:.0f} µs/block{note}")
                    print(f"  {op:5s} uring / loop: x{med['uring'] / med['loop']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What checksums and safe path resolution cost in the native core, measured in one run.

    python bench/native_checksum.py [--roots /dev/shm,/var/tmp] [--sizes 2M,256K]
                                    [--pass-bytes 256M] [--rounds 7] [--threads 1,4]
                                    [--out bench/results/native_checksum.json]

1. CRC32C on one core (the process is pinned to one CPU) over a 2 MiB block already in
   cache, for each implementation: the C core's best (SSE4.2 / ARMv8), its tables, and
   the numpy twin. GB/s, best of several timed runs.
2. Batch store and load through the native errno layer (the worker's hot path), with
   CHECKSUM against without, per root and block size. Each round runs both variants,
   alternating which goes first; each pass stores fresh files (one batch call per
   16 MiB task, spread over ``--threads`` threads), then loads them back; the files
   are removed outside the timed part. Ratios are per round (checksum / plain): the
   median and the quartiles are reported, the spread being the machine's noise. One
   thread runs pinned to one core; several threads stand for the tier's workers.
   Besides the wall clock, each pass's speed per CPU second of this process is
   reported (``*_cpu_ratio``): on a shared machine that is the steadier measure of
   what checksums cost a core-bound (tmpfs) pass. O_DIRECT is used where the root
   supports it, as the tier does.
3. Resolution beneath a root: per-block cost of lookup (open beneath the root, fstat,
   close) and of a 4 KiB load, with openat2 against the O_NOFOLLOW walk.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time

from mptier import native
from mptier.config import parse_bytes

TASK_BYTES = 16 << 20  # one batch call per task, as the tier's default task size
CRC_BLOCK = 2 << 20


def fmt_size(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}K"


# -- 1. CRC32C ---------------------------------------------------------------------------

def crc_speeds(min_seconds: float = 0.3, trials: int = 5) -> dict[str, float]:
    data = mmap.mmap(-1, CRC_BLOCK)
    data[:] = os.urandom(CRC_BLOCK)
    out = {}
    for name in ("native", "python"):
        try:
            backend = native.get_backend(name)
        except ImportError:
            continue
        for impl in backend.crc32c_impls:
            backend.crc32c(data, impl=impl)  # warm: tables, cache
            best = 0.0
            for _ in range(trials):
                reps, start = 0, time.perf_counter()
                while True:
                    backend.crc32c(data, impl=impl)
                    reps += 1
                    elapsed = time.perf_counter() - start
                    if elapsed >= min_seconds:
                        break
                best = max(best, reps * CRC_BLOCK / elapsed / 1e9)
            out[f"{name}/{impl}"] = round(best, 3)
    data.close()
    return out


# -- 2. batch store / load with and without checksums -------------------------------------

def _run_tasks(fn, tasks, threads: int) -> None:
    pending = list(tasks)
    lock = threading.Lock()
    errors: list[str] = []

    def worker():
        while True:
            with lock:
                if not pending:
                    return
                task = pending.pop()
            rc = fn(*task)
            if rc:
                errors.append(os.strerror(-rc))

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise OSError(f"{len(errors)} batch call(s) failed, first: {errors[0]}")


def io_pass(backend, root_fd: int, buf, block: int, n_blocks: int, flags: int, prefix: str,
            threads: int) -> tuple[float, float, float, float]:
    """Store then load ``n_blocks`` fresh blocks: (store GB/s, load GB/s) by the wall
    clock, then the same per CPU second this process spent (user + system)."""
    per_task = max(1, TASK_BYTES // block)
    paths = [f"{prefix}/{i % 997:03x}/{i:08x}.bin".encode() for i in range(n_blocks)]
    tag = b"benchbenchbench0"
    tasks = [(paths[i : i + per_task], [j * block for j in range(i, min(i + per_task,
                                                                         n_blocks))])
             for i in range(0, n_blocks, per_task)]

    def store(p, offs):
        return backend.store(root_fd, p, buf, offs, block, flags, tag)[0]

    def load(p, offs):
        return backend.load(root_fd, p, buf, offs, block, flags)[0]

    start, cpu = time.perf_counter(), time.process_time()
    _run_tasks(store, tasks, threads)
    stored, stored_cpu = time.perf_counter() - start, time.process_time() - cpu
    start, cpu = time.perf_counter(), time.process_time()
    _run_tasks(load, tasks, threads)
    loaded, loaded_cpu = time.perf_counter() - start, time.process_time() - cpu
    total = n_blocks * block / 1e9
    return total / stored, total / loaded, total / stored_cpu, total / loaded_cpu


def _quartiles(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return [round(q[0], 3), round(q[2], 3)]


def io_ratios(roots: list[str], sizes: list[int], pass_bytes: int, rounds: int,
              threads: int) -> list[dict]:
    backend = native.get_backend("native")
    results = []
    buf = mmap.mmap(-1, pass_bytes)
    buf[:] = os.urandom(1 << 20) * (pass_bytes >> 20)  # also prefaults the mapping
    for root in roots:
        work = tempfile.mkdtemp(prefix="mptier-crcbench-", dir=root)
        try:
            direct = backend.probe_o_direct(work)
            root_fd = native.open_root(work)
            try:
                for block in sizes:
                    n_blocks = pass_bytes // block
                    base = native.O_DIRECT if direct else 0
                    samples: dict[str, list[float]] = {f"{op}_{label}{clock}": [] for op in (
                        "store", "load") for label in ("plain", "crc") for clock in ("", "_cpu")}
                    for r in range(rounds):
                        order = [("plain", base), ("crc", base | native.CHECKSUM)]
                        if r % 2:
                            order.reverse()
                        for label, flags in order:
                            prefix = f"r{r}{label}"
                            speeds = io_pass(backend, root_fd, buf, block, n_blocks, flags,
                                             prefix, threads)
                            for key, value in zip(("store_{}", "load_{}", "store_{}_cpu",
                                                   "load_{}_cpu"), speeds):
                                samples[key.format(label)].append(value)
                            shutil.rmtree(os.path.join(work, prefix))
                    row = {"root": root, "block": fmt_size(block), "o_direct": direct,
                           "threads": threads}
                    for op in ("store", "load"):
                        plain, crc = samples[f"{op}_plain"], samples[f"{op}_crc"]
                        row[f"{op}_plain_gbps"] = round(statistics.median(plain), 3)
                        row[f"{op}_crc_gbps"] = round(statistics.median(crc), 3)
                        ratios = [c / p for c, p in zip(crc, plain)]
                        row[f"{op}_ratio"] = round(statistics.median(ratios), 3)
                        row[f"{op}_ratio_iqr"] = _quartiles(ratios)
                        # per CPU second: what a core-bound (tmpfs) pass costs, whatever
                        # else the machine runs meanwhile
                        cpu_ratios = [c / p for c, p in zip(samples[f"{op}_crc_cpu"],
                                                            samples[f"{op}_plain_cpu"])]
                        row[f"{op}_cpu_ratio"] = round(statistics.median(cpu_ratios), 3)
                        row[f"{op}_cpu_ratio_iqr"] = _quartiles(cpu_ratios)
                    results.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                os.close(root_fd)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    buf.close()
    return results


# -- 3. openat2 against the walk --------------------------------------------------------------

def resolution_cost(root: str, n: int = 4000, rounds: int = 5) -> dict:
    backend = native.get_backend("native")
    work = tempfile.mkdtemp(prefix="mptier-resolve-", dir=root)
    block = 4096
    try:
        paths = [f"{i % 4096:03x}/{i % 251:02x}_g0/{i:060x}.bin".encode() for i in range(n)]
        buf = mmap.mmap(-1, n * block)
        fd = native.open_root(work)
        try:
            rc = backend.store(fd, paths, buf, [i * block for i in range(n)], block, 0,
                               b"benchbenchbench0")[0]
            assert rc == 0, os.strerror(-rc)
            cost: dict[str, list[float]] = {}
            for _ in range(rounds):
                for how, flags in (("openat2", 0), ("walk", native.NO_OPENAT2)):
                    start = time.perf_counter()
                    backend.lookup(fd, paths, block, flags)
                    cost.setdefault(f"lookup_{how}_us", []).append(
                        (time.perf_counter() - start) / n * 1e6)
                    start = time.perf_counter()
                    backend.load(fd, paths, buf, [i * block for i in range(n)], block, flags)
                    cost.setdefault(f"load4k_{how}_us", []).append(
                        (time.perf_counter() - start) / n * 1e6)
        finally:
            os.close(fd)
            buf.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {k: round(min(v), 2) for k, v in cost.items()}
    out["root"] = root
    out["resolver"] = backend.resolver()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--roots", default="/dev/shm,/var/tmp")
    parser.add_argument("--sizes", default="2M,256K")
    parser.add_argument("--pass-bytes", default="256M")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", default="1,4", help="thread counts to run, e.g. 1,4")
    parser.add_argument("--cpu", type=int, default=None,
                        help="pin the whole run to this CPU (default: the first allowed)")
    parser.add_argument("--out", default=None, help="also write the results here (JSON)")
    args = parser.parse_args()
    if not native.HAS_NATIVE:
        raise SystemExit(f"the native core is not built: {native.NATIVE_IMPORT_ERROR}")
    allowed = os.sched_getaffinity(0)
    cpu = args.cpu if args.cpu is not None else min(allowed)
    roots = [r for r in args.roots.split(",") if r]
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s]
    os.sched_setaffinity(0, {cpu})  # CRC and resolution: one core
    report: dict = {"crc32c_gbps_one_core": crc_speeds()}
    print(json.dumps(report), flush=True)
    report["io"] = []
    for threads in (int(t) for t in args.threads.split(",")):
        # one thread stays on one core: the ratio is CPU cost; more use every core
        os.sched_setaffinity(0, {cpu} if threads == 1 else allowed)
        report["io"] += io_ratios(roots, sizes, parse_bytes(args.pass_bytes), args.rounds,
                                  threads)
    os.sched_setaffinity(0, {cpu})
    report["resolution"] = [resolution_cost(r) for r in roots]
    for row in report["resolution"]:
        print(json.dumps(row), flush=True)
    report["machine"] = {"cpus": os.cpu_count(), "crc32c_impl": native.crc32c_impl(),
                         "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()

"""What checksums and safe path resolution cost in the native core, measured in one run.

    python bench/native_checksum.py [--roots /dev/shm,/var/tmp] [--sizes 2M,256K]
                                    [--pass-bytes 256M] [--rounds 7] [--threads 1,4]
                                    [--crc-only] [--out bench/results/native_checksum.json]

1. CRC32C on one core (the process is pinned to one CPU) over a block already in cache
   (each of ``--sizes``), for every path this CPU runs, side by side: the C core's
   (avx512-vpclmulqdq, avx2-vpclmulqdq, pclmulqdq, sse4.2 or armv8-crc, table) and the
   numpy twin. GB/s, best of several timed runs; ``*`` marks the path in use.
   ``--crc-only`` stops after this part.
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


def fmt_size(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}K"


# -- 1. CRC32C ---------------------------------------------------------------------------

# A timed batch of CRC calls covers about this many bytes (a tenth of a millisecond on the
# fast paths): short enough that many batches run without being preempted on a busy
# shared machine, long enough for the clock's resolution. Best batch wins.
CRC_BATCH_BYTES = 4 << 20


def _crc_callers(data) -> list[tuple[str, object]]:
    """(``backend/path``, a no-argument call that CRCs ``data`` once) for every path.
    The native ones call the C entry point directly: the tier's CRCs run inside the C
    core's batches, and the Python wrapper's per-call cost (microseconds) would be a
    quarter of a 256 KiB block's CRC."""
    out = []
    if native.HAS_NATIVE:
        from mptier.native import _native  # the cffi module, for the bare C call

        ptr, nbytes, crc32c = _native.ffi.from_buffer("char[]", data), len(data), \
            _native.lib.mpt_crc32c
        for impl in native.get_backend("native").crc32c_impls:
            def call(code=_native._IMPL_CODE[impl]):
                return crc32c(0, ptr, nbytes, code)
            out.append((f"native/{impl}", call))
    python = native.get_backend("python")
    out.append(("python/numpy", lambda: python.crc32c(data)))
    return out


def crc_speeds(sizes: list[int], seconds: float = 0.25,
               rounds: int = 4) -> dict[str, dict[str, float]]:
    """{block size: {"backend/path": GB/s}}: the best batch of each path. Paths take
    turns, round by round, so a busy moment of the machine does not land on one alone."""
    out: dict[str, dict[str, float]] = {}
    for size in sizes:
        data = bytearray(os.urandom(size))
        callers = _crc_callers(data)
        best = dict.fromkeys((key for key, _ in callers), 0.0)
        for _ in range(rounds):
            for key, call in callers:
                call()  # warm: tables, cache
                reps = max(1, CRC_BATCH_BYTES // size)
                if key.endswith(("/table", "/numpy")):  # the slow ones: fewer a batch
                    reps = max(1, reps // 16)
                stop = time.perf_counter() + seconds / rounds
                while time.perf_counter() < stop:
                    start = time.perf_counter()
                    for _ in range(reps):
                        call()
                    elapsed = time.perf_counter() - start
                    best[key] = max(best[key], round(reps * size / elapsed / 1e9, 2))
        out[fmt_size(size)] = best
    return out


def print_crc_table(speeds: dict[str, dict[str, float]]) -> None:
    in_use = f"{native.BACKEND}/{native.crc32c_impl()}"
    keys = list(next(iter(speeds.values())))
    print(f"CRC32C GB/s on one core, block in cache ({os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}; * in use)")
    print(f"  {'path':<26}" + "".join(f"{size:>9}" for size in speeds))
    for key in keys:
        mark = "*" if key == in_use else " "
        print(f"{mark} {key:<26}" + "".join(f"{speeds[size][key]:>9.1f}" for size in speeds))


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
    parser.add_argument("--crc-only", action="store_true",
                        help="measure the CRC32C paths only (part 1)")
    parser.add_argument("--out", default=None, help="also write the results here (JSON)")
    args = parser.parse_args()
    if not native.HAS_NATIVE:
        raise SystemExit(f"the native core is not built: {native.NATIVE_IMPORT_ERROR}")
    allowed = os.sched_getaffinity(0)
    cpu = args.cpu if args.cpu is not None else min(allowed)
    roots = [r for r in args.roots.split(",") if r]
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s]
    os.sched_setaffinity(0, {cpu})  # CRC and resolution: one core
    report: dict = {"crc32c_gbps_one_core": crc_speeds(sizes),
                    "machine": {"cpus": os.cpu_count(), "crc32c_impl": native.crc32c_impl(),
                                "load_average": os.getloadavg()[0],
                                "time": time.strftime("%Y-%m-%d %H:%M:%S")}}
    print_crc_table(report["crc32c_gbps_one_core"])
    print(json.dumps(report), flush=True)
    if args.crc_only:
        write_report(report, args.out)
        return
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
    write_report(report, args.out)


def write_report(report: dict, out: str | None) -> None:
    if out:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()

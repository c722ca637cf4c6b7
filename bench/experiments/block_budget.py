"""Where the time of one block goes: a per-block budget for stores and loads.

    python bench/experiments/block_budget.py [--roots /dev/shm,/var/tmp] [--blocks 2M,256K]

Three parts, each printed as a table:

A. Python work per block and per task, in thread CPU time (robust on a loaded machine):
   the engine encoding a 16-block job, a worker decoding a task record, computing the
   block paths, building the native call's arguments, encoding the completion message.
B. CPU per block inside the native batch call, by system call and by kernel activity
   (data copy, page allocation, path walk, faults), from a ``perf record`` cpu-clock
   profile of a child process storing then loading N blocks in the tier's file layout
   (inclusive time of the kernel's entry points), with wall time and user/system CPU.
C. The wake-up chain: a tier with 4 KiB one-block jobs (I/O nearly free), the engine
   waiting in select() on the tier's descriptor: dispatch (submit -> the worker starts
   the I/O), the I/O, completion (I/O end -> get_finished_jobs returns the job).
"""

from __future__ import annotations

import argparse
import array
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from mptier.config import parse_bytes
from mptier.jobs import (
    MessageType,
    TaskKind,
    decode_task,
    encode_job,
    encode_message,
)
from mptier.keys import make_key
from mptier.layout import FileMapper

TASK_BYTES = 8 << 20  # the tier's default task size


def cpu_ns(fn, n: int) -> float:
    """Median thread CPU ns of one call over 5 batches of ``n`` calls."""
    out = []
    for _ in range(5):
        t0 = time.thread_time_ns()
        for _ in range(n):
            fn()
        out.append((time.thread_time_ns() - t0) / n)
    return statistics.median(out)


def part_a(block: int) -> dict[str, float]:
    per_task = max(1, TASK_BYTES // block)
    keys = [make_key(os.urandom(32), 0) for _ in range(16)]
    ids = array.array("q", range(16))
    mapper = FileMapper("/dev/shm/x", "bench-model")
    job = encode_job(TaskKind.STORE, 1, keys, ids, per_task)
    record = memoryview(job)[:4096]
    task = decode_task(record)
    from mptier.native import _checks, _native
    buf = bytearray(block * 16)
    paths = [mapper.relative_path_for(k) for k in task.keys]
    offsets = [b * block for b in task.block_ids]
    encoded = [os.fsencode(p) for p in paths]
    m = len(task.keys)
    res = {
        "blocks per task": m,
        "engine: encode 16-block job (per block)": cpu_ns(
            lambda: encode_job(TaskKind.STORE, 1, keys, ids, per_task), 2000) / 16,
        "worker: decode task (per block)": cpu_ns(lambda: decode_task(record), 5000) / m,
        "worker: path_for (per block)": cpu_ns(
            lambda: [mapper.relative_path_for(k) for k in task.keys], 2000) / m,
        "worker: offsets (per block)": cpu_ns(
            lambda: [b * block for b in task.block_ids], 5000) / m,
        "worker: check args (per block)": cpu_ns(
            lambda: _checks.batch(paths, buf, offsets, block), 2000) / m,
        "worker: cffi call set-up (per block)": cpu_ns(
            lambda: (_native._blob(encoded), _native._offsets(offsets)), 2000) / m,
        "worker: encode message (per block)": cpu_ns(lambda: encode_message(
            MessageType.DONE, 1, 123, n_done=m, task_id=5, started_ns=1, elapsed_ns=2), 5000) / m,
    }
    return res


IO_CHILD = r"""
import hashlib, mmap, os, resource, sys, time, json
from mptier import native
op, root, block, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
direct = sys.argv[5] == "1"
buf = mmap.mmap(-1, block * min(n, 256))
buf.write(b"\x5a" * len(buf))
names = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(n)]
# the tier's layout: <h[0:3]>/<h[3:5]>_g0/<h>.bin, so a fresh cache makes most folders
paths = [f"{h[:3]}/{h[3:5]}_g0/{h}.bin" for h in names]
offs = [(i % 256) * block for i in range(n)]
import ctypes
# Samples after this carry the thread name "mpt-batch": the report keeps only those.
ctypes.CDLL(None).prctl(15, b"mpt-batch", 0, 0, 0)
r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
io = native.batch_store if op == "store" else native.batch_load
io(root, paths, buf, offs, block, o_direct=direct)
t = time.perf_counter() - t0; r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"s": t, "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime}))
"""

# Kernel and libc functions whose inclusive CPU time makes up a block's budget.
BUDGET_SYMBOLS = {
    "open (create/lookup)": ("__x64_sys_openat", "__x64_sys_open"),
    "write": ("ksys_write", "__x64_sys_write"),
    "read": ("ksys_read", "__x64_sys_read"),
    "close": ("__x64_sys_close",),
    "rename": ("__x64_sys_rename", "__x64_sys_renameat2"),
    "mkdir": ("__x64_sys_mkdir", "__x64_sys_mkdirat"),
    "access (exists?)": ("__x64_sys_access", "__x64_sys_faccessat", "__x64_sys_faccessat2"),
    "getpid+gettid (temp name)": ("__x64_sys_getpid", "__x64_sys_gettid"),
    "  of which: data copy": ("rep_movs_alternative", "copy_user_enhanced_fast_string",
                              "copy_user_generic_string", "_copy_from_iter",
                              "_copy_to_iter", "copy_page_to_iter", "copy_page_from_iter",
                              "copy_page_from_iter_atomic", "copy_folio_from_iter_atomic"),
    "  of which: page alloc + zero": ("__alloc_frozen_pages_noprof", "__alloc_pages_noprof",
                                      "clear_page_erms"),
    "  of which: path walk": ("link_path_walk", "path_lookupat", "filename_lookup",
                              "lookup_fast", "walk_component"),
    "  of which: page fault (buffer)": ("asm_exc_page_fault",),
}


def _perf_symbols(data: str) -> tuple[float, dict[str, float]]:
    """Total cpu-clock ns of a recording and inclusive percent per symbol."""
    rep = subprocess.run(["perf", "report", "-i", data, "--children", "--stdio", "-g", "none",
                          "--comm", "mpt-batch", "--sort", "sym", "--percent-limit", "0.05"],
                         capture_output=True, text=True, check=False).stdout
    total = float(re.search(r"Event count \(approx\.\): (\d+)", rep).group(1))
    pct: dict[str, float] = {}
    for line in rep.splitlines():
        m = re.match(r"\s+([\d.]+)%\s+[\d.]+%\s+\[[k.]\]\s+(\S+)", line)
        if m:
            pct[m.group(2)] = max(pct.get(m.group(2), 0.0), float(m.group(1)))
    return total, pct


def part_b(root: str, block: int, n: int, direct: bool) -> dict[str, object]:
    folder = tempfile.mkdtemp(prefix="perf-budget-", dir=root)
    out = {}
    try:
        for op in ("store", "load"):
            if op == "load":
                os.sync()
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
            data = f"{folder}.{op}.perf"
            proc = subprocess.run(
                ["perf", "record", "-q", "-F", "4999", "-g", "-e", "cpu-clock", "-o", data,
                 "--", sys.executable, "-c", IO_CHILD, op, folder, str(block), str(n),
                 str(int(direct))], capture_output=True, text=True, check=False)
            if proc.returncode:
                raise RuntimeError(proc.stderr[-2000:])
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            total_ns, pct = _perf_symbols(data)
            if os.environ.get("BUDGET_TOP"):
                for sym, share in sorted(pct.items(), key=lambda kv: -kv[1])[:40]:
                    print(f"    {share:6.2f}% {sym}")
            os.unlink(data)
            parts = {}
            for label, symbols in BUDGET_SYMBOLS.items():
                share = sum(pct.get(sym, 0.0) for sym in symbols)
                if label.startswith("  ") or "+" in label:
                    share = sum(pct.get(sym, 0.0) for sym in symbols)
                if share:
                    parts[label] = share / 100 * total_ns / n / 1e3
            out[op] = {"gbps": n * block / result["s"] / 1e9,
                       "us_per_block": result["s"] / n * 1e6,
                       "user_us_per_block": result["user"] / n * 1e6,
                       "sys_us_per_block": result["sys"] / n * 1e6,
                       "cpu_us_per_block": parts}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def part_c(root: str, n_jobs: int = 300, spin: bool = False) -> dict[str, float]:
    """Dispatch (submit -> the worker starts the I/O), I/O, and completion (I/O end ->
    the engine's poll returns the job), all on CLOCK_MONOTONIC, which every process
    shares. The engine waits in select() on the tier's descriptor (or spins)."""
    import select

    from mptier import FileSystemTier, SharedKVBuffer, TransferJob
    folder = tempfile.mkdtemp(prefix="perf-chain-", dir=root)
    out = {}
    try:
        with SharedKVBuffer.create(64, 4096) as buf:
            buf.view[:] = 7
            with FileSystemTier(buf, root_dir=folder) as tier:
                seen: list[tuple[int, int, int]] = []
                ledger = tier._ledger
                original = ledger.task_finished

                def record(message):
                    seen.append((message.started_ns, message.elapsed_ns, time.monotonic_ns()))
                    return original(message)

                ledger.task_finished = record
                keys = [make_key(os.urandom(32), 0) for _ in range(n_jobs)]
                fd = tier.fileno()
                for kind in ("store", "load"):
                    submit = tier.submit_store if kind == "store" else tier.submit_load
                    rows = []
                    for i, key in enumerate(keys):
                        time.sleep(0.002)  # the pool is idle and waiting, every time
                        job = TransferJob(i + (0 if kind == "store" else n_jobs),
                                          [key], [i % 32 + (32 if kind == "load" else 0)])
                        seen.clear()
                        t0 = time.monotonic_ns()
                        submit(job)
                        while not (done := tier.get_finished_jobs()):
                            if not spin:
                                select.select([fd], [], [], 1.0)
                        t1 = time.monotonic_ns()
                        assert done[0].success, done
                        started, elapsed, _ = seen[0]
                        rows.append((started - t0, elapsed, t1 - started - elapsed))
                    for j, name in enumerate(("dispatch", "I/O", "completion")):
                        out[f"{kind}: {name} p50 µs"] = statistics.median(
                            r[j] for r in rows) / 1e3
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--roots", default="/dev/shm,/var/tmp")
    p.add_argument("--blocks", default="2M,256K")
    p.add_argument("--bytes", default="1G", help="bytes per part-B run")
    p.add_argument("--parts", default="abc")
    p.add_argument("--json")
    args = p.parse_args()
    doc = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "load": os.getloadavg()}
    print(f"{doc['time']} load {doc['load'][0]:.2f}", flush=True)
    blocks = [parse_bytes(b) for b in args.blocks.split(",")]
    if "a" in args.parts:
        doc["a"] = {}
        for block in blocks:
            doc["a"][block] = res = part_a(block)
            print(f"\nA. Python work, {block >> 10} KiB blocks (thread CPU ns)")
            for k, v in res.items():
                print(f"  {k:45s} {v:10.0f}")
    if "b" in args.parts:
        doc["b"] = {}
        for root in args.roots.split(","):
            from mptier.native import probe_o_direct
            direct = probe_o_direct(root)
            for block in blocks:
                n = parse_bytes(args.bytes) // block
                res = part_b(root, block, n, direct)
                doc["b"][f"{root} {block}"] = res
                for op, r in res.items():
                    print(f"\nB. {op} {n} x {block >> 10} KiB on {root} (O_DIRECT {direct}): "
                          f"{r['gbps']:.2f} GB/s, {r['us_per_block']:.1f} µs/block wall, "
                          f"CPU user {r['user_us_per_block']:.1f} sys "
                          f"{r['sys_us_per_block']:.1f} µs/block")
                    for name, us in r["cpu_us_per_block"].items():
                        print(f"  {name:34s} {us:8.1f} µs/block")
    if "c" in args.parts:
        doc["c"] = {}
        for root in args.roots.split(",")[:1]:
            doc["c"][root] = res = part_c(root)
            print(f"\nC. wake-up chain, one 4 KiB block per job on {root} (µs)")
            for k, v in res.items():
                print(f"  {k:32s} {v:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE))
    sys.exit(main())

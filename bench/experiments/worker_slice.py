"""The engine's busy loop beside one tier whose workers run with the kernel's default
EEVDF slice or a short one (``sched_setattr`` with ``sched_runtime``, Linux 6.12+;
SCHED_BATCH and ``worker_nice`` 10 kept), in alternating windows: does a worker that
gives its CPU back sooner leave the engine's thread more of it?

Each round runs a load window and a store window (fresh keys) per slice, the pair's
order reversed every other round, each window between two idle windows of the loop
alone (as the bench measures interference). Loads read the 1,024 blocks stored first.

    python bench/experiments/worker_slice.py --root /var/tmp --block-bytes 2097152

docs/performance.md, section 26 (tried, not landed).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import shutil
import statistics
import struct
import time

import numpy as np

from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
from mptier.bench.measure import SchedulerLoad

SYS_SCHED_SETATTR = 314  # x86-64
SCHED_ATTR_BYTES = 56  # struct sched_attr up to util_max (SCHED_ATTR_SIZE_VER1)
JOB_BLOCKS = 16
IN_FLIGHT = 16
SLOTS = 256
POOL_BLOCKS = 1024

_libc = ctypes.CDLL(None, use_errno=True)


def set_slice(tid: int, slice_ns: int, nice: int = 10, policy: int = os.SCHED_BATCH) -> None:
    """``policy`` (SCHED_BATCH unless told) at ``nice`` with a slice of ``slice_ns`` (0:
    the kernel's default)."""
    attr = struct.pack("<IIQiIQQQII", SCHED_ATTR_BYTES, policy, 0, nice, 0,
                       slice_ns, 0, 0, 0, 0)
    buf = ctypes.create_string_buffer(attr, SCHED_ATTR_BYTES)
    if _libc.syscall(SYS_SCHED_SETATTR, tid, buf, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/var/tmp")
    ap.add_argument("--block-bytes", type=int, default=2 << 20)
    ap.add_argument("--short-ns", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--window-s", type=float, default=1.5)
    args = ap.parse_args()
    root = os.path.join(args.root, f"worker-slice-{os.getpid()}")
    block = args.block_bytes
    buf = SharedKVBuffer.create(SLOTS, block)
    buf.view[:] = np.random.default_rng(1).integers(0, 256, (SLOTS, block), dtype=np.uint8)
    tier = FileSystemTier(buf, root_dir=root)
    busy = SchedulerLoad(500_000, 500_000)
    ids, fresh = itertools.count(1), itertools.count()
    pool = [make_key(b"pool", i) for i in range(POOL_BLOCKS)]

    def apply(slice_ns: int) -> None:
        for pid in tier.worker_pids():
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    set_slice(int(tid), slice_ns)
                except OSError:
                    pass  # a thread that ended, or the kernel's own (io-wq)

    def submit(kind: str) -> None:
        if kind == "store":
            keys = [make_key(b"fresh", next(fresh)) for _ in range(JOB_BLOCKS)]
            tier.submit_store(TransferJob(next(ids), keys, list(range(JOB_BLOCKS))))
        else:
            start = next(fresh) * JOB_BLOCKS % POOL_BLOCKS
            tier.submit_load(TransferJob(next(ids), pool[start:start + JOB_BLOCKS],
                                         [SLOTS // 2 + i for i in range(JOB_BLOCKS)]))

    def window(kind: str) -> tuple[float, float]:
        """(loop iterations per s, GB/s) with IN_FLIGHT jobs kept in flight."""
        inflight = finished = iterations = loop_ns = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.window_s:
            for _ in range(IN_FLIGHT - inflight):
                submit(kind)
            inflight = IN_FLIGHT
            done = len(tier.get_finished_jobs())
            inflight -= done
            finished += done
            n, dt = busy.step()
            iterations += n
            loop_ns += dt
        seconds = time.monotonic() - t0
        tier.drain_jobs()
        tier.get_finished_jobs()
        return iterations / (loop_ns / 1e9), finished * JOB_BLOCKS * block / seconds / 1e9

    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        for s in range(0, POOL_BLOCKS, JOB_BLOCKS):
            tier.submit_store(TransferJob(next(ids), pool[s:s + JOB_BLOCKS],
                                          list(range(JOB_BLOCKS))))
        tier.drain_jobs()
        tier.get_finished_jobs()
        for rnd in range(args.rounds):
            for kind in ("load", "store"):
                order = ("default", "short") if rnd % 2 == 0 else ("short", "default")
                for mode in order:
                    apply(0 if mode == "default" else args.short_ns)
                    before = busy.idle_rate(0.5)
                    rate, gbps = window(kind)
                    after = busy.idle_rate(0.5)
                    results.setdefault((kind, mode), []).append(
                        (rate / ((before + after) / 2), gbps))
                    print(f"round {rnd} {kind:5} {mode:7} loop {results[kind, mode][-1][0]:.2f}"
                          f"  {gbps:.2f} GB/s", flush=True)
    finally:
        tier.shutdown()
        buf.close()
        buf.unlink()
        shutil.rmtree(root, ignore_errors=True)
    for (kind, mode), got in sorted(results.items()):
        print(f"{kind:5} {mode:7} loop median {statistics.median(r for r, _ in got):.2f}, "
              f"GB/s median {statistics.median(g for _, g in got):.2f}")


if __name__ == "__main__":
    main()

"""How short a window of stores tells, from the block device alone, whether the bounce
copy pays on a local disk: two tiers on one disk, one copying every stored block
through its bounce buffer (``bounce_stores=true``), one writing from the engine's slots
(``false``), storing fresh blocks in turn for W seconds each (16 jobs of 16 blocks in
flight, then drained). Each window reads the device's counters in /proc/diskstats: busy
milliseconds per GB the device wrote (what a write from 4 KiB pages costs the device,
whoever issued it) and the tier's GB/s. Adjacent windows make a pair, their order
reversed every other pair; a pair's ratio is the direct way's busy time per GB over the
copy's.

    python bench/experiments/store_way_windows.py --root /var/tmp --block 2M \\
        --windows 0.25,0.5,1 --pairs 6

Why: docs/performance.md, section 27. A worker's own call timing does not see what a
direct write costs the device (the cost lengthens everyone's queue); a decision per root
from the device's counters would. This measures how long its windows must be. Every
block stays on disk until the end (ext4's deletions would cost the next window device
time: section 14); mind the free space (about 2 GB a second of windows).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator

from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
from mptier.bench.saturation import device_counters
from mptier.config import parse_bytes

JOB_BLOCKS = 16
IN_FLIGHT = 16
# A pair says "copy" when the direct way kept the device busy this much longer per GB
# (StoreWay's margin on the branch store-way: the copy costs a worker's CPU).
COPY_MARGIN = 1.15
CLK_TCK = os.sysconf("SC_CLK_TCK")  # /proc/PID/stat counts CPU time in these


def _cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds of ``pids`` so far, every thread (/proc/PID/stat)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue  # a worker replaced meanwhile: its CPU is lost to the figure
        total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


class Way:
    """One tier (``settings``: TierConfig fields) and its stream of fresh keys."""

    def __init__(self, name: str, buf: SharedKVBuffer, root: str, **settings: object) -> None:
        self.name, self.buf, self.root = name, buf, root
        self.tier = FileSystemTier(buf, root_dir=root, **settings)
        self.next_key = self.next_job = 0
        self.cpu_s_per_gb = 0.0  # the workers', over the last window

    def window(self, seconds: float) -> tuple[float, float]:
        """Store for ``seconds`` (then drain); (device busy ms per GB written, GB/s).
        The workers' CPU seconds per GB stored are left in ``cpu_s_per_gb``."""
        before = device_counters(self.root)
        pids = self.tier.worker_pids()
        cpu = _cpu_seconds(pids)
        start = time.perf_counter()
        running = stored = 0
        while time.perf_counter() - start < seconds or running:
            while running < IN_FLIGHT and time.perf_counter() - start < seconds:
                slot = self.next_job % IN_FLIGHT * JOB_BLOCKS
                keys = [make_key(f"{self.name}-{self.next_key + i}".encode(), 0)
                        for i in range(JOB_BLOCKS)]
                self.next_key += JOB_BLOCKS
                self.tier.submit_store(TransferJob(self.next_job, keys,
                                                   list(range(slot, slot + JOB_BLOCKS))))
                self.next_job += 1
                running += 1
            select.select([self.tier.fileno()], [], [], 0.05)
            for result in self.tier.get_finished_jobs():
                if not result.success:
                    raise SystemExit(f"{self.name}: a store failed: {result.error}")
                running -= 1
                stored += JOB_BLOCKS * self.buf.block_bytes
        elapsed = time.perf_counter() - start
        self.cpu_s_per_gb = (_cpu_seconds(pids) - cpu) / max(stored / 1e9, 1e-9)
        after = device_counters(self.root)
        if before is None or after is None:
            raise SystemExit("the root is on no block device: nothing to read")
        written = max(1, after.write_bytes - before.write_bytes)
        return (after.busy_ms - before.busy_ms) / (written / 1e9), stored / elapsed / 1e9


@contextlib.contextmanager
def two_ways(root: str, block: int, window_seconds: float, prefix: str, fewer: str,
             settings: dict[str, dict[str, object]]) -> Iterator[list[Way]]:
    """One :class:`Way` per entry of ``settings`` (name -> TierConfig fields), each in its
    own folder of a temporary one on ``root``, sharing one buffer of ``block`` blocks, their
    first stores done off the clock; shut down and removed on the way out. Exits first if
    ``root`` is on no block device, or has not the room ``window_seconds`` of windows per
    way may write at 2.5 GB/s (``fewer`` says how to ask for less)."""
    if device_counters(root) is None:
        raise SystemExit(f"--root {root} is on no block device /proc/diskstats "
                         "names: give a folder on a local disk")
    need = 2.5e9 * len(settings) * window_seconds
    free = shutil.disk_usage(root).free
    if free < need:
        raise SystemExit(f"--root {root} has {free / 1e9:.0f} GB free; these windows "
                         f"may write {need / 1e9:.0f} GB: {fewer}")
    top = tempfile.mkdtemp(prefix=prefix, dir=root)
    buf = SharedKVBuffer.create(JOB_BLOCKS * IN_FLIGHT, block)
    ways: list[Way] = []
    try:
        buf.view[:] = 7
        for name, fields in settings.items():
            ways.append(Way(name, buf, os.path.join(top, name), **fields))
        for way in ways:
            way.window(0.2)  # the pools' first stores (bounce buffers, folders) off the clock
        yield ways
    finally:
        for way in ways:
            way.tier.shutdown()
        buf.close()
        buf.unlink()
        print(f"removing {top} ...", flush=True)
        shutil.rmtree(top, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/var/tmp", help="a folder on a local disk")
    ap.add_argument("--block", default="2M")
    ap.add_argument("--windows", default="0.25,0.5,1", help="seconds, comma-separated")
    ap.add_argument("--pairs", type=int, default=6, help="pairs of windows per length")
    args = ap.parse_args()
    block = parse_bytes(args.block)
    windows = [float(w) for w in args.windows.split(",")]
    with two_ways(args.root, block, args.pairs * sum(windows), "mptier-way-windows-",
                  "fewer --pairs or --windows",
                  {"copy": {"bounce_stores": True}, "direct": {"bounce_stores": False}}) as ways:
        print(f"block {args.block}, {IN_FLIGHT} jobs of {JOB_BLOCKS} in flight; per pair: "
              "busy ms per GB written, copy / direct, their ratio; GB/s copy / direct")
        for seconds in windows:
            ratios = []
            for pair in range(args.pairs):
                order = ways if pair % 2 == 0 else ways[::-1]
                got = {way.name: way.window(seconds) for way in order}
                (copy_ms, copy_gbps), (direct_ms, direct_gbps) = got["copy"], got["direct"]
                ratios.append(direct_ms / copy_ms if copy_ms > 0 else float("inf"))
                print(f"  {seconds:g} s  {copy_ms:6.0f} / {direct_ms:6.0f}  "
                      f"x{ratios[-1]:.2f}   {copy_gbps:.2f} / {direct_gbps:.2f}", flush=True)
            says_copy = sum(r > COPY_MARGIN for r in ratios)
            print(f"{seconds:g} s windows: median x{statistics.median(ratios):.2f}, "
                  f"{says_copy} of {len(ratios)} pairs say copy (ratio > {COPY_MARGIN})")


if __name__ == "__main__":
    main()

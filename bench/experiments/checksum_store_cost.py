"""What the per-block checksum costs a store on a disk: two tiers on one root, one with
``checksum_blocks`` on (a CRC32C per block, taken as the bounce copy goes, and the
``user.vllm.kv_crc32c`` xattr written before the block is published), one without,
storing fresh blocks in turn for W seconds each (16 jobs of 16 blocks in flight, then
drained; adjacent windows make a pair, their order reversed every other pair). Per
window: GB/s, the workers' CPU seconds per GB stored (every thread of every worker,
``/proc/PID/stat``), and the device's busy milliseconds per GB written.

    python bench/experiments/checksum_store_cost.py --root /var/tmp --block 256K \\
        --window-s 1 --pairs 8

Why: docs/performance.md, section 29. In a bench run at 256 KiB on ext4, stores without
checksums ran 1.05-1.60x as fast, far more than a CRC at 35 GB/s and an xattr (~5 us) per
block should cost. Measured here: about 80 ms of the workers' CPU per GB, the same GB/s;
stretches of windows in which one tier's workers spend 1-5 CPU seconds per GB are ext4's
inode allocator skipping inodes deleted in the last minutes (journal-less ext4; sections
11, 25), whichever tier meets them. Every block stays on disk until the end (ext4's
deletions would cost the next window: section 14).
"""

from __future__ import annotations

import argparse
import statistics

from store_way_windows import IN_FLIGHT, JOB_BLOCKS, two_ways  # this folder

from mptier.config import parse_bytes


def _huge_kib(pids: list[int]) -> int:
    """KiB of ``pids``' anonymous memory in transparent huge pages (their bounce buffers':
    a copy out of 4 KiB pages costs more, and so does a write from them)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("AnonHugePages:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/var/tmp", help="a folder on a local disk")
    ap.add_argument("--block", default="256K")
    ap.add_argument("--window-s", type=float, default=1.0)
    ap.add_argument("--pairs", type=int, default=8)
    args = ap.parse_args()
    block = parse_bytes(args.block)
    with two_ways(args.root, block, args.pairs * args.window_s, "mptier-checksum-cost-",
                  "fewer --pairs or a shorter --window-s",
                  {"on": {"checksum_blocks": True}, "off": {"checksum_blocks": False}}) as ways:
        for way in ways:
            print(f"checksums {way.name}: workers' anonymous huge pages "
                  f"{_huge_kib(way.tier.worker_pids()) >> 10} MiB")
        print(f"block {args.block}, {IN_FLIGHT} jobs of {JOB_BLOCKS} in flight, "
              f"{args.window_s:g} s windows; per pair, checksums on / off: GB/s, the "
              "workers' CPU s per GB, device busy ms per GB")
        got: dict[str, list[tuple[float, float, float]]] = {"on": [], "off": []}
        for pair in range(args.pairs):
            for way in (ways if pair % 2 == 0 else ways[::-1]):
                busy, gbps = way.window(args.window_s)
                got[way.name].append((gbps, way.cpu_s_per_gb, busy))
            on, off = got["on"][-1], got["off"][-1]
            huge = [_huge_kib(way.tier.worker_pids()) >> 10 for way in ways]
            print(f"  pair {pair + 1}: {on[0]:.2f} / {off[0]:.2f} GB/s   "
                  f"{on[1]:.2f} / {off[1]:.2f} CPU s/GB   {on[2]:.0f} / {off[2]:.0f} ms/GB   "
                  f"huge pages {huge[0]} / {huge[1]} MiB",
                  flush=True)
        ratio = [a[0] / b[0] for a, b in zip(got["off"], got["on"])]
        extra = [a[1] - b[1] for a, b in zip(got["on"], got["off"])]
        print(f"medians: off / on GB/s x{statistics.median(ratio):.2f} "
              f"({min(ratio):.2f}-{max(ratio):.2f}); the checksum's CPU "
              f"{statistics.median(extra) * 1e3:.0f} ms per GB "
              f"({min(extra) * 1e3:.0f} to {max(extra) * 1e3:.0f})")


if __name__ == "__main__":
    main()

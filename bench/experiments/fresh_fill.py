"""Stores into a fresh root through the tier, with the block folder's 4,096 top folders
made ahead by the caretaker (``folders_ahead=True``, waited for before the clock
starts) and without (made by the stores as they need them): 16 jobs of 16 blocks in
flight, a new root each time, the two ways alternating and each pair's order reversed
every other round. The roots are removed at the end, not between rounds (ext4's
deletions would slow the next fill: docs/performance.md, section 14).

    python bench/experiments/fresh_fill.py --root /var/tmp --blocks 2048 --rounds 6
    python bench/experiments/fresh_fill.py --at-once ...   # no wait for the folders

Where the time of the way without goes (the helper threads waiting for the lock of the
block folder): run one fill under ``perf record -e sched:sched_switch -g -a`` and read
the record with ``offcpu_waits.py``. docs/performance.md, section 24.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import select
import shutil
import statistics
import tempfile
import time

from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
from mptier.config import parse_bytes
from mptier.storage.folders import TOP_FOLDER_NAMES

JOB_BLOCKS = 16
IN_FLIGHT = 16
# How long to wait for the caretaker to make the folders (a local disk takes ~0.4 s).
FOLDERS_WAIT_S = 30.0


def fill(tier: FileSystemTier, keys: list[bytes]) -> float:
    """Store ``keys`` with IN_FLIGHT jobs in flight; the seconds it took."""
    start = time.perf_counter()
    sent = running = job = 0
    while sent < len(keys) or running:
        while running < IN_FLIGHT and sent < len(keys):
            slot = job % IN_FLIGHT * JOB_BLOCKS
            part = keys[sent:sent + JOB_BLOCKS]
            tier.submit_store(TransferJob(job, part, list(range(slot, slot + len(part)))))
            sent += len(part)
            running += 1
            job += 1
        select.select([tier.fileno()], [], [], 0.05)
        for result in tier.get_finished_jobs():
            assert result.success, result.error
            running -= 1
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/var/tmp")
    ap.add_argument("--block", default="256K")
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--at-once", action="store_true",
                    help="store as soon as the tier is up, while its caretaker still makes "
                         "the folders (an engine that stores at once)")
    a = ap.parse_args()
    block_bytes = parse_bytes(a.block)
    buf = SharedKVBuffer.create(JOB_BLOCKS * IN_FLIGHT, block_bytes)
    buf.view[:] = 5
    roots: list[str] = []
    rates: dict[str, list[float]] = {"ahead": [], "on demand": []}
    try:
        for rnd in range(a.rounds):
            ways = ["on demand", "ahead"] if rnd % 2 == 0 else ["ahead", "on demand"]
            for way in ways:
                root = tempfile.mkdtemp(dir=a.root, prefix="fresh-fill-")
                roots.append(root)
                tier = FileSystemTier(buf, root_dir=root, folders_ahead=way == "ahead")
                try:
                    blocks_dir = tier.mapper.blocks_dir
                    waited = time.monotonic()
                    while way == "ahead" and not a.at_once and len(
                            os.listdir(blocks_dir)) < len(TOP_FOLDER_NAMES):
                        assert time.monotonic() - waited < FOLDERS_WAIT_S, "no folders"
                        time.sleep(0.01)
                    os.sync()
                    keys = [make_key(hashlib.sha256(f"{rnd}-{way}-{i}".encode()).digest(), 0)
                            for i in range(a.blocks)]
                    seconds = fill(tier, keys)
                    if way == "ahead":
                        made = len(os.listdir(blocks_dir))
                        print(f"  {made} top folders when the fill ended", flush=True)
                finally:
                    tier.shutdown()
                rates[way].append(a.blocks * block_bytes / seconds / 1e9)
                print(f"round {rnd + 1}: {way:9s} {rates[way][-1]:.2f} GB/s", flush=True)
    finally:
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
        buf.close()
        buf.unlink()
    pairs = [a_ / d for a_, d in zip(rates["ahead"], rates["on demand"])]
    print(f"{a.blocks} fresh blocks of {a.block} on {a.root}, {IN_FLIGHT} jobs of "
          f"{JOB_BLOCKS} in flight; GB/s, median and every round:")
    for way, got in rates.items():
        print(f"  {way:9s} {statistics.median(got):5.2f}   "
              + " ".join(f"{x:.2f}" for x in got))
    print(f"  ahead / on demand, round by round: median {statistics.median(pairs):.2f}   "
          + " ".join(f"{x:.2f}" for x in pairs))


if __name__ == "__main__":
    main()

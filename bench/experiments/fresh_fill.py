"""Stores into a fresh root through the tier, with the block folder's 4,096 top folders
made ahead by the caretaker (``folders_ahead=True``, waited for before the clock
starts) and without (made by the stores as they need them): 16 jobs of 16 blocks in
flight, a new root each time, the two ways alternating and each pair's order reversed
every other round. The roots are removed at the end, not between rounds (ext4's
deletions would slow the next fill: docs/performance.md, section 14).

    python bench/experiments/fresh_fill.py --root /var/tmp --blocks 2048 --rounds 6
    python bench/experiments/fresh_fill.py --at-once ...   # no wait for the folders
    .venv-vllm/bin/python bench/experiments/fresh_fill.py --raw-threads 1,16,64 --vllm

``--raw-threads`` adds fills without a tier (fresh_files.c: each thread stores a block
as vLLM + C does, folders, temporary file, write, rename), the fastest this file system
takes fresh blocks at each number of threads; ``--vllm`` adds vLLM + C's own fills
(from the environment scripts/vllm-env.sh makes), its tier driven as the bench drives it.

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
import subprocess
import sys
import tempfile
import time

from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
from mptier.config import parse_bytes
from mptier.storage.folders import TOP_FOLDER_NAMES

HERE = os.path.dirname(os.path.abspath(__file__))

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
    ap.add_argument("--raw-threads", default="",
                    help="also fills without a tier on these numbers of threads, e.g. 16,64")
    ap.add_argument("--vllm", action="store_true",
                    help="also vLLM + C's fills (needs vLLM with fs_io_C)")
    ap.add_argument("--tier", action="append", default=[], metavar="KEY=VALUE,...",
                    help="also fills of a tier with these settings, folders ahead "
                         "(repeatable), e.g. checksum_blocks=false")
    a = ap.parse_args()
    block_bytes = parse_bytes(a.block)
    buf = SharedKVBuffer.create(JOB_BLOCKS * IN_FLIGHT, block_bytes)
    buf.view[:] = 5
    roots: list[str] = []
    settings = {"on demand": {"folders_ahead": False}, "ahead": {"folders_ahead": True}}
    for text in a.tier:
        pairs = dict(part.split("=", 1) for part in text.split(",") if part)
        settings[f"tier[{text}]"] = {"folders_ahead": True, **{
            k: {"true": True, "false": False}.get(v, v) for k, v in pairs.items()}}
    order = list(settings) + [
        f"raw threads={t}" for t in a.raw_threads.split(",") if t] + (
        ["vllm + C"] if a.vllm else [])
    rates: dict[str, list[float]] = {way: [] for way in order}
    helper = None
    if a.raw_threads:
        helper = os.path.join(tempfile.mkdtemp(prefix="fresh-files-"), "fresh_files")
        subprocess.run(["gcc", "-O2", "-pthread", "-o", helper,
                        os.path.join(HERE, "fresh_files.c")], check=True)
    try:
        for rnd in range(a.rounds):
            ways = order if rnd % 2 == 0 else order[::-1]
            for way in ways:
                root = tempfile.mkdtemp(dir=a.root, prefix="fresh-fill-")
                roots.append(root)
                keys = [make_key(hashlib.sha256(f"{rnd}-{way}-{i}".encode()).digest(), 0)
                        for i in range(a.blocks)]
                if way not in settings:
                    os.sync()
                    seconds = other_fill(way, root, keys, buf, block_bytes, helper)
                    rates[way].append(a.blocks * block_bytes / seconds / 1e9)
                    print(f"round {rnd + 1}: {way:9s} {rates[way][-1]:.2f} GB/s", flush=True)
                    continue
                tier = FileSystemTier(buf, root_dir=root, **settings[way])
                ahead = settings[way]["folders_ahead"]
                try:
                    blocks_dir = tier.mapper.blocks_dir
                    waited = time.monotonic()
                    while ahead and not a.at_once and len(
                            os.listdir(blocks_dir)) < len(TOP_FOLDER_NAMES):
                        assert time.monotonic() - waited < FOLDERS_WAIT_S, "no folders"
                        time.sleep(0.01)
                    os.sync()
                    seconds = fill(tier, keys)
                    if ahead:
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
        if helper is not None:
            shutil.rmtree(os.path.dirname(helper))
    print(f"{a.blocks} fresh blocks of {a.block} on {a.root}, {IN_FLIGHT} jobs of "
          f"{JOB_BLOCKS} in flight; GB/s, median and every round:")
    for way, got in rates.items():
        print(f"  {way:9s} {statistics.median(got):5.2f}   "
              + " ".join(f"{x:.2f}" for x in got))
    for other in [way for way in order if way != "ahead"]:
        pairs = [x / y for x, y in zip(rates["ahead"], rates[other])]
        print(f"  ahead / {other}, round by round: median {statistics.median(pairs):.2f}   "
              + " ".join(f"{x:.2f}" for x in pairs))


def other_fill(way: str, root: str, keys: list[bytes], buf: SharedKVBuffer,
               block_bytes: int, helper: str | None) -> float:
    """A fill of a fresh root without mptier: the raw helper's, or vLLM + C's."""
    if way == "vllm + C":
        sys.path.insert(0, HERE)
        from cold_opens import VllmWay

        vllm = VllmWay(buf, root, block_bytes)
        try:
            return vllm.fill(keys, JOB_BLOCKS, IN_FLIGHT)
        finally:
            vllm.close()
    from mptier.bench.base import MODEL_NAME
    from mptier.layout import FileMapper

    mapper = FileMapper(root, MODEL_NAME)
    os.makedirs(mapper.blocks_dir, exist_ok=True)
    out = subprocess.run(
        [helper, way.rsplit("=", 1)[1], str(block_bytes), mapper.blocks_dir],
        check=True, capture_output=True, text=True,
        input="\n".join(mapper.relative_path_for(k) for k in keys))
    return float(out.stdout) / 1e3


if __name__ == "__main__":
    main()

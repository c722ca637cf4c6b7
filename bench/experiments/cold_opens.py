"""Where a lone job's time goes when its files' folders and inodes are not in memory
(the bench's "64-block job alone" drops the page cache, dentries and inodes included,
between its store and its load): 64 cold opens on 1, 4, 16, 64 threads (cold_opens.c),
the same opens as a lookup in the ring (O_PATH, ``Backend.batch_lookup``), and the tier's
64-block load with the whole cache dropped (``drop_caches`` 3) and with only the page
cache dropped (1: folders and inodes stay). Every way gets its own fresh blocks each
round, stored through the tier beside ``--background`` others (a root in use), and the
ways run in a shuffled order each round. Needs root (drop_caches) and gcc.

    sudo python bench/experiments/cold_opens.py --root /var/tmp --rounds 5

docs/performance.md, section 24.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import select
import shutil
import statistics
import subprocess
import tempfile
import time

from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key, native
from mptier.config import parse_bytes

HERE = os.path.dirname(os.path.abspath(__file__))


def drop(level: int) -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write(str(level))
    time.sleep(0.05)  # let the drop's own writes settle


def keys_for(tag: str, n: int) -> list[bytes]:
    return [make_key(hashlib.sha256(f"{tag}-{i}".encode()).digest(), 0) for i in range(n)]


def store(tier: FileSystemTier, keys: list[bytes], n: int) -> None:
    for start in range(0, len(keys), n):
        part = keys[start:start + n]
        tier.submit_store(TransferJob(start, part, list(range(len(part)))))
        tier.drain_jobs()
        assert all(r.success for r in tier.get_finished_jobs())


def timed_load(tier: FileSystemTier, keys: list[bytes], n: int) -> float:
    start = time.perf_counter()
    tier.submit_load(TransferJob(1, keys, list(range(n, 2 * n))))
    done = []
    while not done:
        select.select([tier.fileno()], [], [], 1.0)
        done = tier.get_finished_jobs()
    assert done[0].success, done[0].error
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/var/tmp")
    ap.add_argument("--block", default="256K")
    ap.add_argument("--blocks", type=int, default=64, help="blocks of the lone job")
    ap.add_argument("--background", type=int, default=2048,
                    help="blocks stored first, so the root's folders are a tier's in use")
    ap.add_argument("--threads", default="1,4,16,64")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    block_bytes, n = parse_bytes(a.block), a.blocks
    work = tempfile.mkdtemp(prefix="cold-opens-")
    helper = os.path.join(work, "cold_opens")
    subprocess.run(["gcc", "-O2", "-pthread", "-o", helper,
                    os.path.join(HERE, "cold_opens.c")], check=True)
    buf = SharedKVBuffer.create(2 * n, block_bytes)
    buf.view[:] = 3
    root = tempfile.mkdtemp(dir=a.root, prefix="cold-opens-")
    tier = FileSystemTier(buf, root_dir=root)
    ways = [f"threads={t}" for t in a.threads.split(",")] + [
        "ring lookup", "tier load, cache dropped", "tier load, folders and inodes kept"]
    times: dict[str, list[float]] = {way: [] for way in ways}
    try:
        store(tier, keys_for("background", a.background), n)
        shuffle = random.Random(1)
        blocks_dir = tier.mapper.blocks_dir
        for rnd in range(a.rounds):
            shuffle.shuffle(ways)
            for way in ways:
                keys = keys_for(f"{rnd}-{way}", n)
                store(tier, keys, n)
                paths = [tier.mapper.relative_path_for(k) for k in keys]
                drop(1 if "kept" in way else 3)
                if way.startswith("threads="):
                    out = subprocess.run(
                        [helper, way.split("=")[1]], check=True, capture_output=True,
                        text=True, input="\n".join(f"{blocks_dir}/{p}" for p in paths))
                    times[way].append(float(out.stdout))
                elif way == "ring lookup":
                    start = time.perf_counter()
                    found = native.batch_lookup(blocks_dir, paths, block_bytes, uring=True)
                    times[way].append((time.perf_counter() - start) * 1e3)
                    assert set(found) == {native.LOOKUP_PRESENT}, found
                else:
                    times[way].append(timed_load(tier, keys, n))
            print(f"round {rnd + 1} of {a.rounds} done", flush=True)
    finally:
        tier.shutdown()
        shutil.rmtree(root)
        shutil.rmtree(work)
        buf.close()
        buf.unlink()
    print(f"{n} blocks of {a.block} on {a.root}, beside {a.background} others; ms, "
          f"median and every round:")
    for way in sorted(times):
        got = times[way]
        print(f"  {way:36s} {statistics.median(got):7.2f}   "
              + " ".join(f"{x:.1f}" for x in got))


if __name__ == "__main__":
    main()

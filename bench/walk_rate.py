"""Walk rate of mptier.storage on a tree of small block files in the vLLM layout.

    python bench/walk_rate.py [--root /var/tmp/mptier-walk] [--files 200000] [--keep]

Builds ``--files`` 64-byte blocks (sha256 keys, so they spread over the folders as
vLLM's do: about one leaf folder per file) unless the root already holds that tree, then
times, with a warm page cache (dropping it would slow every other user of the machine):
a full walk (``Walker.walk_all``), the same walk in ``step(1000)`` slices with the time
of each step, ``RootMaintainer.step(1000)`` (walk + usage + sweep + candidates) and
``os.walk`` + ``lstat`` for reference. Removes the tree afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time

from mptier.keys import make_key
from mptier.layout import FileMapper
from mptier.storage import Kind, RootMaintainer, Walker
from mptier.storage.names import MPTIER_JSON

BLOCK = b"k" * 64


def build(root: str, files: int) -> None:
    marker = f"{root}/.built-{files}"
    if os.path.exists(marker):
        return
    shutil.rmtree(root, ignore_errors=True)
    mapper = FileMapper(root, "bench/walk")
    mapper.write_config()
    with open(f"{mapper.base_path}/{MPTIER_JSON}", "w") as f:
        json.dump({"block_bytes": len(BLOCK)}, f)
    made: set[str] = set()
    start = time.perf_counter()
    for i in range(files):
        path = mapper.path_for(make_key(hashlib.sha256(i.to_bytes(8, "big")).digest()))
        parent = os.path.dirname(path)
        if parent not in made:
            os.makedirs(parent, exist_ok=True)
            made.add(parent)
        with open(path, "wb") as f:
            f.write(BLOCK)
    open(marker, "w").close()
    print(f"built {files:,} files in {len(made):,} leaf folders in "
          f"{time.perf_counter() - start:.1f} s")


def timed_walk(root: str) -> tuple[float, int, int]:
    start = time.perf_counter()
    walker = Walker(root)
    blocks = sum(e.kind is Kind.BLOCK for e in walker.walk_all())
    return time.perf_counter() - start, walker.entries, blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="/var/tmp/mptier-walk")
    parser.add_argument("--files", type=int, default=200_000)
    parser.add_argument("--keep", action="store_true", help="keep the tree for next time")
    args = parser.parse_args()
    build(args.root, args.files)
    try:
        timed_walk(args.root)   # warm the cache
        runs = [timed_walk(args.root) for _ in range(3)]
        seconds, entries, blocks = min(runs)
        print(f"Walker.walk_all: {entries:,} entries ({blocks:,} blocks) in {seconds:.2f} s"
              f" = {entries / seconds:,.0f} entries/s, {blocks / seconds:,.0f} blocks/s "
              f"(best of 3; all: {', '.join(f'{r[0]:.2f}' for r in runs)} s)")

        walker = Walker(args.root)
        steps = []
        start = time.perf_counter()
        while not walker.done:
            t = time.perf_counter_ns()
            walker.step(1000)
            steps.append(time.perf_counter_ns() - t)
        total = time.perf_counter() - start
        steps.sort()
        print(f"Walker.step(1000): {len(steps)} steps, {walker.entries / total:,.0f} entries/s;"
              f" per step median {steps[len(steps) // 2] / 1e6:.2f} ms, p99 "
              f"{steps[int(len(steps) * 0.99)] / 1e6:.2f} ms, max {steps[-1] / 1e6:.2f} ms")

        maint = RootMaintainer(args.root, capacity_bytes=10 * args.files * len(BLOCK),
                               locks_work=True)
        start = time.perf_counter()
        n = 0
        while not maint.complete:
            maint.step(1000)
            n += 1
        total = time.perf_counter() - start
        print(f"RootMaintainer.step(1000): one pass in {n} steps, {total:.2f} s, "
              f"usage {maint.usage_bytes:,} bytes ({maint.usage()['blocks']:,} blocks)")

        start = time.perf_counter()
        count = 0
        for dirpath, dirs, names in os.walk(args.root):
            for name in names + dirs:
                os.lstat(os.path.join(dirpath, name))
                count += 1
        total = time.perf_counter() - start
        print(f"os.walk + lstat (reference): {count:,} entries in {total:.2f} s = "
              f"{count / total:,.0f} entries/s")
    finally:
        if not args.keep:
            shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()

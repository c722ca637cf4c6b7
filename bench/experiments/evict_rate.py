"""How fast a file system lets blocks be evicted, by number of unlink threads: the
ceiling a burst of stores runs into once the slack is spent (docs/storage.md, "Capacity
at scale").

    python bench/experiments/evict_rate.py [--root /var/tmp] [--blocks 8000]
        [--block 4K] [--threads 1,4,8,16] [--rounds 2]

Per round and thread count: writes ``--blocks`` blocks in the tier's folder shape (a
``<h3>/<h2>_g0`` leaf folder per block, as the layout gives nearly every block), syncs
them (an eviction removes blocks written back long ago), then removes them the way the
caretaker's unlink threads do (``lstat``, ``unlink``, the emptied leaf and ``<h3>``
folders: :func:`mptier.storage.walk.remove_empty_parents`) from that many threads, and
prints blocks removed per second beside the rate the blocks were written at and the
load average. Thread counts alternate within a round, so the disk's drift falls on all.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import queue
import shutil
import tempfile
import threading
import time

from mptier.config import parse_bytes
from mptier.storage.walk import remove_empty_parents


def write_blocks(folder: str, n: int, data: bytes) -> list[str]:
    paths = []
    for i in range(n):
        name = hashlib.sha256(f"{folder}/{i}".encode()).hexdigest()
        leaf = os.path.join(folder, name[:3], f"{name[3:5]}_g0")
        os.makedirs(leaf, exist_ok=True)
        path = os.path.join(leaf, f"{name}.bin")
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
    return paths


def remove_all(paths: list[str], n_threads: int) -> float:
    """Remove ``paths`` from ``n_threads`` threads as an eviction does; the seconds."""
    todo: queue.SimpleQueue[str] = queue.SimpleQueue()
    for path in paths:
        todo.put(path)

    def run() -> None:
        while True:
            try:
                path = todo.get_nowait()
            except queue.Empty:
                return
            os.lstat(path)
            os.unlink(path)
            remove_empty_parents(path)

    threads = [threading.Thread(target=run) for _ in range(n_threads)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="/var/tmp", help="a folder on the file system")
    parser.add_argument("--blocks", type=int, default=8000)
    parser.add_argument("--block", default="4K", help="block size (default 4K)")
    parser.add_argument("--threads", default="1,4,8,16", help="thread counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    data = os.urandom(parse_bytes(args.block))
    for rnd in range(1, args.rounds + 1):
        for n_threads in counts:
            folder = tempfile.mkdtemp(prefix="mptier-evict-rate-", dir=args.root)
            try:
                began = time.monotonic()
                paths = write_blocks(folder, args.blocks, data)
                written = args.blocks / (time.monotonic() - began)
                os.sync()
                removed = args.blocks / remove_all(paths, n_threads)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            print(f"round {rnd} threads {n_threads:2d}: removed {removed:7.0f} blocks/s "
                  f"(written {written:6.0f}/s), load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()

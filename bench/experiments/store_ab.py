"""ext4 stores of fresh 256 KiB blocks, the C cores alone: vLLM's fs_io_C batch store
(its tier's way: a job of blocks per call, on T threads) against mptier's native batch
store (a task per call, on T threads), same block count, interleaved rounds, a fresh
folder each, nothing deleted until the end (deletions slow the next creations down on
ext4 without a journal: inode_create.py). Needs .venv-vllm (scripts/vllm-env.sh).

    .venv-vllm/bin/python bench/experiments/store_ab.py --root /var/tmp
"""

import argparse
import mmap
import os
import queue
import shutil
import statistics
import tempfile
import threading
import time

from vllm.v1.kv_offload.tiering.fs.io import batch_store_block

from mptier import native
from mptier.native import _checks

ap = argparse.ArgumentParser()
ap.add_argument("--root", default="/var/tmp")
ap.add_argument("--block", type=int, default=256 << 10)
ap.add_argument("--jobs", type=int, default=128)
ap.add_argument("--job-blocks", type=int, default=16)
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--ways", default="vllm16,mpt4,mpt4-nocrc,mpt16",
                help="design and threads, -nocrc: mptier without checksums")
a = ap.parse_args()
bb, n = a.block, a.jobs * a.job_blocks
buf = mmap.mmap(-1, n * bb)
mem = memoryview(buf)
for i in range(0, n * bb, 4096):
    buf[i] = (i // 4096) % 251
tag = _checks.tag(None)
be = native.get_backend()


def run(way: str, folder: str) -> float:
    threads = int("".join(ch for ch in way.split("-")[0] if ch.isdigit()))
    rel = [f"{h[:3]}/{h[3:5]}_g0/{h}.bin" for h in (os.urandom(32).hex() for _ in range(n))]
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for j in range(a.jobs):
        todo.put(j)
    mine = way.startswith("mpt")
    root_fd = native.open_root(folder) if mine else -1
    flags = _checks.flags(True, "nocrc" not in way, True, True, False, True)

    def worker() -> None:
        while True:
            try:
                j = todo.get_nowait()
            except queue.Empty:
                return
            s, e = j * a.job_blocks, (j + 1) * a.job_blocks
            offsets = [i * bb for i in range(s, e)]
            if mine:
                rc, *_ = be.store(root_fd, [r.encode() for r in rel[s:e]], mem, offsets, bb,
                                  flags, tag)
                assert rc == 0, rc
            else:
                paths = [f"{folder}/{r}" for r in rel[s:e]]
                for p in paths:
                    os.makedirs(os.path.dirname(p), exist_ok=True)
                batch_store_block(paths, mem, offsets, bb, True)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    wall = time.perf_counter() - t0
    if mine:
        os.close(root_fd)
    return n * bb / wall / 1e9


results: dict[str, list[float]] = {w: [] for w in a.ways.split(",")}
folders = []
for rnd in range(a.rounds):
    for way in (list(results) if rnd % 2 == 0 else list(results)[::-1]):
        folders.append(tempfile.mkdtemp(dir=a.root, prefix="store-ab-"))
        os.sync()
        results[way].append(run(way, folders[-1]))
for folder in folders:
    shutil.rmtree(folder)
for way, values in results.items():
    print(f"{way:12s} GB/s median {statistics.median(values):.3f} "
          f"({' '.join(f'{x:.2f}' for x in values)})")

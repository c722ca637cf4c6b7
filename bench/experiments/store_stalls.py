"""Where a slow store phase's time goes: the longest waits between two finished store
jobs, and what the workers' threads were doing in the kernel during the longest one
(docs/performance.md, section 15).

    python bench/experiments/store_stalls.py [--root /var/tmp] [--block 256K]
        [--phases 8] [--total 1G]

Per phase: a fresh tier in a fresh folder under ``--root`` (files kept, as the bench keeps
them on a disk), a cold pass of ``--total`` bytes, then a timed store phase of as many
new blocks with 16 jobs of 16 blocks in flight, as the bench's store phase runs them.
While the phase runs, a thread reads the state of every thread of the workers and of
this process every SAMPLE_S from ``/proc`` (R running, D waiting in the kernel, with the
kernel function it waits in). Prints one JSON line per phase: GB/s, the three longest
gaps between completions (start in the phase, length, seconds), and the thread states
counted over the longest gap. Every thread waiting in ``__iomap_dio_rw`` with nothing
completing is the disk not finishing direct writes; ``filename_create`` or
``__ext4_get_inode_loc`` would be the file system's metadata.

The folders are removed at the end (``--keep`` leaves them).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import threading
import time

from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
from mptier.config import parse_bytes

JOB_BLOCKS, INFLIGHT = 16, 16  # the bench's defaults
SAMPLE_S = 0.003  # /proc reads of ~10 threads take well under a millisecond
POLL_S = 0.0005  # the engine loop's sleep between looks for finished jobs


class ThreadStates(threading.Thread):
    """Samples which threads of ``pids`` are not sleeping, and where they wait."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.tids = [(pid, int(t)) for pid in pids for t in os.listdir(f"/proc/{pid}/task")]
        self.done = threading.Event()
        self.samples: list[tuple[float, list[tuple[str, str]]]] = []

    def run(self) -> None:
        while not self.done.is_set():
            now, seen = time.monotonic(), []
            for pid, tid in self.tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        stat = f.read()
                    state = stat[stat.rindex(")") + 2]
                    if state != "S":
                        with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                            seen.append((state, f.read() or "-"))
                except OSError:
                    continue
            self.samples.append((now, seen))
            time.sleep(SAMPLE_S)

    def between(self, start: float, stop: float) -> list[tuple[tuple[str, str], int]]:
        counts: collections.Counter = collections.Counter()
        for now, seen in self.samples:
            if start <= now <= stop:
                counts.update(seen)
        return counts.most_common(6)


def store_phase(tier: FileSystemTier, tag: str, blocks: int) -> tuple[float, list[float]]:
    """Store ``blocks`` new blocks; (seconds, monotonic time of each finished job)."""
    free, pending, finished = list(range(INFLIGHT)), {}, []
    submitted = job_id = 0
    started = time.monotonic()
    while submitted < blocks or pending:
        for result in tier.get_finished_jobs():
            if not result.success:
                raise RuntimeError(f"store job {result.job_id} failed: {result.error}")
            free.append(pending.pop(result.job_id))
            finished.append(time.monotonic())
        while free and submitted < blocks:
            slot, job_id = free.pop(), job_id + 1
            keys = [make_key(hashlib.sha256(f"{tag}-{submitted + i}".encode()).digest(), 0)
                    for i in range(JOB_BLOCKS)]
            pending[job_id] = slot
            tier.submit_store(TransferJob(job_id, keys, [slot * JOB_BLOCKS + i
                                                         for i in range(JOB_BLOCKS)]))
            submitted += JOB_BLOCKS
        time.sleep(POLL_S)
    return time.monotonic() - started, [started, *finished]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="/var/tmp")
    p.add_argument("--block", default="256K")
    p.add_argument("--phases", type=int, default=8)
    p.add_argument("--total", default="1G")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    block, total = parse_bytes(args.block), parse_bytes(args.total)
    blocks = total // block
    buffer = SharedKVBuffer.create(INFLIGHT * JOB_BLOCKS, block)
    buffer.view[:] = 7
    top = tempfile.mkdtemp(prefix="store-stalls-", dir=args.root)
    try:
        for phase in range(args.phases):
            folder = os.path.join(top, str(phase))
            os.mkdir(folder)
            tier = FileSystemTier(buffer, root_dir=folder, status_socket="")
            try:
                store_phase(tier, f"cold{phase}", blocks)
                states = ThreadStates([*tier.worker_pids(), os.getpid()])
                states.start()
                seconds, times = store_phase(tier, f"warm{phase}", blocks)
                states.done.set()
                states.join()
            finally:
                tier.shutdown()
            gaps = sorted((b - a, a) for a, b in itertools.pairwise(times))[-3:]
            longest, at = gaps[-1]
            print(json.dumps({
                "phase": phase, "gbps": round(total / seconds / 1e9, 3),
                "longest_gaps": [[round(a - times[0], 3), round(g, 3)] for g, a in gaps],
                "threads_in_longest_gap": states.between(at, at + longest)}), flush=True)
    finally:
        buffer.close()
        buffer.unlink()
        if not args.keep:
            shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()

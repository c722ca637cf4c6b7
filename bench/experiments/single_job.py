"""One 64-block load job alone, timed from its submit to the completion that select() on
the tier's pipe sees (the bench's figure includes up to one step of its scheduler's
0.5 ms sleep), per way: checksums on and off, smaller tasks. Beside each job's time,
the CPU the tier's workers spent on it (the sum of their /proc/PID/schedstat run
times from the submit to the completion) and the busiest worker's share of it: a lone
job split over two workers is done when the busier one is.

Every way keeps its own tier; the ways take turns job by job (a job of each way, then
the next round), so a minute in which the machine's memory is slow falls on all of
them. ``--settle`` waits after the tiers start, so their start-up work (folders made
ahead, the first walk) is not in the first jobs.

    python bench/experiments/single_job.py --root /dev/shm --block 256K
    python bench/experiments/single_job.py --block 2M --ways crc,nocrc --jobs 40

docs/performance.md, sections 11 and 30.
"""

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

WAYS = {"crc": {}, "nocrc": {"checksum_blocks": False}, "task4M": {"task_bytes": 4 << 20},
        "task2M": {"task_bytes": 2 << 20}, "task16M": {"task_bytes": 16 << 20},
        "task32M": {"task_bytes": 32 << 20}, "task64M": {"task_bytes": 64 << 20}}
BLOCKS = 64  # the bench's large job alone


def workers_run_ns(tier_pids: list[int]) -> dict[int, int]:
    """Each worker's time on a CPU so far (schedstat's first field, ns)."""
    out = {}
    for pid in tier_pids:
        try:
            with open(f"/proc/{pid}/schedstat") as f:
                out[pid] = int(f.read().split()[0])
        except OSError:  # a worker gone meanwhile: its time is lost, not wrong
            out[pid] = 0
    return out


def one_job(tier: FileSystemTier, tag: str, job: int) -> tuple[float, int, float]:
    keys = [make_key(hashlib.sha256(f"{tag}{job}-{i}".encode()).digest(), 0)
            for i in range(BLOCKS)]
    tier.submit_store(TransferJob(2 * job, keys, list(range(BLOCKS))))
    tier.drain_jobs()
    tier.get_finished_jobs()
    pids = tier.worker_pids()  # a restarted worker is a new pid: taken per job
    ran = workers_run_ns(pids)
    t0 = time.perf_counter_ns()
    tier.submit_load(TransferJob(2 * job + 1, keys, list(range(BLOCKS, 2 * BLOCKS))))
    done = []
    while not done:
        select.select([tier.fileno()], [], [], 1.0)
        done = tier.get_finished_jobs()
    ms = (time.perf_counter_ns() - t0) / 1e6
    assert done[0].success, done[0].error
    spent = {pid: max(0, ns - ran[pid]) for pid, ns in workers_run_ns(pids).items()}
    total = sum(spent.values())
    return ms, total, max(spent.values()) / total if total else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/dev/shm")
    ap.add_argument("--block", default="256K")
    ap.add_argument("--ways", default=",".join(WAYS), help=f"of {', '.join(WAYS)}")
    ap.add_argument("--jobs", type=int, default=30, help="jobs per way")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after the start")
    a = ap.parse_args()
    ways = a.ways.split(",")
    unknown = [w for w in ways if w not in WAYS]
    if unknown:
        ap.error(f"--ways {a.ways!r}: no way {unknown[0]!r}; the ways are {', '.join(WAYS)}")
    bb = parse_bytes(a.block)
    # Every job stores fresh blocks and none are removed before the end: keep them to
    # half the root's free space (in memory, twice the jobs fill the machine's RAM).
    need, st = a.jobs * len(ways) * BLOCKS * bb, os.statvfs(a.root)
    if need > st.f_bavail * st.f_frsize // 2:
        ap.error(f"--jobs {a.jobs}: {len(ways)} ways would store {need / 2**30:.1f} GiB under "
                 f"{a.root}, more than half its free space; use fewer jobs or ways")
    buf = SharedKVBuffer.create(2 * BLOCKS, bb)
    buf.view[:] = 3
    root = tempfile.mkdtemp(dir=a.root, prefix="single-job-")
    tiers, results = {}, {w: [] for w in ways}
    try:
        for way in ways:
            tiers[way] = FileSystemTier(buf, root_dir=f"{root}/{way}", **WAYS[way])
        time.sleep(a.settle)
        for job in range(a.jobs):
            for way in ways:
                results[way].append(one_job(tiers[way], way, job))
    finally:
        for tier in tiers.values():
            tier.shutdown()
        shutil.rmtree(root)
        buf.close()
        buf.unlink()
    for way, rows in results.items():
        ms = [r[0] for r in rows]
        print(f"{way:8s} {BLOCKS}-block load alone ({a.block}): p50 {statistics.median(ms):.2f}"
              f" ms, min {min(ms):.2f}; workers' CPU p50 "
              f"{statistics.median(r[1] for r in rows) / 1e6:.2f} ms a job, the busiest "
              f"worker's share {statistics.median(r[2] for r in rows):.2f}")


if __name__ == "__main__":
    main()

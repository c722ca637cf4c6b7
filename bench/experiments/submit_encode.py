"""submit_store with the C task-record encoder against the Python one, on a live tier.

    python bench/experiments/submit_encode.py [--block 2M,256K] [--calls 400] [--rounds 3]

An idle tier on /dev/shm whose workers are stopped (SIGSTOP) so that nothing but the
calls runs: each round times ``--calls`` ``submit_store`` calls of 16-block jobs back to
back (thread CPU time per call, median), once with ``mptier.jobs.encode_job`` using the
C core and once with its Python twin, in alternating order; then ``encode_job`` alone.
The records stay queued (and are failed at shutdown): only the submit path is measured.
"""

from __future__ import annotations

import argparse
import array
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

import mptier.jobs as jobs
from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
from mptier.config import parse_bytes


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--block", default="2M,256K")
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    c_encode = jobs._c_encode
    if c_encode is None:
        print("the C encoder is not available here")
        return 1
    print(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}")
    for block in (parse_bytes(b) for b in args.block.split(",")):
        folder = tempfile.mkdtemp(prefix="perf-enc-", dir="/dev/shm")
        res: dict[str, list[float]] = {}
        try:
            with SharedKVBuffer.create(16, block) as buf, \
                    FileSystemTier(buf, root_dir=folder) as tier:
                for pid in tier.worker_pids():
                    os.kill(pid, signal.SIGSTOP)
                keys = [make_key(os.urandom(32), 0) for _ in range(16)]
                ids = list(range(16))
                job_id = 0
                try:
                    for rnd in range(args.rounds):
                        order = [("C", c_encode), ("Python", None)]
                        for name, enc in order if rnd % 2 == 0 else order[::-1]:
                            jobs._c_encode = enc
                            samples = []
                            for _ in range(args.calls):
                                job_id += 1
                                c0 = time.thread_time_ns()
                                tier.submit_store(TransferJob(job_id, keys, ids))
                                samples.append(time.thread_time_ns() - c0)
                                # the pipes hold ~16 records: keep them from overflowing
                                for q in tier._queues.values():
                                    q.take_all()
                            res.setdefault(f"submit_store {name}", []).append(
                                statistics.median(samples) / 1e3)
                            per_task = tier._per_task
                            arr = array.array("q", ids)
                            c0 = time.thread_time_ns()
                            for _ in range(args.calls):
                                jobs.encode_job(jobs.TaskKind.STORE, 1, keys, arr, per_task)
                            res.setdefault(f"encode_job {name}", []).append(
                                (time.thread_time_ns() - c0) / args.calls / 1e3)
                finally:
                    jobs._c_encode = c_encode
                    for pid in tier.worker_pids():
                        os.kill(pid, signal.SIGCONT)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        print(f"\n{block >> 10} KiB blocks, 16-block jobs ({tier._per_task} blocks per "
              f"task): µs of thread CPU per call, median of rounds (each round)")
        for key, vals in res.items():
            print(f"  {key:22s} {statistics.median(vals):6.2f}   "
                  f"({' '.join(f'{v:.2f}' for v in vals)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

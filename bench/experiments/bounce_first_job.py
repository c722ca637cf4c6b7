"""The 64-block job alone, into slots no load used before, in a fresh tier: bounced and
direct, each variant in a child process, interleaved rounds (``ab_trees``). Per variant:
each job's time (the first one shows what a new worker pays before its first load), the
workers' CPU time and minor faults per job, and how many destination pages the workers
had mapped before the first job (``/proc/PID/pagemap``).

    python bench/experiments/bounce_first_job.py --root /var/tmp --rounds 3
    python bench/experiments/bounce_first_job.py --old DIR   # an older tree, bounced
"""

from __future__ import annotations

import sys

from ab_trees import CHILD_WORKERS, flag_rounds, load_line, parser

CHILD = CHILD_WORKERS + r'''
import json, os, shutil, sys, time
import numpy as np
from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
block, region, bounce, root, repeats = (int(sys.argv[1]), int(sys.argv[2]),
    sys.argv[3] == "1", sys.argv[4], int(sys.argv[5]))
JOB = 64
def mapped_destination(pid, nbytes):
    """Pages of the buffer's second half present in pid's page table."""
    for line in open(f"/proc/{pid}/maps"):
        parts = line.split()
        if len(parts) < 6 or parts[1] != "rw-s":
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if hi - lo != nbytes:
            continue
        with open(f"/proc/{pid}/pagemap", "rb") as f:
            f.seek((lo + nbytes // 2) // 4096 * 8)
            entries = np.frombuffer(f.read(nbytes // 2 // 4096 * 8), dtype=np.uint64)
        return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())
    return None

with SharedKVBuffer.create(2 * region, block) as buf:
    rng = np.random.default_rng(0)
    for s in range(0, region, 16):
        buf.view[s:s + 16] = rng.integers(0, 256, (min(16, region - s), block), dtype=np.uint8)
    buf.view[region:] = 0
    keys = [make_key(os.urandom(32), 0) for _ in range(region)]
    tier = FileSystemTier(buf, root_dir=root, bounce_loads=bounce)
    jid = pending = 0
    for s in range(0, region, 16):
        jid += 1
        tier.submit_store(TransferJob(jid, keys[s:s + 16], list(range(s, s + 16))))
        pending += 1
    while pending:
        done = tier.get_finished_jobs()
        assert all(r.success for r in done), done
        pending -= len(done)
        time.sleep(0.001)
    nbytes = 2 * region * block
    mapped = [mapped_destination(p, nbytes) for p in workers()]
    times = []
    w0 = workers()
    for r in range(repeats):
        base = (r * JOB) % region
        jid += 1
        t0 = time.perf_counter()
        tier.submit_load(TransferJob(jid, keys[base:base + JOB],
                                     list(range(region + base, region + base + JOB))))
        while not (done := tier.get_finished_jobs()):
            time.sleep(0.0002)
        times.append((time.perf_counter() - t0) * 1e3)
        assert done[0].success, done
    w1 = workers()
    ok = all(bool((buf.view[region + b] == buf.view[b]).all())
             for b in range(min(region, repeats * JOB)))
    tier.shutdown()
    shutil.rmtree(root, ignore_errors=True)
    import mptier
print(json.dumps({"code": mptier.__file__, "ms": times, "ok": ok,
                  "pages": nbytes // 2 // 4096, "mapped": mapped,
                  "faults": sum(w1[p][0] - w0[p][0] for p in w1 if p in w0) / repeats,
                  "cpu_ms": sum(w1[p][1] - w0[p][1] for p in w1 if p in w0) / repeats * 1e3}))
'''


def main() -> int:
    p = parser(blocks=512)
    p.add_argument("--repeats", type=int, default=8, help="64-block jobs per tier")
    args = p.parse_args()
    load_line()
    def argv(bounce: str, root: str) -> list:
        return [args.block, args.blocks, bounce, root, args.repeats]

    for rnd, label, r in flag_rounds(CHILD, "bounce", args, "perf-exp-first-job", argv):
        print(f"round {rnd} {label:>10}: jobs (ms) {[round(t) for t in r['ms']]}; "
              f"workers per job {r['cpu_ms']:.0f} ms CPU, {r['faults']:.0f} faults; "
              f"destination pages mapped before {r['mapped']} of {r['pages']}; "
              f"ok {r['ok']}", flush=True)
    load_line()
    return 0


if __name__ == "__main__":
    sys.exit(main())

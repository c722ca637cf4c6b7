"""Where a bounced load's time goes inside the tier: the ext4 store/load of
tier_prefault.py with ``bounce_loads`` on and off, interleaved, each run in a child
process, with the load phase's worker CPU time and minor faults (the sum over the
tier's worker processes, read from /proc/PID/stat before and after the load), and the
root's disk requests in each phase (/proc/diskstats: how many, their mean size and
latency, the mean number in flight; for the store phase also the discard requests, which
a file system mounted with ``discard`` sends for every freed block, and their device
time). ``JOB=64 INFLIGHT=1`` in the environment runs
64-block jobs one at a time (default: 16-block jobs, 16 in flight).

    python bench/experiments/bounce_tier.py --root /var/tmp --rounds 3
    python bench/experiments/bounce_tier.py --fill-dest   # engine buffer fully written

``--old DIR`` adds an older copy of the package as a variant (``git archive <commit>
mptier | tar -x -C DIR`` plus the built _mptier_cffi*.so), bounced and not.
"""

from __future__ import annotations

import sys

from ab_trees import CHILD_PHASE, CHILD_WORKERS, flag_rounds, load_line, parser

CHILD = CHILD_WORKERS + r'''
import json, os, shutil, sys, time
import numpy as np
from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
block, n, bounce, root, fill_dest, rounds = (int(sys.argv[1]), int(sys.argv[2]),
    sys.argv[3] == "1", sys.argv[4], sys.argv[5] == "1", int(sys.argv[6]))

JOB, INFLIGHT = int(os.environ.get("JOB", 16)), int(os.environ.get("INFLIGHT", 16))

def disk():
    """(reads, sectors read, ms reading, writes, sectors written, ms writing, discards,
    ms discarding) of the root's disk, /proc/diskstats."""
    dev = os.stat(root if os.path.exists(root) else os.path.dirname(root)).st_dev
    for line in open("/proc/diskstats"):
        f = line.split()
        if (int(f[0]), int(f[1])) == (os.major(dev), os.minor(dev)):
            return (int(f[3]), int(f[5]), int(f[6]), int(f[7]), int(f[9]), int(f[10]),
                    int(f[14]) if len(f) > 17 else 0, int(f[17]) if len(f) > 17 else 0)
    return 0, 0, 0, 0, 0, 0, 0, 0

''' + CHILD_PHASE + r'''
with SharedKVBuffer.create(2 * n, block) as buf:
    rng = np.random.default_rng(0)
    buf.view[:n] = rng.integers(0, 256, (1, block), dtype=np.uint8)
    if fill_dest:
        buf.view[n:] = 1
    keys = [make_key(os.urandom(32), 0) for _ in range(n)]
    tier = FileSystemTier(buf, root_dir=root, bounce_loads=bounce)
    d0 = disk()
    ts, jid = phase(tier, "store", keys, list(range(n)), 0, poll_s=0.0002)
    d1 = disk()
    writes = d1[3] - d0[3]
    wdisk = (writes, (d1[4] - d0[4]) / 2 / max(writes, 1), (d1[5] - d0[5]) / max(writes, 1),
             (d1[5] - d0[5]) / 1e3 / ts, d1[6] - d0[6], d1[7] - d0[7])
    res = []
    for r in range(rounds):
        buf.view[n:] = 0 if fill_dest else buf.view[n:]
        w0 = workers(); d0 = disk()
        tl, jid = phase(tier, "load", keys, list(range(n, 2 * n)), jid, poll_s=0.0002)
        w1 = workers(); d1 = disk()
        reads, ms = d1[0] - d0[0], d1[2] - d0[2]
        kib = (d1[1] - d0[1]) / 2 / max(reads, 1)
        flt = sum(w1[p][0] - w0[p][0] for p in w1 if p in w0)
        cpu = sum(w1[p][1] - w0[p][1] for p in w1 if p in w0)
        res.append((n * block / tl / 1e9, flt, cpu, reads, kib, ms / max(reads, 1),
                    ms / 1e3 / tl))
    ok = bool((buf.view[n:] == buf.view[:n]).all())
    bl = tier.stats()["roots"][0].get("bounce_loads")
    tier.shutdown()
    shutil.rmtree(root, ignore_errors=True)
    import mptier
print(json.dumps({"code": mptier.__file__, "store_gbps": n * block / ts / 1e9, "wdisk": wdisk,
                  "loads": res, "ok": ok, "bounce_loads": bl}))
'''


def main() -> int:
    p = parser(blocks=256)
    p.add_argument("--loads", type=int, default=2, help="load passes per tier")
    args = p.parse_args()
    load_line()
    def argv(bounce: str, root: str) -> list:
        return [args.block, args.blocks, bounce, root, int(args.fill_dest), args.loads]

    for rnd, label, r in flag_rounds(CHILD, "bounce", args, "perf-exp-bounce", argv):
        loads = ", ".join(f"{g:5.2f} GB/s {f} flt {c:.2f} cpu-s; disk: {n} reads of "
                          f"{kib:.0f} KiB, {lat:.2f} ms each, {q:.1f} in flight"
                          for g, f, c, n, kib, lat, q in r["loads"])
        w = r["wdisk"]
        print(f"round {rnd} {label:>10} ({r['bounce_loads']}): store "
              f"{r['store_gbps']:5.2f} GB/s (disk: {w[0]} writes of {w[1]:.0f} KiB, "
              f"{w[2]:.2f} ms each, {w[3]:.1f} in flight, {w[4]} discards taking "
              f"{w[5]} ms); loads: {loads}; ok {r['ok']}",
              flush=True)
    load_line()
    return 0


if __name__ == "__main__":
    sys.exit(main())

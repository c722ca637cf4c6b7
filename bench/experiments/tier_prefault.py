"""The tier's tmpfs store/load with each pre-fault variant, interleaved in one run.

    python bench/experiments/tier_prefault.py --old /tmp/perf-old --rounds 3

Each variant runs in a child process (so an older copy of the package can be one of
them: ``--old DIR`` puts DIR first on the child's path; make it with
``git archive <commit> mptier | tar -x -C DIR`` plus the built _mptier_cffi*.so):
a SharedKVBuffer of 2 x BLOCKS slots whose source half is filled and whose destination
half is a hole (never written, as a fresh engine buffer), a tier with default settings
except ``prefault``, a store of BLOCKS blocks in 16-block jobs with 16 in flight into a
fresh folder under ``--root`` (default /dev/shm), then a load of them into the
destination half. Prints tier start time, store and load GB/s, and how many pages the
machine allocated meanwhile.
"""

from __future__ import annotations

import os
import sys
import time

from ab_trees import load_line, parser, rounds, run_child, variants

CHILD = r'''
import json, os, resource, shutil, sys, time
import numpy as np
from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
block, n, prefault, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
fill_dest = sys.argv[5] == "1"

def vm():
    out = {}
    for line in open("/proc/vmstat"):
        k, v = line.split(); out[k] = int(v)
    out["pgalloc"] = out["pgalloc_normal"] + out.get("pgalloc_dma32", 0)
    return out

def phase(tier, kind, keys, slots):
    submit = tier.submit_store if kind == "store" else tier.submit_load
    jobs = [(keys[i:i + 16], slots[i:i + 16]) for i in range(0, len(keys), 16)]
    t0 = time.perf_counter(); pending = nxt = 0; jid = 1000 if kind == "load" else 0
    while nxt < len(jobs) or pending:
        while pending < 16 and nxt < len(jobs):
            jid += 1; submit(TransferJob(jid, *jobs[nxt])); nxt += 1; pending += 1
        done = tier.get_finished_jobs()
        assert all(r.success for r in done), done
        pending -= len(done)
        if not done:
            time.sleep(0.0002)
    return time.perf_counter() - t0

with SharedKVBuffer.create(2 * n, block) as buf:
    rng = np.random.default_rng(0)
    buf.view[:n] = rng.integers(0, 256, (1, block), dtype=np.uint8)
    if fill_dest:
        buf.view[n:] = 1  # a fully allocated engine buffer
    keys = [make_key(os.urandom(32), 0) for _ in range(n)]
    v0 = vm(); t0 = time.perf_counter()
    tier = FileSystemTier(buf, root_dir=root, prefault=prefault)
    start_s = time.perf_counter() - t0; v1 = vm()
    ts = phase(tier, "store", keys, list(range(n))); v2 = vm()
    tl = phase(tier, "load", keys, list(range(n, 2 * n))); v3 = vm()
    ok = bool((buf.view[n:] == buf.view[:n]).all())
    tier.shutdown()
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(root, ignore_errors=True)
    import mptier
print(json.dumps({"code": mptier.__file__, "start_s": start_s, "store_gbps": n * block / ts / 1e9,
                      "load_gbps": n * block / tl / 1e9, "ok": ok,
                      "workers_cpu_s": cpu.ru_utime + cpu.ru_stime,
                      "workers_minflt": cpu.ru_minflt,
                      "alloc_start": v1["pgalloc"] - v0["pgalloc"],
                      "alloc_store": v2["pgalloc"] - v1["pgalloc"],
                      "alloc_load": v3["pgalloc"] - v2["pgalloc"]}))
'''


def main() -> int:
    p = parser(blocks=512, root="/dev/shm")
    p.add_argument("--pause", type=float, default=3.0, help="seconds between runs")
    args = p.parse_args()
    load_line()
    for rnd, (label, tree, prefault) in rounds(variants("prefault", "1", "0", args.old),
                                               args.rounds):
        root = os.path.join(args.root, f"perf-exp-tier-{os.getpid()}")
        r = run_child(CHILD, tree, [args.block, args.blocks, prefault, root,
                                    int(args.fill_dest)], label)
        if r is None:
            continue
        print(f"round {rnd} {label:>13}: start {r['start_s']:5.2f} s, store "
              f"{r['store_gbps']:5.2f} GB/s, load {r['load_gbps']:5.2f} GB/s, ok "
              f"{r['ok']}, workers {r['workers_cpu_s']:.2f} CPU s "
              f"{r['workers_minflt']} faults, pages allocated: start {r['alloc_start']}, store "
              f"{r['alloc_store']}, load {r['alloc_load']}", flush=True)
        time.sleep(args.pause)
    return 0


if __name__ == "__main__":
    sys.exit(main())

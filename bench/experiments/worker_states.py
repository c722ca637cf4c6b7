"""Where a tier's workers are while it loads or stores from memory: every worker's (and
the engine's) scheduler state and kernel wait channel, sampled every --every-ms while
16-block jobs run 16 in flight as the bench's light scheduler runs them, beside the
machine's CPUs busy (/proc/stat). A CPU the designs leave idle shows up here as the
wait channel its workers sleep in.

    python bench/experiments/worker_states.py --root /dev/shm --block 2097152 --blocks 2048
    python bench/experiments/worker_states.py --ways crc,nocrc --op store
    python bench/experiments/worker_states.py --root /var/tmp --ways crc,nocrc,nobounce,big
"""

import argparse
import collections
import hashlib
import os
import shutil
import tempfile
import threading

from tier_jobs import drive

from mptier import FileSystemTier, SharedKVBuffer, make_key
from mptier.bench.saturation import machine_busy_seconds

ap = argparse.ArgumentParser()
ap.add_argument("--root", default="/dev/shm")
ap.add_argument("--block", type=int, default=2 << 20)
ap.add_argument("--blocks", type=int, default=2048)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--ways", default="crc,nocrc",
                help="crc: the defaults; nocrc: checksums off; nobounce: loads read "
                     "straight into the slots (bounce_loads=false); big: 32 MiB tasks")
ap.add_argument("--op", choices=("load", "store"), default="load")
ap.add_argument("--every-ms", type=float, default=0.5)
ap.add_argument("--lookups", type=int, default=0,
                help="1: look every key of a load up before submitting it, as the bench does")
a = ap.parse_args()
JOB, INFLIGHT = 16, 16
n = a.blocks
buf = SharedKVBuffer.create(2 * n, a.block)
buf.view[:n] = 7
buf.view[n:] = 1
keys = [make_key(hashlib.sha256(b"k%d" % i).digest(), 0) for i in range(n)]


def state_of(pid: int) -> str:
    """``"R"``, ``"D wchan"`` or ``"S wchan"`` of every thread of ``pid``, joined."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state == "R":
                out.append("R")
                continue
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                out.append(f"{state} {f.read().strip() or '?'}")
    except OSError:
        return "gone"
    return " + ".join(sorted(out))


class Sampler(threading.Thread):
    def __init__(self, pids: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.pids, self.seen = pids, collections.Counter()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(a.every_ms / 1000):
            for who, pid in self.pids.items():
                self.seen[(who, state_of(pid))] += 1


def run(tier, op, base_keys, slots, sample=False):
    pids = {f"{w['role']} {w['slot']}": w["pid"] for w in tier.stats()["workers"]}
    sampler = Sampler(pids) if sample else None
    busy0 = machine_busy_seconds()
    if sampler:
        sampler.start()
    wall = drive(tier, op, base_keys, slots, JOB, INFLIGHT, bool(a.lookups))
    if sampler:
        sampler.stop.set()
        sampler.join()
    cpus = (machine_busy_seconds() - busy0) / wall
    return len(base_keys) * a.block / 1e9 / wall, cpus, sampler.seen if sampler else None


WAYS = {"crc": {}, "nocrc": {"checksum_blocks": False}, "nobounce": {"bounce_loads": False},
        "big": {"task_bytes": 32 << 20}}
tiers = {}
for way in a.ways.split(","):
    if way not in WAYS:
        raise SystemExit(f"--ways: unknown way {way!r} (known: {', '.join(WAYS)})")
    root = tempfile.mkdtemp(dir=a.root, prefix=f"worker-states-{way}-")
    tiers[way] = (FileSystemTier(buf, root_dir=root, **WAYS[way]), root)
    if a.op == "load":
        run(tiers[way][0], "store", keys, list(range(n)))
try:
    for rnd in range(a.rounds):
        for way in (list(tiers) if rnd % 2 == 0 else list(tiers)[::-1]):
            tier = tiers[way][0]
            if a.op == "store":
                fresh = [make_key(hashlib.sha256(b"r%d-%d" % (rnd, i)).digest(), 0)
                         for i in range(n)]
                gbps, cpus, seen = run(tier, "store", fresh, list(range(n)), True)
            else:
                gbps, cpus, seen = run(tier, "load", keys, list(range(n, 2 * n)), True)
            print(f"round {rnd} {way}: {gbps:.2f} GB/s, {cpus:.2f} CPUs busy "
                  f"(load average {os.getloadavg()[0]:.1f})")
            per_worker = collections.defaultdict(collections.Counter)
            for (who, state), count in seen.items():
                per_worker[who][state] += count
            for who, states in sorted(per_worker.items()):
                total = sum(states.values())
                top = ", ".join(f"{s} {c / total:.0%}" for s, c in states.most_common(5))
                print(f"    {who}: {top}")
finally:
    for tier, root in tiers.values():
        tier.shutdown()
        shutil.rmtree(root)
    buf.close()
    buf.unlink()

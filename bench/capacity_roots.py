"""Throughput with a capacity budget that forces eviction against without one, and with
three roots against one: ratios from one interleaved run.

    python bench/capacity_roots.py --root /var/tmp/mptier-cap [--variants none,cap=1G,roots=3]
        [--rounds 3] [--total 3G] [--load 512M] [--json out.json]

Each round runs every variant once (the order alternates between rounds, so a drift of
the machine hits them alike), each on a fresh folder under ``--root``:

* store ``--total`` of 2 MiB blocks (16-block jobs, 8 in flight), timed;
* load back the last-stored ``--load`` bytes (they survive any budget above it), timed.

Variants: ``none`` (no budget, one root), ``cap=SIZE`` (``capacity_bytes``; store more than
it to force eviction), ``roots=N`` (``root_dirs``: N sub-folders of the variant's folder --
one file system, so this measures the routing and per-root caretakers, not more drives).
Prints per-round figures, then medians and ratios to the first variant; ``room_waits``
are the stores that waited for eviction, ``evicted`` the keys evicted (tier stats).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import time
from typing import Any

from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
from mptier.config import parse_bytes

BLOCK = 2 << 20
JOB_BLOCKS = 16
IN_FLIGHT = 8
POLL_S = 0.0005


def run_jobs(tier: FileSystemTier, submit, jobs: list[list[bytes]]) -> tuple[float, int]:
    """Run ``jobs`` with IN_FLIGHT in flight; returns (seconds, failed jobs)."""
    started = time.monotonic()
    next_job = 0
    in_flight: dict[int, int] = {}
    free = list(range(IN_FLIGHT))
    failed = 0
    while next_job < len(jobs) or in_flight:
        while free and next_job < len(jobs):
            slot = free.pop()
            keys = jobs[next_job]
            next_job += 1
            submit(TransferJob(next_job, keys, list(range(slot * JOB_BLOCKS,
                                                          slot * JOB_BLOCKS + len(keys)))))
            in_flight[next_job] = slot
        for result in tier.get_finished_jobs():
            free.append(in_flight.pop(result.job_id))
            failed += not result.success
        time.sleep(POLL_S)
    return time.monotonic() - started, failed


def variant_config(variant: str, folder: str) -> dict[str, Any]:
    if variant == "none":
        return {"root_dir": folder}
    name, _, value = variant.partition("=")
    if name == "cap":
        return {"root_dir": folder, "capacity_bytes": value}
    if name == "roots":
        return {"root_dirs": [f"{folder}/r{i}" for i in range(int(value))]}
    raise SystemExit(f"unknown variant {variant!r}: none, cap=SIZE or roots=N")


def run_variant(buf: SharedKVBuffer, root: str, variant: str, rnd: int, total: int,
                load: int) -> dict[str, Any]:
    folder = f"{root}/{variant.replace('=', '-')}-{rnd}"
    shutil.rmtree(folder, ignore_errors=True)
    tier = FileSystemTier(buf, prefault=False, status_socket="",
                          **variant_config(variant, folder))
    try:
        n = total // BLOCK
        keys = [make_key(hashlib.sha256(f"{variant}/{rnd}/{i}".encode()).digest(), 0)
                for i in range(n)]
        jobs = [keys[i:i + JOB_BLOCKS] for i in range(0, n, JOB_BLOCKS)]
        store_s, store_failed = run_jobs(tier, tier.submit_store, jobs)
        tail = keys[-(load // BLOCK):]
        load_jobs = [tail[i:i + JOB_BLOCKS] for i in range(0, len(tail), JOB_BLOCKS)]
        load_s, load_failed = run_jobs(tier, tier.submit_load, load_jobs)
        stats = tier.stats()
    finally:
        tier.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
    return {"variant": variant, "round": rnd, "store_gbps": n * BLOCK / store_s / 1e9,
            "load_gbps": len(tail) * BLOCK / load_s / 1e9, "store_failed": store_failed,
            "load_failed": load_failed, "evicted": stats["evicted_keys"],
            "room_waits": sum(w.get("room_waits", 0) for w in stats["workers"]),
            "room_wait_s": sum(w.get("room_wait_s", 0.0) for w in stats["workers"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--variants", default="none,cap=1G,roots=3")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--total", default="3G")
    parser.add_argument("--load", default="512M")
    parser.add_argument("--json")
    args = parser.parse_args()
    variants = args.variants.split(",")
    total, load = parse_bytes(args.total), parse_bytes(args.load)
    os.makedirs(args.root, exist_ok=True)
    buf = SharedKVBuffer.create(JOB_BLOCKS * IN_FLIGHT, BLOCK)
    buf.view[:] = 7
    rows = []
    try:
        for rnd in range(args.rounds):
            for variant in variants if rnd % 2 == 0 else variants[::-1]:
                row = run_variant(buf, args.root, variant, rnd, total, load)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        buf.close()
        buf.unlink()
    medians = {v: {k: statistics.median(r[k] for r in rows if r["variant"] == v)
                   for k in ("store_gbps", "load_gbps")} for v in variants}
    base = medians[variants[0]]
    print(f"{'variant':12} {'store GB/s':>10} {'ratio':>6} {'load GB/s':>10} {'ratio':>6}")
    for v in variants:
        m = medians[v]
        print(f"{v:12} {m['store_gbps']:10.2f} {m['store_gbps'] / base['store_gbps']:6.2f} "
              f"{m['load_gbps']:10.2f} {m['load_gbps'] / base['load_gbps']:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "medians": medians, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()

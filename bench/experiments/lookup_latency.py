"""How long a cold lookup takes to answer through a real tier while loads stream beside it,
with ``ring_lookups`` on and off, interleaved rounds.

The bench's harness never waits for a lookup's answer (it submits the load right after
asking), so its figures cannot show what a lookup costs an engine, which waits for the
answer before it schedules the request. Here, per way (a tier of its own on a fresh
folder of ``--root``; both hold the same stored blocks) and per round:

1. drop the page cache;
2. keep 16 load jobs of 16 blocks in flight over ``--load-blocks`` keys (the background:
   other requests' loads), while
3. one "request" after another asks about 16 keys no one has touched since the drop,
   calling ``lookup`` every scheduler step (a poll, then a 0.5 ms sleep, as the bench's
   light scheduler) until every key has its answer: the time from the first ask to the
   last answer is the request's lookup latency.

Prints per round and way the lookup latency (median and 90th percentile over the
requests) and the load rate beside it; then the medians over the rounds. Removes its
folders.

    sudo python bench/experiments/lookup_latency.py --root /var/tmp --rounds 4
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import tempfile
import time

from mptier import FileSystemTier, LookupResult, SharedKVBuffer, TransferJob, make_key
from mptier.bench.measure import drop_page_cache

JOB_BLOCKS, INFLIGHT = 16, 16  # the bench's defaults
POLL_SLEEP_S = 0.0005  # the bench's light scheduler: --poll-us 500
REQUEST_KEYS = 16  # a request's prefix: one job's blocks


def drop_caches() -> None:
    """The keys' folders and inodes out of memory (the bench's own drop), or stop."""
    drop = drop_page_cache()
    if not drop.dropped:
        raise SystemExit(f"cannot drop the page cache (run as root): {drop.error}")


def store_all(tier: FileSystemTier, keys: list[bytes]) -> None:
    jobs = [TransferJob(i + 1, keys[k:k + JOB_BLOCKS], list(range(k, k + JOB_BLOCKS)))
            for i, k in enumerate(range(0, len(keys), JOB_BLOCKS))]
    pending = set()
    for job in jobs:
        tier.submit_store(job)
        pending.add(job.job_id)
        while len(pending) >= INFLIGHT or (job is jobs[-1] and pending):
            for result in tier.get_finished_jobs():
                assert result.success, result.error
                pending.discard(result.job_id)
            time.sleep(POLL_SLEEP_S)


def one_round(tier: FileSystemTier, load_keys: list[bytes], look_keys: list[bytes],
              region: int, job_base: int, block_bytes: int
              ) -> tuple[list[float], float]:
    """Loads of ``load_keys`` kept in flight while requests look ``look_keys`` up, 16 at
    a time; returns each request's lookup latency (s) and the load rate (GB/s)."""
    jobs = [(load_keys[k:k + JOB_BLOCKS], list(range(region + k, region + k + JOB_BLOCKS)))
            for k in range(0, len(load_keys), JOB_BLOCKS)]
    latencies: list[float] = []
    pending: set[int] = set()
    todo = iter(enumerate(jobs, start=job_base))
    asked = 0
    request: tuple[str, list[bytes], float] | None = None
    started = time.perf_counter()
    loads_done_at = None
    while loads_done_at is None or request is not None:
        while len(pending) < INFLIGHT:
            nxt = next(todo, None)
            if nxt is None:
                break
            job_id, (keys, slots) = nxt
            tier.submit_load(TransferJob(job_id, keys, slots))
            pending.add(job_id)
        for result in tier.get_finished_jobs():
            assert result.success, result.error
            pending.discard(result.job_id)
        if not pending and loads_done_at is None:
            loads_done_at = time.perf_counter()
        if request is None and loads_done_at is None and asked + REQUEST_KEYS <= len(look_keys):
            request = (f"q{job_base}-{asked}", look_keys[asked:asked + REQUEST_KEYS],
                       time.perf_counter())
            asked += REQUEST_KEYS
        if request is not None:
            req, keys, asked_at = request
            answers = [tier.lookup(key, req) for key in keys]
            if LookupResult.RETRY not in answers:
                assert set(answers) == {LookupResult.HIT}, answers
                latencies.append(time.perf_counter() - asked_at)
                tier.on_request_finished(req)
                request = None
        tier.on_schedule_end()
        time.sleep(POLL_SLEEP_S)
    gb = len(load_keys) * block_bytes / 1e9
    return latencies, gb / (loads_done_at - started)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--block-bytes", type=int, default=256 << 10)
    ap.add_argument("--load-blocks", type=int, default=2048)
    ap.add_argument("--look-blocks", type=int, default=1024,
                    help="keys for the requests' lookups (16 a request)")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    n_load, n_look = args.load_blocks, args.look_blocks
    region = n_load + n_look
    ways = {"ring": True, "one key at a time": False}
    buf = SharedKVBuffer.create(region + n_load, args.block_bytes)
    buf.view[:region] = 7
    buf.view[region:] = 1
    tiers: dict[str, tuple[FileSystemTier, str]] = {}
    figures: dict[str, list[tuple[float, float, float]]] = {w: [] for w in ways}
    try:
        for way, ring in ways.items():
            root = tempfile.mkdtemp(dir=args.root, prefix="mptier-lookup-latency-")
            tier = FileSystemTier(buf, root_dir=root, ring_lookups=ring)
            tiers[way] = (tier, root)
        for rnd in range(args.rounds):
            # each round its own keys: stored now, cold after the drop
            keys = [make_key(hashlib.sha256(b"%d-%d" % (rnd, i)).digest(), 0)
                    for i in range(region)]
            for tier, _ in tiers.values():
                store_all(tier, keys)
            order = list(ways) if rnd % 2 == 0 else list(reversed(ways))
            for way in order:
                drop_caches()
                tier = tiers[way][0]
                lat, rate = one_round(tier, keys[:n_load], keys[n_load:], region,
                                      1_000_000 * (rnd + 1), args.block_bytes)
                p50, p90 = statistics.median(lat), sorted(lat)[int(0.9 * (len(lat) - 1))]
                figures[way].append((p50, p90, rate))
                print(f"round {rnd + 1} {way}: {len(lat)} requests, lookup latency "
                      f"p50 {p50 * 1e3:.1f} ms p90 {p90 * 1e3:.1f} ms; loads beside it "
                      f"{rate:.2f} GB/s", flush=True)
    finally:
        for tier, root in tiers.values():
            tier.shutdown()
            shutil.rmtree(root, ignore_errors=True)
        buf.unlink()
        buf.close()
    for way, rows in figures.items():
        print(f"{way}: lookup latency p50 {statistics.median(r[0] for r in rows) * 1e3:.1f} ms,"
              f" p90 {statistics.median(r[1] for r in rows) * 1e3:.1f} ms; loads "
              f"{statistics.median(r[2] for r in rows):.2f} GB/s (medians of the rounds)")
    a, b = (figures[w] for w in ways)
    print("one key at a time / ring, lookup p50 per round: "
          + " ".join(f"{y[0] / x[0]:.2f}" for x, y in zip(a, b)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

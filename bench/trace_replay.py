"""Replay a request trace through a budget-limited tier: ENOSPC, room waits, peak usage
against the budget, and the hit ratio beside a simulated LRU of the same budget.

    python bench/trace_replay.py --trace ../shared/traces/conversation_trace.jsonl \
        --root /var/tmp/mptier-trace [--requests 2000] [--budgets 0.10,0.25] [--json F]

A small measuring script for the eviction work (issue 19 items 1-4); the full trace bench
is ``mptier bench --trace``. Trace lines are JSON with ``hash_ids`` (one id per block,
shared prefixes share ids). Per request, in order: look every block up through the tier
(``lookup`` until no RETRY), load the prefix of hits (every byte checked), then store all
of the request's blocks (present ones are only touched, as an engine that recomputed the
rest would do) and wait for it. The simulated LRU follows the same rule: the prefix of
blocks it holds is a hit, then every block of the request becomes the most recent.

Every USAGE_CHECK_EVERY requests, right after the store (the only writer is then done,
so usage is at its peak; eviction may still run, which only lowers it), the root is
walked (``os.scandir``): the largest sum of block files is the peak usage on disk
against the budget, and ``stats()["usage_bytes"]`` is compared with it. (A walk beside
running stores would count a block evicted behind it and one stored ahead of it both.)
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import shutil
import time

import numpy as np

from mptier import FileSystemTier, LookupResult, SharedKVBuffer, TransferJob, make_key

BLOCK = 64 << 10
POLL_S = 0.0005
# How long one request may wait for its lookups or a job before the replay gives up.
WAIT_S = 60.0
# Every this many requests, stats()' usage is compared with a walk of the files.
USAGE_CHECK_EVERY = 5


def key_of(block_id: int) -> bytes:
    return make_key(hashlib.sha256(block_id.to_bytes(8, "little")).digest(), 0)


def content(key: bytes) -> np.ndarray:
    return np.frombuffer(hashlib.shake_128(key).digest(BLOCK), dtype=np.uint8)


def read_trace(path: str, n: int) -> list[list[int]]:
    out = []
    with open(path) as f:
        for line in f:
            if len(out) == n:
                break
            out.append(json.loads(line)["hash_ids"])
    return out


def simulate_lru(requests: list[list[int]], capacity_blocks: int) -> tuple[int, int]:
    """(prefix hits, blocks asked) of an LRU cache of ``capacity_blocks``."""
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    hits = asked = 0
    for ids in requests:
        asked += len(ids)
        for block in ids:
            if block not in cache:
                break
            hits += 1
        for block in ids:
            cache[block] = None
            cache.move_to_end(block)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hits, asked


class DiskWatch:
    """Walks ``root`` when asked; keeps the largest sum of ``*.bin`` sizes seen."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.peak = 0
        self.walks = 0

    def _size(self, path: str) -> int:
        total = 0
        try:
            with os.scandir(path) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        total += self._size(entry.path)
                    elif entry.name.endswith(".bin"):
                        try:
                            total += entry.stat(follow_symlinks=False).st_size
                        except FileNotFoundError:
                            pass
        except FileNotFoundError:
            pass
        return total

    def size_now(self) -> int:
        size = self._size(self.root)
        self.peak = max(self.peak, size)
        self.walks += 1
        return size


def wait_job(tier: FileSystemTier, job_id: int):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for result in tier.get_finished_jobs():
            if result.job_id == job_id:
                return result
        time.sleep(POLL_S)
    raise TimeoutError(f"job {job_id} did not finish within {WAIT_S} s")


def lookup_all(tier: FileSystemTier, keys: list[bytes], req: int) -> list[LookupResult]:
    deadline = time.monotonic() + WAIT_S
    while True:
        answers = [tier.lookup(key, req) for key in keys]
        if LookupResult.RETRY not in answers:
            tier.on_request_finished(req)
            return answers
        tier.on_schedule_end()
        if time.monotonic() > deadline:
            raise TimeoutError("lookups still RETRY")
        time.sleep(POLL_S)


def replay(requests: list[list[int]], root: str, budget: int, buf: SharedKVBuffer) -> dict:
    watch = DiskWatch(root)
    tier = FileSystemTier(buf, root_dir=root, model_name="trace", capacity_bytes=budget,
                          prefault=False, status_socket="")
    hits = asked = enospc = failed = wrong = usage_err = 0
    job = 0
    started = time.monotonic()
    try:
        for req, ids in enumerate(requests):
            keys = [key_of(b) for b in ids]
            asked += len(keys)
            answers = lookup_all(tier, keys, req)
            prefix = 0
            while prefix < len(keys) and answers[prefix] is LookupResult.HIT:
                prefix += 1
            if prefix:
                job += 1
                buf.view[:prefix] = 0
                tier.submit_load(TransferJob(job, keys[:prefix], list(range(prefix))))
                result = wait_job(tier, job)
                done = prefix if result.success else len(result.successful_keys or [])
                for slot in range(done):
                    wrong += not np.array_equal(buf.view[slot], content(keys[slot]))
                hits += done
            for slot, key in enumerate(keys):
                buf.view[slot] = content(key)
            job += 1
            tier.submit_store(TransferJob(job, keys, list(range(len(keys)))))
            result = wait_job(tier, job)
            if not result.success:
                failed += 1
                enospc += result.errno == 28
            tier.take_events()
            if req % USAGE_CHECK_EVERY == 0:  # stats() against the files, after a store
                seen = tier.stats()["usage_bytes"]
                usage_err = max(usage_err, seen - watch.size_now(), key=abs)
        elapsed = time.monotonic() - started
        stats = tier.stats()
    finally:
        tier.shutdown()
    return {"budget": budget, "requests": len(requests), "seconds": round(elapsed, 2),
            "hits": hits, "asked": asked, "hit_ratio": hits / asked,
            "store_failures": failed, "enospc": enospc, "wrong_blocks": wrong,
            "room_waits": sum(w.get("room_waits", 0) for w in stats["workers"]),
            "room_wait_s": round(sum(w.get("room_wait_s", 0.0) for w in stats["workers"]),
                                 3),
            "peak_usage_ratio": round(watch.peak / budget, 4),
            "usage_error_max_blocks": usage_err / BLOCK, "disk_walks": watch.walks,
            "evicted_keys": stats["evicted_keys"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--budgets", default="0.10,0.25",
                        help="fractions of the trace's footprint, comma-separated")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    requests = read_trace(args.trace, args.requests)
    footprint = len({b for ids in requests for b in ids})
    buf = SharedKVBuffer.create(max(len(ids) for ids in requests), BLOCK)
    out = []
    try:
        for fraction in (float(f) for f in args.budgets.split(",")):
            blocks = int(fraction * footprint)
            folder = os.path.join(args.root, f"budget-{fraction:g}")
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            try:
                result = replay(requests, folder, blocks * BLOCK, buf)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            lru_hits, lru_asked = simulate_lru(requests, blocks)
            result.update(fraction=fraction, footprint_blocks=footprint,
                          lru_hit_ratio=lru_hits / lru_asked,
                          vs_lru=result["hits"] / lru_hits if lru_hits else None,
                          load_average=os.getloadavg()[0])
            print(json.dumps(result), flush=True)
            out.append(result)
    finally:
        buf.close()
        buf.unlink()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

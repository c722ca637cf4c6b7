"""Replaying a request trace through a real tier (``mptier bench --trace``).

::

    bench (this thread = the engine's scheduler)          the tier's worker processes
    for each request, in trace order:
      lookup every block ── on_schedule_end ──────────▶  existence checks
      hit prefix = blocks up to the first MISS
      load the hit prefix into slots 0.. ─────────────▶  reads (bytes verified here)
      store the rest from the next slots ─────────────▶  writes, eviction to the budget
      wait for both, then the next request
    a sampler thread walks the tier's folder twice a second (the bytes really on disk)
    every USAGE_CHECK_EVERY requests, after the store: stats() against a walk

Requests run one after another, each finished before the next starts: the trace's
timestamps give the order and nothing else (every gap is compressed to zero), so the
tier sees the block stream the simulators see (:mod:`mptier.bench.tracesim`) and its hit
ratio can be compared with theirs count for count. A block's bytes are derived from its
hash id, so every loaded byte is checked.
"""

from __future__ import annotations

import errno
import hashlib
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mptier import FileSystemTier, LookupResult, SharedKVBuffer, TransferJob, make_key
from mptier.bench.tracefile import TraceRequest

# How often the sampler thread walks the tier's folder for the bytes on disk: often
# enough to catch an overshoot that lasts a second, rare enough (a walk of a 10k-block
# budget takes milliseconds) not to slow the tier it measures.
WALK_EVERY_S = 0.5
# The longest any one lookup, load or store may take before the replay gives up: the
# tier's own io_timeout_s (60 s) plus room for its retry.
WAIT_LIMIT_S = 150.0
# Points of the usage series printed (the JSON keeps every sample, thinned to MAX_SAMPLES).
SERIES_POINTS = 12
MAX_SAMPLES = 2000
# Every this many requests, right after the store (no store in flight: only eviction
# runs, which lowers usage), the tier's folder is walked between two reads of
# stats()["usage_bytes"]: an exact figure brackets the walk. Often enough for a few
# hundred checks a run; the walks' time is left out of the run's seconds.
USAGE_CHECK_EVERY = 10
# Multiplier that spreads hash ids over a block's 64-bit words (odd, so distinct ids
# give distinct words: a block loaded under another id differs in every word).
_ID_MIX = 0x9E3779B97F4A7C15
_HIT = LookupResult.HIT
_RETRY = LookupResult.RETRY


class BlockContent:
    """The bytes of block ``id``: a random pattern XORed with a word derived from id."""

    def __init__(self, block_bytes: int, seed: int = 19) -> None:
        if block_bytes % 8:
            raise ValueError(f"block size {block_bytes} is not a multiple of 8 bytes")
        self.base = np.random.default_rng(seed).integers(
            0, 1 << 63, size=block_bytes // 8, dtype=np.uint64)

    def of(self, ids: list[int]) -> np.ndarray:
        """(len(ids), block_bytes) uint8 array of the blocks' contents."""
        mix = (np.array(ids, dtype=np.uint64) * np.uint64(_ID_MIX))[:, None]
        return (self.base[None, :] ^ mix).view(np.uint8)


def key_of(block_id: int) -> bytes:
    """The tier key of a trace block: a hash of its id, so files spread over folders as
    real block hashes do."""
    return make_key(hashlib.blake2b(block_id.to_bytes(8, "little"), digest_size=16)
                    .digest(), 0)


def disk_usage(folder: str) -> tuple[int, int]:
    """(bytes of published blocks, bytes of temporary files) under ``folder``."""
    blocks = temps = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                size = os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue  # evicted or renamed meanwhile
            if name.endswith(".bin"):
                blocks += size
            elif name.endswith(".tmp"):
                temps += size
    return blocks, temps


class _Sampler(threading.Thread):
    """Walks ``folder`` every WALK_EVERY_S; keeps the peak and a series."""

    def __init__(self, folder: str, start: float) -> None:
        super().__init__(name="trace-usage-sampler", daemon=True)
        self.folder, self.start_time = folder, start
        self.peak = self.peak_temps = 0
        self.samples: list[tuple[float, int]] = []
        self.walks = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(WALK_EVERY_S):
            self.sample()

    def sample(self) -> None:
        blocks, temps = disk_usage(self.folder)
        self.walks += 1
        self.peak = max(self.peak, blocks)
        self.peak_temps = max(self.peak_temps, temps)
        self.samples.append((time.monotonic() - self.start_time, blocks))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)


class Replay:
    """One replay: a fresh tier in ``folder`` with ``capacity_bytes``; :meth:`run`."""

    def __init__(self, requests: list[TraceRequest], block_bytes: int, folder: str,
                 capacity_bytes: int, tier_options: dict[str, Any] | None = None) -> None:
        self.requests, self.block_bytes = requests, block_bytes
        self.folder, self.capacity = folder, capacity_bytes
        self.tier_options = tier_options or {}
        self.content = BlockContent(block_bytes)
        self.keys: dict[int, bytes] = {}
        self.next_job = 0
        self.c: dict[str, Any] = {
            "blocks_requested": 0, "blocks_hit": 0, "tokens_requested": 0,
            "tokens_hit": 0, "lookups": 0, "lookup_hits": 0, "lookup_misses": 0,
            "blocks_loaded": 0, "blocks_lost_on_load": 0, "blocks_stored": 0,
            "blocks_store_failed": 0, "bytes_served": 0, "bytes_stored": 0,
            "wrong_bytes": 0, "enospc_jobs": 0,
            "failed_jobs": {"load": 0, "store": 0}, "errors": {}}

    def _key(self, block: int) -> bytes:
        key = self.keys.get(block)
        if key is None:
            key = self.keys[block] = key_of(block)
        return key

    def _wait(self, tier: FileSystemTier, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_LIMIT_S
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the tier did not answer {what} in {WAIT_LIMIT_S:g} s")
            select.select([tier.fileno()], [], [], 0.05)

    def _job(self, tier: FileSystemTier, submit: Callable[[TransferJob], None],
             keys: list[bytes], slots: list[int]):
        self.next_job += 1
        job_id = self.next_job
        submit(TransferJob(job_id, keys, slots))
        found: list = []

        def done() -> bool:
            found.extend(r for r in tier.get_finished_jobs() if r.job_id == job_id)
            return bool(found)

        self._wait(tier, done, f"job {job_id}")
        return found[0]

    def _failed(self, kind: str, result: Any) -> None:
        self.c["failed_jobs"][kind] += 1
        if result.errno == errno.ENOSPC:
            self.c["enospc_jobs"] += 1
        name = f"{kind}: {errno.errorcode.get(result.errno, result.errno)}"
        self.c["errors"][name] = self.c["errors"].get(name, 0) + 1

    def _request(self, tier: FileSystemTier, buf: SharedKVBuffer, n: int,
                 request: TraceRequest) -> None:
        c = self.c
        ids = list(request.hash_ids)
        keys = [self._key(i) for i in ids]
        tokens = request.block_tokens()
        for key in keys:  # one batch of checks, as a scheduler step asks
            tier.lookup(key, n)
        tier.on_schedule_end()
        hit = 0
        for key in keys:  # answers read in order, up to the first miss
            answer: list = []

            def answered(key: bytes = key, answer: list = answer) -> bool:
                got = tier.lookup(key, n)
                if got is _RETRY:
                    tier.on_schedule_end()
                    return False
                answer.append(got)
                return True

            self._wait(tier, answered, f"the lookup of block {ids[hit]}")
            c["lookups"] += 1
            if answer[0] is not _HIT:
                c["lookup_misses"] += 1
                break
            c["lookup_hits"] += 1
            hit += 1
        tier.on_request_finished(n)
        loaded = 0
        if hit:
            buf.view[:hit] = 0
            result = self._job(tier, tier.submit_load, keys[:hit], list(range(hit)))
            if result.success:
                loaded = hit
            else:
                self._failed("load", result)
                got = set(result.successful_keys or ())
                while loaded < hit and keys[loaded] in got:
                    loaded += 1
                c["blocks_lost_on_load"] += hit - loaded
            if loaded:
                want = self.content.of(ids[:loaded])
                c["wrong_bytes"] += int(np.count_nonzero(buf.view[:loaded] != want))
        c["blocks_requested"] += len(ids)
        c["blocks_hit"] += loaded
        c["blocks_loaded"] += loaded
        c["bytes_served"] += loaded * self.block_bytes
        c["tokens_requested"] += sum(tokens)
        c["tokens_hit"] += sum(tokens[:loaded])
        if loaded < len(ids):
            buf.view[loaded:len(ids)] = self.content.of(ids[loaded:])
            result = self._job(tier, tier.submit_store, keys[loaded:],
                               list(range(loaded, len(ids))))
            if result.success:
                c["blocks_stored"] += len(ids) - loaded
                c["bytes_stored"] += (len(ids) - loaded) * self.block_bytes
            else:
                self._failed("store", result)
                c["blocks_store_failed"] += len(ids) - loaded

    def run(self, progress: Callable[[int, dict[str, Any], float], None] | None = None
            ) -> dict[str, Any]:
        """Replay every request; returns the counts and figures (see trace.py)."""
        slots = max(len(r.hash_ids) for r in self.requests)
        buf = SharedKVBuffer.create(slots, self.block_bytes)
        try:
            tier = FileSystemTier(buf, root_dir=self.folder, capacity_bytes=self.capacity,
                                  **self.tier_options)
            try:
                return self._run(tier, buf, progress)
            finally:
                tier.shutdown()
        finally:
            buf.close()
            buf.unlink()

    def _run(self, tier: FileSystemTier, buf: SharedKVBuffer,
             progress: Callable[[int, dict[str, Any], float], None] | None
             ) -> dict[str, Any]:
        start = time.monotonic()
        sampler = _Sampler(self.folder, start)  # fresh: all of it is this tier's
        published: list[tuple[float, int]] = []
        peak_published = 0
        checks = {"checks": 0, "worst_low_bytes": 0, "worst_high_bytes": 0,
                  "seconds": 0.0}
        sampler.start()
        try:
            for n, request in enumerate(self.requests):
                self._request(tier, buf, n, request)
                usage = tier.stats()["usage_bytes"]
                peak_published = max(peak_published, usage)
                published.append((time.monotonic() - start, usage))
                if n % USAGE_CHECK_EVERY == 0:
                    _check_usage(tier, self.folder, usage, checks)
                if progress is not None:
                    progress(n + 1, self.c, time.monotonic() - start)
            tier.drain_jobs()
        finally:
            sampler.stop()
        run_s = time.monotonic() - start - checks["seconds"]
        sampler.sample()  # the final state, after every store
        stats = tier.stats()
        root = stats["roots"][0]
        room_wait_s = sum(w.get("room_wait_s", 0.0) for w in stats["workers"])
        c = dict(self.c)
        c.update({
            "run_s": run_s,
            "bytes_written": stats["bytes_done"]["store"],
            "keys_checked": stats["keys_checked"],
            "evicted_blocks": root.get("evicted_blocks", 0),
            "no_space_stores": root.get("no_space_stores", 0),
            "room_waits": sum(w.get("room_waits", 0) for w in stats["workers"]),
            "room_wait_s": room_wait_s,
            "room_wait_fraction": room_wait_s / run_s if run_s else 0.0,
            "usage": {
                "peak_walked_bytes": sampler.peak, "peak_published_bytes": peak_published,
                "peak_temp_bytes": sampler.peak_temps, "walks": sampler.walks,
                "final_walked_bytes": sampler.samples[-1][1],
                "final_published_bytes": stats["usage_bytes"],
                "stats_vs_disk": checks,
                "walked": _thin(sampler.samples), "published": _thin(published)},
            "tier": {"backend": stats["backend"], "o_direct": stats["o_direct"],
                     "io_uring": stats["io_uring"], "blocks_per_task":
                     stats["blocks_per_task"], "root": stats["root"]},
        })
        return c


def _check_usage(tier: FileSystemTier, folder: str, before: int,
                 checks: dict[str, Any]) -> None:
    """Walk ``folder`` between two reads of ``stats()["usage_bytes"]`` (``before``, and
    one after the walk); with no store in flight usage only falls meanwhile, so an
    exact figure has the walk's bytes between the two. The worst distance outside
    (bytes on disk above the first read: stats() low; below the second: high) is kept."""
    began = time.monotonic()
    on_disk, _ = disk_usage(folder)
    after = tier.stats()["usage_bytes"]
    checks["checks"] += 1
    checks["worst_low_bytes"] = max(checks["worst_low_bytes"], on_disk - before)
    checks["worst_high_bytes"] = max(checks["worst_high_bytes"], min(before, after) - on_disk)
    checks["seconds"] += time.monotonic() - began


def _thin(samples: list[tuple[float, int]], most: int = MAX_SAMPLES
          ) -> list[tuple[float, int]]:
    if len(samples) <= most:
        return samples
    step = len(samples) / most
    return [samples[int(i * step)] for i in range(most)] + [samples[-1]]

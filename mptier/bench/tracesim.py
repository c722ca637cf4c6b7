"""Simulated caches for the trace bench: LRU, Belady's optimum and an unbounded cache,
all fed the same block stream and counting hits the way the replay does.

The accounting (shared with :mod:`mptier.bench.trace_replay`): a request is a list of
block ids, its prefix in order. Its *hit prefix* is the longest run of leading blocks the
cache holds when the request starts; those blocks are loaded (and count as used again),
every block from the first miss on is computed and stored (a stored block that the cache
already held only counts as used again). A block after the first miss that the cache
happens to hold is not a hit: an engine cannot use a block whose prefix it recomputes.

Belady's optimum (MIN, with the right not to admit): when a block must be stored into a
full cache, the block whose next use lies furthest ahead leaves, and that may be the new
block itself (it is then not kept). On a prefix stream each block's parent is used right
before it, so MIN never holds a block without its parent and its plain hits are prefix
hits: the figure is an upper bound for any policy of the same capacity under this
accounting, LRU included.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from mptier.storage.maintain import PROBATION_SHARE

# A next use that never comes (the block is not asked for again in the stream).
NEVER = 1 << 62


@dataclass
class SimResult:
    """Counts of one simulated cache over a stream of requests."""

    policy: str
    capacity_blocks: int | None  # None: unbounded
    blocks_requested: int = 0
    blocks_hit: int = 0
    tokens_requested: int = 0
    tokens_hit: int = 0
    blocks_stored: int = 0  # blocks from a request's first miss on (each written once)

    @property
    def blocks_missed(self) -> int:
        return self.blocks_requested - self.blocks_hit

    @property
    def hit_ratio(self) -> float:
        return self.blocks_hit / self.blocks_requested if self.blocks_requested else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.tokens_hit / self.tokens_requested if self.tokens_requested else 0.0

    def as_dict(self) -> dict[str, object]:
        return {"policy": self.policy, "capacity_blocks": self.capacity_blocks,
                "blocks_requested": self.blocks_requested, "blocks_hit": self.blocks_hit,
                "blocks_missed": self.blocks_missed, "blocks_stored": self.blocks_stored,
                "tokens_requested": self.tokens_requested, "tokens_hit": self.tokens_hit,
                "hit_ratio": self.hit_ratio, "token_hit_ratio": self.token_hit_ratio}


def _count(result: SimResult, ids: Sequence[int], hit: int, tokens: Sequence[int]) -> None:
    result.blocks_requested += len(ids)
    result.blocks_hit += hit
    result.blocks_stored += len(ids) - hit
    result.tokens_requested += sum(tokens)
    result.tokens_hit += sum(tokens[:hit])


def simulate_lru(requests: Sequence[Sequence[int]], capacity_blocks: int,
                 tokens: Sequence[Sequence[int]] | None = None) -> SimResult:
    """An LRU cache of ``capacity_blocks`` blocks fed ``requests`` (lists of block ids).

    ``tokens[i][j]``: tokens of block j of request i (default: 1 per block, so token
    figures equal block figures).
    """
    _check_capacity(capacity_blocks)
    result = SimResult("lru", capacity_blocks)
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    for n, ids in enumerate(requests):
        hit = 0
        while hit < len(ids) and ids[hit] in cache:
            hit += 1
        for block in ids:  # the hit prefix is used again, the rest stored, in order
            if block in cache:
                cache.move_to_end(block)
                continue
            if capacity_blocks == 0:
                continue
            if len(cache) >= capacity_blocks:
                cache.popitem(last=False)
            cache[block] = None
        _count(result, ids, hit, tokens[n] if tokens is not None else [1] * len(ids))
    return result


def simulate_two_queue(requests: Sequence[Sequence[int]], capacity_blocks: int,
                       tokens: Sequence[Sequence[int]] | None = None,
                       probation_share: float = PROBATION_SHARE) -> SimResult:
    """The tier's ``"two-queue"`` eviction (mptier.storage.maintain.BlockIndex) over the
    same stream and accounting as :func:`simulate_lru`: a hit moves a block to the used
    order; a block stored again while the ghost (the last evicted, as many as the
    capacity) remembers it enters the used order; the oldest never-used block leaves
    while those are more than ``probation_share`` of the cache, else the oldest used."""
    _check_capacity(capacity_blocks)
    result = SimResult("two-queue", capacity_blocks)
    probation: collections.OrderedDict[int, None] = collections.OrderedDict()
    used: collections.OrderedDict[int, None] = collections.OrderedDict()
    ghost: collections.OrderedDict[int, None] = collections.OrderedDict()
    for n, ids in enumerate(requests):
        hit = 0
        while hit < len(ids) and (ids[hit] in probation or ids[hit] in used):
            hit += 1
        for block in ids[:hit]:  # loaded: used again
            probation.pop(block, None)
            used.pop(block, None)
            used[block] = None
        for block in ids[hit:]:
            if block in probation or block in used or capacity_blocks == 0:
                continue  # present (the tier skips it, touching nothing), or no room
            while len(probation) + len(used) >= capacity_blocks:
                held = len(probation) + len(used)
                if probation and (len(probation) > probation_share * held or not used):
                    ghost[probation.popitem(last=False)[0]] = None
                    if len(ghost) > capacity_blocks:
                        ghost.popitem(last=False)
                else:
                    used.popitem(last=False)
            if ghost.pop(block, False) is None:
                used[block] = None
            else:
                probation[block] = None
        _count(result, ids, hit, tokens[n] if tokens is not None else [1] * len(ids))
    return result


def simulate_belady(requests: Sequence[Sequence[int]], capacity_blocks: int,
                    tokens: Sequence[Sequence[int]] | None = None) -> SimResult:
    """Belady's MIN (furthest next use leaves; a new block may be left out) over the
    same stream and accounting as :func:`simulate_lru`."""
    _check_capacity(capacity_blocks)
    result = SimResult("belady", capacity_blocks)
    stream = [block for ids in requests for block in ids]
    next_use = [NEVER] * len(stream)
    later: dict[int, int] = {}
    for pos in range(len(stream) - 1, -1, -1):
        next_use[pos] = later.get(stream[pos], NEVER)
        later[stream[pos]] = pos
    held: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block); stale entries skipped
    pos = 0
    for n, ids in enumerate(requests):
        hit = 0
        while hit < len(ids) and ids[hit] in held:
            hit += 1
        for block in ids:
            upcoming = next_use[pos]
            pos += 1
            if block in held:
                held[block] = upcoming
                heapq.heappush(heap, (-upcoming, block))
                continue
            if capacity_blocks == 0 or upcoming == NEVER:
                continue  # never asked for again: keeping it can win nothing
            if len(held) >= capacity_blocks:
                while True:
                    neg, victim = heap[0]
                    if held.get(victim) == -neg:
                        break
                    heapq.heappop(heap)  # stale: the block was used again or left
                if -neg <= upcoming:
                    continue  # the new block is the one needed last: not kept
                heapq.heappop(heap)
                del held[victim]
            held[block] = upcoming
            heapq.heappush(heap, (-upcoming, block))
        _count(result, ids, hit, tokens[n] if tokens is not None else [1] * len(ids))
    return result


def simulate_unbounded(requests: Sequence[Sequence[int]],
                       tokens: Sequence[Sequence[int]] | None = None) -> SimResult:
    """A cache that keeps everything: the most any policy can hit on the stream."""
    result = SimResult("unbounded", None)
    seen: set[int] = set()
    for n, ids in enumerate(requests):
        hit = 0
        while hit < len(ids) and ids[hit] in seen:
            hit += 1
        seen.update(ids)
        _count(result, ids, hit, tokens[n] if tokens is not None else [1] * len(ids))
    return result


def _check_capacity(capacity_blocks: int) -> None:
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be 0 or more, not {capacity_blocks}")

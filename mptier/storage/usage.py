"""How much a root holds, and which blocks to evict when it holds too much.

    walk pass k (Walker, a slice at a time)    a tier's own stores / evictions
            │ BLOCK entries                          │ record_store / record_remove
            ▼                                        ▼
    UsageTracker.building ◀── delta only where the walk cannot see it any more
            │ pass complete                          │
            ▼                                        ▼
    UsageTracker.current  ◀───────────── every delta ┘  -> usage_bytes, per folder
    OldestBlocks (bounded heap of the oldest atimes seen in a pass) -> plan_eviction

Recency is the file's atime, which the tier sets explicitly on load and store (so it
does not depend on relatime or on which node read the block). Each node sets it from
its own clock (or the server's, for UTIME_NOW on NFS). Clock skew between nodes only
reorders LRU: a node whose clock runs behind makes its blocks look older and evicted
sooner. It cannot make eviction wrong, because correctness never rests on the order:
:func:`evict` removes a file only if it is still the inode that was chosen and its atime
has not moved at all since (forwards or backwards), and a block removed under a reader
is either read whole (the open file keeps its data) or becomes a miss — names are
content hashes, so no other bytes can appear under a name.

Another node's stores are seen only by the walk: between passes ``usage_bytes`` lags
them by at most one pass worth of their writes.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from mptier.storage.walk import Entry, Kind, Walker, relative_to, remove_empty_parents

# Default bound on eviction candidates kept in memory (about 150-250 bytes each, path
# included, so ~10 MB). One pass can then plan at most this many evictions; more waits
# for the next pass. Larger costs memory in the worker; smaller, more passes when far
# over budget.
DEFAULT_MAX_CANDIDATES = 50_000


@dataclass
class Usage:
    """Blocks and their bytes under a root, in total and per block folder."""

    bytes: int = 0
    blocks: int = 0
    folders: dict[str, list[int]] = field(default_factory=dict)  # folder -> [bytes, blocks]

    def add(self, folder: str, nbytes: int, nblocks: int = 1) -> None:
        self.bytes += nbytes
        self.blocks += nblocks
        slot = self.folders.get(folder)
        if slot is None:
            self.folders[folder] = [nbytes, nblocks]
        else:
            slot[0] += nbytes
            slot[1] += nblocks

    def copy(self) -> Usage:
        return Usage(self.bytes, self.blocks, {k: list(v) for k, v in self.folders.items()})

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "blocks": self.blocks,
                "folders": {k: {"bytes": v[0], "blocks": v[1]}
                            for k, v in sorted(self.folders.items())}}


def folder_of(root: str, path: str) -> str:
    """The first component of ``path`` under ``root`` (a normalised absolute path)."""
    return relative_to(root, path).split(os.sep, 1)[0]


class UsageTracker:
    """Usage of one root, rebuilt by an endless incremental walk, adjusted by deltas.

    :meth:`step` walks a slice; when a pass completes its totals replace
    :attr:`current` and a new pass starts. :attr:`usage_bytes` is the last complete
    pass plus deltas since, or (before the first pass completes) the partial pass —
    a lower bound. Not thread-safe: the walking thread also records the deltas.
    """

    def __init__(self, root: str | os.PathLike[str], *,
                 default_block_bytes: int | Mapping[str, int] | None = None) -> None:
        self.root = os.path.normpath(os.fspath(root))
        self._default = default_block_bytes
        self.current: Usage | None = None
        self.building = Usage()
        self.walker = Walker(self.root, default_block_bytes=default_block_bytes)
        self.passes = 0
        self.last_visited = 0   # entries visited by the last step

    @property
    def complete(self) -> bool:
        """Whether at least one full pass finished (``usage_bytes`` is then a total)."""
        return self.current is not None

    @property
    def usage(self) -> Usage:
        """The last complete pass with deltas since, or the pass in progress where it
        has already counted more: it is a lower bound of what is there (exact for the
        part walked), so others' stores it found count before the pass ends."""
        current = self.current
        if current is None or self.building.bytes > current.bytes:
            return self.building
        return current

    @property
    def usage_bytes(self) -> int:
        return self.usage.bytes

    def step(self, budget: int) -> list[Entry]:
        """Walk at most ``budget`` entries, count the blocks among them, and return the
        walked entries (for the sweeper and the eviction candidates). At the end of a
        pass, publish it and start the next one in the same call (no entries walked)."""
        before = self.walker.entries
        entries = self.walker.step(budget)
        self.last_visited = self.walker.entries - before
        building = self.building
        for entry in entries:
            if entry.kind is Kind.BLOCK:
                building.add(entry.folder, entry.size)
        if self.walker.done:
            self.current = building
            self.building = Usage()
            self.passes += 1
            self.walker = Walker(self.root, default_block_bytes=self._default)
        return entries

    def record_store(self, path: str, nbytes: int) -> None:
        """A block this process created at ``path`` (not one that already existed).

        Counted now; counted in the pass in progress only if the walk will not reach it
        (otherwise the walk finds it) — so never twice, never missed.
        """
        folder = folder_of(self.root, path)
        if self.current is not None:
            self.current.add(folder, nbytes)
        if not self.walker.will_visit(path):
            self.building.add(folder, nbytes)

    def record_remove(self, path: str, nbytes: int) -> None:
        """A block this process removed; uncounted in the pass in progress only if the
        walk will not reach its place (then it was counted, by the walk or a delta)."""
        folder = folder_of(self.root, path)
        if self.current is not None:
            self.current.add(folder, -nbytes, -1)
        if not self.walker.will_visit(path):
            self.building.add(folder, -nbytes, -1)

    def record_unplaced(self, folder: str, nbytes: int, nblocks: int) -> None:
        """Blocks stored elsewhere (another process of this tier) without their paths:
        counted in both totals, so ``usage_bytes`` errs high (evicting a little early)
        by what the walk also finds of them, until the pass after next."""
        if self.current is not None:
            self.current.add(folder, nbytes, nblocks)
        self.building.add(folder, nbytes, nblocks)


    def record_counted(self, folder: str, nbytes: int, nblocks: int, *,
                       in_current: bool, in_building: bool) -> None:
        """Blocks created by another process, whose paths are not known here, counted
        where the caller decided (see :meth:`RootMaintainer.record_told`)."""
        if in_current and self.current is not None:
            self.current.add(folder, nbytes, nblocks)
        if in_building:
            self.building.add(folder, nbytes, nblocks)


class OldestBlocks:
    """The oldest blocks offered, by atime: the fewest whose sizes add up to
    ``target_bytes``, and at most ``max_entries`` of them.

    A bounded max-heap: memory is O(kept), each offer O(log kept). With ``max_entries``
    reached, a plan covers less than the target and the rest waits for the next pass.
    """

    def __init__(self, target_bytes: int, max_entries: int = DEFAULT_MAX_CANDIDATES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.target_bytes = target_bytes
        self.max_entries = max_entries
        self._heap: list[tuple[int, int, Entry]] = []   # (-atime, -order, entry)
        self._order = itertools.count()
        self.kept_bytes = 0
        self.offered = 0

    def __len__(self) -> int:
        return len(self._heap)

    def offer(self, entry: Entry) -> None:
        self.offered += 1
        heap = self._heap
        if heap and self.kept_bytes >= self.target_bytes and -heap[0][0] <= entry.atime_ns:
            return  # younger than everything kept, and enough is kept
        heapq.heappush(heap, (-entry.atime_ns, -next(self._order), entry))
        self.kept_bytes += entry.size
        # Drop the youngest while the rest still covers the target (or too many are kept).
        while len(heap) > self.max_entries or (
                len(heap) > 1 and self.kept_bytes - heap[0][2].size >= self.target_bytes):
            self.kept_bytes -= heapq.heappop(heap)[2].size

    def oldest_first(self) -> list[Entry]:
        """The kept entries, oldest atime first (ties in the order offered)."""
        return [e for _, _, e in sorted(self._heap, key=lambda t: (-t[0], -t[1]))]


@dataclass
class EvictionPlan:
    """Blocks to evict, oldest first. ``complete``: they cover ``bytes_to_free``."""

    entries: list[Entry]
    bytes_to_free: int
    bytes_planned: int

    @property
    def complete(self) -> bool:
        return self.bytes_planned >= self.bytes_to_free


def check_watermarks(capacity_bytes: int, high: float, low: float) -> None:
    """Raise ``ValueError`` naming the value unless ``0 < low < high <= 1`` and the
    capacity is positive."""
    if capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes must be positive to plan evictions, got "
                         f"{capacity_bytes} (0 means unlimited: nothing to evict)")
    if not (0.0 < low < high <= 1.0):
        raise ValueError(f"watermarks high={high!r}, low={low!r}: need 0 < low < high <= 1,"
                         f" e.g. high=0.95 low=0.85")


def bytes_to_free(usage_bytes: int, capacity_bytes: int, high: float, low: float) -> int:
    """0 while usage is at or under ``high``; once past it, what brings it under ``low``."""
    check_watermarks(capacity_bytes, high, low)
    if usage_bytes <= high * capacity_bytes:
        return 0
    return usage_bytes - math.floor(low * capacity_bytes)


def plan_eviction(candidates: Iterable[Entry], usage_bytes: int, capacity_bytes: int,
                  high: float, low: float, *,
                  max_entries: int = DEFAULT_MAX_CANDIDATES) -> EvictionPlan:
    """Least-recently-used blocks among ``candidates`` that bring ``usage_bytes`` under
    ``low * capacity_bytes`` — only once usage is past ``high * capacity_bytes``.

    ``candidates`` may be a whole walk (an iterator): only the oldest are kept, in a
    bounded heap (:class:`OldestBlocks`), never a sorted list of everything. Non-block
    entries are skipped. Raises ``ValueError`` for bad watermarks or capacity.
    """
    need = bytes_to_free(usage_bytes, capacity_bytes, high, low)
    if need == 0:
        return EvictionPlan([], 0, 0)
    oldest = OldestBlocks(need, max_entries)
    for entry in candidates:
        if entry.kind is Kind.BLOCK:
            oldest.offer(entry)
    chosen = oldest.oldest_first()
    planned = 0
    for i, entry in enumerate(chosen):  # the kept set may overshoot by its youngest
        planned += entry.size
        if planned >= need:
            chosen = chosen[:i + 1]
            break
    return EvictionPlan(chosen, need, planned)


def evict(entry: Entry) -> bool:
    """Remove the block ``entry`` names if it is still that regular file — same inode,
    same size — and its atime has not moved since it was chosen (a load anywhere sets
    it). Returns whether it was removed; a vanished file is ``False``. Blocks on two
    metadata calls. Between the check and the unlink a concurrent use can slip in (a
    few microseconds): the reader then has the whole block open or finds a miss."""
    try:
        st = os.lstat(entry.path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_ino != entry.ino \
            or st.st_size != entry.size or st.st_atime_ns != entry.atime_ns:
        return False
    try:
        os.unlink(entry.path)
    except FileNotFoundError:
        return False
    remove_empty_parents(entry.path)  # an empty folder still takes an inode and a block
    return True

"""One object a worker drives to keep a root in shape, a slice at a time.

    worker loop (between I/O tasks, never the engine's scheduler thread)
      report = maintainer.step(budget, want_free=reserved)   walk <= budget entries
        ├─ UsageTracker    usage rebuilt pass by pass, own stores/evictions as deltas
        ├─ TempSweeper     stale temporary files and dead writers' leases removed
        ├─ BlockIndex      every block the walk saw or a worker told, in eviction
        │                  order (two-queue by default, or LRU: heaps by atime)
        ├─ evict           usage + want_free past capacity - slack: the index's next,
        │                  exactly the excess (or ``free_bytes``: inodes, ENOSPC)
        └─ empty folders   <h3> and <h2>_g<group> folders the walk finds empty: removed
                           (<h3> ones kept with keep_top_folders: storage.folders)
      report.removed       -> "removed" events;  maintainer.usage_bytes -> stats()

Eviction never waits for a walk pass: a block enters the index the moment the walk
lists it, and eviction takes the oldest known one. A candidate used since it was
indexed (its atime moved) is looked at again (one lstat) and put back with its new
atime (and, under two-queue, as used), so the order is the policy's over every block
walked. The walk only reconciles
the index with what others did (their stores are added as it finds them, their
evictions are dropped when :func:`evict` finds the file gone). Should the index run dry
while usage is still over, the caretaker walks on at once: what the next step finds is
evictable in the same step.

Long because RootMaintainer is the one object that ties walk, usage, sweep, index and
eviction together step by step; the parts themselves live in walk, usage, leases and the
index above.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from mptier.storage.leases import DEFAULT_STALE_TEMP_S, TempSweeper
from mptier.storage.names import LEAF_RE, key_of_block_path
from mptier.storage.usage import UsageTracker, check_watermarks, evict, folder_of
from mptier.storage.walk import Entry, Kind, remove_empty_folder

# Eviction keeps usage (with the room stores have reserved) this far under the capacity,
# so that a store usually finds room at once instead of waiting for an unlink. Larger
# makes stores wait less but keeps the cache smaller than its budget (the hit ratio of
# an LRU of capacity * (1 - slack)); 1 % costs about 1 % of the cache.
EVICT_SLACK_FRACTION = 0.01
# Blocks the eviction index holds at most (a NamedTuple of ~200 bytes each with its
# path, so ~200 MB at the bound). Past it, newly walked blocks are left out until
# evictions make room; they are the youngest anyway, the last LRU would choose.
DEFAULT_MAX_INDEX = 1_000_000
# The index's heap is rebuilt once stale tuples (blocks walked again, forgotten) exceed
# this many times the live ones: amortised O(1) per change.
HEAP_GARBAGE_FACTOR = 2
# The inode of a block a writer told about (record_created) before anyone looked at it.
UNSEEN_INO = 0
# The walk removes an empty block folder only once it has been unchanged this long: a
# writer that just made it (and writes an O_TMPFILE block in it, which leaves it empty
# until the link) is not made to retry. Any older leftover goes; a clock skewed by more
# (a network file system's server) only brings back the writer's retry.
FOLDER_GRACE_NS = 10 * 10**9
# Blocks the walk lists whose mtime is at most this old are remembered with the passes
# that listed them (RootMaintainer.record_told), so that a block a writer reports after
# the walk moved on is counted once: by the walk if it listed the block, else by the
# report. Reports arrive milliseconds after the store (seconds under heavy load); a
# block reported later than this, or whose mtime a server's clock put this far back, is
# counted as unlisted (high until the next pass, never low). Memory: the blocks stored
# in this time, not the root's size.
TOLD_WINDOW_NS = 60 * 10**9
# Eviction orders (BlockIndex): "lru", or "two-queue" (blocks used again since their
# store are kept ahead of blocks never used again). Measured on the conversation trace
# (bench --trace; docs/storage.md "Eviction policy"): two-queue beats an LRU of the full
# budget while keeping the slack free, LRU of the same files does not.
POLICIES = ("two-queue", "lru")
DEFAULT_POLICY = "two-queue"
# Two-queue: the oldest never-used block leaves while never-used blocks are more than
# this share of the index, else the oldest used one. Simulated at 0.95 of a 10 %
# budget: 0.3 fell under LRU on the whole trace, 0.7 on its first 2,000 requests, 0.4-0.6
# stayed over it; at 25 % of the whole trace every share was 1-3 % under (storage.md).
PROBATION_SHARE = 0.5
# Two-queue: evicted paths remembered (hashes, ~70 bytes each: 18 MB at the bound). The
# bound is also the index's size, so the ghost covers about one cache's worth.
GHOST_MAX = 262_144
# Two-queue: a block the walk meets first whose atime is this far past its mtime was
# loaded after its store (the store's own touch lands milliseconds after the data).
USED_GAP_NS = 2 * 10**9


class BlockIndex:
    """Blocks by atime, oldest first: heaps with lazy deletion and a dict of the latest
    entry per path. Blocks of one atime (a store's blocks share the kernel's clock tick,
    a few milliseconds) go deepest first: a block's *rank* is its place in the store
    that created it (``know(entry, rank)``, kept while the block is known), and the
    higher rank leaves first. A prefix's tail then goes before its head, which keeps
    more whole prefixes: measured on the conversation trace, 1.02-1.03x the hit ratio of
    an LRU of the same size that leaves a tick's blocks in any order (simulated, 10 % and
    25 % budgets; docs/storage.md). Not thread-safe (the caretaker's thread owns it).

    ``policy`` (:data:`POLICIES`): ``"lru"`` takes the oldest block known.
    ``"two-queue"`` keeps two LRU orders: *probation*, blocks not used since their
    store, and *used*, blocks a load touched since (seen as an atime that moved while
    the block was known, or, for a block first met by the walk, an atime
    ``USED_GAP_NS`` past its mtime) and blocks stored again soon after this index
    evicted them (the *ghost*, the last ``GHOST_MAX`` evicted paths). It takes the
    oldest of probation while probation holds more than ``PROBATION_SHARE`` of the
    index, else the oldest used block: a burst of blocks asked for once cannot push out
    the ones asked for again."""

    def __init__(self, max_entries: int = DEFAULT_MAX_INDEX,
                 policy: str = DEFAULT_POLICY) -> None:
        if policy not in POLICIES:
            raise ValueError(f"eviction policy {policy!r}: use one of {', '.join(POLICIES)}")
        self.max_entries = max_entries
        self.policy = policy
        self._known: dict[str, Entry] = {}
        self._rank: dict[str, int] = {}
        self._used: set[str] = set()   # paths in the used order (two-queue), out or in
        self._used_known = 0           # of them, those in the index now
        self._heaps: tuple[list, list] = ([], [])  # probation (and lru), used
        self._ghost: dict[int, None] = {}  # hashes of evicted paths, oldest first
        self._order = itertools.count()
        self.left_out = 0  # blocks not indexed because it was full
        self.promoted = 0  # blocks that went to the used order (two-queue)

    def __len__(self) -> int:
        return len(self._known)

    @property
    def used_blocks(self) -> int:
        """Known blocks in the used order (0 under ``"lru"``)."""
        return self._used_known

    def know(self, entry: Entry, rank: int | None = None, used: bool = False) -> None:
        """Index ``entry`` (a walked or re-checked block), replacing what was known of
        its path; ``rank``: its place in the store that created it (kept for later
        entries of the same path); ``used``: it was used since it was last known (its
        atime moved: a candidate :func:`evict` refused)."""
        if rank is not None:
            self._rank[entry.path] = rank
        known = self._known.get(entry.path)
        if known is not None and known.atime_ns == entry.atime_ns \
                and known.ino == entry.ino:
            return  # the walk saw it again, unchanged
        if known is None and len(self._known) >= self.max_entries:
            self.left_out += 1
            return
        if self.policy == "two-queue" and entry.path not in self._used:
            if known is not None:  # a told block's atime is the moment it was told
                used = used or (known.ino in (entry.ino, UNSEEN_INO)
                                and entry.atime_ns > known.atime_ns)
            elif not used:
                ghost = hash(entry.path) in self._ghost
                if ghost:
                    del self._ghost[hash(entry.path)]
                used = ghost or (entry.ino != UNSEEN_INO
                                 and entry.atime_ns - entry.mtime_ns > USED_GAP_NS)
            if used:
                self._used.add(entry.path)
                self.promoted += 1
                if known is not None:
                    self._used_known += 1
        if known is None and entry.path in self._used:
            self._used_known += 1
        self._known[entry.path] = entry
        heapq.heappush(self._heaps[entry.path in self._used], self._item(entry))
        if sum(map(len, self._heaps)) > HEAP_GARBAGE_FACTOR * len(self._known) + 1024:
            self._rebuild()

    def _rebuild(self) -> None:
        used = self._used
        self._heaps = ([], [])
        for e in self._known.values():
            self._heaps[e.path in used].append(self._item(e))
        for heap in self._heaps:
            heapq.heapify(heap)
        if len(self._rank) > HEAP_GARBAGE_FACTOR * len(self._known) + 1024:
            self._rank = {p: r for p, r in self._rank.items() if p in self._known}
        # Paths out for eviction lose their mark here; refused, they earn it again
        # (their atime moved).
        self._used = {p for p in self._used if p in self._known}
        self._used_known = len(self._used)

    def _item(self, entry: Entry) -> tuple[int, int, int, Entry]:
        return (entry.atime_ns, -self._rank.get(entry.path, 0), next(self._order), entry)

    def forget(self, path: str) -> None:
        """``path`` is gone (removed): neither its entry nor its rank is kept; under
        ``"two-queue"`` the ghost remembers it (stored again soon, it was evicted too
        early: it comes back in the used order)."""
        if self._known.pop(path, None) is not None and path in self._used:
            self._used_known -= 1
        if self.policy == "two-queue":
            ghost = self._ghost
            ghost[hash(path)] = None
            if len(ghost) > min(GHOST_MAX, max(len(self._known), 1024)):
                del ghost[next(iter(ghost))]
        self._rank.pop(path, None)
        self._used.discard(path)

    def pop_oldest(self) -> Entry | None:
        """The block to evict next (under ``"lru"`` the oldest atime, deepest first
        among equals; under ``"two-queue"`` the oldest of the order the class docstring
        says), taken out of the index (None: empty). Its rank and order are kept: a
        block that turns out used again comes back with them (:meth:`know`)."""
        probation, used = self._heaps
        first = used if (self._used_known and len(self._known) - self._used_known
                         <= PROBATION_SHARE * len(self._known)) else probation
        for heap in (first, used if first is probation else probation):
            while heap:
                entry = heapq.heappop(heap)[3]
                if self._known.get(entry.path) is entry \
                        and (entry.path in self._used) is (heap is used):
                    del self._known[entry.path]
                    self._used_known -= heap is used
                    return entry
        return None


def evict_told(entry: Entry) -> bool:
    """:func:`evict` for a block that may be told and never looked at (``UNSEEN_INO``):
    removed only if its file's atime is not past the moment it was told (no use since;
    its store set the atime before), then with :func:`evict`'s own checks. Runs on an
    unlink thread, so the look costs the caretaker nothing (RootMaintainer.hand_out_unseen)."""
    if entry.ino != UNSEEN_INO:
        return evict(entry)
    seen = recheck(entry)
    if seen is None or seen.atime_ns > entry.atime_ns:
        return False  # gone, or used since: the caretaker indexes it anew (_refused)
    return evict(seen)


def recheck(entry: Entry) -> Entry | None:
    """``entry`` as it is now (one ``lstat``), or None when it is no block of its size
    any more (gone, replaced by something else)."""
    try:
        st = os.lstat(entry.path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
        return None
    return entry._replace(atime_ns=st.st_atime_ns, mtime_ns=st.st_mtime_ns, ino=st.st_ino)


@dataclass
class StepReport:
    """What one :meth:`RootMaintainer.step` did."""

    walked: int = 0                     # directory entries visited
    # Evicted blocks as (block folder, key): the tier emits "removed" events for the
    # keys in its own folder (other folders under the root belong to other models).
    removed: list[tuple[str, bytes]] = field(default_factory=list)
    removed_bytes: int = 0
    refused: int = 0                    # candidates in use again or replaced: kept
    temps_removed: int = 0
    folders_removed: int = 0            # empty block sub-folders the walk removed
    sweep_error: OSError | None = None  # the first error judging a temporary or lease
    pass_completed: bool = False
    usage_bytes: int = 0
    # With hand_out: blocks to evict, oldest first, for the caller to remove (evict())
    # and report back through RootMaintainer.evicted().
    to_evict: list[Entry] = field(default_factory=list)


class RootMaintainer:
    """Usage, temporary-file sweeping and LRU eviction for one root.

    ``capacity_bytes`` 0 means unlimited (no eviction). Eviction keeps usage (plus the
    ``want_free`` of :meth:`step`) at or under ``capacity_bytes - slack_bytes`` (default
    ``EVICT_SLACK_FRACTION`` of the capacity), evicting just the excess, oldest atime
    first. ``high_watermark`` / ``low_watermark`` are checked and kept for the caller's
    other resources (the caretaker's inode watch); they no longer make byte eviction
    run in bands. ``block_bytes`` is this tier's block size, used where a cache folder
    has no ``mptier.json``. ``locks_work`` None probes the root on the first step. Not
    thread-safe; every call blocks its thread on file-system metadata calls only.

    ``hand_out=True``: :meth:`step` does not remove blocks itself but hands them out
    (``StepReport.to_evict``) for another thread to remove with :func:`evict`, each
    reported back with :meth:`evicted`; bytes handed out count as being freed. A caller
    whose thread also does other I/O (a worker) keeps eviction going meanwhile.
    """

    def __init__(self, root: str | os.PathLike[str], *, capacity_bytes: int = 0,
                 high_watermark: float = 0.95, low_watermark: float = 0.85,
                 block_bytes: int | Mapping[str, int] | None = None,
                 stale_temp_s: float = DEFAULT_STALE_TEMP_S, locks_work: bool | None = None,
                 sweep: bool = True, max_index: int = DEFAULT_MAX_INDEX,
                 hand_out: bool = False, slack_bytes: int | None = None,
                 eviction_policy: str = DEFAULT_POLICY, keep_top_folders: bool = False
                 ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 (0 = unlimited), got "
                             f"{capacity_bytes}")
        if capacity_bytes:
            check_watermarks(capacity_bytes, high_watermark, low_watermark)
        if slack_bytes is None:
            slack_bytes = math.floor(EVICT_SLACK_FRACTION * capacity_bytes)
        if not 0 <= slack_bytes < max(1, capacity_bytes):
            raise ValueError(f"slack_bytes={slack_bytes} must be >= 0 and below "
                             f"capacity_bytes={capacity_bytes}")
        self.root = os.path.normpath(os.fspath(root))
        self.capacity_bytes = capacity_bytes
        self.high = high_watermark
        self.low = low_watermark
        self.slack_bytes = slack_bytes
        self.tracker = UsageTracker(self.root, default_block_bytes=block_bytes)
        self.sweeper = TempSweeper(self.root, locks_work=locks_work,
                                   stale_temp_s=stale_temp_s) if sweep else None
        self.index = BlockIndex(max_index, eviction_policy) if capacity_bytes else None
        self._pass_begun = False
        self.evicting = False   # the last step found usage past capacity - slack
        self.evicted_blocks = 0
        self.evicted_bytes = 0
        self.hand_out = hand_out
        self.handed_bytes = 0   # handed out, not yet reported back
        # Handed out: path -> (the walk was still to reach it, pass number), and those
        # the walk listed while out: what their unlink takes off which count.
        self._handed: dict[str, tuple[bool, int]] = {}
        self._walked_handed: set[str] = set()
        self.refused = 0
        self.rechecked = 0      # candidates used since indexed: put back, newer
        self.folders_removed = 0
        # Empty <h3> folders stay (made ahead for stores: mptier.storage.folders); only
        # empty <h2>_g<group> folders go.
        self.keep_top_folders = keep_top_folders
        # Hand told blocks out unseen (their look is then evict_told's, on an unlink
        # thread): for a walker that other tiers hand their blocks to, where every
        # evicted block is a told one and each look a round trip on a network mount.
        self.hand_out_unseen = False
        # Recently made blocks the walk listed: path -> (mtime, last pass that listed
        # it, the pass before that or -1), for record_told; pruned by TOLD_WINDOW_NS.
        self._listed_new: dict[str, tuple[int, int, int]] = {}
        self._listed_prune_at = 1024

    def evicted(self, entry: Entry, removed: bool) -> bytes | None:
        """A block handed out by :meth:`step` was removed (``removed``) or kept (used
        again, replaced, gone). Returns its key when it was removed."""
        self.handed_bytes -= entry.size
        ahead, passes = self._handed.pop(entry.path, (False, self.tracker.passes))
        walked = entry.path in self._walked_handed
        self._walked_handed.discard(entry.path)
        if not removed:
            self._refused(entry)
            return None
        if self.index is not None:
            self.index.forget(entry.path)
        tracker = self.tracker
        if ahead and not walked and (passes != tracker.passes
                                     or not tracker.walker.will_visit(entry.path)):
            # The walk passed its place while it was out, after its unlink: the pass
            # never counted it. Uncounted where it was counted only (record_remove's
            # rule would take it off the pass twice).
            if passes == tracker.passes:
                tracker.record_counted(entry.folder, -entry.size, -1, in_current=True,
                                       in_building=False)
        else:
            tracker.record_remove(entry.path, entry.size)
        self.evicted_blocks += 1
        self.evicted_bytes += entry.size
        return key_of_block_path(entry.path)

    def record_created(self, path: str, nbytes: int, rank: int | None = None,
                       told_ns: int | None = None) -> None:
        """A block this tier just created at ``path`` (its ``lstat`` not known here):
        indexed at once as made at ``told_ns`` (default now), and looked at (one
        ``lstat``) only when it comes up for eviction; ``rank``: its place in its store
        (BlockIndex). Usage is not changed (see :meth:`record_told`)."""
        if self.index is not None:
            self.index.know(Entry(path, Kind.BLOCK, nbytes,
                                  time.time_ns() if told_ns is None else told_ns, 0,
                                  UNSEEN_INO, folder_of(self.root, path), None), rank)

    def record_told(self, path: str, nbytes: int) -> None:
        """A block another process of this tier created at ``path``, reported after the
        fact (the caretaker reads the workers' rings): counted exactly once in the
        finished total and in the pass in progress, whatever the walk did between the
        block's creation and now. The pass in progress counts it itself when it is still
        to reach its place or listed it already (then it is not added to it); the
        finished total holds it when the pass before listed it. Usage only: the index
        takes it through :meth:`record_created`."""
        tracker = self.tracker
        k = tracker.passes
        seen = self._listed_new.get(path)
        listed = () if seen is None else seen[1:]
        tracker.record_counted(folder_of(self.root, path), nbytes, 1,
                               in_current=k - 1 not in listed,
                               in_building=k not in listed
                               and not tracker.walker.will_visit(path))

    def _note_listed(self, entry: Entry, pass_id: int, now_ns: int) -> None:
        """Remember a recently made block the walk listed in pass ``pass_id``."""
        if entry.mtime_ns < now_ns - TOLD_WINDOW_NS:
            return
        listed = self._listed_new
        before = listed.get(entry.path)
        if before is None or before[1] != pass_id:
            listed[entry.path] = (entry.mtime_ns, pass_id,
                                  -1 if before is None else before[1])
        if len(listed) > self._listed_prune_at:
            cutoff = now_ns - TOLD_WINDOW_NS
            self._listed_new = {p: v for p, v in listed.items() if v[0] >= cutoff}
            self._listed_prune_at = 2 * len(self._listed_new) + 1024

    def _refused(self, entry: Entry) -> None:
        """A candidate :func:`evict` kept: used since (back in the index with its new
        atime) or gone / replaced (forgotten; the walk finds a replacement)."""
        self.refused += 1
        now = recheck(entry)
        if now is not None and self.index is not None:
            self.rechecked += 1
            self.index.know(now, used=now.atime_ns > entry.atime_ns)

    def _remove_folder(self, path: str, report: StepReport) -> None:
        """An empty block folder the walk found: removed, and for a <h2>_g<group>
        folder its <h3> folder too if that is now empty (its mtime is ours) -- unless
        <h3> folders are kept."""
        removed = remove_empty_folder(path)
        if removed and not self.keep_top_folders and LEAF_RE.match(os.path.basename(path)):
            removed += remove_empty_folder(os.path.dirname(path))
        report.folders_removed += removed
        self.folders_removed += removed

    @property
    def usage_bytes(self) -> int:
        """Bytes of blocks under the root (a lower bound until :attr:`complete`)."""
        return self.tracker.usage_bytes

    @property
    def complete(self) -> bool:
        return self.tracker.complete

    def usage(self) -> dict:
        """Usage as a plain dict: bytes, blocks, per folder, and whether it is complete."""
        return {**self.tracker.usage.as_dict(), "complete": self.complete,
                "passes": self.tracker.passes, "capacity_bytes": self.capacity_bytes}

    def bytes_to_free(self, want_free: int = 0) -> int:
        """Bytes to evict now: what takes usage plus ``want_free`` (room reserved by
        stores about to write) to ``capacity - slack_bytes``; 0 under it."""
        if not self.capacity_bytes:
            return 0
        need = self.usage_bytes + want_free + self.slack_bytes - self.capacity_bytes
        self.evicting = need > 0
        return max(0, need)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more stay within the capacity (always, when unlimited)."""
        return not self.capacity_bytes or self.usage_bytes + nbytes <= self.capacity_bytes

    def record_store(self, path: str, nbytes: int) -> None:
        """A block this process created (see :meth:`UsageTracker.record_store`)."""
        self.tracker.record_store(path, nbytes)

    def record_remove(self, path: str, nbytes: int) -> None:
        """A block this process removed (not one :meth:`step` evicted: those count)."""
        self.tracker.record_remove(path, nbytes)

    @property
    def pass_id(self) -> int:
        """The number of the walk pass in progress (0 for the first)."""
        return self.tracker.passes

    def top_position(self, folder: str) -> int:
        """Where the pass in progress stands in block folder ``folder``
        (:meth:`Walker.top_position`): published in the control block (``stats()``)."""
        return self.tracker.walker.top_position(folder)

    @property
    def candidates_left(self) -> int:
        """Blocks in the eviction index."""
        return len(self.index) if self.index is not None else 0

    def record_unplaced(self, folder: str, nbytes: int, nblocks: int) -> None:
        """Blocks created by other processes of this tier, paths unknown: counted high
        until the walk passes (see :meth:`UsageTracker.record_unplaced`)."""
        self.tracker.record_unplaced(folder, nbytes, nblocks)

    def step(self, budget: int, want_free: int = 0, walk: bool = True,
             evict_s: float | None = None, free_bytes: int = 0,
             walk_budget: int | None = None) -> StepReport:
        """Walk at most ``budget`` entries (sweeping and indexing as it goes), then evict
        at most ``budget`` blocks, oldest first, as many as take usage plus
        ``want_free`` to ``capacity - slack_bytes``. Work per call is bounded by
        ``budget`` metadata calls of each kind; a few hundred to a few thousand keeps a
        step in the low milliseconds on a local disk.

        ``want_free``: bytes stores have reserved and not written yet. ``walk=False``
        only evicts (a pause between passes). ``evict_s`` bounds the time spent
        evicting in this step (an unlink can take milliseconds on a busy disk); the rest
        waits for the next step. ``free_bytes``: evict at least this much whatever the
        capacity says (the file system is short of inodes or space the budget does not
        see). ``walk_budget``: walk at most this many entries instead (the walk is slow
        where each entry is a round trip, and eviction should not wait for it)."""
        report = StepReport()
        passes = self.tracker.passes
        if self.sweeper is not None and not self._pass_begun:
            self.sweeper.begin_pass()
            self._pass_begun = True
        entries = self.tracker.step(walk_budget or budget) if walk else []
        report.walked = self.tracker.last_visited if walk else 0
        index = self.index
        now_ns = time.time_ns()
        for entry in entries:
            if entry.kind is Kind.BLOCK:
                self._note_listed(entry, passes, now_ns)
                if entry.path in self._handed:  # counted by this pass while out
                    self._walked_handed.add(entry.path)
                if index is not None:
                    index.know(entry)
            elif entry.kind is Kind.EMPTY_FOLDER:
                if self.keep_top_folders and not LEAF_RE.match(os.path.basename(entry.path)):
                    continue
                if time.time_ns() - entry.mtime_ns > FOLDER_GRACE_NS:
                    self._remove_folder(entry.path, report)
            elif self.sweeper is not None:
                try:
                    if self.sweeper.offer(entry) and entry.kind is Kind.TEMP:
                        report.temps_removed += 1
                except OSError as exc:
                    # The sweep's own files (its lock probe) can fail where the root is
                    # out of inodes or space: the entry is kept for a later pass, and
                    # the walk and eviction -- what gives the space back -- go on.
                    if report.sweep_error is None:
                        report.sweep_error = exc
        if self.tracker.passes != passes:
            report.pass_completed = True
            self._pass_begun = False
        if index is not None:
            self._evict(budget, report, want_free,
                        None if evict_s is None else time.monotonic() + evict_s, free_bytes)
        report.usage_bytes = self.usage_bytes
        return report

    def _evict(self, budget: int, report: StepReport, want_free: int = 0,
               deadline: float | None = None, free_bytes: int = 0) -> None:
        need = max(self.bytes_to_free(want_free), free_bytes) - self.handed_bytes
        index = self.index
        freed = 0
        tried = 0
        while freed < need and tried < budget:
            if deadline is not None and tried and time.monotonic() > deadline:
                break
            entry = index.pop_oldest()
            if entry is None:
                break  # the caretaker walks on: the next blocks found are evictable
            tried += 1
            if entry.ino == UNSEEN_INO and not (self.hand_out and self.hand_out_unseen):
                # told, not walked: its real atime and inode
                seen = recheck(entry)
                if seen is not None:  # used since it was told: its atime moved past
                    index.know(seen, used=seen.atime_ns > entry.atime_ns)
                continue
            # Leaving: what the walk listed of it is forgotten, so that a block stored
            # again at this path (a new file) is not taken for the one listed.
            self._listed_new.pop(entry.path, None)
            if self.hand_out:
                report.to_evict.append(entry)
                self.handed_bytes += entry.size
                self._handed[entry.path] = (self.tracker.walker.will_visit(entry.path),
                                            self.tracker.passes)
                freed += entry.size
            elif evict(entry):
                index.forget(entry.path)
                self.tracker.record_remove(entry.path, entry.size)
                freed += entry.size
                report.removed_bytes += entry.size
                report.removed.append((entry.folder, key_of_block_path(entry.path)))
                self.evicted_blocks += 1
                self.evicted_bytes += entry.size
            else:
                report.refused += 1
                self._refused(entry)

"""One object a worker drives to keep a root in shape, a slice at a time.

    worker loop (between I/O tasks, never the engine's scheduler thread)
      report = maintainer.step(budget)        walk <= budget entries
        ├─ UsageTracker    usage rebuilt pass by pass, own stores/evictions as deltas
        ├─ TempSweeper     stale temporary files and dead writers' leases removed
        ├─ OldestBlocks    the oldest blocks of this pass, for the next eviction
        ├─ evict           past the high watermark: oldest first, down to the low one
        │                  (or ``free_bytes`` more: the caretaker's inode watch)
        └─ empty folders   <h3> and <h2>_g<group> folders the walk finds empty: removed
      report.removed       -> "removed" events;  maintainer.usage_bytes -> stats()

Eviction uses the candidates of the last complete pass, so it follows LRU over the whole
root. Before the first pass completes (a tier just started on a full root) it waits,
unless what the pass has counted so far already exceeds the capacity itself: then it
evicts the oldest seen so far (LRU approximate, once) rather than fail stores for the
length of a walk of millions.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from mptier.storage.leases import DEFAULT_STALE_TEMP_S, TempSweeper
from mptier.storage.names import LEAF_RE, key_of_block_path
from mptier.storage.usage import (
    DEFAULT_MAX_CANDIDATES,
    OldestBlocks,
    UsageTracker,
    bytes_to_free,
    check_watermarks,
    evict,
)
from mptier.storage.walk import Entry, Kind, remove_empty_folder

# Candidates kept per pass cover this many times the band between the watermarks, so
# that one pass's candidates outlast some blocks becoming recently used (refused)...
CANDIDATE_SLACK = 2.0
# ...and at least this fraction of the capacity: under continuous stores eviction rounds
# come one after another, and each round without candidates waits for a whole walk pass.
# Candidates used since the pass are refused by evict(), so a longer list costs memory
# only (bounded by max_candidates).
CANDIDATE_MIN_FRACTION = 0.25
# The walk removes an empty block folder only once it has been unchanged this long: a
# writer that just made it (and writes an O_TMPFILE block in it, which leaves it empty
# until the link) is not made to retry. Any older leftover goes; a clock skewed by more
# (a network file system's server) only brings back the writer's retry.
FOLDER_GRACE_NS = 10 * 10**9


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

    ``capacity_bytes`` 0 means unlimited (no eviction). ``block_bytes`` is this tier's
    block size, used where a cache folder has no ``mptier.json``. ``locks_work`` None
    probes the root on the first step. Not thread-safe; every call blocks its thread on
    file-system metadata calls only (no data is read).

    ``hand_out=True``: :meth:`step` does not remove blocks itself but hands them out
    (``StepReport.to_evict``) for another thread to remove with :func:`evict`, each
    reported back with :meth:`evicted`; bytes handed out count as being freed. A caller
    whose thread also does other I/O (a worker) keeps eviction going meanwhile.
    """

    def __init__(self, root: str | os.PathLike[str], *, capacity_bytes: int = 0,
                 high_watermark: float = 0.95, low_watermark: float = 0.85,
                 block_bytes: int | Mapping[str, int] | None = None,
                 stale_temp_s: float = DEFAULT_STALE_TEMP_S, locks_work: bool | None = None,
                 sweep: bool = True, max_candidates: int = DEFAULT_MAX_CANDIDATES,
                 hand_out: bool = False) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 (0 = unlimited), got "
                             f"{capacity_bytes}")
        if capacity_bytes:
            check_watermarks(capacity_bytes, high_watermark, low_watermark)
        self.root = os.path.normpath(os.fspath(root))
        self.capacity_bytes = capacity_bytes
        self.high = high_watermark
        self.low = low_watermark
        self.max_candidates = max_candidates
        self.tracker = UsageTracker(self.root, default_block_bytes=block_bytes)
        self.sweeper = TempSweeper(self.root, locks_work=locks_work,
                                   stale_temp_s=stale_temp_s) if sweep else None
        self._next = self._new_candidates()
        self._ready: deque[Entry] = deque()  # last complete pass, oldest first, consumed
        self._pass_begun = False
        self.evicting = False   # past high, not yet back under low (hysteresis)
        self.evicted_blocks = 0
        self.evicted_bytes = 0
        self.hand_out = hand_out
        self.handed_bytes = 0   # handed out, not yet reported back
        self.refused = 0
        self.folders_removed = 0

    def evicted(self, entry: Entry, removed: bool) -> bytes | None:
        """A block handed out by :meth:`step` was removed (``removed``) or kept (used
        again, replaced, gone). Returns its key when it was removed."""
        self.handed_bytes -= entry.size
        if not removed:
            self.refused += 1
            return None
        self.tracker.record_remove(entry.path, entry.size)
        self.evicted_blocks += 1
        self.evicted_bytes += entry.size
        return key_of_block_path(entry.path)

    def _remove_folder(self, path: str, report: StepReport) -> None:
        """An empty block folder the walk found: removed, and for a <h2>_g<group>
        folder its <h3> folder too if that is now empty (its mtime is ours)."""
        removed = remove_empty_folder(path)
        if removed and LEAF_RE.match(os.path.basename(path)):
            removed += remove_empty_folder(os.path.dirname(path))
        report.folders_removed += removed
        self.folders_removed += removed

    def _new_candidates(self) -> OldestBlocks | None:
        if not self.capacity_bytes:
            return None
        band = (self.high - self.low) * self.capacity_bytes
        over = max(0, self.tracker.usage_bytes - self.low * self.capacity_bytes)
        target = max(max(band, over) * CANDIDATE_SLACK,
                     CANDIDATE_MIN_FRACTION * self.capacity_bytes)
        return OldestBlocks(math.ceil(target), self.max_candidates)

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

    def bytes_to_free(self) -> int:
        """Bytes to evict now: once usage passed the high watermark, whatever brings it
        under the low one (and 0 again only when it is there)."""
        if not self.capacity_bytes:
            return 0
        if bytes_to_free(self.usage_bytes, self.capacity_bytes, self.high, self.low):
            self.evicting = True
        if self.evicting:
            need = self.usage_bytes - math.floor(self.low * self.capacity_bytes)
            if need <= 0:
                self.evicting = False
            return max(0, need)
        return 0

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
        (:meth:`Walker.top_position`): published for other processes of the tier, who
        sort their new blocks into "ahead" (their h3 folder is past this and in
        :meth:`top_listing`, or the folder is not listed yet) and "behind" (the rest)
        for :meth:`record_other_stores`."""
        return self.tracker.walker.top_position(folder)

    def top_listing(self, folder: str) -> bytes | None:
        """:meth:`Walker.top_listing` of the pass in progress."""
        return self.tracker.walker.top_listing(folder)

    def record_other_stores(self, pass_id: int, folder: str, ahead: tuple[int, int],
                            behind: tuple[int, int]) -> None:
        """Blocks another process of this tier created in ``folder``, as ``(bytes,
        blocks)``, sorted by that process against :meth:`top_position` of pass
        ``pass_id`` into those the pass will still count (``ahead``) and those it may
        not (``behind``). Counted so that the total is right whichever pass is in
        progress now: in the same pass, ``ahead`` goes into the finished total only (the
        walk will find them) and ``behind`` into both; a pass later, the walk already
        counted ``ahead`` and the new pass will find ``behind``; older, the new pass
        finds everything. Errs high only for blocks in the h3 folder being walked."""
        current = self.tracker.passes
        if pass_id == current:
            self.tracker.record_counted(folder, *ahead, in_current=True, in_building=False)
            self.tracker.record_counted(folder, *behind, in_current=True, in_building=True)
        elif pass_id == current - 1:
            self.tracker.record_counted(folder, *behind, in_current=True, in_building=False)
        else:
            self.tracker.record_counted(folder, ahead[0] + behind[0], ahead[1] + behind[1],
                                        in_current=True, in_building=False)

    @property
    def candidates_left(self) -> int:
        """Eviction candidates of the last complete pass not yet tried."""
        return len(self._ready)

    def record_unplaced(self, folder: str, nbytes: int, nblocks: int) -> None:
        """Blocks created by other processes of this tier, paths unknown: counted high
        until the walk passes (see :meth:`UsageTracker.record_unplaced`)."""
        self.tracker.record_unplaced(folder, nbytes, nblocks)

    def step(self, budget: int, want_free: int = 0, walk: bool = True,
             evict_s: float | None = None, free_bytes: int = 0) -> StepReport:
        """Walk at most ``budget`` entries (sweeping and collecting as it goes), then, if
        past the high watermark, evict at most ``budget`` blocks. Work per call is
        bounded by ``budget`` metadata calls of each kind; a few hundred to a few
        thousand keeps a step in the low milliseconds on a local disk.

        ``want_free``: bytes writers are waiting to store; eviction then also frees
        what takes usage to ``capacity - want_free`` (when that is below the low
        watermark). ``walk=False`` only evicts (a pause between passes). ``evict_s``
        bounds the time spent evicting in this step (an unlink can take milliseconds on
        a busy disk); the rest waits for the next step. ``free_bytes``: evict at least
        this much whatever the byte watermarks say (the file system is short of inodes
        or space the budget does not see)."""
        report = StepReport()
        passes = self.tracker.passes
        if self.sweeper is not None and not self._pass_begun:
            self.sweeper.begin_pass()
            self._pass_begun = True
        entries = self.tracker.step(budget) if walk else []
        report.walked = self.tracker.last_visited if walk else 0
        for entry in entries:
            if entry.kind is Kind.BLOCK:
                if self._next is not None:
                    self._next.offer(entry)
            elif entry.kind is Kind.EMPTY_FOLDER:
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
            self._ready = deque(self._next.oldest_first() if self._next is not None else ())
            self._next = self._new_candidates()
        if self.capacity_bytes:
            self._evict(budget, report, want_free,
                        None if evict_s is None else time.monotonic() + evict_s, free_bytes)
        report.usage_bytes = self.usage_bytes
        return report

    def _evict(self, budget: int, report: StepReport, want_free: int = 0,
               deadline: float | None = None, free_bytes: int = 0) -> None:
        need = max(self.bytes_to_free(), free_bytes,
                   self.usage_bytes + want_free - self.capacity_bytes if want_free else 0)
        need -= self.handed_bytes  # already on their way out
        if need <= 0:
            return
        if not self._ready and not self.complete and self._next is not None \
                and (self.usage_bytes + want_free > self.capacity_bytes or free_bytes):
            # The first pass is still running and what it has counted so far is already
            # past the capacity: stores would fail. Evict the oldest seen so far rather
            # than wait for the whole walk (LRU is then approximate, once).
            self._ready = deque(self._next.oldest_first())
            self._next = self._new_candidates()
        freed = 0
        tried = 0
        while self._ready and freed < need and tried < budget:
            if deadline is not None and tried and time.monotonic() > deadline:
                break
            entry = self._ready.popleft()
            tried += 1
            if self.hand_out:
                report.to_evict.append(entry)
                self.handed_bytes += entry.size
                freed += entry.size
            elif evict(entry):
                self.tracker.record_remove(entry.path, entry.size)
                freed += entry.size
                report.removed_bytes += entry.size
                report.removed.append((entry.folder, key_of_block_path(entry.path)))
                self.evicted_blocks += 1
                self.evicted_bytes += entry.size
            else:
                report.refused += 1

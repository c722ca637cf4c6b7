"""The caretaker: the one worker per root that keeps the root in shape between tasks.

The supervisor designates one serving worker per root (``caretake`` message; again when
that worker dies or detaches). The caretaker owns the root's
:class:`~mptier.storage.RootMaintainer` (walk, usage, temp sweep, LRU eviction) and
steps it -- never on the engine's scheduler thread -- ::

    idle (between epoll waits)      a step of MAINT_BUDGET entries every IDLE_GAP_S
    busy (between tasks)            a step every BUSY_GAP_S, or EVICT_GAP_S while the
                                    root is past its high watermark or a store waits
                                    for room, so eviction keeps up under load
    after a complete pass           a rest without walking (eviction still runs): four
                                    times the pass's duration, 0.5 s to WALK_REST_S
    folders to make ahead           first in each step, a slice of the block folder's
                                    <h3> folders (storage.folders), and an idle
                                    worker's next step within FOLDERS_GAP_S

After each step it publishes the root's usage and the walk's position in the control
block (other workers and the engine read them without a message), and reports keys it
evicted from the engine's own block folder as REMOVED messages on the completion pipe.

Other workers' new blocks reach the usage and the eviction index through a ring per
slot (their paths: ``RootMaintainer.record_told`` counts each once against the walk,
whatever the walk did since the store; ``record_created`` indexes it); other nodes'
stores through the walk only. Stores reserve their room
in their slots before they check it, and the caretaker publishes beside the usage the
created bytes it holds (the stamp) and, from its unlink threads as each unlink returns,
the bytes removed: ``ControlBlock.usage_now`` is then this tier's usage at any moment.
Eviction keeps usage plus reservations under ``capacity - slack``, the slack being what
the writers reserved at once lately (1-10 % of the capacity); a store writes only the
part of its task that fits under the capacity (``rootio._room``).

Bytes are not all a root can run out of. The caretaker also watches its file system's
inodes (``statvfs`` f_files / f_favail, every INODE_CHECK_S): past the tier's high
watermark of inodes in use it evicts as many blocks (one inode each) as bring them to
the low one. And a store the file system refused for space (ENOSPC while the budget has
room, or EDQUOT: counted in the worker's slot) starts eviction at once: one watermark
band of the usage. Both need ``capacity_bytes`` (without it nothing is ever evicted).

Long because the caretaker's schedule (when to step, rest, hurry) and what it publishes
after each step read one root's state (_Kept) together, and each tunable above carries
the measurement behind it; its unlink threads are in evictor.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from mptier.errors import MptierError
from mptier.jobs import MessageType, encode_message, pack_keys
from mptier.storage import RootMaintainer, TopFolders
from mptier.storage.election import ELECT_GAP_S, RootShare
from mptier.storage.maintain import EVICT_SLACK_FRACTION
from mptier.storage.roots import root_identity
from mptier.workers.control import (
    ROOT_COMPLETE,
    ROOT_EVICTING,
    ROOT_INODES_LOW,
    ROOT_WALKER,
    RootState,
)
from mptier.workers.evictor import EVICTOR_STOP_S, EVICTOR_THREADS, Evictor, backend_evict
from mptier.workers.health import is_fault


class CaretakerHost(Protocol):
    """What a caretaker uses of the worker hosting it (its ``WorkerContext``, which
    imports this module: the worker knows its caretaker, not the other way round)."""

    slot_writer: Any  # its SlotWriter
    io: Any  # the session's IoSettings
    block_bytes: int
    roots: list[Any]  # its RootHandles
    backend: Any  # its mptier.native.Backend (the unlink threads' evict_block)
    report_root: Callable[[int, bool, int, str], None]

    def report(self, message: bytes | None = None) -> None: ...


log = logging.getLogger("mptier.workers")

# Directory entries per maintainer step: a step then takes a few milliseconds on a
# local disk (docs/storage.md: step(1000) 16 ms median on 2 loaded cores), short enough
# to sit between tasks without delaying the next one noticeably.
MAINT_BUDGET = 256
# Idle: the gap between steps while a pass walks or eviction runs. 256 entries per 20 ms
# is ~13k entries/s, a fraction of one core; a root of a million files takes ~80 s a pass.
IDLE_GAP_S = 0.02
# Busy (a task after another): a step at least this often, so usage and the sweep go on
# under continuous load...
BUSY_GAP_S = 0.25
# ...and after every task while the root is at or near its high watermark, or a store
# waits for room: eviction then keeps pace with stores (measured: stepping only every
# 50 ms there made stores wait ~100 ms for room, 8-24 times per GiB stored). "Near":
# within this of the mark (at most half the band), about what a few workers' tasks add
# at once.
URGENT_MARGIN_BYTES = 64 << 20
# While urgent and idle, steps follow each other this closely.
EVICT_GAP_S = 0.005
# Entries walked and blocks evicted per step while urgent: a pass that must find new
# candidates ends sooner.
URGENT_BUDGET = 4 * MAINT_BUDGET
# After a complete pass, no walking for a while (eviction and accounting go on): a small
# root would otherwise be walked over and over. Other nodes' stores are seen only by the
# walk, so the rest is as short as the walk's cost allows: WALK_REST_FACTOR times the
# pass's own duration (walking then takes at most a fifth of the caretaker's steps),
# within [WALK_REST_MIN_S, WALK_REST_S]. A root of a few thousand blocks is walked again
# every half second; a root of a million files (a pass ~80 s) every 10 s.
WALK_REST_FACTOR = 4.0
WALK_REST_MIN_S = 0.5
WALK_REST_S = 10.0
# Eviction runs ahead of the stores by a slack (RootMaintainer.slack_bytes): at least
# EVICT_SLACK_FRACTION of the capacity, and as much as the writers reserved at once lately
# (the most slots reserving at one look times the largest task's new bytes, over the
# last SLACK_WINDOW_S), so a store finds its room evicted already instead of waiting for
# unlinks; at most MAX_SLACK_FRACTION, since the slack is cache the budget does not
# use (an LRU of capacity - slack).
MAX_SLACK_FRACTION = 0.10
SLACK_WINDOW_S = 30.0
# Entries a root's elected walker walks per step while it evicts: every tier hands it
# the blocks it creates, so eviction and the published figure need no walk, and on a
# distributed file system (an lstat a round trip) a full step's walk took ~1 s under
# load, stalling the other tiers' stores for room.
SHARED_WALK_BUDGET = 32
# And the time it spends evicting per step (each block another tier created is looked
# at once, an lstat, before it is handed out): the others' blocks are folded and the
# figure they trust published between two such slices.
SHARED_EVICT_S = 0.05
# A contributor to a root's walker asks for a grant (election.py) that leaves room,
# beyond what its stores hold now, for what they stored in GRANT_AHEAD_S lately (and at
# least what they reserved at once), so that its next stores find room without waiting
# for the walker's answer (a round trip: both caretakers' steps, the fold, publication
# and read gaps, the file system's metadata; 0.1-0.5 s measured on JuiceFS under load).
# "Lately" is this GRANT_WINDOW_S and the one before it: an idle tier asks for nothing
# within two windows and the walker takes its room back. The walker gives such headroom
# out of its slack only (election.RootShare.grant), so asking more costs no cache.
GRANT_WINDOW_S = 1.0
GRANT_AHEAD_S = 0.5
# A store of the caretaker itself, waiting for room, steps this often.
MAKE_ROOM_POLL_S = 0.005
# How often a resting or unhealthy root is looked at.
REST_CHECK_S = 0.1
# While a root's folders are being made ahead (storage.folders), an idle worker's next
# step comes this soon: a slice takes at most folders.MAKE_STEP_S, so the 4,096 are
# made within a second of the pool's start on a local disk. Under load only a busy
# step's slice is made (every BUSY_GAP_S), and that is better than faster: a fill of
# 2,048 blocks started with the pool ran 1.09x as fast as without the folders, but
# 0.95x with a thread that made all of them at once -- its mkdirs wait for the same
# lock as the stores' (bench/experiments/fresh_fill.py --at-once).
FOLDERS_GAP_S = 0.005
ERROR_BACKOFF_S = 1.0
# How often the root's free inodes are looked at (one statvfs: a round trip on a network
# mount). A file system running out of inodes does so over many stores; once a second
# sees it long before the last one, and a refused store triggers a look at once.
INODE_CHECK_S = 1.0


def _near_high(m: RootMaintainer, usage: int) -> bool:
    """Usage at or within URGENT_MARGIN_BYTES (at most a tenth of the capacity) of the
    mark eviction keeps it under (capacity - slack)."""
    if not m.capacity_bytes:
        return False
    margin = min(URGENT_MARGIN_BYTES, m.capacity_bytes / 10)
    return usage >= m.capacity_bytes - m.slack_bytes - margin


@dataclass
class _Kept:
    index: int
    path: str
    maintainer: RootMaintainer
    pass_base: int  # published pass ids are pass_base + the maintainer's pass number
    inherited_bytes: int  # usage published before this caretaker (a restart's guess)
    evicted_base: tuple[int, int]
    temps_base: int
    next_at: float = 0.0
    last_at: float = 0.0
    rest_until: float = 0.0
    pass_began: float | None = None  # when the current pass started walking
    # Elected at this time (monotonic) and no pass begun since has ended: the usage is
    # at least inherited_bytes. A tier walker before keeps its last stint's pass, which
    # holds nothing of what the other tiers stored and removed since.
    elected_at: float | None = None
    temps_removed: int = 0
    # Per slot: (pid, created bytes folded into the usage); their sum is the stamp
    # published beside the usage (ControlBlock.usage_now).
    made: dict[int, tuple[int, int]] = field(default_factory=dict)
    pending: int = 0  # created, not folded, plus reserved: what stores add next
    ring_at: dict[int, int] = field(default_factory=dict)  # per slot: ring entries read
    freed_folded: int = 0  # bytes the unlink threads removed that the usage holds
    # The largest task (new bytes) and the most writers at once seen in this window,
    # and when the window began: the slack is their product (MAX_SLACK_FRACTION).
    task_peak: int = 0
    writers_peak: int = 0
    window_at: float = 0.0
    # A contributor's headroom (GRANT_WINDOW_S): this window's most bytes its stores
    # reserved at once and bytes they created, the last window's headroom, and when
    # this window began.
    ask_peak: int = 0
    ask_made: int = 0
    ask_last: int = 0
    ask_at: float = 0.0
    evictor: Evictor | None = None
    folders_base: int = 0
    walked: int = 0  # directory entries walked ever (the tier's, across caretakers)
    inodes: tuple[int, int] = (0, 0)  # statvfs (f_files, f_favail); 0 files: unknown
    inodes_low: bool = False  # past the high watermark of inodes, not back under low
    inodes_at: float = 0.0  # when the inodes are looked at next
    no_space_seen: int = 0  # the slots' count of stores refused for space, last seen
    usage_target: int | None = None  # evicting for inodes or space: down to this usage
    # The root folder this maintainer walks ((st_dev, st_ino); None: not seen yet). A
    # path that leads elsewhere now starts a fresh maintainer: the root is followed by
    # path, and the budget counts what is behind the path.
    identity: tuple[int, int] | None = None
    # The root's walker election (mptier/storage/election.py); None where locks do not
    # work (this caretaker then walks and evicts on its own, as every tier's did), or
    # until the election could be joined (share_at: when it is tried again; None once
    # it is joined, or locks are known not to work).
    share: RootShare | None = None
    share_at: float | None = None
    # The block folder's <h3> folders still to make (None: made, given up, or not
    # made ahead on this root: RootIo.folders_ahead).
    folders: TopFolders | None = None


class Caretaker:
    """The maintainers of the roots one worker was designated for. Not thread-safe:
    the worker's serving thread drives it."""

    def __init__(self, ctx: CaretakerHost) -> None:
        self.ctx = ctx
        self.kept: dict[int, _Kept] = {}
        self.folder = os.path.basename(ctx.roots[0].mapper.blocks_dir)

    def __bool__(self) -> bool:
        return bool(self.kept)

    def take(self, indices: list[int], fresh: bool = False) -> None:
        """Become the caretaker of these roots (indices into the tier's roots).
        ``fresh``: the folder behind the root changed, so nothing published before about
        its usage holds."""
        ctx = self.ctx
        control = ctx.slot_writer.control
        io = ctx.io
        for index in indices:
            if index in self.kept or not 0 <= index < len(ctx.roots):
                continue
            path = ctx.roots[index].path
            rec = control.root(index)
            maintainer = RootMaintainer(
                path, capacity_bytes=io.capacity_bytes, high_watermark=io.high_watermark,
                low_watermark=io.low_watermark, block_bytes=ctx.block_bytes,
                stale_temp_s=io.stale_temp_s, locks_work=io.lease_locks,
                hand_out=bool(io.capacity_bytes), eviction_policy=io.eviction_policy,
                keep_top_folders=io.roots[index].folders_ahead)
            kept = _Kept(index, path, maintainer, pass_base=rec.pass_id + 2,
                         inherited_bytes=0 if fresh else rec.usage_bytes,
                         evicted_base=(rec.evicted_blocks, rec.evicted_bytes),
                         temps_base=rec.temps_removed,
                         evictor=Evictor(path, EVICTOR_THREADS,
                                          functools.partial(control.set_freed, index),
                                          backend_evict(ctx.backend))
                         if io.capacity_bytes else None,
                         folders_base=control.root_extra(index)[2],
                         walked=control.walked_entries(index),
                         no_space_seen=control.no_space_stores(index),
                         folders=TopFolders(ctx.roots[index].mapper.blocks_dir)
                         if io.roots[index].folders_ahead else None)
            # What workers created before now is on disk already: this walk finds it.
            for slot in range(control.n_slots):
                kept.ring_at[slot] = control.ring_count(slot)
                kept.made[slot] = (control.slot_pid(slot), control.slot_made(slot, index))
            control.set_freed(index, 0)  # this caretaker's unlink threads count anew
            control.set_freed_stamp(index, 0)
            with contextlib.suppress(OSError):  # a root that fails now: the walk says so
                kept.identity = root_identity(path)
            _join_election(kept, time.monotonic())
            self.kept[index] = kept
            self._publish(kept)
            log.debug("mptier: worker pid %d takes care of root %s", os.getpid(), path)

    def close(self, wait_s: float = EVICTOR_STOP_S) -> None:
        """Stop the eviction threads (at the end of the session). Blocks at most
        ``wait_s`` per root (a thread in a hung unlink is left behind: it is a daemon)."""
        for kept in self.kept.values():
            if kept.evictor is not None:
                kept.evictor.stop(wait_s)
            _close_share(kept)
        self.kept.clear()

    # -- scheduling --------------------------------------------------------------------

    def wait_s(self, cap: float) -> float:
        """How long an idle worker may sleep before a step is due (at most ``cap``)."""
        if not self.kept:
            return cap
        now = time.monotonic()
        return max(0.0, min(cap, *(k.next_at - now for k in self.kept.values())))

    def run(self, busy: bool) -> None:
        """Step every root that is due. ``busy``: between two tasks (steps are then
        spaced by BUSY_GAP_S; while the root is at or past its high watermark, or a store
        waits for room, one follows every task)."""
        now = time.monotonic()
        for kept in list(self.kept.values()):
            if busy:
                # Between tasks, first bring the usage up to date (no I/O: the slots'
                # counters and the evictor's results), so that "near the high
                # watermark" is seen in time.
                self._collect(kept)
                self._take_evicted(kept)
                self._publish(kept)
                if now - kept.last_at < BUSY_GAP_S and not self._urgent(kept):
                    continue
            elif now < kept.next_at:
                continue
            self._step(kept, now)
            if kept.folders is not None:  # folders still to make: the next slice soon
                kept.next_at = min(kept.next_at, now + FOLDERS_GAP_S)

    def _urgent(self, kept: _Kept) -> bool:
        """Eviction cannot wait for the next gap: past the high watermark (or nearly:
        the stores in flight may take it there before the next step), or a store waits."""
        m = kept.maintainer
        control = self.ctx.slot_writer.control
        share = kept.share
        granted = share is not None and not share.walker and share.granted
        # (A contributor's figure is its grant's: near the mark whenever its grant is
        # nearly used, which the last test below asks instead.)
        if m.evicting or (not granted and _near_high(m, control.usage_now(kept.index))):
            return True
        if kept.usage_target is not None or \
                control.no_space_stores(kept.index) > kept.no_space_seen:
            return True
        if share is not None and share.walker and m.capacity_bytes and (
                share.others_reserved or share.asking()):
            return True  # another tier's stores wait for this walker's eviction or grant
        if any(control.want_free(slot, kept.index)
               for slot in range(control.n_slots)):
            return True
        # A contributor whose stores will soon run out of their grant: its ask goes out
        # before they wait for it.
        return granted and share.grant_left() - kept.pending < _headroom(kept)

    def make_room(self, index: int, room: Callable[[], int], nbytes: int,
                  deadline: float) -> int:
        """(A store of this worker, on a root it takes care of.) Evict until ``room()``
        (bytes free under the capacity: rootio._room's rule) reaches ``nbytes``, or
        ``deadline`` (monotonic) passes. Returns the last ``room()`` read: the room the
        store may write into. Reading it again would be wrong, since another writer's
        reservation (or a block counted twice for an instant) can take it in between,
        and the store would fail at once for room it had."""
        kept = self.kept.get(index)
        free = room()
        while kept is not None and free < nbytes and time.monotonic() < deadline:
            self._step(kept, time.monotonic(), want_free=nbytes)
            time.sleep(MAKE_ROOM_POLL_S)  # the evictor thread removes meanwhile
            free = room()
        return free

    # -- one step ----------------------------------------------------------------------

    def _step(self, kept: _Kept, now: float, want_free: int = 0) -> None:
        ctx = self.ctx
        writer = ctx.slot_writer
        control = writer.control
        m = kept.maintainer
        state, _, _, retry_at = control.root_health(kept.index)
        kept.last_at = now
        if state == RootState.OUT and time.monotonic_ns() < retry_at:
            kept.next_at = now + REST_CHECK_S  # an operation will probe it, not us
            return
        # First whether the path still leads to the folder walked: after a mount over
        # the root, the election below would fail for good (its .mptier/walk is on the
        # file system underneath) and this step would never come to the check.
        writer.set_root(kept.index)  # a hang in the stat is blamed on this root
        try:
            if self._moved(kept):
                return
        finally:
            writer.set_root(None)
        if kept.folders is not None and not want_free:  # (a store waiting: evict first)
            self._make_folders(kept)
        if kept.share_at is not None and now >= kept.share_at:
            _join_election(kept, now)
        share = kept.share
        try:
            if share is not None and share.walker and not share.keep_seat(now):
                log.warning("mptier: worker pid %d stood still and another tier took over "
                            "as the walker of root %s; this one contributes again",
                            os.getpid(), kept.path)
            elected = share is not None and not share.walker and share.elect(now)
        except OSError as exc:  # the root's .mptier/walk folder is gone or failing
            log.warning("mptier: the walker election of root %s: %s", kept.path, exc)
            if exc.errno == errno.ENOENT:
                self._share_again(kept)
            kept.next_at = now + ERROR_BACKOFF_S
            return
        if share is not None and not share.walker:
            self._contribute(kept, now)
            return
        if elected:
            # The seat is ours: walk from scratch, trusting the last figure meanwhile,
            # and count what this tier created as a contributor that the last walker
            # had not folded (its log goes with the seat).
            kept.inherited_bytes = max(kept.inherited_bytes, share.inherited)
            kept.elected_at = now
            for path, nbytes in share.unfolded_own:
                m.record_store(path, nbytes)
                m.record_created(path, nbytes)
            share.unfolded_own = []
            log.info("mptier: worker pid %d is now the walker of root %s", os.getpid(),
                     kept.path)
        waiting = max(want_free, self._collect(kept))  # stores stopped for room now
        want = max(waiting, kept.pending + self._fold(kept, now))
        free = self._watch_space(kept, now)
        # Without a budget nothing is evicted, whatever stores hold (other tiers'
        # reservations made a walker with contributors walk 32 entries a step: 1,184
        # entries in 30 s under eight tiers' stores, against 133,376 for one tier).
        freeing = m.evicting or (bool(want) and bool(m.capacity_bytes)) or bool(free)
        urgent = freeing or _near_high(m, m.usage_bytes + want)
        # A store that waits for room waits for this step: with candidates in the index
        # it evicts without walking first (a walk slice of URGENT_BUDGET entries took
        # ~150 ms on a loaded disk, many times the task waiting; docs/storage.md,
        # "Capacity at scale"). The pass goes on in the steps between waits.
        walking = (now >= kept.rest_until and not (waiting and m.candidates_left)) \
            or (freeing and not m.candidates_left)
        if walking and kept.pass_began is None:
            kept.pass_began = now
        writer.set_root(kept.index)  # a hang here is blamed on this root
        try:
            shared = share is not None and bool(share.cursors)  # others hand us blocks
            m.hand_out_unseen = shared
            report = m.step(URGENT_BUDGET if urgent else MAINT_BUDGET, want_free=want,
                            walk=walking, free_bytes=free,
                            walk_budget=SHARED_WALK_BUDGET if shared and freeing else None,
                            evict_s=SHARED_EVICT_S if shared else None)
        except OSError as exc:
            text = f"walking root {kept.path}: {exc}"
            log.warning("mptier: %s", text)
            if exc.errno is not None and is_fault(exc.errno):
                ctx.report_root(kept.index, False, exc.errno, text)
            kept.next_at = now + ERROR_BACKOFF_S
            return
        finally:
            writer.set_root(None)
        kept.walked += report.walked
        if report.sweep_error is not None:
            exc = report.sweep_error
            text = f"sweeping root {kept.path}: {exc}"
            log.warning("mptier: %s", text)
            if exc.errno is not None and is_fault(exc.errno):
                ctx.report_root(kept.index, False, exc.errno, text)
        if kept.evictor is not None:
            for entry in report.to_evict:
                kept.evictor.put(entry)
        self._take_evicted(kept)
        if report.pass_completed:
            if share is not None and kept.pass_began is not None:
                share.walked(kept.pass_began)  # a seat taken over: see election.walked
            if kept.elected_at is not None and kept.pass_began is not None \
                    and kept.pass_began >= kept.elected_at:
                kept.elected_at = None  # walked all of it as the walker: exact now
            took = now - (kept.pass_began if kept.pass_began is not None else now)
            kept.rest_until = now + min(WALK_REST_S,
                                        max(WALK_REST_MIN_S, WALK_REST_FACTOR * took))
            kept.pass_began = None
        kept.temps_removed += report.temps_removed
        if report.temps_removed:
            log.info("mptier: removed %d stale temporary file(s) under %s",
                     report.temps_removed, kept.path)
        self._publish(kept)
        freeing = m.evicting or bool(want) or kept.usage_target is not None
        kept.next_at = now + (EVICT_GAP_S if freeing else IDLE_GAP_S if walking or urgent
                              else REST_CHECK_S)
        own = [key for folder, key in report.removed if folder == self.folder]
        if own:
            self._send_removed(own)

    def _make_folders(self, kept: _Kept) -> None:
        """A slice of the block folder's missing <h3> folders (mptier.storage.folders)."""
        writer = self.ctx.slot_writer
        writer.set_root(kept.index)  # a hang in a mkdir is blamed on this root
        try:
            kept.folders.step()
        except OSError as exc:  # read-only, full: stores make the folders they need
            log.warning("mptier: making the folders of %s ahead: %s; stores make them "
                        "as they need them", kept.folders.blocks_dir, exc)
            kept.folders = None
            return
        finally:
            writer.set_root(None)
        if kept.folders.done:
            log.debug("mptier: made %d folders of %s ahead", kept.folders.made,
                      kept.folders.blocks_dir)
            kept.folders = None

    def _moved(self, kept: _Kept) -> bool:
        """Does the root path lead to another folder than the one walked (a file system
        mounted over it or taken away, a folder swapped in)? Then a fresh maintainer
        takes over (its walk, usage and eviction are of the folder behind the path now)
        and True is returned. A path that fails to stat is left to the walk to report."""
        try:
            identity = root_identity(kept.path)
        except OSError:
            return False
        if kept.identity is None:
            kept.identity = identity
        if identity == kept.identity:
            return False
        log.warning("mptier: root %s now leads to another folder (device %d:%d inode %d); "
                    "its caretaker starts over there: walk, usage and eviction follow the "
                    "path", kept.path, os.major(identity[0]), os.minor(identity[0]),
                    identity[1])
        if kept.evictor is not None:
            kept.evictor.stop(EVICTOR_STOP_S)
        _close_share(kept)
        del self.kept[kept.index]
        self.take([kept.index], fresh=True)
        return True

    def _share_again(self, kept: _Kept) -> None:
        """The root's .mptier/walk was removed under a live tier (the root itself still
        leads to the folder walked: _moved said so). A fresh share makes the folder
        again and the next step elects there; without it no tier would ever walk the
        root again. A root that is gone as well keeps the old share, tried again."""
        try:
            fresh = RootShare(kept.maintainer.root,
                              granting=bool(kept.maintainer.capacity_bytes))
        except (OSError, MptierError) as exc:
            log.debug("mptier: root %s: no fresh walker election yet (%s)", kept.path, exc)
            return
        _close_share(kept)
        kept.share = fresh
        log.warning("mptier: %s/.mptier/walk was removed; made again, the walker election "
                    "starts over", kept.path)

    def _watch_space(self, kept: _Kept, now: float) -> int:
        """Bytes to evict now for what the byte budget does not see (module docstring):
        the file system's inodes past the high watermark, or a store refused for space.
        Blocks on one statvfs at most."""
        control = self.ctx.slot_writer.control
        m = kept.maintainer
        io = self.ctx.io
        block = self.ctx.block_bytes
        refused = control.no_space_stores(kept.index)
        grew = refused > kept.no_space_seen  # (a replaced worker's slot starts at 0)
        kept.no_space_seen = refused
        targets = [] if kept.usage_target is None else [kept.usage_target]
        if grew or now >= kept.inodes_at:
            kept.inodes_at = now + INODE_CHECK_S
            try:
                st = os.statvfs(kept.path)
            except OSError:
                st = None
            if st is not None and st.f_files:
                kept.inodes = (st.f_files, st.f_favail)
                used = st.f_files - st.f_favail
                if used > io.high_watermark * st.f_files and not kept.inodes_low:
                    log.warning("mptier: %s has %d of %d inodes free, under the low-inode "
                                "watermark; evicting blocks for inodes", kept.path,
                                st.f_favail, st.f_files)
                    kept.inodes_low = True
                elif used <= io.low_watermark * st.f_files:
                    kept.inodes_low = False
                if kept.inodes_low:
                    spare = used - math.floor(io.low_watermark * st.f_files)
                    targets.append(m.usage_bytes - spare * block)
        if grew:
            band = max(block, math.ceil((io.high_watermark - io.low_watermark)
                                        * m.usage_bytes))
            log.warning("mptier: the file system under %s refused a store for space "
                        "(ENOSPC or EDQUOT) with usage at %d bytes of capacity_bytes=%d; "
                        "evicting %d bytes", kept.path, m.usage_bytes, io.capacity_bytes,
                        band)
            targets.append(m.usage_bytes - band)
        if not targets or not io.capacity_bytes:
            kept.usage_target = None
            return 0
        kept.usage_target = max(0, min(targets))
        if m.usage_bytes <= kept.usage_target:
            kept.usage_target = None
            return 0
        return m.usage_bytes - kept.usage_target

    def _take_evicted(self, kept: _Kept) -> None:
        """Account what the evictor removed (or kept) since; report own keys removed."""
        if kept.evictor is None or not kept.evictor.done:
            return
        m = kept.maintainer
        own = []
        done = kept.evictor.done
        while done:
            entry, removed = done.popleft()
            kept.freed_folded += entry.size if removed else 0
            key = m.evicted(entry, removed)
            if key is not None and entry.folder == self.folder:
                own.append(key)
        if own:
            self._send_removed(own)

    def _collect(self, kept: _Kept) -> int:
        """Account other workers' (and this one's) new blocks since the last step, each
        by its path from the worker's ring (RootMaintainer.record_told: exact whatever
        the walk did since); returns the most bytes any of them waits to find room for,
        and leaves in ``kept.pending`` what stores hold beyond the usage (reserved, or
        created and not folded yet)."""
        control = self.ctx.slot_writer.control
        index = kept.index
        m = kept.maintainer
        block = self.ctx.block_bytes
        want = pending = writers = largest = stores = made_now = 0
        for slot in range(control.n_slots):
            pid = control.slot_pid(slot)
            # (before slot_made: never folds more than the slot created)
            told, lost, store = self._take_ring(kept, slot)
            made = control.slot_made(slot, index)     # more than the slot created
            want = max(want, control.want_free(slot, index))
            made_pid, folded = kept.made.get(slot, (pid, made))
            folded = min(made, folded + told)  # (a race at take(): never below)
            if (lost or made_pid != pid) and made > folded:
                # Blocks whose paths are gone: the ring lapped before we read it, or the
                # slot's last worker died between counting and telling. Counted until
                # the walk passes (errs high).
                m.record_unplaced(self.folder, made - folded, (made - folded) // block)
                folded = made
            kept.made[slot] = (pid, folded)
            reserved = control.slot_reserved(slot, index)
            pending += max(0, made - folded) + reserved
            # A store at once, not what was told since the last look: a caretaker that
            # lagged (a long task of its own) read several stores of a slot together,
            # and their sum as a slack kept the cache 3-8 % under a shared budget
            # (tests/test_dfs_walker.py; 9.4 % of it at one measure).
            task = max(reserved, store)
            writers += task > 0
            largest = max(largest, task)
            stores += max(reserved, store)
            made_now += told
        kept.pending = pending
        self._set_slack(kept, largest, writers, stores, made_now)
        return want

    def _take_ring(self, kept: _Kept, slot: int) -> tuple[int, int, int]:
        """Index and count the blocks the worker in ``slot`` created on this root since
        the last look (its ring in the control block): eviction can take them at once,
        and usage counts them exactly, without waiting for the walk to find them.
        Returns ``(bytes counted, entries lost, bytes of the largest store among
        them)``: entries lost are those the ring no longer held (it lapped), on
        whichever root."""
        control = self.ctx.slot_writer.control
        end = control.ring_count(slot)
        start = kept.ring_at.get(slot, end)
        if end == start:
            return 0, 0, 0
        kept.ring_at[slot] = end
        m = kept.maintainer
        size = self.ctx.block_bytes
        entries = control.ring_read(slot, start, end)
        lost = end - start - len(entries) + sum(1 for _, path, _ in entries if not path)
        mine = [(path.decode(), first) for index, path, first in entries
                if index == kept.index and path]
        store = run = 0
        for _, first in mine:
            run = 1 if first else run + 1
            store = max(store, run)
        if kept.share is not None and not kept.share.walker:  # for the walker to count
            for path, _ in mine:
                kept.share.created(f"{self.folder}/{path}", size)
            return len(mine) * size, lost, store * size
        top = os.path.join(m.root, self.folder)
        # The stores read at once are told 1 ns apart, in the order they were made (the
        # older goes first); within one store its blocks go deepest first (rank).
        told_ns = time.time_ns()
        rank = 0
        for path, first in mine:
            if first:
                told_ns, rank = told_ns + 1, 0
            full = os.path.join(top, path)
            m.record_told(full, size)
            m.record_created(full, size, rank, told_ns)
            rank += 1
        return len(mine) * size, lost, store * size

    def _set_slack(self, kept: _Kept, task: int, writers: int, stores: int,
                   made: int) -> None:
        """Eviction runs ahead by what the writers reserve at once (MAX_SLACK_FRACTION);
        a contributor's headroom follows what its stores reserved at once (``stores``,
        each store counted once) and created (``made``) lately (GRANT_WINDOW_S)."""
        m = kept.maintainer
        if not m.capacity_bytes:
            return
        now = time.monotonic()
        if now - kept.ask_at >= GRANT_WINDOW_S:
            kept.ask_last = _window_headroom(kept.ask_peak, kept.ask_made) \
                if now - kept.ask_at < 2 * GRANT_WINDOW_S else 0
            kept.ask_peak, kept.ask_made, kept.ask_at = 0, 0, now
        kept.ask_peak = max(kept.ask_peak, stores)
        kept.ask_made += made
        if now - kept.window_at > SLACK_WINDOW_S:
            kept.window_at, kept.task_peak, kept.writers_peak = now, 0, 0
        kept.task_peak = max(kept.task_peak, task)
        kept.writers_peak = max(kept.writers_peak, writers)
        cap = m.capacity_bytes
        m.slack_bytes = min(math.floor(MAX_SLACK_FRACTION * cap),
                            max(math.floor(EVICT_SLACK_FRACTION * cap),
                                kept.task_peak * kept.writers_peak))

    def _contribute(self, kept: _Kept, now: float) -> None:
        """A step of a caretaker that is not its root's walker: no walk, no eviction;
        hand the walker this tier's new blocks and reservations, and publish the
        walker's figure plus this tier's blocks it does not hold yet."""
        share = kept.share
        assert share is not None
        self._collect(kept)
        try:
            share.contribute(kept.pending, _headroom(kept))
            share.refresh(now)
        except OSError as exc:
            log.warning("mptier: sharing root %s with its walker: %s", kept.path, exc)
            kept.next_at = now + ERROR_BACKOFF_S
            return
        self._publish(kept)
        # The figure just published holds the grant adopted: the next record says so if
        # what this tier created and holds fits in it (counted after the publication: a
        # store that looked at the figure before holds its reservation still).
        self._collect(kept)
        share.acknowledge(kept.pending)
        kept.next_at = now + (EVICT_GAP_S if self._urgent(kept) else REST_CHECK_S)

    def _fold(self, kept: _Kept, now: float) -> int:
        """(The walker.) Other tiers' new blocks into the usage and the index; returns
        the room their stores hold."""
        share = kept.share
        if share is None:
            return 0
        m = kept.maintainer

        def record(path: str, nbytes: int) -> None:
            m.record_store(path, nbytes)
            m.record_created(path, nbytes)

        return share.fold(now, record)

    def _publish(self, kept: _Kept) -> None:
        m = kept.maintainer
        usage = m.tracker.usage
        usage_bytes = usage.bytes if m.complete and kept.elected_at is None \
            else max(usage.bytes, kept.inherited_bytes)
        complete = m.complete
        share = kept.share
        room_held = 0
        if share is not None and not share.walker:
            usage_bytes, complete = share.usage_for_tier(), share.published_complete
            room_held = share.room_held(m.capacity_bytes)
        elif share is not None:
            self._publish_share(kept, usage_bytes, complete)
            if not share.walker:  # it saw the seat taken over (keep_seat): a contributor
                usage_bytes, complete = share.usage_for_tier(), share.published_complete
            room_held = share.room_held(m.capacity_bytes)
        self._publish_control(kept, usage_bytes, complete, room_held)

    def _publish_share(self, kept: _Kept, usage_bytes: int, complete: bool) -> None:
        """(The walker.) Grant the contributors what they ask, where there is room, and
        publish the root's usage and the grants (usage.json, at most every
        PUBLISH_GAP_S)."""
        share = kept.share
        assert share is not None
        m = kept.maintainer
        now = time.monotonic()
        if not share.publish_due(now):
            return
        try:
            if share.granting and m.capacity_bytes and share.cursors:
                asked = share.asking()
                free = 0
                if asked:
                    # This tier's own figure first counts every ask as given; a store of
                    # ours that looked before holds its reservation, which the look
                    # below counts: the room given is room none of ours takes.
                    self._publish_control(kept, usage_bytes, complete,
                                          share.outstanding() + asked)
                    free = m.capacity_bytes - self.ctx.slot_writer.control.usage_now(
                        kept.index)
                share.grant(asked + min(0, free), m.slack_bytes)
            # Less what the unlink threads removed since the usage last took it in (as
            # usage_now does for this tier): the others see the room at once.
            unfolded = 0 if kept.evictor is None else max(
                0, kept.evictor.freed_total - kept.freed_folded)
            share.publish(now, max(0, usage_bytes - unfolded), m.tracker.usage.blocks,
                          complete, m.capacity_bytes, held_bytes=kept.pending)
        except OSError as exc:
            log.warning("mptier: publishing the usage of root %s: %s", kept.path, exc)

    def _publish_control(self, kept: _Kept, usage_bytes: int, complete: bool,
                         room_held: int) -> None:
        """This tier's figure for the root in the control block (ControlBlock.usage_now:
        ``room_held`` is the room its room checks count as other tiers')."""
        m = kept.maintainer
        control = self.ctx.slot_writer.control
        share = kept.share
        # Evicting while the last step wants room or blocks handed to the unlink threads
        # are not yet counted back (their files may be gone, evicted_blocks not yet up).
        evicting = m.evicting or m.handed_bytes > 0
        flags = (ROOT_COMPLETE if complete else 0) | (ROOT_EVICTING if evicting else 0) \
            | (ROOT_WALKER if share is None or share.walker else 0)
        position = m.top_position(self.folder)
        # First say which removals the usage below holds: a reader between the two sees
        # them counted (high), never subtracted twice. Readers of usage_now take the
        # three figures as one (the publication's sequence).
        control.begin_publish(kept.index)
        control.set_freed_stamp(kept.index, kept.freed_folded)
        control.set_root_usage(
            kept.index, usage_bytes=usage_bytes, usage_blocks=m.tracker.usage.blocks,
            evicted_blocks=kept.evicted_base[0] + m.evicted_blocks,
            evicted_bytes=kept.evicted_base[1] + m.evicted_bytes,
            temps_removed=kept.temps_base + kept.temps_removed,
            pass_id=kept.pass_base + m.pass_id, top_position=position,
            flags=flags, caretaker_pid=os.getpid())
        control.set_root_extra(kept.index, inodes_total=kept.inodes[0],
                               inodes_free=kept.inodes[1],
                               folders_removed=kept.folders_base + m.folders_removed,
                               flags=ROOT_INODES_LOW if kept.inodes_low else 0,
                               stamp=sum(folded for _, folded in kept.made.values()),
                               walked=kept.walked, room_held=room_held)
        control.end_publish(kept.index)

    def _send_removed(self, keys: list[bytes]) -> None:
        ctx = self.ctx
        writer = ctx.slot_writer
        for payload, count in pack_keys(keys):
            message = encode_message(MessageType.REMOVED, writer.slot, os.getpid(),
                                     n_done=count, payload=payload)
            try:
                ctx.report(message)  # waits in the worker's list while the pipe is full
            except OSError:
                return  # the engine is gone; serve() finds out at its next write


def _window_headroom(peak: int, made: int) -> int:
    return max(peak, math.ceil(made * GRANT_AHEAD_S / GRANT_WINDOW_S))


def _headroom(kept: _Kept) -> int:
    """The room a contributor asks for beyond what it holds (GRANT_WINDOW_S), at most
    MAX_SLACK_FRACTION of its capacity; 0 without a budget or once idle."""
    cap = kept.maintainer.capacity_bytes
    return min(math.floor(MAX_SLACK_FRACTION * cap),
               max(kept.ask_last, _window_headroom(kept.ask_peak, kept.ask_made)))


def _join_election(kept: _Kept, now: float) -> None:
    """Join the root's walker election, where locks prove the walker alive. A root
    whose locks do not work gets none: this tier walks it alone. One that fails now
    (the probe or the election's folder: a distributed file system's metadata busy
    under load) is tried again ELECT_GAP_S later, walked alone meanwhile: giving up for
    good would leave a second walker evicting beside the elected one all session."""
    m = kept.maintainer
    again = kept.share_at is not None
    kept.share_at = None
    try:
        if m.sweeper is None or not m.sweeper.locks_work:
            return
        kept.share = RootShare(m.root, granting=bool(m.capacity_bytes))
    except OSError as exc:
        kept.share_at = now + ELECT_GAP_S
        log.log(logging.DEBUG if again else logging.WARNING,
                "mptier: root %s: cannot join its walker election yet (%s); this tier "
                "walks it alone until it can (tried every %g s)", m.root, exc, ELECT_GAP_S)
        return
    if again:
        log.info("mptier: root %s: joined its walker election", m.root)


def _close_share(kept: _Kept) -> None:
    if kept.share is not None:
        with contextlib.suppress(OSError):
            kept.share.close()
        kept.share = None

"""The control block: shared memory the pool, its workers and the engine all map.

It is created by the pool (a memfd: nothing appears in /dev/shm, and it is freed with the
last descriptor or mapping) and handed to every worker at spawn and to the engine when it
attaches. Three parts::

    0             pool header: the pool's state (serving / unavailable), the errno and
                  text of why it cannot serve -- the engine reads it before queueing work
    ROOTS_AT      one record per root (ROOT_BYTES each, up to MAX_ROOTS): its health
                  (in rotation or out, why, when it is probed again; written by the
                  supervisor) and its usage (bytes, blocks, evictions, the walk's
                  position; written by the root's caretaker worker) -- read by workers
                  and the engine without a message
    PAGE          message counters: one u64 per slot, then the supervisor's. Whoever
                  writes a message to an engine's completion pipe bumps its own counter
                  afterwards, so the engine tells "nothing new" from a few integers in
                  shared memory, without a system call
    extras        per root (ROOT_EXTRA_BYTES): its file system's inodes (total, free),
                  empty folders removed, flags, entries walked (written by the
                  caretaker)
    counters_end  one slot per worker (SLOT_BYTES each):
        +0            header: state, started_ns, tasks_done, bytes_done, busy_ns,
                      tasks_failed (u64 each), pid, role (u32 each)
        +SLOT_ROOT_AT   the root the task in hand is on (for a timeout's blame)
        +SLOT_WRITTEN_AT bytes its stores wrote, and skipped (blocks already there;
                      folded into the pool header's totals when the slot is emptied)
        +SLOT_WANT_FREE_AT per root: the bytes this worker waits to find room for --
                      read by the root's caretaker (new blocks are told by path, in
                      the rings below)
        +SLOT_READ_ONLY_AT per root: stores failed at once, the root being read-only
        +SLOT_NO_SPACE_AT  per root: stores the file system refused for space (ENOSPC,
                      EDQUOT) -- the caretaker evicts on a rise
        +SLOT_LATENCY_AT   per task kind: how long this slot's tasks took, a count per
                      power of two of microseconds (a service's status has task latency
                      without seeing the engine's completions)
        +RECORD_OFFSET  the task record being worked on (all zero when idle)

A worker reads each task record from its queue *straight into its slot* (``readv`` into
the shared mapping), so the moment a task leaves the queue the supervisor can see who
holds it -- even if the worker is killed the next instant -- and fail or retry exactly
that task. Each slot header has a single writer (its worker); the pool header has one
writer (the supervisor).

Long because it is the one map of one shared-memory block: every offset, and every
reader (ControlBlock) and single writer (SlotWriter) of it, sit together so that a
change of layout is made in one place. An engine attached to a service maps its block:
a change of layout bumps ``mptier.service.server.PROTOCOL_VERSION``.
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
import struct
from dataclasses import dataclass

from mptier.jobs import TASK_HEADER_BYTES, TASK_RECORD_BYTES, TaskKind, peek_task

PAGE_BYTES = mmap.PAGESIZE
# A slot is a header page and a record page: the record area starts page-aligned, so a
# worker's readv of one record (exactly a page) lands in one page of the mapping.
RECORD_OFFSET = PAGE_BYTES
SLOT_BYTES = RECORD_OFFSET + max(TASK_RECORD_BYTES, PAGE_BYTES)
# The pool header's text is cut here: it travels into every JobResult it fails.
REASON_BYTES = 1024
# Only the first bytes of a held record are needed to say which task it is.
RECORD_PEEK_BYTES = 64

# Root records in the pool header page (after the pool header's ~1 KiB).
ROOTS_AT = 1536
ROOT_BYTES = 80
MAX_ROOTS = 32  # == mptier.storage.roots.MAX_ROOTS (ROOTS_AT + 32 * 80 == 4096)
# health: state, errno, failures in a row, times taken out (u32), retry_at_ns (u64)
_ROOT_HEALTH = struct.Struct("<IIIIQ")
# usage: bytes, blocks, evicted blocks, evicted bytes, temps removed (u64), walk pass,
# walk position (h3 index, -1 not reached), flags, caretaker pid (u32)
_ROOT_USAGE = struct.Struct("<QQQQQIiII")
_ROOT_USAGE_AT = _ROOT_HEALTH.size
# In a slot's header page: the root of the task in hand (index + 1; 0 = none).
SLOT_ROOT_AT = 960
# Stores that had to wait for room (capacity_bytes), and the time they waited (u64 each).
SLOT_WAITS_AT = 968
# Bytes of blocks this worker's stores wrote, and of blocks they found already on disk
# and skipped (u64 each; see ControlBlock.store_bytes).
SLOT_WRITTEN_AT = 984
# Per root: bytes this worker's store waits to find room for (u64 each; 0: none).
SLOT_WANT_FREE_AT = 1024
# Per root: stores this worker failed at once because the root is read-only (u64 each).
SLOT_READ_ONLY_AT = SLOT_WANT_FREE_AT + MAX_ROOTS * 8
# Per root: stores the file system refused for space, ENOSPC or EDQUOT (u64 each).
SLOT_NO_SPACE_AT = SLOT_READ_ONLY_AT + MAX_ROOTS * 8
# Task latency per kind (store, load, lookup): bucket i counts tasks of [2^i, 2^(i+1)) us
# (bucket 0 also those under 1 us; the last all from 2^31 us, ~36 min, on). Power-of-two
# buckets put a percentile within a factor of sqrt(2) of the truth, in 128 bytes a kind.
SLOT_LATENCY_AT = SLOT_NO_SPACE_AT + MAX_ROOTS * 8
LATENCY_BUCKETS = 32
_SLOT_LATENCY = struct.Struct(f"<{LATENCY_BUCKETS}I")
# Per root: bytes of blocks ever created from this slot (u64; kept when the slot passes
# to a new worker, so a sum over slots never goes back), then per root the bytes the
# store in hand reserved and has not counted as created yet (u64). With the caretaker's
# stamp (the created bytes its published usage holds) they make the usage exact at any
# moment: ControlBlock.usage_now.
SLOT_MADE_AT = SLOT_LATENCY_AT + 3 * _SLOT_LATENCY.size
SLOT_RESERVED_AT = SLOT_MADE_AT + MAX_ROOTS * 8
assert SLOT_RESERVED_AT + MAX_ROOTS * 8 <= RECORD_OFFSET, "past the header page"
_SLOT_HEADER = struct.Struct("<QQQQQQII")
_POOL_HEADER = struct.Struct(f"<4sIIiQ{REASON_BYTES}s")
# After the pool header: the written and skipped bytes of workers whose slots were
# emptied since (the supervisor folds them in), so the pool's totals never go back when
# a worker is replaced (u64 each).
POOL_WRITTEN_AT = 1056
_BYTE_PAIR = struct.Struct("<QQ")
_STATE_OFFSET = 8  # the state word's place in the pool header (after magic, version)
_POOL_MAGIC = b"MPTC"
_POOL_VERSION = 1


class SlotState(enum.IntEnum):
    EMPTY = 0  # no worker holds this slot
    BOOTING = 1  # process started, not ready yet
    IDLE = 2  # ready (attached or not), waiting for work
    BUSY = 3  # running the task in its record area
    LEAVING = 4  # exiting on purpose
    REPORTING = 5  # its task's I/O is over; its report waits for room in the engine's
    #                completion pipe (the engine is not reading): not a hung file system


class PoolState(enum.IntEnum):
    SERVING = 0
    UNAVAILABLE = 1  # no worker can serve (boot failures, every slot held by stuck
    #                  workers...): queued and new jobs fail at once with the reason


ROLES = ("load", "store")


class RootState(enum.IntEnum):
    IN = 0  # in rotation
    OUT = 1  # out of rotation: its keys are misses; probed again from retry_at_ns
    READ_ONLY = 2  # in rotation for loads and lookups; stores fail fast (EROFS) until a
    #                store from retry_at_ns on finds it writable again


ROOT_COMPLETE = 1  # flags: the usage is a whole walk's total (else a lower bound)
ROOT_EVICTING = 2  # flags: past the high watermark, or removals handed out and not yet counted
ROOT_WALKER = 4  # flags: this tier's caretaker walks the root (it holds the seat, or
#                  locks do not work there and it walks alone)
# extras: inodes total, inodes free (statvfs f_files, f_favail), empty folders removed
# (u64), flags (u32, pad)
# inodes total, inodes free, folders removed (u64), flags, pad (u32), then the stamp:
# the bytes of slots' created blocks the published usage holds, the bytes the
# caretaker's unlink threads removed (ever), and of those the part the published usage
# holds (u64 each), then the directory entries this tier's caretakers walked on the
# root, ever (u64: the walk work that one walker per root keeps to one tier's), then the
# room of the capacity held beyond this tier's usage for other tiers sharing the root
# (i64; 0 without them: see ControlBlock.usage_now)
_ROOT_EXTRA = struct.Struct("<QQQIIQQQQq")
_FREED_AT = 40  # the removed bytes' place in a root's extras
# The pad after the flags holds the publication's sequence number (odd while the
# caretaker publishes; ControlBlock.begin_publish), the stamp follows it.
_SEQ_AT = 28
_STAMP_AT = 32
_WALKED_AT = 56
_ROOM_HELD_AT = 64
# A reader of a root's usage retries this often at most while its caretaker publishes
# (a publication is a few stores into shared memory: microseconds), then takes the
# figure as read (a caretaker killed mid-publication leaves the sequence odd).
USAGE_READ_TRIES = 1000
ROOT_EXTRA_BYTES = _ROOT_EXTRA.size
EXTRAS_BYTES = MAX_ROOTS * ROOT_EXTRA_BYTES
ROOT_INODES_LOW = 1  # extras flags: free inodes under the low-inode watermark
# After the slots, one ring per slot: the blocks its worker created last (root index,
# path under the block folder), so the caretaker puts them in its eviction index at once
# instead of waiting for its walk to find them. A u64 count of entries ever written, then
# RING_ENTRIES entries. A caretaker that falls more than a ring behind loses the oldest:
# it counts them without their paths (high until the walk passes) and the walk indexes
# them. 512 entries are a few of the largest tasks (128 blocks of 64 KiB
# in 8 MiB) and 64 KiB a slot.
RING_ENTRIES = 512
_RING_PATH_BYTES = 125  # a block's path under its folder is ~60 bytes
_RING_ENTRY = struct.Struct(f"<HB{_RING_PATH_BYTES}s")
# The length byte's top bit marks the first block of one ring_add (one store): the
# caretaker keeps the stores' order apart from the order of the blocks within each.
_RING_FIRST = 0x80
assert _RING_PATH_BYTES < _RING_FIRST
RING_BYTES = PAGE_BYTES + RING_ENTRIES * _RING_ENTRY.size


@dataclass
class RootRecord:
    """One root's record in the control block (see the module docstring)."""

    state: RootState
    err: int
    failures: int
    outs: int
    retry_at_ns: int
    usage_bytes: int
    usage_blocks: int
    evicted_blocks: int
    evicted_bytes: int
    temps_removed: int
    pass_id: int
    top_position: int
    flags: int
    caretaker_pid: int


@dataclass
class SlotSnapshot:
    state: SlotState
    started_ns: int
    tasks_done: int
    bytes_done: int
    busy_ns: int
    tasks_failed: int
    pid: int
    role: str
    record: bytes

    @property
    def held_task(self) -> tuple | None:
        """``(kind, task_id, attempt)`` of the task in the slot, if any."""
        return peek_task(self.record)


def counters_bytes(n_slots: int) -> int:
    return (8 * (n_slots + 1) + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES


class ControlBlock:
    """``n_slots`` worker slots plus the pool header and message counters.

    ``ControlBlock(n)`` creates one; ``ControlBlock(n, fd=...)`` maps an existing one
    (workers, an attached engine). Thread-safe for the single-writer pattern above.
    """

    def __init__(self, n_slots: int, fd: int | None = None) -> None:
        self.n_slots = n_slots
        self._counters_at = PAGE_BYTES
        self._extras_at = PAGE_BYTES + counters_bytes(n_slots)
        self._slots_at = self._extras_at + EXTRAS_BYTES
        self._rings_at = self._slots_at + n_slots * SLOT_BYTES
        size = self._rings_at + n_slots * RING_BYTES
        created = fd is None
        if fd is None:
            fd = os.memfd_create("mptier-control", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        self.fd = fd
        self._map: mmap.mmap | None = mmap.mmap(fd, size)
        self.memory = memoryview(self._map)
        # counters[slot] for workers, counters[n_slots] for the supervisor
        self.counters = self.memory[self._counters_at:self._counters_at
                                    + 8 * (n_slots + 1)].cast("Q")
        self.supervisor_counter = n_slots
        self._state_word = self.memory[_STATE_OFFSET:_STATE_OFFSET + 4].cast("I")
        if created:
            self.set_pool_state(PoolState.SERVING)

    # -- pool header ---------------------------------------------------------------------

    def set_pool_state(self, state: PoolState, err: int = 0, reason: str = "") -> None:
        """Publish the pool's state (supervisor only). The reason goes in before the
        state word, so a reader that sees UNAVAILABLE also sees why."""
        _POOL_HEADER.pack_into(self.memory, 0, _POOL_MAGIC, _POOL_VERSION,
                               self._state_word[0], err, self.n_slots,
                               reason.encode("utf-8", "replace")[:REASON_BYTES])
        self._state_word[0] = int(state)

    def pool_state(self) -> tuple[PoolState, int, str]:
        """``(state, errno, reason)``; the engine calls this before queueing work."""
        _, _, state, err, _, reason = _POOL_HEADER.unpack_from(self.memory, 0)
        return PoolState(state), err, reason.rstrip(b"\0").decode("utf-8", "replace")

    def pool_serving(self) -> bool:
        """One integer read: whether the pool takes work (the engine's fast path)."""
        return self._state_word[0] == PoolState.SERVING

    # -- roots ---------------------------------------------------------------------------

    def _root_at(self, index: int) -> int:
        if not 0 <= index < MAX_ROOTS:
            raise IndexError(f"root {index} outside 0..{MAX_ROOTS - 1}")
        return ROOTS_AT + index * ROOT_BYTES

    def root(self, index: int) -> RootRecord:
        """Root ``index``'s record (any process, never blocks)."""
        at = self._root_at(index)
        health = _ROOT_HEALTH.unpack_from(self.memory, at)
        usage = _ROOT_USAGE.unpack_from(self.memory, at + _ROOT_USAGE_AT)
        return RootRecord(RootState(health[0]), *health[1:], *usage)

    def root_health(self, index: int) -> tuple[int, int, int, int]:
        """``(state, errno, failures, retry_at_ns)`` of root ``index``: a worker's check
        before each run of keys (one unpack)."""
        state, err, failures, _, retry_at = _ROOT_HEALTH.unpack_from(
            self.memory, self._root_at(index))
        return state, err, failures, retry_at

    def set_root_health(self, index: int, state: RootState, err: int, failures: int,
                        outs: int, retry_at_ns: int) -> None:
        """(The health owner: the supervisor, or the thread pool under its lock.)"""
        _ROOT_HEALTH.pack_into(self.memory, self._root_at(index), int(state), err,
                               failures, outs, retry_at_ns)

    def set_root_usage(self, index: int, *, usage_bytes: int, usage_blocks: int,
                       evicted_blocks: int, evicted_bytes: int, temps_removed: int,
                       pass_id: int, top_position: int, flags: int,
                       caretaker_pid: int) -> None:
        """(The root's caretaker.)"""
        _ROOT_USAGE.pack_into(self.memory, self._root_at(index) + _ROOT_USAGE_AT,
                              max(0, usage_bytes), max(0, usage_blocks), evicted_blocks,
                              evicted_bytes, temps_removed, pass_id, top_position, flags,
                              caretaker_pid)

    def walk_state(self, index: int) -> tuple[int, int]:
        """``(pass id, h3 position)`` of root ``index``'s walk (what its caretaker last
        published)."""
        values = _ROOT_USAGE.unpack_from(self.memory, self._root_at(index) + _ROOT_USAGE_AT)
        return values[5], values[6]

    def usage_bytes(self, index: int) -> int:
        """The usage of root ``index`` its caretaker published (see :meth:`usage_now`)."""
        return struct.unpack_from("<Q", self.memory, self._root_at(index) + _ROOT_USAGE_AT)[0]

    def slot_made(self, slot: int, root: int) -> int:
        """Bytes of blocks ever created on ``root`` from ``slot`` (every worker it had)."""
        return struct.unpack_from("<Q", self.memory,
                                  self._slot_at(slot) + SLOT_MADE_AT + 8 * root)[0]

    def slot_reserved(self, slot: int, root: int) -> int:
        """Bytes the store in hand in ``slot`` reserved on ``root``, not created yet."""
        return struct.unpack_from("<Q", self.memory,
                                  self._slot_at(slot) + SLOT_RESERVED_AT + 8 * root)[0]

    def stamp(self, index: int) -> int:
        """Created bytes (summed over slots) that root ``index``'s published usage
        holds (its caretaker's last collection)."""
        return _ROOT_EXTRA.unpack_from(self.memory,
                                       self._extras_at + index * ROOT_EXTRA_BYTES)[5]

    def set_freed(self, index: int, total: int) -> None:
        """(The caretaker's unlink threads, under its lock.) Bytes removed ever."""
        struct.pack_into("<Q", self.memory, self._extras_at + index * ROOT_EXTRA_BYTES
                         + _FREED_AT, total)

    def set_freed_stamp(self, index: int, stamp: int) -> None:
        """(The caretaker, before it publishes a usage holding them.)"""
        struct.pack_into("<Q", self.memory, self._extras_at + index * ROOT_EXTRA_BYTES
                         + _FREED_AT + 8, stamp)

    def unpublished_freed(self, index: int) -> int:
        """Bytes unlinked that the published usage still holds."""
        total, stamp = struct.unpack_from("<QQ", self.memory, self._extras_at
                                          + index * ROOT_EXTRA_BYTES + _FREED_AT)
        return max(0, total - stamp)

    def pending_bytes(self, index: int, reserved: bool = True) -> tuple[int, int]:
        """``(created, reserved)``: bytes workers created on root ``index`` that the
        published usage does not hold yet, and bytes stores reserved there and have not
        written yet (0 when not ``reserved``). Never blocks (a read per slot)."""
        made = held = 0
        for slot in range(self.n_slots):
            made += self.slot_made(slot, index)
            if reserved:
                held += self.slot_reserved(slot, index)
        return max(0, made - self.stamp(index)), held

    def usage_now(self, index: int, reserved: bool = True) -> int:
        """Root ``index``'s usage at this moment for this tier's own writes: the
        published usage, plus blocks created since its caretaker's last collection,
        less the blocks its unlink threads removed since; with ``reserved`` (the figure
        room checks compare with the capacity) also the room stores in flight reserved
        and the room held for other tiers that share the root (:meth:`room_held`: the
        walker's grants to them, or, in another tier, all but its own grant;
        ``mptier.storage.election``). Readers may see a block twice for an instant
        (created and still reserved): it errs high, never low. The usage and its stamps
        are read as one publication (a torn read -- a new stamp beside the old usage --
        counted the blocks of the last collection nowhere)."""
        for _ in range(USAGE_READ_TRIES):
            seq = self._publish_seq(index)
            made, held = self.pending_bytes(index, reserved)
            usage = max(0, self.usage_bytes(index) - self.unpublished_freed(index))
            others = self.room_held(index) if reserved else 0
            if not seq & 1 and self._publish_seq(index) == seq:
                break
        return usage + made + held + others

    def want_free(self, slot: int, root: int) -> int:
        """Bytes the store in ``slot`` waits to find room for on ``root`` (0: none)."""
        return struct.unpack_from("<Q", self.memory,
                                  self._slot_at(slot) + SLOT_WANT_FREE_AT + 8 * root)[0]

    def slot_pid(self, slot: int) -> int:
        """The pid of the worker in ``slot`` (0: none yet)."""
        return struct.unpack_from("<I", self.memory, self._slot_at(slot) + 48)[0]

    def slot_latency(self, slot: int, kind: TaskKind) -> tuple[int, ...]:
        """Counts per latency bucket (``SLOT_LATENCY_AT``) of ``kind`` tasks in ``slot``."""
        return _SLOT_LATENCY.unpack_from(self.memory, self._slot_at(slot) + _latency_at(kind))

    def slot_waits(self, slot: int) -> tuple[int, int]:
        """``(stores that waited for room, ns they waited)`` of the worker in ``slot``."""
        return struct.unpack_from("<QQ", self.memory, self._slot_at(slot) + SLOT_WAITS_AT)

    def set_root_extra(self, index: int, *, inodes_total: int, inodes_free: int,
                       folders_removed: int, flags: int, stamp: int = 0,
                       walked: int = 0, room_held: int = 0) -> None:
        """(The root's caretaker.) The removed-bytes fields are left as they are.
        ``room_held``: see :meth:`usage_now`."""
        self._root_at(index)  # range check
        at = self._extras_at + index * ROOT_EXTRA_BYTES
        struct.pack_into("<QQQI", self.memory, at, max(0, inodes_total),
                         max(0, inodes_free), folders_removed, flags)
        struct.pack_into("<Q", self.memory, at + _STAMP_AT, stamp)
        struct.pack_into("<Q", self.memory, at + _WALKED_AT, walked)
        self.set_room_held(index, room_held)

    def set_room_held(self, index: int, room_held: int) -> None:
        """(The root's caretaker, between :meth:`begin_publish` and :meth:`end_publish`.)"""
        self._root_at(index)
        struct.pack_into("<q", self.memory, self._extras_at + index * ROOT_EXTRA_BYTES
                         + _ROOM_HELD_AT, room_held)

    def room_held(self, index: int) -> int:
        """Bytes of root ``index``'s capacity its room checks count as taken beyond this
        tier's usage (see :meth:`usage_now`)."""
        self._root_at(index)
        return struct.unpack_from("<q", self.memory, self._extras_at
                                  + index * ROOT_EXTRA_BYTES + _ROOM_HELD_AT)[0]

    def walked_entries(self, index: int) -> int:
        """Directory entries this tier's caretakers walked on root ``index``, ever."""
        self._root_at(index)
        return struct.unpack_from("<Q", self.memory, self._extras_at
                                  + index * ROOT_EXTRA_BYTES + _WALKED_AT)[0]

    def begin_publish(self, index: int) -> None:
        """(The root's caretaker.) Its usage, stamp and freed stamp change together:
        readers (:meth:`usage_now`) that see the sequence odd or moved read again. Odd
        from here to :meth:`end_publish` (also after a caretaker killed in between)."""
        seq = self._publish_seq(index)
        self._set_seq(index, seq + (2 if seq & 1 else 1))

    def end_publish(self, index: int) -> None:
        self._set_seq(index, self._publish_seq(index) + 1)

    def _set_seq(self, index: int, seq: int) -> None:
        struct.pack_into("<I", self.memory, self._extras_at + index * ROOT_EXTRA_BYTES
                         + _SEQ_AT, seq & 0xFFFFFFFF)  # (2**32 is even: parity kept)

    def _publish_seq(self, index: int) -> int:
        return struct.unpack_from("<I", self.memory, self._extras_at
                                  + index * ROOT_EXTRA_BYTES + _SEQ_AT)[0]

    def root_extra(self, index: int) -> tuple[int, int, int, int]:
        """``(inodes total, inodes free, folders removed, flags)`` of root ``index``
        (0 inodes total: not known yet, or a file system without an inode count)."""
        self._root_at(index)
        return _ROOT_EXTRA.unpack_from(self.memory,
                                       self._extras_at + index * ROOT_EXTRA_BYTES)[:4]

    def no_space_stores(self, root: int) -> int:
        """Stores of root ``root`` the file system refused for space (every worker)."""
        return sum(struct.unpack_from("<Q", self.memory, self._slot_at(slot)
                                      + SLOT_NO_SPACE_AT + 8 * root)[0]
                   for slot in range(self.n_slots))

    def read_only_stores(self, root: int) -> int:
        """Stores of root ``root`` that every worker failed at once as read-only."""
        return sum(struct.unpack_from("<Q", self.memory, self._slot_at(slot)
                                      + SLOT_READ_ONLY_AT + 8 * root)[0]
                   for slot in range(self.n_slots))

    def slot_root(self, slot: int) -> int | None:
        """The root the task in ``slot`` was working on, if it said."""
        value = struct.unpack_from("<I", self.memory, self._slot_at(slot) + SLOT_ROOT_AT)[0]
        return value - 1 if value else None

    # -- counters ------------------------------------------------------------------------

    def counters_snapshot(self) -> bytes:
        return self.counters.tobytes()

    def bump(self, index: int, n: int = 1) -> None:
        """Count ``n`` more messages from ``index`` (each index has a single writer)."""
        self.counters[index] += n

    # -- slots ---------------------------------------------------------------------------

    def _slot_at(self, slot: int) -> int:
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} outside 0..{self.n_slots - 1}")
        return self._slots_at + slot * SLOT_BYTES

    def slot_memory(self, slot: int) -> memoryview:
        base = self._slot_at(slot)
        return self.memory[base:base + SLOT_BYTES]

    def store_bytes(self) -> tuple[int, int]:
        """``(written, skipped)``: bytes of blocks the pool's stores wrote, and bytes of
        blocks they found on disk already and did not write, over the pool's life."""
        written, skipped = _BYTE_PAIR.unpack_from(self.memory, POOL_WRITTEN_AT)
        for slot in range(self.n_slots):
            w, k = _BYTE_PAIR.unpack_from(self.memory, self._slot_at(slot) + SLOT_WRITTEN_AT)
            written, skipped = written + w, skipped + k
        return written, skipped

    def _retire(self, base: int) -> None:
        """Fold the byte counts of the slot at ``base`` into the pool's (before it is
        emptied; the pool header's single writer only)."""
        w, k = _BYTE_PAIR.unpack_from(self.memory, base + SLOT_WRITTEN_AT)
        if w or k:
            written, skipped = _BYTE_PAIR.unpack_from(self.memory, POOL_WRITTEN_AT)
            _BYTE_PAIR.pack_into(self.memory, POOL_WRITTEN_AT, written + w, skipped + k)

    def _clear_slot(self, base: int) -> None:
        """Zero a slot, except its created-bytes counters (they only grow)."""
        made = bytes(self.memory[base + SLOT_MADE_AT:base + SLOT_RESERVED_AT])
        self.memory[base:base + SLOT_BYTES] = bytes(SLOT_BYTES)
        self.memory[base + SLOT_MADE_AT:base + SLOT_RESERVED_AT] = made

    def ring_count(self, slot: int) -> int:
        """Entries ever written to ``slot``'s ring of created blocks."""
        return struct.unpack_from("<Q", self.memory, self._rings_at + slot * RING_BYTES)[0]

    def ring_read(self, slot: int, start: int, end: int) -> list[tuple[int, bytes, bool]]:
        """``(root, path under its block folder, first of its store)`` of ring entries
        ``start..end`` of ``slot`` (as many of the newest as the ring still holds)."""
        base = self._rings_at + slot * RING_BYTES
        out = []
        for n in range(max(start, end - RING_ENTRIES), end):
            root, length, path = _RING_ENTRY.unpack_from(
                self.memory, base + PAGE_BYTES + (n % RING_ENTRIES) * _RING_ENTRY.size)
            out.append((n, root, path[:length & ~_RING_FIRST], bool(length & _RING_FIRST)))
        overwritten = self.ring_count(slot) - RING_ENTRIES  # lapped while reading
        return [(root, path, first) for n, root, path, first in out if n >= overwritten]

    def reset(self, slot: int, role: str) -> None:
        """Empty ``slot`` for a new worker of ``role`` (state BOOTING)."""
        base = self._slot_at(slot)
        self._retire(base)
        self._clear_slot(base)
        _SLOT_HEADER.pack_into(self.memory, base, SlotState.BOOTING, 0, 0, 0, 0, 0, 0,
                               ROLES.index(role))

    def release_slot(self, slot: int) -> None:
        base = self._slot_at(slot)
        self._retire(base)
        self._clear_slot(base)

    def snapshot(self, slot: int) -> SlotSnapshot:
        base = self._slot_at(slot)
        state, started, done, nbytes, busy, failed, pid, role = _SLOT_HEADER.unpack_from(
            self.memory, base)
        record = bytes(self.memory[base + RECORD_OFFSET:base + RECORD_OFFSET
                                   + RECORD_PEEK_BYTES])
        return SlotSnapshot(SlotState(state), started, done, nbytes, busy, failed, pid,
                            ROLES[role], record)

    def full_record(self, slot: int) -> bytes:
        base = self._slot_at(slot) + RECORD_OFFSET
        return bytes(self.memory[base:base + TASK_RECORD_BYTES])

    def clear_record(self, slot: int) -> None:
        base = self._slot_at(slot) + RECORD_OFFSET
        self.memory[base:base + TASK_HEADER_BYTES] = bytes(TASK_HEADER_BYTES)

    def close(self) -> None:
        """Unmap and close the descriptor (the memory goes with the last holder).
        Idempotent."""
        if self._map is None:
            return
        mapping, self._map = self._map, None
        self._state_word.release()
        self.counters.release()
        self.memory.release()
        with contextlib.suppress(BufferError):  # thread workers' slot views linger
            mapping.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


class SlotWriter:
    """A worker's handle on its own slot and message counter (the single writer)."""

    def __init__(self, control: ControlBlock, slot: int, role: str) -> None:
        memory = control.slot_memory(slot)
        self.control = control
        self._mem = memory
        self._counters = control.counters
        self.slot = slot
        self.record = memory[RECORD_OFFSET:RECORD_OFFSET + TASK_RECORD_BYTES]
        self.tasks_done = self.bytes_done = self.busy_ns = self.tasks_failed = 0
        self._role = ROLES.index(role)
        self._pid = os.getpid()

    def set_state(self, state: SlotState, started_ns: int = 0) -> None:
        _SLOT_HEADER.pack_into(self._mem, 0, state, started_ns, self.tasks_done,
                               self.bytes_done, self.busy_ns, self.tasks_failed, self._pid,
                               self._role)

    def mark_started(self, started_ns: int) -> None:
        struct.pack_into("<QQ", self._mem, 0, SlotState.BUSY, started_ns)

    def message_sent(self, n: int = 1) -> None:
        if n:
            self._counters[self.slot] += n

    def mark_reporting(self, started_ns: int) -> None:
        """The task's I/O is over and its report waits for room in the completion pipe:
        the task stays held (a death now is handled as one after the I/O), but the
        supervisor's io_timeout_s no longer runs for it."""
        struct.pack_into("<QQ", self._mem, 0, SlotState.REPORTING, started_ns)

    def account(self, nbytes: int, elapsed_ns: int, failed: bool, started_ns: int,
                kind: TaskKind | None = None) -> None:
        """Count a finished task (before it is reported, so stats agree with results),
        and its time in the ``kind``'s latency buckets. The slot keeps saying the task
        started until :meth:`release`: a death before then must not look like one
        before the I/O."""
        if kind is not None:
            at = _latency_at(kind) + 4 * latency_bucket(elapsed_ns)
            (count,) = struct.unpack_from("<I", self._mem, at)
            struct.pack_into("<I", self._mem, at, (count + 1) & 0xFFFFFFFF)
        self.tasks_done += 1
        self.bytes_done += nbytes
        self.busy_ns += elapsed_ns
        self.tasks_failed += failed
        self.set_state(SlotState.BUSY, started_ns)

    def release(self) -> None:
        """Empty the record area: the task is no longer held."""
        self.record[:TASK_HEADER_BYTES] = bytes(TASK_HEADER_BYTES)
        self.set_root(None)
        # The state alone: the counters after it are those account() wrote last.
        struct.pack_into("<QQ", self._mem, 0, SlotState.IDLE, 0)

    def waited_for_room(self, ns: int) -> None:
        """Count a store that waited ``ns`` for its root's caretaker to make room."""
        waits, total = struct.unpack_from("<QQ", self._mem, SLOT_WAITS_AT)
        struct.pack_into("<QQ", self._mem, SLOT_WAITS_AT, waits + 1, total + ns)

    def count_stored(self, written: int, skipped: int) -> None:
        """Count bytes of blocks a store wrote, and of blocks it found already there."""
        w, k = _BYTE_PAIR.unpack_from(self._mem, SLOT_WRITTEN_AT)
        _BYTE_PAIR.pack_into(self._mem, SLOT_WRITTEN_AT, w + written, k + skipped)

    def count_read_only(self, root: int) -> None:
        """Count a store of ``root`` failed at once: the root is read-only."""
        self._bump(SLOT_READ_ONLY_AT + 8 * root)

    def count_no_space(self, root: int) -> None:
        """Count a store of ``root`` the file system refused for space."""
        self._bump(SLOT_NO_SPACE_AT + 8 * root)

    def _bump(self, at: int) -> None:
        struct.pack_into("<Q", self._mem, at, struct.unpack_from("<Q", self._mem, at)[0] + 1)

    def set_root(self, root: int | None) -> None:
        """Say which root the task in hand works on now (None: none)."""
        struct.pack_into("<I", self._mem, SLOT_ROOT_AT, 0 if root is None else root + 1)

    def reserve(self, root: int, nbytes: int) -> None:
        """Reserve ``nbytes`` on ``root`` for the store in hand (0: none any more). Set
        before the room check, so every later check counts it."""
        struct.pack_into("<Q", self._mem, SLOT_RESERVED_AT + 8 * root, nbytes)

    def add_made(self, root: int, nbytes: int) -> None:
        """Count ``nbytes`` of blocks this worker created on ``root`` (before
        :meth:`ring_add` tells their paths, so a caretaker reading the ring first never
        folds more than this)."""
        at = SLOT_MADE_AT + 8 * root
        struct.pack_into("<Q", self._mem, at, struct.unpack_from("<Q", self._mem, at)[0]
                         + nbytes)

    def ring_add(self, root: int, paths: list[bytes]) -> None:
        """Tell the caretaker which blocks this worker created on ``root`` (paths under
        its block folder): the entries first, then the count that publishes them. Every
        path counts, those the ring cannot hold too (the oldest of a task larger than
        the ring), so the caretaker knows how many it lost."""
        control = self.control
        base = control._rings_at + self.slot * RING_BYTES
        count = control.ring_count(self.slot)
        skip = max(0, len(paths) - RING_ENTRIES)
        for n, path in enumerate(paths[skip:], count + skip):
            if len(path) > _RING_PATH_BYTES:
                path = b""  # no block path is this long: told as lost (counted high)
            _RING_ENTRY.pack_into(control.memory, base + PAGE_BYTES
                                  + (n % RING_ENTRIES) * _RING_ENTRY.size,
                                  root, len(path) | (_RING_FIRST if n == count else 0),
                                  path)
        struct.pack_into("<Q", control.memory, base, count + len(paths))

    def want_free(self, root: int, nbytes: int) -> None:
        """Ask the caretaker of ``root`` for room for ``nbytes`` (0: no longer)."""
        struct.pack_into("<Q", self._mem, SLOT_WANT_FREE_AT + 8 * root, nbytes)


assert _POOL_HEADER.size <= POOL_WRITTEN_AT and POOL_WRITTEN_AT + 16 <= ROOTS_AT
assert SLOT_WAITS_AT + 16 <= SLOT_WRITTEN_AT and SLOT_WRITTEN_AT + 16 <= SLOT_WANT_FREE_AT
assert _POOL_HEADER.size <= ROOTS_AT and ROOTS_AT + MAX_ROOTS * ROOT_BYTES <= PAGE_BYTES
assert _ROOT_HEALTH.size + _ROOT_USAGE.size == ROOT_BYTES
assert SLOT_NO_SPACE_AT + MAX_ROOTS * 8 <= RECORD_OFFSET


def _latency_at(kind: TaskKind) -> int:
    return SLOT_LATENCY_AT + (int(kind) - 1) * _SLOT_LATENCY.size


def latency_bucket(elapsed_ns: int) -> int:
    """The ``SLOT_LATENCY_AT`` bucket of a task that took ``elapsed_ns``."""
    return min(LATENCY_BUCKETS - 1, max(0, elapsed_ns // 1000).bit_length() - 1) \
        if elapsed_ns >= 1000 else 0


def latency_percentiles(counts: list[int]) -> dict[str, float | int | None]:
    """``{"p50_s", "p99_s", "count"}`` of summed bucket counts: each percentile is the
    geometric middle of its bucket (within a factor of sqrt(2) of the truth)."""
    total = sum(counts)

    def pick(q: float) -> float | None:
        if not total:
            return None
        rank, seen = q * total, 0
        for i, n in enumerate(counts):
            seen += n
            if seen >= rank:
                return 2 ** (i + 0.5) / 1e6
        return 2 ** (len(counts) - 0.5) / 1e6

    return {"p50_s": pick(0.5), "p99_s": pick(0.99), "count": total}

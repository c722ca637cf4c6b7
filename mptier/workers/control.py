"""The control block: shared memory the pool, its workers and the engine all map.

It is created by the pool (a memfd: nothing appears in /dev/shm, and it is freed with the
last descriptor or mapping) and handed to every worker at spawn and to the engine when it
attaches. Three parts::

    0             pool header: the pool's state (serving / unavailable), the errno and
                  text of why it cannot serve -- the engine reads it before queueing work
    PAGE          message counters: one u64 per slot, then the supervisor's. Whoever
                  writes a message to an engine's completion pipe bumps its own counter
                  afterwards, so the engine tells "nothing new" from a few integers in
                  shared memory, without a system call
    counters_end  one slot per worker (SLOT_BYTES each):
        +0            header: state, started_ns, tasks_done, bytes_done, busy_ns,
                      tasks_failed (u64 each), pid, role (u32 each)
        +RECORD_OFFSET  the task record being worked on (all zero when idle)

A worker reads each task record from its queue *straight into its slot* (``readv`` into
the shared mapping), so the moment a task leaves the queue the supervisor can see who
holds it -- even if the worker is killed the next instant -- and fail or retry exactly
that task. Each slot header has a single writer (its worker); the pool header has one
writer (the supervisor).
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
import struct
from dataclasses import dataclass

from mptier.jobs import TASK_HEADER_BYTES, TASK_RECORD_BYTES, peek_task

PAGE_BYTES = mmap.PAGESIZE
# A slot is a header page and a record page: the record area starts page-aligned, so a
# worker's readv of one record (exactly a page) lands in one page of the mapping.
RECORD_OFFSET = PAGE_BYTES
SLOT_BYTES = RECORD_OFFSET + max(TASK_RECORD_BYTES, PAGE_BYTES)
# The pool header's text is cut here: it travels into every JobResult it fails.
REASON_BYTES = 1024
# Only the first bytes of a held record are needed to say which task it is.
RECORD_PEEK_BYTES = 64

_SLOT_HEADER = struct.Struct("<QQQQQQII")
_POOL_HEADER = struct.Struct(f"<4sIIiQ{REASON_BYTES}s")
_STATE_OFFSET = 8  # the state word's place in the pool header (after magic, version)
_POOL_MAGIC = b"MPTC"
_POOL_VERSION = 1


class SlotState(enum.IntEnum):
    EMPTY = 0  # no worker holds this slot
    BOOTING = 1  # process started, not ready yet
    IDLE = 2  # ready (attached or not), waiting for work
    BUSY = 3  # running the task in its record area
    LEAVING = 4  # exiting on purpose


class PoolState(enum.IntEnum):
    SERVING = 0
    UNAVAILABLE = 1  # no worker can serve (boot failures, every slot held by stuck
    #                  workers...): queued and new jobs fail at once with the reason


ROLES = ("load", "store")


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
        self._slots_at = PAGE_BYTES + counters_bytes(n_slots)
        size = self._slots_at + n_slots * SLOT_BYTES
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

    @classmethod
    def size_for(cls, n_slots: int) -> int:
        return PAGE_BYTES + counters_bytes(n_slots) + n_slots * SLOT_BYTES

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

    # -- counters ------------------------------------------------------------------------

    def counters_snapshot(self) -> bytes:
        return self.counters.tobytes()

    def bump(self, index: int) -> None:
        """Count one more message from ``index`` (each index has a single writer)."""
        self.counters[index] += 1

    # -- slots ---------------------------------------------------------------------------

    def _slot_at(self, slot: int) -> int:
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} outside 0..{self.n_slots - 1}")
        return self._slots_at + slot * SLOT_BYTES

    def slot_memory(self, slot: int) -> memoryview:
        base = self._slot_at(slot)
        return self.memory[base:base + SLOT_BYTES]

    def reset(self, slot: int, role: str) -> None:
        """Empty ``slot`` for a new worker of ``role`` (state BOOTING)."""
        base = self._slot_at(slot)
        self.memory[base:base + SLOT_BYTES] = bytes(SLOT_BYTES)
        _SLOT_HEADER.pack_into(self.memory, base, SlotState.BOOTING, 0, 0, 0, 0, 0, 0,
                               ROLES.index(role))

    def release_slot(self, slot: int) -> None:
        base = self._slot_at(slot)
        self.memory[base:base + SLOT_BYTES] = bytes(SLOT_BYTES)

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

    def message_sent(self) -> None:
        self._counters[self.slot] += 1

    def account(self, nbytes: int, elapsed_ns: int, failed: bool, started_ns: int) -> None:
        """Count a finished task (before it is reported, so stats agree with results).
        The slot keeps saying the task started until :meth:`release`: a death before
        then must not look like one before the I/O."""
        self.tasks_done += 1
        self.bytes_done += nbytes
        self.busy_ns += elapsed_ns
        self.tasks_failed += failed
        self.set_state(SlotState.BUSY, started_ns)

    def release(self) -> None:
        """Empty the record area: the task is no longer held."""
        self.record[:TASK_HEADER_BYTES] = bytes(TASK_HEADER_BYTES)
        self.set_state(SlotState.IDLE)

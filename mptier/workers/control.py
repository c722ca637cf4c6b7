"""The control block: one slot of shared memory per worker, mapped by the engine too.

A worker reads each task record from its queue *straight into its slot* (``readv`` into
the shared mapping), so the moment a task leaves the queue the engine can see who holds
it -- even if the worker is killed the next instant. The supervisor reads a dead or hung
worker's slot to fail or retry exactly the task it held; ``stats()`` reads the counters.

It also carries one *message counter* per slot (and one for the supervisor): whoever
writes a message to the completion pipe bumps its own counter afterwards, so the engine
can tell "nothing new" from eight integers in shared memory, without a system call.

Layout (little-endian)::

    0                      message counters: u64 per slot, then the supervisor's
    counters_bytes + k*8192  slot k:
        0     header: state, started_ns, tasks_done, bytes_done, busy_ns, errors (u64
              each), pid (u32), role (u32)
        4096  the task record being worked on (all zero when idle)
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
import struct
from dataclasses import dataclass

from mptier.jobs import TASK_RECORD_BYTES, peek_task

SLOT_BYTES = 8192
RECORD_OFFSET = 4096
_HEADER = struct.Struct("<QQQQQQII")
_STARTED_OFFSET = 8


class SlotState(enum.IntEnum):
    EMPTY = 0
    BOOTING = 1
    IDLE = 2
    BUSY = 3
    LEAVING = 4


ROLES = ("load", "store")


@dataclass
class SlotSnapshot:
    state: SlotState
    started_ns: int
    tasks_done: int
    bytes_done: int
    busy_ns: int
    errors: int
    pid: int
    role: str
    record: bytes

    @property
    def held_task(self) -> tuple | None:
        """``(kind, task_id, attempt)`` of the task in the slot, if any."""
        return peek_task(self.record)


def counters_bytes(n_slots: int) -> int:
    return (8 * (n_slots + 1) + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE


class ControlBlock:
    """``n_slots`` slots in a memfd (nothing appears in /dev/shm; freed with the last fd)."""

    def __init__(self, n_slots: int, fd: int | None = None) -> None:
        self.n_slots = n_slots
        self._base = counters_bytes(n_slots)
        size = self._base + n_slots * SLOT_BYTES
        if fd is None:
            fd = os.memfd_create("mptier-control", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        self.fd = fd
        self._map = mmap.mmap(fd, size)
        self.memory = memoryview(self._map)
        # counters[slot] for workers, counters[n_slots] for the supervisor
        self.counters = self.memory[:8 * (n_slots + 1)].cast("Q")
        self.supervisor_counter = n_slots

    def slot_memory(self, slot: int) -> memoryview:
        base = self._base + slot * SLOT_BYTES
        return self.memory[base:base + SLOT_BYTES]

    def counters_snapshot(self) -> bytes:
        return self.counters.tobytes()

    def bump(self, index: int) -> None:
        """Count one more message from ``index`` (each index has a single writer)."""
        self.counters[index] += 1

    def reset(self, slot: int, role: str) -> None:
        base = self._base + slot * SLOT_BYTES
        self.memory[base:base + SLOT_BYTES] = bytes(SLOT_BYTES)
        _HEADER.pack_into(self.memory, base, SlotState.BOOTING, 0, 0, 0, 0, 0, 0,
                          ROLES.index(role))

    def record_area(self, slot: int) -> memoryview:
        start = self._base + slot * SLOT_BYTES + RECORD_OFFSET
        return self.memory[start:start + TASK_RECORD_BYTES]

    def snapshot(self, slot: int) -> SlotSnapshot:
        base = self._base + slot * SLOT_BYTES
        state, started, done, nbytes, busy, errors, pid, role = _HEADER.unpack_from(
            self.memory, base)
        record = bytes(self.memory[base + RECORD_OFFSET:base + RECORD_OFFSET + 64])
        return SlotSnapshot(SlotState(state), started, done, nbytes, busy, errors, pid,
                            ROLES[role], record)

    def full_record(self, slot: int) -> bytes:
        return bytes(self.record_area(slot))

    def clear_record(self, slot: int) -> None:
        start = self._base + slot * SLOT_BYTES + RECORD_OFFSET
        self.memory[start:start + 16] = bytes(16)

    def close(self) -> None:
        """Unmap (once no view of a slot is left; else when the last one goes) and close
        the memfd: the memory is freed with the last mapping."""
        if self._map is None:
            return
        mapping, self._map = self._map, None
        self.counters.release()
        self.memory.release()
        with contextlib.suppress(BufferError):  # thread workers' slot views linger
            mapping.close()
        os.close(self.fd)


class SlotWriter:
    """A worker's handle on its own slot and message counter."""

    def __init__(self, control: ControlBlock, slot: int, role: str) -> None:
        memory = control.slot_memory(slot)
        self._mem = memory
        self._counters = control.counters
        self._slot = slot
        self.record = memory[RECORD_OFFSET:RECORD_OFFSET + TASK_RECORD_BYTES]
        self.tasks_done = self.bytes_done = self.busy_ns = self.errors = 0
        self._role = ROLES.index(role)

    def set_state(self, state: SlotState, started_ns: int = 0) -> None:
        _HEADER.pack_into(self._mem, 0, state, started_ns, self.tasks_done, self.bytes_done,
                          self.busy_ns, self.errors, os.getpid(), self._role)

    def mark_started(self, started_ns: int) -> None:
        struct.pack_into("<QQ", self._mem, 0, SlotState.BUSY, started_ns)

    def message_sent(self) -> None:
        self._counters[self._slot] += 1

    def account(self, nbytes: int, elapsed_ns: int, failed: bool) -> None:
        """Count a finished task (before it is reported, so stats agree with results)."""
        self.tasks_done += 1
        self.bytes_done += nbytes
        self.busy_ns += elapsed_ns
        self.errors += failed
        self.set_state(SlotState.BUSY)

    def release(self) -> None:
        """Empty the record area: the task is no longer held."""
        self.record[:16] = bytes(16)
        self.set_state(SlotState.IDLE)

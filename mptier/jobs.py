"""The records of the tier: what the engine hands in, what it gets back, and the small
versioned messages that cross the process boundary.

Engine-facing: :class:`TransferJob`, :class:`JobResult`, :class:`LookupResult`,
:class:`TierEvent`.

Wire records (engine <-> workers), all little-endian and fixed-layout:

* a **task** is exactly :data:`TASK_RECORD_BYTES` bytes, so that it is written to a
  queue pipe in one atomic ``write`` and read back whole by exactly one worker::

      header  magic "MPT" version(u8) kind(u8) attempt(u8) reserved(u16)
              n_items(u32) task_id(u64)
      body    n_items x block_id (u64)   [not for LOOKUP]
              n_items x key length (u16)
              the keys back to back, then zero padding

* a **message** (worker -> engine) is at most ``PIPE_BUF`` bytes, length-prefixed, and
  also written in one atomic ``write``::

      length(u16) type(u8) version(u8) outcome(u8) slot(u16) attempt(u16) pid(u32)
      errno(i32) n_done(u32) task_id(u64) started_ns(u64) elapsed_ns(u64) payload...

  ``outcome`` is what the errno says of the task (:class:`~mptier.native.entries.
  Outcome`: ok, missing, corrupt, checksum, bad entry, full, read-only, fault, lost,
  other), summed up by whoever wrote the message, which knew the operation; the engine
  counts by it and never reads the errno's meaning again. ``payload`` is one status
  byte per key for a finished LOOKUP task (see :mod:`mptier.native`'s lookup
  statuses), or UTF-8 text (an error description) otherwise.

Worker lifecycle messages (ready, attached, leaving...) do not travel here: they go to
the supervisor over each worker's control socket (:mod:`mptier.workers.protocol`).
"""

from __future__ import annotations

import array
import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mptier.native.entries import Outcome

# Of task records and messages alike (3: messages carry the outcome); the C core's
# MPT_WIRE_VERSION must agree, or its encoder is not used (_native_encoder).
WIRE_VERSION = 3
TASK_RECORD_BYTES = 4096  # == PIPE_BUF on Linux: larger writes are not atomic
_TASK_HEADER = struct.Struct("<3sBBBHIQ")
TASK_HEADER_BYTES = _TASK_HEADER.size  # 20: magic .. task_id, see the module docstring
_TASK_MAGIC = b"MPT"
# Bytes one item costs in a task record besides the key itself.
TASK_ITEM_OVERHEAD = 8 + 2  # block id (u64) + key length (u16)
LOOKUP_ITEM_OVERHEAD = 2  # key length (u16): lookups carry no block ids

_MESSAGE_HEADER = struct.Struct("<HBBBHHIiIQQQ")
MESSAGE_HEADER_BYTES = _MESSAGE_HEADER.size
# Longest completion message (a worker's report on the completion pipe): written in one
# write(), so at most PIPE_BUF bytes to stay atomic among many writers.
MAX_COMPLETION_BYTES = 4096
MAX_TEXT_BYTES = 1024


class TaskKind(enum.IntEnum):
    STORE = 1
    LOAD = 2
    LOOKUP = 3


_LOOKUP = int(TaskKind.LOOKUP)
_KINDS = frozenset(int(k) for k in TaskKind)
_KIND_OF = {int(k): k for k in TaskKind}


class MessageType(enum.IntEnum):
    DONE = 2  # a worker finished a task (errno 0 = success)
    LOST = 4  # the supervisor or the engine gave up on a task (worker died, hung, pool
    #           unavailable, shutdown); it will not be reported again
    RETRY = 5  # the supervisor: the worker holding this task died; run it again as
    #            ``attempt`` -- unless it was already reported (only the engine knows:
    #            a worker may have sent DONE just before it died)
    REMOVED = 6  # a root's caretaker evicted these keys of the engine's own folder
    #              (payload: pack_keys; n_done = how many); no task_id


class LookupResult(enum.Enum):
    """Answer of :meth:`FileSystemTier.lookup` (same members as vLLM's)."""

    HIT = "hit"
    MISS = "miss"
    RETRY = "retry"


@dataclass
class TransferJob:
    """A store or load of whole blocks between primary-buffer slots and files.

    ``keys[i]`` goes to/from slot ``block_ids[i]``.
    """

    job_id: int
    keys: Sequence[bytes]
    block_ids: Sequence[int]


@dataclass
class JobResult:
    """How a job ended. Every submitted job is reported exactly once.

    ``successful_keys`` is set only for loads that partly failed: the keys that did
    load, in job order. ``None`` means every key shares the fate of ``success``.
    ``transfer_time`` is seconds from the first task's I/O start to the last one's end;
    ``transfer_bytes`` counts the blocks that succeeded. ``checksum_failed`` is set when
    a block of a load did not match its CRC32C record (it was deleted; its key is now a
    miss), as on vLLM's tier.
    """

    job_id: int
    success: bool
    successful_keys: tuple[bytes, ...] | None = None
    transfer_time: float | None = None
    transfer_bytes: int | None = None
    errno: int = 0
    error: str | None = None
    checksum_failed: bool = False


@dataclass
class TierEvent:
    """``kind`` is ``"stored"`` (keys a successful store wrote) or ``"removed"`` (keys
    whose files the tier deleted: ``extra["reason"]`` is ``"corrupt"`` for a file shorter
    than a block, ``"checksum"`` for one that failed its CRC32C record, ``"evicted"`` for
    least recently used blocks removed to stay within ``capacity_bytes``)."""

    kind: str
    keys: tuple[bytes, ...]
    extra: dict[str, Any] = field(default_factory=dict)


# -- tasks -------------------------------------------------------------------------------

@dataclass
class Task:
    kind: TaskKind
    task_id: int
    keys: list[bytes]
    block_ids: list[int]
    attempt: int = 0


def task_record_capacity(kind: TaskKind, key_len: int) -> int:
    """How many items of ``key_len``-byte keys fit in one task record."""
    per_item = key_len + (LOOKUP_ITEM_OVERHEAD if kind == TaskKind.LOOKUP
                          else TASK_ITEM_OVERHEAD)
    return (TASK_RECORD_BYTES - TASK_HEADER_BYTES) // per_item


def encode_task(kind: TaskKind, task_id: int, keys: Sequence[bytes],
                block_ids: Sequence[int] = (), attempt: int = 0) -> bytes:
    """Pack a task into one fixed-size record. Raises ``ValueError`` if it does not fit.

    ``block_ids`` may be a list or an ``array('q')`` slice (the engine's hot path).
    """
    header = _TASK_HEADER.pack(_TASK_MAGIC, WIRE_VERSION, kind, attempt, 0, len(keys), task_id)
    ids = b"" if kind == TaskKind.LOOKUP else array.array("Q", block_ids).tobytes()
    record = b"".join((header, ids, array.array("H", map(len, keys)).tobytes(), *keys))
    pad = TASK_RECORD_BYTES - len(record)
    if pad < 0:
        raise ValueError(f"task {task_id} needs {len(record)} bytes, more than the "
                         f"{TASK_RECORD_BYTES}-byte record")
    return record + bytes(pad)


_record_structs: dict[tuple[int, int, int], struct.Struct] = {}


def _record_struct(kind: int, m: int, key_len: int) -> struct.Struct:
    """The layout of a record of ``m`` items with ``key_len``-byte keys (cached)."""
    layout = _record_structs.get((kind, m, key_len))
    if layout is None:
        ids = "" if kind == _LOOKUP else f"{m}Q"
        layout = struct.Struct(f"<3sBBBHIQ{ids}{m}H{m * key_len}s")
        if layout.size > TASK_RECORD_BYTES:
            raise ValueError(f"{m} items of {key_len}-byte keys do not fit a task record")
        _record_structs[(kind, m, key_len)] = layout
    return layout


def _native_encoder():
    """The C core's encoder (one call per job), or None: not built, switched off with
    ``MPTIER_NATIVE=0``, or built for another wire version."""
    from mptier import native

    if native.BACKEND != "native":
        return None
    from mptier.native import _native

    if (_native.WIRE_VERSION, _native.TASK_RECORD_BYTES, _native.TASK_HEADER_BYTES) != (
            WIRE_VERSION, TASK_RECORD_BYTES, TASK_HEADER_BYTES):
        return None
    return _native.encode_job


def encode_job(kind: TaskKind, first_task_id: int, keys: Sequence[bytes],
               block_ids: array.array, per_task: int) -> bytearray:
    """All task records of a job, back to back, ids ``first_task_id`` onwards.

    The caller guarantees ``per_task`` items of these keys fit a record (see
    :func:`task_record_capacity`); raises ``ValueError`` when they do not. This is the
    engine's submit path: keys of one length (the usual case) are encoded by the C core
    in one call where it is built; otherwise, and as its twin, by
    :func:`encode_job_python` -- the same bytes (tests/test_jobs.py).
    """
    if _c_encode is not None:
        out = _c_encode(int(kind), first_task_id, keys, block_ids, per_task)
        if out is not None:
            return out
    return encode_job_python(kind, first_task_id, keys, block_ids, per_task)


def encode_job_python(kind: TaskKind, first_task_id: int, keys: Sequence[bytes],
                      block_ids: array.array, per_task: int) -> bytearray:
    """:func:`encode_job` in Python: one zeroed allocation for the whole job and, for
    equal-length keys, one cached ``struct`` packing per record."""
    n = len(keys)
    n_tasks = -(-n // per_task)
    out = bytearray(n_tasks * TASK_RECORD_BYTES)
    kind = int(kind)
    lengths = list(map(len, keys))
    key_len = lengths[0] if n else 0
    if lengths.count(key_len) != n:
        return _encode_job_mixed(out, kind, first_task_id, keys, block_ids, per_task)
    all_keys = b"".join(keys)
    ids = block_ids.tolist() if kind != _LOOKUP else ()
    pos = 0
    task_id = first_task_id
    for start in range(0, n, per_task):
        stop = start + per_task if start + per_task < n else n
        m = stop - start
        _record_struct(kind, m, key_len).pack_into(
            out, pos, _TASK_MAGIC, WIRE_VERSION, kind, 0, 0, m, task_id,
            *ids[start:stop], *lengths[start:stop],
            all_keys[start * key_len:stop * key_len])
        pos += TASK_RECORD_BYTES
        task_id += 1
    return out


def _encode_job_mixed(out: bytearray, kind: int, first_task_id: int,
                      keys: Sequence[bytes], block_ids: array.array,
                      per_task: int) -> bytearray:
    for t, start in enumerate(range(0, len(keys), per_task)):
        record = encode_task(TaskKind(kind), first_task_id + t, keys[start:start + per_task],
                             block_ids[start:start + per_task] if kind != _LOOKUP else ())
        out[t * TASK_RECORD_BYTES:(t + 1) * TASK_RECORD_BYTES] = record
    return out


_c_encode = _native_encoder()


def peek_task(record: bytes | memoryview) -> tuple[TaskKind, int, int] | None:
    """``(kind, task_id, attempt)`` of a record, or ``None`` for an empty/invalid one."""
    magic, version, kind, attempt, _, _, task_id = _TASK_HEADER.unpack_from(record, 0)
    if magic != _TASK_MAGIC or version != WIRE_VERSION or task_id == 0 or \
            kind not in _KINDS:
        return None
    return TaskKind(kind), task_id, attempt


def check_task(record: bytes | memoryview) -> tuple[TaskKind, int, int]:
    """``(kind, task_id, n_items)`` of ``record``, having checked that it decodes: raises
    ``ValueError`` for a record no encoder here writes (wrong magic, version or kind,
    more items or key bytes than a record holds). The worker's check before a task's
    items are decoded in one native call (``Backend.load_task``, ``task_items``)."""
    magic, version, kind, _, _, n, task_id = _TASK_HEADER.unpack_from(record, 0)
    if magic != _TASK_MAGIC or version != WIRE_VERSION:
        raise ValueError(f"not an mptier v{WIRE_VERSION} task record: {bytes(record[:8])!r}")
    kind = _KIND_OF.get(kind) or TaskKind(kind)  # (the dict: ~1 us less than the enum)
    item = LOOKUP_ITEM_OVERHEAD if kind == TaskKind.LOOKUP else TASK_ITEM_OVERHEAD
    if TASK_HEADER_BYTES + n * item > TASK_RECORD_BYTES:
        raise ValueError(f"a task record cannot hold {n} items")
    pos = TASK_HEADER_BYTES + (item - LOOKUP_ITEM_OVERHEAD) * n  # past the block ids
    lengths = array.array("H")
    lengths.frombytes(record[pos:pos + 2 * n])
    if pos + 2 * n + sum(lengths) > TASK_RECORD_BYTES:
        raise ValueError(f"the keys of a task record end past its {TASK_RECORD_BYTES} bytes")
    return kind, task_id, n


def decode_task(record: bytes | memoryview) -> Task:
    """The task in ``record``. Raises ``ValueError`` for a record no encoder here writes
    (wrong magic, version or kind, more items or key bytes than a record holds)."""
    kind, task_id, n = check_task(record)
    pos = TASK_HEADER_BYTES
    ids = array.array("Q")
    if kind != TaskKind.LOOKUP:
        ids.frombytes(record[pos:pos + 8 * n])
        pos += 8 * n
    lengths = array.array("H")
    lengths.frombytes(record[pos:pos + 2 * n])
    raw = bytes(record[pos + 2 * n:pos + 2 * n + sum(lengths)])
    keys, start = [], 0
    for length in lengths:
        keys.append(raw[start:start + length])
        start += length
    return Task(kind, task_id, keys, ids.tolist(), record[5])


# -- messages ----------------------------------------------------------------------------

@dataclass
class Message:
    type: MessageType
    slot: int
    pid: int
    errno: int = 0
    n_done: int = 0
    task_id: int = 0
    started_ns: int = 0
    elapsed_ns: int = 0
    payload: bytes = b""
    attempt: int = 0
    outcome: Outcome = Outcome.OK

    @property
    def text(self) -> str:
        return self.payload.decode("utf-8", "replace")


def encode_message(type_: MessageType, slot: int, pid: int, *, errno: int = 0,
                   n_done: int = 0, task_id: int = 0, started_ns: int = 0,
                   elapsed_ns: int = 0, payload: bytes | str = b"", attempt: int = 0,
                   outcome: Outcome = Outcome.OK) -> bytes:
    if isinstance(payload, str):
        payload = payload.encode("utf-8", "replace")[:MAX_TEXT_BYTES]
    length = MESSAGE_HEADER_BYTES + len(payload)
    if length > MAX_COMPLETION_BYTES:
        raise ValueError(f"message of {length} bytes exceeds {MAX_COMPLETION_BYTES}")
    return _MESSAGE_HEADER.pack(length, int(type_), WIRE_VERSION, int(outcome), slot,
                                attempt, pid, errno, n_done, task_id, started_ns,
                                elapsed_ns) + payload


def pack_keys(keys: Sequence[bytes]) -> list[tuple[bytes, int]]:
    """Payloads of REMOVED messages and how many keys each holds: each key as
    ``length(u8) + key``, as many per payload as fit one message (keys are at most 255
    bytes)."""
    room = MAX_COMPLETION_BYTES - MESSAGE_HEADER_BYTES
    out: list[tuple[bytes, int]] = []
    part = bytearray()
    count = 0
    for key in keys:
        if len(part) + 1 + len(key) > room:
            out.append((bytes(part), count))
            part = bytearray()
            count = 0
        part.append(len(key))
        part += key
        count += 1
    if part:
        out.append((bytes(part), count))
    return out


def unpack_keys(payload: bytes) -> list[bytes]:
    """The keys of one :func:`pack_keys` payload."""
    keys = []
    pos = 0
    while pos < len(payload):
        n = payload[pos]
        keys.append(bytes(payload[pos + 1:pos + 1 + n]))
        pos += 1 + n
    return keys


def decode_messages(buffer: bytearray) -> list[Message]:
    """Take every whole message off the front of ``buffer`` (in place)."""
    out = []
    pos = 0
    end = len(buffer)
    while end - pos >= MESSAGE_HEADER_BYTES:
        (length, type_, version, outcome, slot, attempt, pid, err, n_done, task_id, started,
         elapsed) = _MESSAGE_HEADER.unpack_from(buffer, pos)
        if end - pos < length:
            break
        if version != WIRE_VERSION or length < MESSAGE_HEADER_BYTES:
            raise ValueError(f"corrupt completion stream at byte {pos}: version {version}, "
                             f"length {length}")
        payload = bytes(buffer[pos + MESSAGE_HEADER_BYTES:pos + length])
        out.append(Message(MessageType(type_), slot, pid, err, n_done, task_id, started,
                           elapsed, payload, attempt, Outcome(outcome)))
        pos += length
    del buffer[:pos]
    return out

"""Wire records: tasks and messages survive encoding, from bytes and from shared memory."""

from __future__ import annotations

import array
import os

import pytest

from mptier import native
from mptier.jobs import (
    TASK_RECORD_BYTES,
    MessageType,
    TaskKind,
    decode_messages,
    decode_task,
    encode_job,
    encode_job_python,
    encode_message,
    encode_task,
    peek_task,
    task_record_capacity,
)
from mptier.native.entries import Outcome


@pytest.mark.parametrize("kind", list(TaskKind))
def test_job_records_decode_from_bytes_and_memoryview(kind):
    keys = [os.urandom(32) + bytes([0, 0, 0, i % 3]) for i in range(10)]
    ids = array.array("q", range(100, 110))
    blob = encode_job(kind, 7, keys, ids, per_task=4)
    assert len(blob) == 3 * TASK_RECORD_BYTES
    shared = memoryview(bytearray(blob))  # workers decode straight from their slot
    for t, pos in enumerate(range(0, len(blob), TASK_RECORD_BYTES)):
        for record in (bytes(blob[pos:pos + TASK_RECORD_BYTES]),
                       shared[pos:pos + TASK_RECORD_BYTES]):
            task = decode_task(record)
            assert (task.kind, task.task_id, task.attempt) == (kind, 7 + t, 0)
            assert task.keys == keys[4 * t:4 * t + 4]
            expected_ids = [] if kind == TaskKind.LOOKUP else list(ids[4 * t:4 * t + 4])
            assert task.block_ids == expected_ids
    assert encode_task(kind, 7, keys[:4], ids[:4]) == bytes(blob[:TASK_RECORD_BYTES])


def test_capacity_is_exact_and_overflow_is_refused():
    cap = task_record_capacity(TaskKind.STORE, 36)
    keys = [b"k" * 36] * (cap + 1)
    ids = array.array("q", range(cap + 1))
    encode_job(TaskKind.STORE, 1, keys[:cap], ids[:cap], per_task=cap)
    with pytest.raises(ValueError):
        encode_job(TaskKind.STORE, 1, keys, ids, per_task=cap + 1)


def _c_encoder():
    if not native.HAS_NATIVE:
        pytest.skip(f"the native core is not built ({native.NATIVE_IMPORT_ERROR})")
    from mptier.native import _native

    return _native.encode_job


@pytest.mark.parametrize("kind", list(TaskKind))
@pytest.mark.parametrize("n, per_task", [(1, 1), (16, 1), (16, 4), (16, 16), (17, 4),
                                         (100, 32), (5, 8)])
@pytest.mark.parametrize("key_len", [5, 36, 255])
def test_c_encoder_writes_the_python_encoders_bytes(kind, n, per_task, key_len):
    """The engine's hot path (the C core) and its twin give the same records, byte for
    byte: the record header, ids, lengths, keys and the zero padding."""
    c_encode = _c_encoder()
    per_task = min(per_task, task_record_capacity(kind, key_len))
    keys = [os.urandom(key_len) for _ in range(n)]
    ids = array.array("q", [(i * 7919) % (1 << 40) for i in range(n)])
    if kind == TaskKind.LOOKUP:
        ids = array.array("q")
    expected = encode_job_python(kind, 1 << 33, keys, ids, per_task)
    got = c_encode(int(kind), 1 << 33, keys, ids, per_task)
    assert type(got) is bytearray and got == expected
    assert encode_job(kind, 1 << 33, keys, ids, per_task) == expected
    assert [decode_task(got[p:p + TASK_RECORD_BYTES]).keys
            for p in range(0, len(got), TASK_RECORD_BYTES)] == \
        [keys[i:i + per_task] for i in range(0, n, per_task)]


def test_c_encoder_leaves_mixed_lengths_and_overflow_to_python():
    c_encode = _c_encoder()
    mixed = [b"a" * 36, b"b" * 37]
    ids = array.array("q", [1, 2])
    assert c_encode(int(TaskKind.STORE), 1, mixed, ids, 2) is None  # Python encodes it
    assert encode_job(TaskKind.STORE, 1, mixed, ids, 2) == \
        encode_job_python(TaskKind.STORE, 1, mixed, ids, 2)
    assert c_encode(int(TaskKind.LOAD), 1, [b"k" * 36], [5], 1) == \
        encode_job_python(TaskKind.LOAD, 1, [b"k" * 36], array.array("q", [5]), 1)
    cap = task_record_capacity(TaskKind.STORE, 36)
    too_many = [b"k" * 36] * (cap + 1)
    with pytest.raises(ValueError, match="do not fit"):
        c_encode(int(TaskKind.STORE), 1, too_many, array.array("q", range(cap + 1)), cap + 1)
    assert c_encode(int(TaskKind.STORE), 1, [], array.array("q"), 4) == bytearray()


def test_attempt_and_peek():
    record = encode_task(TaskKind.LOAD, 99, [b"abcdefgh"], [3])
    assert peek_task(record) == (TaskKind.LOAD, 99, 0)
    assert peek_task(encode_task(TaskKind.LOAD, 99, [b"abcdefgh"], [3], attempt=2)) == \
        (TaskKind.LOAD, 99, 2)
    assert peek_task(bytes(TASK_RECORD_BYTES)) is None


def test_messages_split_across_reads():
    stream = (encode_message(MessageType.DONE, 3, 1234, errno=2, n_done=5, task_id=9,
                             started_ns=10, elapsed_ns=20, payload="boom",
                             outcome=Outcome.MISSING)
              + encode_message(MessageType.LOST, 1, 42, task_id=8, payload="gone"))
    buffer = bytearray(stream[:10])
    assert decode_messages(buffer) == []
    buffer += stream[10:]
    first, second = decode_messages(buffer)
    assert (first.type, first.slot, first.pid, first.errno, first.n_done, first.task_id,
            first.started_ns, first.elapsed_ns, first.text, first.outcome) == \
        (MessageType.DONE, 3, 1234, 2, 5, 9, 10, 20, "boom", Outcome.MISSING)
    assert (second.type, second.task_id, second.text, second.outcome) == (
        MessageType.LOST, 8, "gone", Outcome.OK)
    assert buffer == bytearray()

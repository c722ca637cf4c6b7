"""Wire records: tasks and messages survive encoding, from bytes and from shared memory."""

from __future__ import annotations

import array
import os

import pytest

from mptier.jobs import (
    TASK_RECORD_BYTES,
    MessageType,
    TaskKind,
    decode_messages,
    decode_task,
    encode_job,
    encode_message,
    encode_task,
    peek_task,
    task_record_capacity,
)


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


def test_attempt_and_peek():
    record = encode_task(TaskKind.LOAD, 99, [b"abcdefgh"], [3])
    assert peek_task(record) == (TaskKind.LOAD, 99, 0)
    assert peek_task(encode_task(TaskKind.LOAD, 99, [b"abcdefgh"], [3], attempt=2)) == \
        (TaskKind.LOAD, 99, 2)
    assert peek_task(bytes(TASK_RECORD_BYTES)) is None


def test_messages_split_across_reads():
    stream = (encode_message(MessageType.DONE, 3, 1234, errno=2, n_done=5, task_id=9,
                             started_ns=10, elapsed_ns=20, payload="boom")
              + encode_message(MessageType.LOST, 1, 42, task_id=8, payload="gone"))
    buffer = bytearray(stream[:10])
    assert decode_messages(buffer) == []
    buffer += stream[10:]
    first, second = decode_messages(buffer)
    assert (first.type, first.slot, first.pid, first.errno, first.n_done, first.task_id,
            first.started_ns, first.elapsed_ns, first.text) == \
        (MessageType.DONE, 3, 1234, 2, 5, 9, 10, 20, "boom")
    assert (second.type, second.task_id, second.text) == (MessageType.LOST, 8, "gone")
    assert buffer == bytearray()

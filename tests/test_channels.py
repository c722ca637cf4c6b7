"""The engine's pipes (mptier/channels.py) with real pipes and processes: records never
torn or lost when a pipe fills (the overflow list), many readers sharing one queue,
completion messages read whole across partial writes, the lifeline's end-of-file in
another process, and closing twice."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap

import pytest

from mptier.channels import (
    CompletionReader,
    EngineChannels,
    RecordWriter,
    TaskQueue,
    drain_records,
    make_pipe,
)
from mptier.jobs import TASK_RECORD_BYTES, MessageType, TaskKind, encode_message


def record(n: int) -> bytes:
    return n.to_bytes(8, "little") * (TASK_RECORD_BYTES // 8)


def numbers(records) -> list[int]:
    out = []
    for r in records:
        assert len(r) == TASK_RECORD_BYTES and r == r[:8] * (TASK_RECORD_BYTES // 8), "torn"
        out.append(int.from_bytes(r[:8], "little"))
    return out


@pytest.fixture
def queue():
    q = TaskQueue("test")
    yield q
    q.close()


def test_a_full_queue_keeps_the_rest_in_overflow_in_order_and_flush_moves_it_on(queue):
    capacity = queue.pipe_bytes // TASK_RECORD_BYTES
    total = capacity + 7
    blob = b"".join(record(i) for i in range(total))
    queue.put_records(blob)  # one call more than the pipe holds: never blocks
    assert queue.pipe_depth() == capacity
    assert queue.overflow_depth == 7
    queue.writer.put(record(total))  # behind the overflow, never ahead of it
    assert queue.overflow_depth == 8
    got = drain_records(queue.read_fd)
    assert queue.flush() == 0
    got += drain_records(queue.read_fd)
    assert numbers(got) == list(range(total + 1))
    assert queue.writer.sent == total + 1


def test_take_all_empties_pipe_and_overflow(queue):
    capacity = queue.pipe_bytes // TASK_RECORD_BYTES
    queue.put_records(b"".join(record(i) for i in range(capacity + 3)))
    assert numbers(queue.take_all()) == list(range(capacity + 3))
    assert queue.pipe_depth() == 0 and queue.overflow_depth == 0


def test_a_record_longer_than_pipe_buf_is_refused_naming_the_limit():
    r, w = make_pipe()
    try:
        with pytest.raises(ValueError, match=f"{select.PIPE_BUF + 1} bytes .*PIPE_BUF"):
            RecordWriter(w).put(b"x" * (select.PIPE_BUF + 1))
    finally:
        os.close(r)
        os.close(w)


def test_a_pipe_nobody_reads_raises_broken_pipe_instead_of_blocking():
    r, w = make_pipe()
    writer = RecordWriter(w)
    os.close(r)
    try:
        with pytest.raises(BrokenPipeError):
            writer.put(record(1))
    finally:
        os.close(w)


READER = textwrap.dedent("""
    import os, select, sys
    from mptier.channels import drain_records
    fd = int(sys.argv[1])
    out = os.fdopen(int(sys.argv[2]), "w")
    got = []
    while True:
        select.select([fd], [], [], 5)
        recs = drain_records(fd)
        if not recs:
            try:
                if os.read(fd, 4096) == b"":
                    break
            except BlockingIOError:
                continue
            raise SystemExit("a short read: a torn record")
        got += [int.from_bytes(r[:8], "little") for r in recs
                if r == r[:8] * (len(r) // 8)] + [-1] * sum(r != r[:8] * (len(r) // 8)
                                                           for r in recs)
    out.write(" ".join(map(str, got)))
""")


def test_readers_in_several_processes_share_a_queue_and_each_record_reaches_one(queue):
    """Three processes read the queue while the engine writes past its capacity: every
    record arrives once and whole, and none is lost in the overflow list."""
    readers = []
    for _ in range(3):
        r, w = os.pipe()
        proc = subprocess.Popen([sys.executable, "-c", READER, str(queue.read_fd), str(w)],
                                pass_fds=(queue.read_fd, w))
        os.close(w)
        readers.append((proc, r))
    total = 3 * (queue.pipe_bytes // TASK_RECORD_BYTES)
    for start in range(0, total, 16):
        queue.put_records(b"".join(record(i) for i in range(start, min(total, start + 16))))
        queue.flush()
    while queue.flush():
        select.select([], [queue.write_fd], [], 1)
    os.close(queue.write_fd)  # end of file for the readers once the pipe drains
    queue.write_fd = -1
    seen = []
    for proc, r in readers:
        with os.fdopen(r) as f:
            seen += [int(x) for x in f.read().split()]
        assert proc.wait(30) == 0
    assert sorted(seen) == list(range(total))


def test_completion_messages_are_read_whole_even_when_written_in_pieces():
    reader = CompletionReader()
    try:
        one = encode_message(MessageType.DONE, 3, 1234, n_done=5, task_id=9, payload="ok")
        two = encode_message(MessageType.LOST, 4, 99, errno=5, task_id=10, payload="gone")
        os.write(reader.write_fd, one + two[:7])
        first = reader.read_available()
        assert [(m.type, m.slot, m.pid, m.n_done, m.task_id, m.text) for m in first] == [
            (MessageType.DONE, 3, 1234, 5, 9, "ok")]
        assert reader.read_available() == []  # the rest of two has not arrived
        os.write(reader.write_fd, two[7:])
        (second,) = reader.read_available()
        assert (second.type, second.errno, second.task_id, second.text) == (
            MessageType.LOST, 5, 10, "gone")
    finally:
        reader.close()


def test_a_worker_sees_the_lifeline_end_when_the_engine_closes_it():
    channels = EngineChannels()
    try:
        child = subprocess.Popen(
            [sys.executable, "-c",
             "import os,select,sys; fd=int(sys.argv[1]); select.select([fd],[],[],30);"
             "sys.exit(0 if os.read(fd, 1) == b'' else 3)", str(channels.lifeline_r)],
            pass_fds=(channels.lifeline_r,))
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.3)  # the engine still holds the write end
        channels.close_lifeline()
        assert child.wait(30) == 0
    finally:
        channels.close()
        channels.close()  # idempotent
    assert channels.lifeline_r == channels.lifeline_w == -1
    assert all(q.read_fd == -1 for q in channels.queues.values())


def test_the_session_hands_over_one_queue_per_task_kind_and_the_completion_write_end():
    channels = EngineChannels()
    try:
        session = channels.session(segments=[], nbytes=0, block_bytes=4096, layout={},
                                   label="t")
        assert set(session.queues) == set(TaskKind)
        assert {session.queues[k] for k in TaskKind} == {
            q.read_fd for q in channels.queues.values()}
        assert session.completion == channels.completions.write_fd
        assert session.lifeline == channels.lifeline_r
        assert session.engine_pid == os.getpid()
    finally:
        channels.close()

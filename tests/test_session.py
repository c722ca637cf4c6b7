"""A session (mptier/workers/session.py) as it really travels: the engine's channels and
buffer descriptors duplicated for the pool, sent over a Unix socket to another process
that rebuilds it (WorkerSession.from_wire), maps the buffer and uses each descriptor;
closing is idempotent and closes every copy's descriptors; IoSettings survive the wire."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from mptier.channels import EngineChannels, drain_records
from mptier.jobs import TASK_RECORD_BYTES, TaskKind
from mptier.workers.session import QUEUE_ORDER, IoSettings, RootIo, WorkerSession

BLOCK = 4096

WORKER = textwrap.dedent("""
    import json, os, socket, sys
    from mptier.jobs import TaskKind
    from mptier.mapping import MappedBuffer
    from mptier.workers.session import WorkerSession
    sock = socket.socket(fileno=int(sys.argv[1]))
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 64)
    session = WorkerSession.from_wire(json.loads(msg), fds)
    mapped = MappedBuffer(session.segments, session.nbytes)
    record = os.read(session.queues[TaskKind.STORE], 4096)
    first = bytes(mapped.memory[:8])
    mapped.memory[session.block_bytes:session.block_bytes + 6] = b"worker"
    os.write(session.completion, json.dumps({"first": first.decode(),
        "record": record[:8].hex(), "label": session.label, "pid": session.engine_pid,
        "layout": session.layout, "segments": len(session.segments)}).encode())
    mapped.close()
    session.close()
""")


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def still_holds(fd: int, ident: tuple[int, int]) -> bool:
    """Whether ``fd`` is open on the file it named before: a closed number may be taken
    at once by a thread of this test process opening something else."""
    try:
        return identity(fd) == ident
    except OSError:
        return False


def test_a_session_sent_to_another_process_gives_it_every_channel_and_the_buffer(
        make_buffer):
    buf = make_buffer(4, BLOCK)
    buf.view[0][:8] = list(b"blockone")
    channels = EngineChannels()
    segments = buf.open_segments()
    try:
        session = channels.session(segments=segments, nbytes=buf.nbytes, block_bytes=BLOCK,
                                   layout={"model": "m"}, label="engine under test")
        pool_copy = session.dup()  # what the pool keeps: descriptors of its own
        assert not set(pool_copy.descriptors()) & set(session.descriptors())
        channels.queues[TaskKind.STORE].put_records(b"R" * 8 + b"\0" * (TASK_RECORD_BYTES - 8))
        description, fds = pool_copy.to_worker()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        worker = subprocess.Popen([sys.executable, "-c", WORKER, str(child.fileno())],
                                  pass_fds=(child.fileno(),))
        child.close()
        socket.send_fds(parent, [json.dumps(description).encode()], fds)
        parent.close()
        assert worker.wait(60) == 0
        report = json.loads(os.read(channels.completions.read_fd, 65536))
        assert buf.view[1][:6].tobytes() == b"worker"  # it wrote into the engine's buffer
        assert report == {"first": "blockone", "record": (b"R" * 8).hex(),
                          "label": "engine under test", "pid": os.getpid(),
                          "layout": {"model": "m"}, "segments": len(segments)}
        assert drain_records(channels.queues[TaskKind.STORE].read_fd) == []  # it took it
        assert all(is_open(fd) for fd in pool_copy.descriptors())
        held = {fd: identity(fd) for fd in pool_copy.descriptors()}
        pool_copy.close()
        pool_copy.close()  # idempotent
        assert not any(still_holds(fd, ident) for fd, ident in held.items())
        assert all(is_open(fd) for fd in session.descriptors())  # the engine's own stay
    finally:
        for seg in segments:
            os.close(seg.fd)
        channels.close()


def test_a_session_message_with_the_wrong_number_of_descriptors_is_refused():
    description = {"nbytes": 0, "block_bytes": BLOCK, "layout": {}, "engine_pid": 1,
                   "label": "", "segments": [{"fd": None, "file_offset": 0, "length": 4096,
                                              "buffer_offset": 0, "path": ""}]}
    expected = len(TaskKind) + 4 + 1
    with pytest.raises(ValueError, match=f"carried 2 descriptors, expected {expected}"):
        WorkerSession.from_wire(description, [0, 1])


def test_io_settings_survive_the_wire_and_fill_the_first_root_from_the_flat_fields():
    settings = IoSettings(root_dir="/kv", use_o_direct=True, checksum=True, uring=True,
                          capacity_bytes=1 << 30)
    assert settings.roots == [RootIo("/kv", True, True, False, True)]
    again = IoSettings.from_wire(json.loads(json.dumps(settings.to_wire())))
    assert again == settings and again.root_dirs == ["/kv"]
    two = IoSettings(root_dir="/a", roots=[{"path": "/a"}, {"path": "/b", "checksum": True}])
    assert two.root_dirs == ["/a", "/b"] and two.roots[1].checksum


def test_each_role_takes_lookups_first_then_its_own_queue_then_the_other():
    assert QUEUE_ORDER["load"] == (TaskKind.LOOKUP, TaskKind.LOAD, TaskKind.STORE)
    assert QUEUE_ORDER["store"] == (TaskKind.LOOKUP, TaskKind.STORE, TaskKind.LOAD)

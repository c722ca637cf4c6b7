"""A hostile client of ``mptier serve``, for the security tests
(``tests/test_security_client.py``) and the scenario runner's ``hostile_client``
(``tests/reliability_run.py``): the same attacks in both.

It speaks the wire protocol by hand (:mod:`mptier.messages`: one JSON datagram over a
``SOCK_SEQPACKET`` socket, descriptors alongside), as a real engine does in
:mod:`mptier.service.link`, but sends what a real engine never would:

* :data:`FIRST_DATAGRAMS` -- malformed first messages (not JSON, not an object, no or a
  foreign op, nested too deep, too long, too many descriptors);
* :data:`ATTACHES` -- attach messages with one thing wrong each: a field of the wrong
  type or out of range, a layout that leaves the root (``rank = "0/../../..."``), a
  descriptor of the wrong kind (pipe, socket, directory, device, a read-only or blocking
  one), a buffer larger than the file behind it, segments that do not cover it;
* :class:`RawEngine` -- a real engine's channels and buffer, attached by hand, that then
  writes task records whose block ids lie past its buffer (stores that would copy the
  worker's own memory into block files, loads that would write into it).

:func:`well_behaved` is the engine every attack is followed by: a real
:class:`~mptier.FileSystemTier` attached to the service, its loads checked byte for byte
(:class:`reliability_kit.JobBook`).
"""

from __future__ import annotations

import array
import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from reliability_kit import EngineCalls, JobBook

from mptier import FileSystemTier, SharedKVBuffer, make_key, messages
from mptier.channels import EngineChannels
from mptier.jobs import (
    TASK_RECORD_BYTES,
    MessageType,
    TaskKind,
    encode_job_python,
    task_record_capacity,
)
from mptier.layout import FileMapper
from mptier.service.server import ATTACH, DETACH, PROTOCOL_VERSION, STATUS

KB = 1 << 10
BLOCK = 64 * KB
RAW_BLOCKS = 4  # the hostile engine's buffer: block ids 0..3
# How long a reply (or the service hanging up) may take on a loaded 2-core machine.
REPLY_S = 20.0


@dataclass
class Sent:
    """What a datagram got: the reply (None: the service hung up without one)."""

    reply: dict[str, Any] | None
    hung_up: bool


def connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(REPLY_S)
    sock.connect(path)
    return sock


def send_datagram(path: str, data: bytes, fds: list[int] = ()) -> Sent:
    """Send one raw datagram on a new connection and wait for the reply and the end."""
    with connect(path) as sock:
        if fds:
            socket.send_fds(sock, [data], list(fds))
        else:
            sock.send(data)
        return _answer(sock)


def _answer(sock: socket.socket) -> Sent:
    try:
        got = messages.receive(sock)
    except ConnectionResetError:
        return Sent(None, True)
    if got is None:
        return Sent(None, True)
    reply, fds = got
    messages.close_all(fds)
    try:
        hung_up = messages.receive(sock) is None
    except (ConnectionResetError, TimeoutError):
        hung_up = False
    return Sent(reply, hung_up)


def status(path: str) -> dict[str, Any]:
    """The service's figures (raises if it does not answer)."""
    sent = send_datagram(path, json.dumps({"op": STATUS}).encode())
    assert sent.reply is not None and sent.reply.get("ok"), sent
    return sent.reply["figures"]


# -- malformed first messages --------------------------------------------------------

def _many_fds() -> list[int]:
    return [os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
            for _ in range(messages.MAX_MESSAGE_FDS + 6)]


# name -> (datagram, descriptors to send with it (made per send, closed after))
FIRST_DATAGRAMS: dict[str, tuple[bytes, Callable[[], list[int]]]] = {
    "empty list": (b"[]", list),
    "null": (b"null", list),
    "a number": (b"1", list),
    "a string": (b'"x"', list),
    "empty object": (b"{}", list),
    "op a number": (b'{"op": 1}', list),
    "op null": (b'{"op": null}', list),
    "op a list": (b'{"op": ["attach"]}', list),
    "op unknown": (b'{"op": "shutdown"}', list),
    "op detach before attach": (b'{"op": "detach"}', list),
    "not JSON": (b"{not json", list),
    "not UTF-8": (b'{"op": "\xff\xfe"}', list),
    "nested too deep": (b"[" * 100_000, list),
    "huge number": (b'{"op": "status", "x": ' + b"9" * 5000 + b"}", list),
    "oversize datagram": (b'{"op": "status"}' + b" " * (messages.MAX_DATAGRAM_BYTES + 4096),
                          list),
    "too many descriptors": (b'{"op": "status"}', _many_fds),
    "descriptors with a status": (b'{"op": "status"}', lambda: _many_fds()[:3]),
}


# -- attach messages with one thing wrong -------------------------------------------------

class RawEngine:
    """An engine's channels and shared buffer, with the attach message a real engine
    sends (:meth:`fields`, :meth:`fds`) for the attacks to spoil. Close it."""

    def __init__(self, num_blocks: int = RAW_BLOCKS, block_bytes: int = BLOCK) -> None:
        self.channels = EngineChannels()
        self.buf = SharedKVBuffer.create(num_blocks, block_bytes)
        self.segments = self.buf.open_segments()
        self.sock: socket.socket | None = None
        self.control_fd = -1
        self.io: dict[str, Any] = {}
        self.layout = {"model_name": "hostile"}

    def fields(self) -> dict[str, Any]:
        return {"op": ATTACH, "version": PROTOCOL_VERSION, "engine_pid": os.getpid(),
                "label": f"hostile pid {os.getpid()}", "nbytes": self.buf.nbytes,
                "block_bytes": self.buf.block_bytes, "layout": dict(self.layout),
                "segments": [{"file_offset": s.file_offset, "length": s.length,
                              "buffer_offset": s.buffer_offset, "path": s.path}
                             for s in self.segments]}

    def fds(self) -> list[int]:
        c = self.channels
        assert c.completions is not None
        return [*(c.queues[k].read_fd for k in TaskKind), c.completions.write_fd,
                c.lifeline_r, *c.doorbell, *(s.fd for s in self.segments)]

    def attach(self, path: str) -> dict[str, Any]:
        """Attach as a real engine would; returns the reply (asserted ok)."""
        sock = connect(path)
        socket.send_fds(sock, [json.dumps(self.fields()).encode()], self.fds())
        got = messages.receive(sock)
        assert got is not None, "the service hung up on a well-formed attach"
        reply, fds = got
        assert reply.get("ok"), reply
        self.sock, self.control_fd, self.io = sock, fds[0], reply["io"]
        return reply

    def mapper(self) -> FileMapper:
        return FileMapper(self.io["root_dir"], **self.layout)

    def submit(self, kind: TaskKind, first_task: int, keys: list[bytes],
               block_ids: list[int]) -> int:
        """Write the task records of one job, one key per task (any block ids, as a
        hostile engine may). Returns how many tasks."""
        per_task = 1
        assert task_record_capacity(kind, len(keys[0])) >= per_task
        # The Python encoder: it packs any u64 block id, as a record may hold.
        records = encode_job_python(kind, first_task, keys, array.array("Q", block_ids),
                                    per_task)
        self.channels.queues[kind].put_records(records)
        self.channels.queues[kind].flush()
        return len(keys)

    def results(self, task_ids: set[int], timeout: float = REPLY_S) -> dict[int, int]:
        """``{task_id: errno}`` of the DONE messages for ``task_ids``."""
        assert self.channels.completions is not None
        got: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        while task_ids - set(got) and time.monotonic() < deadline:
            for m in self.channels.completions.read_available():
                if m.type == MessageType.DONE and m.task_id in task_ids:
                    got[m.task_id] = m.errno
            time.sleep(0.01)
        return got

    def garbage_failed(self, n: int, timeout: float = REPLY_S) -> int:
        """How many of ``n`` task-id-0 failures (malformed records) came back."""
        assert self.channels.completions is not None
        seen = 0
        deadline = time.monotonic() + timeout
        while seen < n and time.monotonic() < deadline:
            seen += sum(m.type == MessageType.DONE and m.task_id == 0
                        and m.errno == errno.EINVAL
                        for m in self.channels.completions.read_available())
            time.sleep(0.01)
        return seen

    def hang_up(self, path: str | None = None) -> None:
        """Detach (the service ends the session); with ``path``, wait until the service
        takes the next engine."""
        self.channels.close_lifeline()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                messages.send(self.sock, DETACH)
                self.sock.settimeout(REPLY_S)
                messages.receive(self.sock)
            self.sock.close()
            self.sock = None
        if path is not None:
            deadline = time.monotonic() + REPLY_S
            while status(path).get("attached") and time.monotonic() < deadline:
                time.sleep(0.05)

    def close(self) -> None:
        self.hang_up()
        if self.control_fd >= 0:
            os.close(self.control_fd)
            self.control_fd = -1
        messages.close_all([s.fd for s in self.segments])
        self.segments = []
        self.channels.close()
        self.buf.close()
        self.buf.unlink()


def _fd_of(kind: str, engine: RawEngine) -> int:
    """A descriptor of ``kind`` for an attack (closed by the caller)."""
    if kind == "pipe":
        r, w = os.pipe2(os.O_CLOEXEC)
        os.close(w)
        return r
    if kind == "socket":
        a, b = socket.socketpair()
        b.close()
        return a.detach()
    if kind == "directory":
        return os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    if kind == "device":
        return os.open("/dev/zero", os.O_RDWR | os.O_CLOEXEC)
    if kind == "read-only buffer":
        return os.open(f"/proc/self/fd/{engine.segments[0].fd}", os.O_RDONLY | os.O_CLOEXEC)
    if kind == "small file":
        fd = os.memfd_create("mptier-hostile-small", os.MFD_CLOEXEC)
        os.ftruncate(fd, BLOCK)  # one block, where the buffer claims RAW_BLOCKS
        return fd
    if kind == "blocking queue":
        r, w = os.pipe2(os.O_CLOEXEC)
        os.close(w)
        return r  # a pipe left blocking: a worker's read of an empty queue would hang
    raise ValueError(kind)


@dataclass
class Attach:
    """An attach with one thing wrong: ``fields`` changes the message, ``swap`` puts a
    descriptor of a kind into position ``at`` (-1: the buffer's), ``fd_count`` sends
    that many of the descriptors only."""

    fields: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] | None = None
    swap: str = ""
    at: int = -1
    fd_count: int | None = None


def _escape(outside: str) -> str:
    """A rank that walks from ``<root>/<base>_r`` up to ``/`` and down into ``outside``."""
    return "0/" + "../" * 40 + outside.strip("/") + "/escaped"


def attaches(outside: str) -> dict[str, Attach]:
    """The attach attacks; ``outside`` is a folder outside the service's root that none
    of them may write into."""
    huge = 1 << 70
    return {
        "traversal in rank": Attach(layout={"model_name": "hostile", "rank": _escape(outside)}),
        "rank a string": Attach(layout={"rank": "0"}),
        "model_name with a NUL": Attach(layout={"model_name": "a\x00b"}),
        "model_name too long": Attach(layout={"model_name": "m" * 300}),
        "model_name a list": Attach(layout={"model_name": ["x"]}),
        "foreign layout field": Attach(layout={"root_dir": outside}),
        "layout a list": Attach(fields={"layout": []}),
        "negative tp_size": Attach(layout={"tp_size": -1}),
        "version a string": Attach(fields={"version": "1"}),
        "engine_pid a string": Attach(fields={"engine_pid": "1"}),
        "engine_pid negative": Attach(fields={"engine_pid": -1}),
        "engine_pid huge": Attach(fields={"engine_pid": huge}),
        "label not text": Attach(fields={"label": {"x": 1}}),
        "label with escapes": Attach(fields={"label": "\x1b[2Jowned"}),
        "nbytes missing": Attach(fields={"nbytes": None}),
        "nbytes a float": Attach(fields={"nbytes": 262144.0}),
        "nbytes infinite": Attach(fields={"nbytes": float("inf")}),
        "nbytes past the file": Attach(fields={"nbytes": 64 * RAW_BLOCKS * BLOCK}),
        "nbytes short of the segments": Attach(fields={"nbytes": BLOCK}),
        "block_bytes zero": Attach(fields={"block_bytes": 0}),
        "block_bytes negative": Attach(fields={"block_bytes": -BLOCK}),
        "block_bytes past the buffer": Attach(fields={"block_bytes": 2 * RAW_BLOCKS * BLOCK}),
        "block_bytes huge": Attach(fields={"block_bytes": huge, "nbytes": huge}),
        "segments a string": Attach(fields={"segments": "x"}),
        "segments empty": Attach(fields={"segments": []}),
        "segment past the file": Attach(fields={"segments": [
            {"file_offset": BLOCK, "length": RAW_BLOCKS * BLOCK, "buffer_offset": 0,
             "path": ""}]}),
        "segment negative offset": Attach(fields={"segments": [
            {"file_offset": -4096, "length": RAW_BLOCKS * BLOCK, "buffer_offset": 0,
             "path": ""}]}),
        "segment with a gap": Attach(fields={"segments": [
            {"file_offset": 0, "length": RAW_BLOCKS * BLOCK, "buffer_offset": 4096,
             "path": ""}]}),
        "segment extra field": Attach(fields={"segments": [
            {"file_offset": 0, "length": RAW_BLOCKS * BLOCK, "buffer_offset": 0,
             "path": "", "fd": 3}]}),
        "no descriptors": Attach(fd_count=0),
        "one descriptor short": Attach(fd_count=7),
        "buffer is a pipe": Attach(swap="pipe"),
        "buffer is a socket": Attach(swap="socket"),
        "buffer is a directory": Attach(swap="directory"),
        "buffer is a device": Attach(swap="device"),
        "buffer opened read-only": Attach(swap="read-only buffer"),
        "buffer smaller than claimed": Attach(swap="small file"),
        "queue is a directory": Attach(swap="directory", at=0),
        "queue is a socket": Attach(swap="socket", at=1),
        "queue is a blocking pipe": Attach(swap="blocking queue", at=0),
        "completion is a regular file": Attach(swap="small file", at=3),
    }


# Values of the wrong type or out of range, tried on every field (those a field takes
# are left out by wrong_values).
WRONG_VALUES: tuple[Any, ...] = (None, "x", "", [], {}, [1], {"a": 1}, 1.5, True, -1, 0,
                                 1 << 70, "0/../..")
# What each attach field takes, beside what a real engine sends.
_FIELD_TAKES: dict[str, Callable[[Any], bool]] = {
    "version": lambda v: v == PROTOCOL_VERSION and v is not True,
    "engine_pid": lambda v: False,  # every wrong value is wrong here (0, -1, ...)
    "nbytes": lambda v: False,
    "block_bytes": lambda v: False,
    "label": lambda v: v is None or isinstance(v, str),  # absent or "": the default
    "layout": lambda v: v == {} or v is None,  # the defaults
    "segments": lambda v: False,
}


def wrong_values() -> dict[str, Attach]:
    """Every field of the attach message, and every layout field, set to each of
    :data:`WRONG_VALUES` it does not take (for the layout: those a local configuration
    refuses, TierConfig.layout_from -- the service must refuse exactly those)."""
    from mptier.config import LAYOUT_FIELDS, TierConfig
    from mptier.errors import ConfigError

    out = {}
    for name, takes in _FIELD_TAKES.items():
        for value in WRONG_VALUES:
            if not takes(value):
                out[f"{name} = {value!r}"] = Attach(fields={name: value})
    for name in LAYOUT_FIELDS:
        for value in WRONG_VALUES:
            try:
                TierConfig.layout_from({name: value})
            except ConfigError:
                out[f"layout {name} = {value!r}"] = Attach(layout={name: value})
    return out


def send_attach(path: str, attack: Attach) -> Sent:
    """One spoiled attach on a new connection (its own buffer and channels, closed
    after)."""
    engine = RawEngine()
    made: list[int] = []
    try:
        message = engine.fields()
        message.update(attack.fields)
        message = {k: v for k, v in message.items() if v is not None}
        if attack.layout is not None:
            message["layout"] = {**engine.layout, **attack.layout}
        fds = engine.fds()
        if attack.swap:
            made.append(_fd_of(attack.swap, engine))
            fds[attack.at] = made[-1]
        if attack.fd_count is not None:
            fds = fds[:attack.fd_count]
        return send_datagram(path, json.dumps(message).encode(), fds)
    finally:
        messages.close_all(made)
        engine.close()


# -- what every attack is followed by -------------------------------------------------------

def keys_for(n: int, tag: str) -> list[bytes]:
    return [make_key(f"{tag}:{i}".encode().ljust(28, b".")[:28] + i.to_bytes(4, "big"))
            for i in range(n)]


@dataclass
class EngineCheck:
    """A well-behaved engine: attached (or kept attached) to the service, storing and
    loading back keys, every loaded byte checked."""

    name: str
    buf: SharedKVBuffer = field(default_factory=lambda: SharedKVBuffer.create(8, BLOCK))
    tier: FileSystemTier | None = None
    book: JobBook | None = None
    calls: EngineCalls | None = None
    rounds: int = 0

    def attach(self) -> None:
        self.tier = FileSystemTier(self.buf, root_dir="/unused/by/a/service",
                                   service=self.name, worker_start_timeout_s=REPLY_S)
        self.calls = EngineCalls(self.tier)
        self.book = JobBook(self.calls, self.buf)

    def round_trip(self, n: int = 4) -> tuple[int, int]:
        """Store ``n`` new keys, load them into other slots: ``(failed jobs, wrong
        blocks)`` of this round."""
        if self.tier is None:
            self.attach()
        assert self.book is not None
        self.rounds += 1
        keys = keys_for(n, f"good-{os.getpid()}-{self.rounds}")
        wrong_before = len(self.book.wrong)
        stored = self.book.wait([self.book.store(keys, list(range(n)))])
        loaded = self.book.wait([self.book.load(keys, list(range(n, 2 * n)))])
        results = [*stored.values(), *loaded.values()]
        failed = 2 - sum(r.success for r in results)
        return failed, len(self.book.wrong) - wrong_before

    def detach(self) -> None:
        if self.tier is not None:
            self.tier.shutdown()
            self.tier = None

    def close(self) -> None:
        self.detach()
        self.buf.close()
        self.buf.unlink()


def files_under(folder: str) -> list[str]:
    """Every entry beneath ``folder`` (nothing followed)."""
    out = []
    for dirpath, dirs, names in os.walk(folder):
        out += [os.path.join(dirpath, n) for n in dirs + names]
    return out


# -- attacks from an attached engine --------------------------------------------------------

# Datagrams an attached engine sends on its link instead of a status request:
# name -> (datagram, descriptors to send with it).
LINK_GARBAGE: dict[str, tuple[bytes, int]] = {
    "empty list": (b"[]", 0), "null": (b"null", 0), "a number": (b"1", 0),
    "attach again": (b'{"op": "attach"}', 0),
    "a status with descriptors": (b'{"op": "status"}', 2),
}


def garbage_on_link(path: str, data: bytes, n_fds: int) -> str:
    """Attach by hand, then send ``data`` on the link: "" when the service hung up on
    this engine (what it must do), else what happened instead."""
    raw = RawEngine()
    try:
        raw.attach(path)
        assert raw.sock is not None
        extra = [os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC) for _ in range(n_fds)]
        try:
            if extra:
                socket.send_fds(raw.sock, [data], extra)
            else:
                raw.sock.send(data)
        finally:
            messages.close_all(extra)
        raw.sock.settimeout(REPLY_S)
        try:
            while (got := raw.sock.recv(messages.MAX_DATAGRAM_BYTES)) != b"":
                if json.loads(got).get("op") != STATUS:  # figures it sent before: fine
                    return f"answered {got[:200]!r}"
        except TimeoutError:
            return f"kept the link open for {REPLY_S:g} s"
        raw.hang_up(path)
        return ""
    finally:
        raw.close()


# Block ids past a RAW_BLOCKS-block buffer: the next one, far past, past 2^40 blocks, the
# largest a record holds.
PAST = (RAW_BLOCKS, RAW_BLOCKS + 1000, 1 << 40, (1 << 64) - 1)


def _record(magic: bytes = b"MPT", version: int = 2, kind: int = 1, n: int = 1,
            task_id: int = 99, body: bytes = b"") -> bytes:
    import struct

    head = struct.pack("<3sBBBHIQ", magic, version, kind, 0, 0, n, task_id)
    return (head + body).ljust(TASK_RECORD_BYTES, b"\0")[:TASK_RECORD_BYTES]


# Task records no engine of ours writes (a worker must fail them and keep serving).
GARBAGE_RECORDS: dict[str, bytes] = {
    "bad magic": _record(magic=b"XYZ"),
    "unknown kind": _record(kind=9),
    "more items than fit": _record(n=1 << 30),
    "keys past the record": _record(n=1, body=(0).to_bytes(8, "little")
                                    + (60000).to_bytes(2, "little")),
    "all ones": b"\xff" * TASK_RECORD_BYTES,
}


@dataclass
class TaskAttack:
    """What task records with block ids past the buffer got (see :func:`task_attacks`)."""

    backend: str = ""
    inside: dict[int, int] = field(default_factory=dict)  # task -> errno, inside the buffer
    loaded_right: bool = False  # the in-buffer load brought back the stored bytes
    past_stores: dict[int, int] = field(default_factory=dict)  # task -> errno
    past_loads: dict[int, int] = field(default_factory=dict)
    files_at_past_keys: list[str] = field(default_factory=list)
    temps: list[str] = field(default_factory=list)
    attached: str | None = None  # who the service said is attached, after the attacks
    garbage_failed: int = 0  # garbage records the workers failed (DONE, EINVAL)
    after_garbage: dict[int, int] = field(default_factory=dict)  # a store after them

    @property
    def sent(self) -> int:
        return len(PAST) * 2 + len(GARBAGE_RECORDS)

    @property
    def wrong(self) -> int:
        """Blocks served or written wrongly: a task past the buffer that did not fail
        with EINVAL, a file published for one, an in-buffer round trip that failed."""
        refused = [e == errno.EINVAL for e in (*self.past_stores.values(),
                                                *self.past_loads.values())]
        return (len(PAST) * 2 - sum(refused) + len(self.files_at_past_keys)
                + (not self.loaded_right or any(self.inside.values()))
                + (self.after_garbage != {30: 0}))


def task_attacks(path: str) -> TaskAttack:
    """Attach by hand, store and load a block inside the buffer, then send store and
    load tasks for every block id in :data:`PAST`; detach."""
    from reliability_kit import temp_files

    out = TaskAttack()
    raw = RawEngine()
    try:
        raw.attach(path)
        out.backend = raw.io.get("backend", "")
        mapper = raw.mapper()
        keys = keys_for(1 + len(PAST), f"raw-{os.getpid()}")
        raw.buf.view[0] = 0x5A
        raw.submit(TaskKind.STORE, 1, keys[:1], [0])
        out.inside.update(raw.results({1}))
        raw.submit(TaskKind.LOAD, 2, keys[:1], [1])
        out.inside.update(raw.results({2}))
        out.loaded_right = bytes(raw.buf.view[1]) == b"\x5a" * raw.buf.block_bytes
        raw.submit(TaskKind.STORE, 10, keys[1:], list(PAST))
        out.past_stores = raw.results(set(range(10, 10 + len(PAST))))
        raw.submit(TaskKind.LOAD, 20, [keys[0]] * len(PAST), list(PAST))
        out.past_loads = raw.results(set(range(20, 20 + len(PAST))))
        out.files_at_past_keys = [mapper.path_for(k) for k in keys[1:]
                                  if os.path.lexists(mapper.path_for(k))]
        out.temps = temp_files(mapper.blocks_dir) if os.path.isdir(mapper.blocks_dir) else []
        out.attached = status(path).get("attached")
        queue = raw.channels.queues[TaskKind.STORE]
        for record in GARBAGE_RECORDS.values():
            queue.put_records(record)
        queue.flush()
        out.garbage_failed = raw.garbage_failed(len(GARBAGE_RECORDS))
        raw.submit(TaskKind.STORE, 30, keys[:1], [0])  # the workers still serve
        out.after_garbage = raw.results({30})
        raw.hang_up(path)
    finally:
        raw.close()
    return out


def blocking_after_attach(path: str, wait_s: float) -> dict[int, int]:
    """Attach by hand, then clear O_NONBLOCK on the queue and doorbell descriptors the
    service was sent (a descriptor passed over a socket shares its file description
    with the sender), wait ``wait_s`` (a few heartbeats of idle workers), store one
    block: ``{task_id: errno}`` of that store ({} if it never finished)."""
    raw = RawEngine()
    try:
        raw.attach(path)
        for queue in raw.channels.queues.values():
            os.set_blocking(queue.read_fd, True)
        os.set_blocking(raw.channels.doorbell[0], True)
        time.sleep(wait_s)
        raw.submit(TaskKind.STORE, 1, keys_for(1, f"blocking-{os.getpid()}"), [0])
        done = raw.results({1})
        raw.hang_up(path)
        return done
    finally:
        raw.close()

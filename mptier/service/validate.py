"""What a client of ``mptier serve`` sends, checked before the service acts on it.

An engine attaching to a service is not trusted: the service's workers write block files
under the service's root with the service's rights and map whatever buffer the engine
hands them. So every message is checked here, in one place, before any I/O::

    datagram ─▶ receive(): whole (not cut short), JSON, an object, a known "op"
    attach   ─▶ attach():  field types and ranges; layout fields by the rules of a local
                           configuration (TierConfig.layout_from: one rule, not two);
                           descriptors: how many, and of which kind (pipes for the
                           channels, regular files -- shm objects, memfds -- for the
                           buffer, opened for reading and writing); the buffer's geometry
                           against the files it is made of (fstat: mapping.check_segments);
                           the channel pipes opened afresh, so their modes are the
                           service's own (the engine cannot clear O_NONBLOCK under it)

A message that fails raises :class:`Malformed` naming what was wrong; the service closes
that client and goes on. The task records an engine writes into its queues later are
not checked here: the native layer refuses any block outside the buffer the worker
mapped (its own mapping's length, which these checks make trustworthy).
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import struct
from typing import Any

from mptier import messages
from mptier.config import TierConfig
from mptier.errors import ConfigError, MptierError
from mptier.jobs import TaskKind
from mptier.mapping import Segment, check_segments
from mptier.workers import Session

# Linux's largest pid (PID_MAX_LIMIT on 64-bit: 2^22).
PID_MAX = 1 << 22
# Longest label an engine may give itself: it goes into logs and the status figures.
MAX_LABEL_CHARS = 200
# Largest block: vLLM's blocks are 256 KiB to 8 MiB; a block costs each worker that
# much private memory when loads go through a bounce buffer (workers/bounce.py), so an
# engine must not name any size it likes.
MAX_BLOCK_BYTES = 1 << 30
# Longest buffer path an engine may name (only used in messages).
MAX_PATH_CHARS = 4096
# Descriptors of the fixed channels, in the order the engine sends them: one queue per
# task kind, the completion pipe, the lifeline, the doorbell's two ends.
N_CHANNELS = len(TaskKind) + 4
SEGMENT_FIELDS = frozenset({"file_offset", "length", "buffer_offset", "path"})
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Malformed(MptierError, ValueError):
    """A message the service refuses; the client that sent it is closed."""


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end (SO_PEERCRED), 0 if unknown."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return 0
    return _UCRED.unpack(raw)[0]


def receive(sock: socket.socket, ops: frozenset[str], carry_fds: frozenset[str] = frozenset()
            ) -> tuple[dict[str, Any], list[int]] | None:
    """One message, as :func:`mptier.messages.receive`, that is a JSON object whose
    ``op`` is one of ``ops`` (only those in ``carry_fds`` may come with descriptors);
    ``None`` at end of file. Raises :class:`Malformed` (its descriptors closed)
    otherwise, ``BlockingIOError`` / ``TimeoutError`` / ``OSError`` as the socket does."""
    try:
        got = messages.receive(sock)
    except ValueError as exc:
        raise Malformed(str(exc)) from None
    if got is None:
        return None
    message, fds = got
    if not isinstance(message, dict):
        messages.close_all(fds)
        raise Malformed(f"a message must be a JSON object with an \"op\", got "
                        f"{type(message).__name__} {short(message)}")
    op = message.get("op")
    if not isinstance(op, str) or op not in ops:
        messages.close_all(fds)
        raise Malformed(f"op = {short(op)} is not a request this service takes "
                        f"({', '.join(sorted(ops))})")
    if fds and op not in carry_fds:
        messages.close_all(fds)
        raise Malformed(f"a {op!r} request came with {len(fds)} descriptor(s); it carries "
                        "none")
    return message, fds


def attach(message: dict[str, Any], fds: list[int]) -> Session:
    """The engine's :class:`Session` from its attach message, every field and
    descriptor checked (see the module docstring). The descriptors become the
    session's; on :class:`Malformed` the caller still owns (and closes) them."""
    try:
        return _attach(message, fds)
    except Malformed:
        raise
    except Exception as exc:  # a check that did not foresee this value: still refused
        raise Malformed(f"attach could not be read ({type(exc).__name__}: {exc})") from None


def _attach(message: dict[str, Any], fds: list[int]) -> Session:
    segments = message.get("segments")
    if not isinstance(segments, list) or not 1 <= len(segments) <= (
            messages.MAX_MESSAGE_FDS - N_CHANNELS):
        raise Malformed(f"segments = {short(segments)}: expected a list of 1 to "
                        f"{messages.MAX_MESSAGE_FDS - N_CHANNELS} buffer segments")
    if len(fds) != N_CHANNELS + len(segments):
        raise Malformed(f"{len(fds)} descriptors came with {len(segments)} buffer "
                        f"segment(s); expected {N_CHANNELS + len(segments)} ({N_CHANNELS} "
                        "channels, then one per segment)")
    engine_pid = _int(message, "engine_pid", 1, PID_MAX)
    block_bytes = _int(message, "block_bytes", 1, MAX_BLOCK_BYTES)
    nbytes = _int(message, "nbytes", block_bytes, 1 << 62)
    label = message.get("label", "")
    if not isinstance(label, str) or len(label) > MAX_LABEL_CHARS or not label.isprintable():
        raise Malformed(f"label = {short(label)}: expected printable text of at most "
                        f"{MAX_LABEL_CHARS} characters")
    try:
        layout = TierConfig.layout_from(message.get("layout"))
    except ConfigError as exc:
        raise Malformed(f"layout: {exc}") from None
    kinds = list(TaskKind)
    queues = fds[:len(kinds)]
    completion, lifeline, bell_r, bell_w = fds[len(kinds):N_CHANNELS]
    for name, fd, mode in [*((f"the {k.name.lower()} queue", fd, "r")
                             for k, fd in zip(kinds, queues)),
                           ("the completion pipe", completion, "w"),
                           ("the lifeline", lifeline, "r"),
                           ("the doorbell's read end", bell_r, "r"),
                           ("the doorbell's write end", bell_w, "w")]:
        _check_pipe(name, fd, mode, nonblocking=name != "the completion pipe"
                    and name != "the lifeline")
    made = [_segment(i, seg, fd) for i, (seg, fd) in
            enumerate(zip(segments, fds[N_CHANNELS:]))]
    try:
        check_segments(made, nbytes)
    except (ValueError, OSError) as exc:
        raise Malformed(f"buffer: {exc}") from None
    own = _own_channels(fds[:N_CHANNELS])
    messages.close_all(fds[:N_CHANNELS])  # ours now: own's copies replace them
    queues = own[:len(kinds)]
    completion, lifeline, bell_r, bell_w = own[len(kinds):]
    return Session(queues=dict(zip(kinds, queues)), completion=completion,
                   lifeline=lifeline, doorbell=(bell_r, bell_w), segments=made,
                   nbytes=nbytes, block_bytes=block_bytes, layout=layout,
                   engine_pid=engine_pid, label=label)


def _own_channels(fds: list[int]) -> list[int]:
    """Each channel pipe opened afresh (``/proc/self/fd/N``), with the mode it came
    with. A descriptor passed over a socket shares its open file description with the
    sender, who could clear O_NONBLOCK on it after the checks: a worker's read of an
    empty queue, or the supervisor's drain of one, would then wait for ever. A pipe
    opened again has a file description of the service's own. Raises
    :class:`Malformed` (nothing left open) if one cannot be opened."""
    out: list[int] = []
    try:
        for fd in fds:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            access = flags & os.O_ACCMODE
            # O_NONBLOCK for the open itself: opening a FIFO end never waits for its peer.
            new = os.open(f"/proc/self/fd/{fd}", access | os.O_NONBLOCK | os.O_CLOEXEC)
            out.append(new)
            if not flags & os.O_NONBLOCK:
                os.set_blocking(new, True)
    except OSError as exc:
        messages.close_all(out)
        raise Malformed(f"a channel pipe could not be opened again ({exc})") from None
    return out


def _segment(i: int, seg: Any, fd: int) -> Segment:
    if not isinstance(seg, dict) or set(seg) != SEGMENT_FIELDS:
        raise Malformed(f"segments[{i}] = {short(seg)}: expected a table of exactly "
                        f"{', '.join(sorted(SEGMENT_FIELDS))}")
    path = seg["path"]
    if not isinstance(path, str) or len(path) > MAX_PATH_CHARS:
        raise Malformed(f"segments[{i}].path = {short(path)}: expected a string of at "
                        f"most {MAX_PATH_CHARS} characters")
    st = _fstat(f"segments[{i}]", fd)
    if not stat.S_ISREG(st.st_mode):
        raise Malformed(f"segments[{i}] came with a descriptor of a {_kind(st.st_mode)}; a "
                        "buffer is made of regular files (shm objects, memfds, files)")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise Malformed(f"segments[{i}] came with a descriptor not open for reading and "
                        "writing: workers store from the buffer and load into it")
    return Segment(fd=fd, path=path, **{k: _int(seg, k, 0, 1 << 62, f"segments[{i}].")
                                        for k in ("file_offset", "length", "buffer_offset")})


def _check_pipe(name: str, fd: int, mode: str, nonblocking: bool) -> None:
    st = _fstat(name, fd)
    if not stat.S_ISFIFO(st.st_mode):
        raise Malformed(f"{name} came with a descriptor of a {_kind(st.st_mode)}; "
                        "expected a pipe")
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    access = flags & os.O_ACCMODE
    if access not in ((os.O_RDONLY, os.O_RDWR) if mode == "r" else (os.O_WRONLY, os.O_RDWR)):
        raise Malformed(f"{name} came with a pipe end not open for "
                        f"{'reading' if mode == 'r' else 'writing'}")
    if nonblocking and not flags & os.O_NONBLOCK:
        raise Malformed(f"{name} is a blocking pipe end: workers read and ring it without "
                        "waiting (set O_NONBLOCK)")


def _fstat(name: str, fd: int) -> os.stat_result:
    try:
        return os.fstat(fd)
    except OSError as exc:
        raise Malformed(f"{name}: its descriptor cannot be examined ({exc})") from None


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "directory"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISFIFO, "pipe"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISREG, "regular file")):
        if test(mode):
            return kind
    return f"file of mode {mode:o}"


def _int(table: dict[str, Any], key: str, low: int, high: int, where: str = "") -> int:
    value = table.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise Malformed(f"{where}{key} = {short(value)}: expected a whole number from "
                        f"{low} to {high}")
    return value


def short(value: Any) -> str:
    """``repr(value)``, cut to 80 characters (for messages and logs)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

"""Control messages between the supervisor and one worker process.

Each worker has a ``SOCK_SEQPACKET`` socketpair with its supervisor: one message per
datagram (a small JSON object with an ``op``), descriptors alongside it (``SCM_RIGHTS``)
when a session is handed over. The supervisor may live in the engine (a thread) or in a
``mptier serve`` process; either way the worker talks only to it::

    worker                               supervisor
      ready / boot_failed  ───────────▶    (after start; boot_failed then exit 3)
      ◀─────────────────── attach + fds     an engine's queues, pipes and buffer
      attached / attach_failed ───────▶
      ◀─────────────────── ping             heartbeat while idle
      pong ───────────────────────────▶
      detached ───────────────────────▶    the engine closed its lifeline, or:
      ◀─────────────────── detach           the supervisor ends the session
      ◀─────────────────── exit             leave (after detaching)
      leaving ────────────────────────▶    a planned exit: never counted as a crash

End of file on the socket means the other side is gone: a worker then leaves; the
supervisor learns the exit from the worker's pidfd.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from typing import Any

# A worker that cannot boot exits with this code after saying boot_failed, so a boot
# failure is told apart from a death even if the message was lost.
EXIT_BOOT_FAILED = 3
# Largest control message: a session description is well under this.
MAX_CONTROL_BYTES = 1 << 16
# Most descriptors one message carries: queues, pipes, and the buffer's segments.
MAX_CONTROL_FDS = 64

READY = "ready"
BOOT_FAILED = "boot_failed"
ATTACH = "attach"
ATTACHED = "attached"
ATTACH_FAILED = "attach_failed"
DETACH = "detach"
DETACHED = "detached"
EXIT = "exit"
LEAVING = "leaving"
PING = "ping"
PONG = "pong"


def control_pair() -> tuple[socket.socket, socket.socket]:
    """``(supervisor_end, worker_end)``, both close-on-exec (the worker's end is passed
    to its process explicitly)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send(sock: socket.socket, op: str, fds: list[int] | tuple[int, ...] = (),
         **fields: Any) -> None:
    """Send one message (blocking only while the socket buffer is full, which a
    handful of small messages never fill). Raises ``OSError`` if the peer is gone."""
    data = json.dumps({"op": op, **fields}).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One message and the descriptors that came with it (close-on-exec), or ``None``
    at end of file. Blocks unless the socket is non-blocking (then raises
    ``BlockingIOError`` when nothing is waiting)."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_CONTROL_BYTES, MAX_CONTROL_FDS,
                                      socket.MSG_CMSG_CLOEXEC)
    if not data:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        return None
    return json.loads(data), fds

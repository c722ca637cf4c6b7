"""Small JSON messages with descriptors attached, over ``SOCK_SEQPACKET`` Unix sockets.

One message per datagram (the socket keeps the boundaries), a JSON object with an
``op``, and any descriptors alongside it (``SCM_RIGHTS``). Used between the supervisor
and each worker (:mod:`mptier.workers.protocol`) and between an engine and a
``mptier serve`` service (:mod:`mptier.service`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from typing import Any

# Largest message: a session description is well under this.
MAX_MESSAGE_BYTES = 1 << 16
# Most descriptors one message carries: queues, pipes, and the buffer's segments.
MAX_MESSAGE_FDS = 64


def send(sock: socket.socket, op: str, fds: list[int] | tuple[int, ...] = (),
         **fields: Any) -> None:
    """Send one message. Blocks only while the socket buffer is full (a handful of small
    messages never fill it) or as the socket's timeout allows. Raises ``OSError`` if the
    peer is gone."""
    data = json.dumps({"op": op, **fields}).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One message and the descriptors that came with it (close-on-exec, the caller's
    to close), or ``None`` at end of file. Blocks unless the socket is non-blocking (then
    raises ``BlockingIOError`` when nothing waits) or has a timeout (``TimeoutError``)."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, MAX_MESSAGE_FDS,
                                      socket.MSG_CMSG_CLOEXEC)
    if not data:
        close_all(fds)
        return None
    try:
        message = json.loads(data)
    except ValueError:
        close_all(fds)
        raise
    return message, fds


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)

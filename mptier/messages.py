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

# Largest datagram on a service socket: a session description is well under this.
MAX_DATAGRAM_BYTES = 1 << 16
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
    to close), or ``None`` at end of file. Raises ``ValueError`` (descriptors closed) for
    a datagram that is not JSON or was cut short (too long, too many descriptors). Blocks
    unless the socket is non-blocking (then raises ``BlockingIOError`` when nothing
    waits) or has a timeout (``TimeoutError``)."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_DATAGRAM_BYTES, MAX_MESSAGE_FDS,
                                          socket.MSG_CMSG_CLOEXEC)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        # Cut short: what arrived is not the message that was sent (the kernel dropped
        # the rest, and any descriptors past MAX_MESSAGE_FDS).
        close_all(fds)
        raise ValueError(f"a message longer than {MAX_DATAGRAM_BYTES} bytes or with more "
                         f"than {MAX_MESSAGE_FDS} descriptors")
    if not data:
        close_all(fds)
        return None
    try:
        message = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        close_all(fds)
        raise ValueError(f"a message that is not JSON: {exc}") from None
    return message, fds


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)

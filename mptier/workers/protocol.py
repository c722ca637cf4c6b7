"""Control messages between the supervisor and one worker process.

Each worker has a ``SOCK_SEQPACKET`` socketpair with its supervisor: one message per
datagram (:mod:`mptier.messages`: a small JSON object, with descriptors alongside it
when a session is handed over). The supervisor may live in the engine (a thread) or in a
``mptier serve`` process; either way the worker talks only to it::

    worker                               supervisor
      ready / boot_failed  ───────────▶    (after start; boot_failed then exit 3)
      ◀─────────────────── attach + fds     an engine's queues, pipes and buffer
      attached / attach_failed ───────▶    (both echo the attach's session id)
      ◀─────────────────── ping             heartbeat while idle
      pong ───────────────────────────▶
      ◀─────────────────── caretake         look after these roots (while serving)
      root_health ────────────────────▶    a root answered, or failed (errno)
      root_probe ─────────────────────▶    about to probe a root out of rotation
      detached ───────────────────────▶    the engine closed its lifeline, or:
      ◀─────────────────── detach           the supervisor ends the session
      ◀─────────────────── exit             leave (after detaching)
      leaving ────────────────────────▶    a planned exit: never counted as a crash

An answer to an attach carries the session id the attach named: a worker still opening
an ended session's buffer answers after the next session began, and its failure is that
session's, not the new one's.

End of file on the socket means the other side is gone: a worker then leaves; the
supervisor learns the exit from the worker's pidfd.
"""

from __future__ import annotations

import socket

from mptier.messages import receive, send

__all__ = ["receive", "send"]

# A worker that cannot boot exits with this code after saying boot_failed, so a boot
# failure is told apart from a death even if the message was lost.
EXIT_BOOT_FAILED = 3

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
CARETAKE = "caretake"
ROOT_HEALTH = "root_health"
ROOT_PROBE = "root_probe"


def control_pair() -> tuple[socket.socket, socket.socket]:
    """``(supervisor_end, worker_end)``, both close-on-exec (the worker's end is passed
    to its process explicitly)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

"""One thread, a bounded number of clients: the loop behind the status socket and the
Prometheus endpoint.

::

    clients ──connect──▶ listener ─┐   ClientLoop.serve() (the endpoint's one thread)
                                   ├─▶ epoll: listener, stop pipe, every client
    operator ◀── reply, close ─────┘     accept: refuse past MAX_CLIENTS, past the
                                         descriptor reserve, or a peer admit() refuses
                                         read until respond() has a reply, send, close
                                         close any client older than its timeout

A monitoring endpoint lives inside an engine or a service, whose worker pool needs
descriptors to replace a dead worker. Whatever its clients do, the loop holds at most
``max_clients`` of them (each at most ``timeout_s``), never takes a descriptor when fewer
than :data:`FD_RESERVE` are left under ``RLIMIT_NOFILE``, and never starts a thread.
``respond`` runs on the loop's thread: a status or scrape takes milliseconds.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("mptier.monitor")

# Clients served at once; one more is accepted and closed at once. Operators and a
# Prometheus scraper need one or two; a handful of dashboards fit well within this.
MAX_CLIENTS = 16
# A client must send its request and take its reply within this long, or it is closed
# (idle, or sending a byte a minute): a few seconds is ample on one host or a LAN.
CLIENT_TIMEOUT_S = 2.0
# Descriptors always left free for the process's real work (the pool replacing a worker
# takes pidfds, pipes and socket pairs, ~10 each; the engine opens files): when fewer
# than this remain under the soft RLIMIT_NOFILE, new clients are closed at once.
FD_RESERVE = 64
# How long the loop rests after accept() failed for want of descriptors (EMFILE): the
# pending client stays queued in the kernel, and a busy retry would spin.
ACCEPT_BACKOFF_S = 0.1
# Clients accepted per wake-up before the others are looked at again.
ACCEPTS_PER_ROUND = 64
RECV_BYTES = 1 << 16

Responder = Callable[[bytes], "bytes | None"]  # request so far -> reply, or None: more
Admitter = Callable[[socket.socket], str]      # "" to serve the client, else why not


@dataclass
class _Client:
    sock: socket.socket
    deadline: float
    request: bytes = b""
    reply: bytes | None = None
    sent: int = 0
    mask: int = selectors.EVENT_READ


def descriptors_left() -> int:
    """Descriptors this process may still open under its soft ``RLIMIT_NOFILE``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    try:
        in_use = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    except OSError:
        return soft
    return soft - in_use


class ClientLoop:
    """Serve ``listener`` (non-blocking) until ``stop_fd`` is readable (see module
    docstring). ``respond(request)`` returns the reply to send, or ``None`` while the
    request is incomplete (it must reply once the request passes its own size limit).
    ``admit(sock)`` (optional) vets a new client before a byte is read from it.
    Counters: ``served``, ``refused`` (peer not admitted), ``turned_away`` (full, or
    descriptors low), ``timed_out``."""

    def __init__(self, listener: socket.socket, respond: Responder, *, name: str,
                 admit: Admitter | None = None, max_clients: int = MAX_CLIENTS,
                 timeout_s: float = CLIENT_TIMEOUT_S, fd_reserve: int = FD_RESERVE
                 ) -> None:
        self._listener = listener
        self._respond = respond
        self._admit = admit
        self.name = name
        self.max_clients = max_clients
        self.timeout_s = timeout_s
        self.fd_reserve = fd_reserve
        self._clients: dict[int, _Client] = {}
        self.served = self.refused = self.turned_away = self.timed_out = 0
        # Made here, by whoever builds the endpoint, not by its thread: a thread that
        # starts once the process is out of descriptors must not die for want of one
        # (its listener would close, and the freed descriptor hide the shortage).
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "accept")

    def serve(self, stop_fd: int) -> None:
        """The loop; returns when ``stop_fd`` is readable, having closed every client
        and the selector (the listener is the caller's)."""
        selector = self._selector
        try:
            selector.register(stop_fd, selectors.EVENT_READ, "stop")
            self._loop(selector)
        finally:
            for client in list(self._clients.values()):
                self._close(selector, client)
            selector.close()

    def _loop(self, selector: selectors.BaseSelector) -> None:
        while True:
            timeout = None
            if self._clients:
                soonest = min(c.deadline for c in self._clients.values())
                timeout = max(0.0, soonest - time.monotonic())
            for key, mask in selector.select(timeout):
                if key.data == "stop":
                    return
                if key.data == "accept":
                    self._accept(selector)
                else:
                    self._service(selector, key.data, mask)
            now = time.monotonic()
            for client in [c for c in self._clients.values() if c.deadline <= now]:
                self.timed_out += 1
                self._close(selector, client)

    def _accept(self, selector: selectors.BaseSelector) -> None:
        for _ in range(ACCEPTS_PER_ROUND):
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("mptier %s: accept failed (%s); clients wait", self.name,
                                exc.strerror)
                    time.sleep(ACCEPT_BACKOFF_S)
                    return
                raise
            if len(self._clients) >= self.max_clients or \
                    descriptors_left() < self.fd_reserve:
                self.turned_away += 1  # closed at once: nothing held for it
                conn.close()
                continue
            problem = ""
            if self._admit is not None:
                try:
                    problem = self._admit(conn)
                except OSError as exc:
                    problem = f"its credentials cannot be read ({exc.strerror})"
            if problem:
                self.refused += 1
                log.warning("mptier %s: refused a client: %s", self.name, problem)
                conn.close()
                continue
            conn.setblocking(False)
            client = _Client(conn, time.monotonic() + self.timeout_s)
            self._clients[conn.fileno()] = client
            selector.register(conn, selectors.EVENT_READ, client)

    def _service(self, selector: selectors.BaseSelector, client: _Client, mask: int) -> None:
        try:
            if client.reply is None and mask & selectors.EVENT_READ:
                data = client.sock.recv(RECV_BYTES)
                if not data:
                    self._close(selector, client)
                    return
                client.request += data
                reply = self._respond(client.request)
                if reply is None:
                    return
                client.reply = reply
                self.served += 1
            if client.reply is not None:
                client.sent += client.sock.send(client.reply[client.sent:])
                if client.sent >= len(client.reply):
                    self._close(selector, client)
                elif client.mask != selectors.EVENT_WRITE:
                    client.mask = selectors.EVENT_WRITE
                    selector.modify(client.sock, selectors.EVENT_WRITE, client)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the client went away
            self._close(selector, client)
        except Exception:  # one bad request must not end the endpoint
            log.debug("mptier %s: request failed", self.name, exc_info=True)
            self._close(selector, client)

    def _close(self, selector: selectors.BaseSelector, client: _Client) -> None:
        self._clients.pop(client.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(client.sock)
        client.sock.close()

    @property
    def clients(self) -> int:
        return len(self._clients)

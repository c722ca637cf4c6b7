"""``mptier serve``: the worker pool as a long-lived service that engines attach to.

::

    engine process                         service process (mptier serve --name NAME)
    ┌────────────────────────────┐         ┌─────────────────────────────────────────┐
    │ FileSystemTier(service=)   │ attach  │ main thread: accept on <run>/NAME.sock, │
    │  its queues, pipes, buffer │─ + fds ▶│   one engine at a time; status replies  │
    │  ServiceLink thread:       │◀ ctrl ──│ WorkerPool: supervisor thread + workers │
    │   status every second,     │  block  │   that map the engine's own buffer      │
    │   notices the service die  │═ link ══│ end of the link = the engine is gone:   │
    └────────────────────────────┘         │   workers detach, stay up, next engine  │
                                           └─────────────────────────────────────────┘

The root and the I/O settings come from the service's configuration; the file layout
comes from each engine. The service creates nothing in /dev/shm (its control block is a
memfd; the buffer is the engine's). SIGTERM or SIGINT: in-flight copies finish, workers
leave, the socket is removed, exit 0.

Trust (docs/security.md): the run folder is checked before the name's lock and socket are
made in it (through its descriptor, never a symlink); every accepted connection's
credentials (``SO_PEERCRED``) must be the service's uid, root or a ``service_group``
member, else it is closed unread and the refusal logged with the peer's uid and pid.

Blocking: the main thread blocks in ``poll()`` on the listening socket, the attached
engine's link and a signal pipe; an attach blocks it until the workers have taken the
session (bounded by ``worker_start_timeout_s``).

Long because the service's accept loop, the attach handshake (descriptors over the
socket, checks of what the engine sends) and the status replies share one engine-at-a-
time state.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import signal
import socket
import time
from dataclasses import asdict
from typing import Any

from mptier import messages
from mptier.config import SERVICE_FIELDS, TierConfig
from mptier.errors import MptierError
from mptier.rundir import (
    Trust,
    UntrustedError,
    open_folder,
    open_lock,
    peer_of,
    remove_own_socket,
)
from mptier.service import validate
from mptier.service.names import LOCK_SUFFIX, SOCKET_SUFFIX, socket_path
from mptier.workers import PoolSettings, WorkerPool

log = logging.getLogger("mptier.service")

# Version of what an engine and its service share -- the messages, and the layout of the
# control block the engine maps (mptier.workers.control); an engine of another version
# is refused. 2: the task records and completion messages the two exchange are
# mptier.jobs' WIRE_VERSION 3 (messages carry the task's outcome). 3: a slot's per-root
# store record became one want_free word (the offsets after it moved).
PROTOCOL_VERSION = 3
# A client must send its first message within this time, or it is dropped.
FIRST_MESSAGE_S = 5.0
# Pending connections the kernel queues while the service attaches an engine.
LISTEN_BACKLOG = 8

ATTACH = "attach"
STATUS = "status"
DETACH = "detach"
DETACHED = "detached"


class Service:
    """A running service. :meth:`run` blocks until a stop signal; see module docstring."""

    def __init__(self, name: str, config: TierConfig) -> None:
        if not config.roots():
            raise MptierError("mptier serve needs root_dir (in --config, or --set "
                              "root_dir=/mnt/kv): the folder the block files go into")
        self.name = name
        self.config = config
        # Who may attach and ask for status: our uid, root, and service_group's members.
        self.trust = Trust.of(group=config.service_group)
        self.path = socket_path(name, create=True, trust=self.trust)
        self._folder_fd = -1  # the checked run folder: every entry is reached through it
        self._lock_fd = -1
        self._listener: socket.socket | None = None
        self._pool: WorkerPool | None = None
        self._link: socket.socket | None = None
        self._engine = ""  # who is attached ("engine pid 1234")
        self._engine_pid = 0
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stopping = False
        self.attaches = 0

    # -- life ----------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (or :meth:`request_stop`). Returns the exit code."""
        with contextlib.ExitStack() as stack:
            stack.callback(self._close)
            self._claim_name()
            self._pool = WorkerPool(PoolSettings.from_config(self.config), in_engine=False)
            self._pool.start()
            self._listen()
            self._start_monitoring(stack)
            previous = {sig: signal.signal(sig, self._on_signal)
                        for sig in (signal.SIGTERM, signal.SIGINT)}
            stack.callback(lambda: [signal.signal(s, h) for s, h in previous.items()])
            log.info("mptier service %r ready on %s: %d+%d workers, root %s", self.name,
                     self.path, self.config.n_load_workers, self.config.n_store_workers,
                     ", ".join(self.config.roots()))
            print(f"mptier service {self.name!r} listening on {self.path}", flush=True)
            self._loop()
        return 0

    def _start_monitoring(self, stack: contextlib.ExitStack) -> None:
        """The status endpoint (``mptier status --name NAME``) and, with
        ``metrics_port``, Prometheus metrics: the same figures as an in-engine tier's."""
        from mptier.monitor import Monitor, start_endpoint, start_metrics_server

        monitor = Monitor(self.figures, name=self.name, kind="service")
        stack.callback(start_endpoint(self.name, monitor.figures, kind="service",
                                      trust=self.trust).close)
        if self.config.metrics_port:
            server = start_metrics_server(monitor, self.config.metrics_port,
                                          self.config.metrics_addr)
            stack.callback(server.close)
            log.info("mptier service %r: metrics on http://%s:%d/metrics", self.name,
                     self.config.metrics_addr, self.config.metrics_port)

    def request_stop(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.request_stop()

    def _claim_name(self) -> None:
        """One service per name: hold the name's lock for life; a socket left by a
        service that died is removed only once its lock is ours, and only if it is a
        socket of our uid (anything else there is refused, naming it). Every entry is
        reached through the checked folder's descriptor, never through a symlink."""
        folder = os.path.dirname(self.path)
        self._folder_fd = open_folder(folder, self.trust)
        lock = self.name + LOCK_SUFFIX
        try:
            fd = open_lock(self._folder_fd, lock)
        except UntrustedError as exc:
            raise UntrustedError(f"mptier service {self.name!r}: {exc} (in {folder})"
                                 ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise MptierError(f"another mptier service named {self.name!r} is running "
                              f"(it holds {os.path.join(folder, lock)}); pick another "
                              "--name") from None
        self._lock_fd = fd
        remove_own_socket(self._folder_fd, self.name + SOCKET_SUFFIX)

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            listener.bind(self.path)  # in the checked folder, which nobody else writes
            sock_name = self.name + SOCKET_SUFFIX
            if self.trust.gid is not None:  # the group's members may connect
                os.chown(sock_name, -1, self.trust.gid, dir_fd=self._folder_fd,
                         follow_symlinks=False)
                os.chmod(sock_name, 0o660, dir_fd=self._folder_fd)
            else:
                os.chmod(sock_name, 0o600, dir_fd=self._folder_fd)
            listener.listen(LISTEN_BACKLOG)
        except BaseException:
            listener.close()
            raise
        self._listener = listener

    def _close(self) -> None:
        """Stop everything: in-flight copies finish, workers leave, socket removed."""
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.name + SOCKET_SUFFIX, dir_fd=self._folder_fd)
            self._listener = None
        if self._pool is not None:
            if self._link is not None:
                self._pool.end_session(ask_workers=True)
            self._drop_link()
            forced = self._pool.stop()
            if forced:
                log.warning("mptier service %r: %s", self.name, "; ".join(forced))
            self._pool = None
        if self._lock_fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.name + LOCK_SUFFIX, dir_fd=self._folder_fd)
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self._folder_fd >= 0:
            os.close(self._folder_fd)
            self._folder_fd = -1
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        assert self._listener is not None
        while True:
            watched = [self._listener.fileno(), self._stop_r]
            if self._link is not None:
                watched.append(self._link.fileno())
            try:
                readable, _, _ = select.select(watched, [], [], 1.0)
            except InterruptedError:
                continue
            if self._stop_r in readable:
                log.info("mptier service %r stopping", self.name)
                return
            if self._link is not None and self._link.fileno() in readable:
                self._serve_link()
            if self._listener.fileno() in readable:
                self._accept()

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        peer = peer_of(conn)
        if not self.trust.admits(peer):  # before reading a byte of what it sends
            log.warning("mptier service %r refused a connection from %s: only uid %d, "
                        "root%s may attach or ask for status", self.name, peer,
                        os.geteuid(), "" if self.trust.gid is None
                        else f" and group {self.trust.gid} (service_group)")
            conn.close()
            return
        conn.settimeout(FIRST_MESSAGE_S)
        try:
            got = validate.receive(conn, _FIRST_OPS, carry_fds=frozenset({ATTACH}))
        except validate.Malformed as exc:
            self._refuse_malformed(conn, exc)
            return
        except OSError:
            conn.close()
            return
        if got is None:
            conn.close()
            return
        message, fds = got
        op = message["op"]
        if op == ATTACH:
            self._attach(conn, message, fds)
            return
        with contextlib.suppress(OSError):  # a status request (validate: nothing else)
            messages.send(conn, STATUS, ok=True, figures=self.figures())
        conn.close()

    def _refuse_malformed(self, conn: socket.socket, exc: validate.Malformed,
                          op: str = "error") -> None:
        """Close a client that sent a malformed message, saying why (to it, if it still
        listens, and in the log); the service goes on."""
        pid = validate.peer_pid(conn)
        log.warning("mptier service %r: closed a client (%s) that sent a malformed "
                    "message: %s", self.name, f"pid {pid}" if pid else "pid unknown", exc)
        with contextlib.suppress(OSError):
            messages.send(conn, op, ok=False, error=f"malformed message: {exc}")
        conn.close()

    def _attach(self, conn: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
        assert self._pool is not None
        label = f"engine pid {validate.peer_pid(conn) or 'unknown'}"
        session = None
        version = message.get("version")
        if type(version) is not int or version != PROTOCOL_VERSION:  # not True, not 1.0
            refusal = (f"protocol version {validate.short(version)} is not "
                       f"the service's {PROTOCOL_VERSION}: run the same mptier on both sides")
        else:
            # Everything checked before the service acts on any of it (busy or not).
            try:
                session = validate.attach(message, fds)
            except validate.Malformed as exc:
                messages.close_all(fds)
                self._refuse_malformed(conn, exc, ATTACH)
                return
            label = session.label or label
            refusal = "" if self._link is None else (
                f"mptier service {self.name!r} is attached to {self._engine} (pid "
                f"{self._engine_pid}); one engine per service at a time")
        if refusal:
            if session is not None:
                session.close()
            else:
                messages.close_all(fds)
            log.warning("mptier service %r refused %s: %s", self.name, label, refusal)
            with contextlib.suppress(OSError):
                messages.send(conn, ATTACH, ok=False, error=refusal)
            conn.close()
            return
        assert session is not None
        try:
            io = self._pool.attach(session)
        except Exception as exc:  # the engine hears why; the service stays up
            log.error("mptier service %r: attaching %s failed: %s", self.name, label, exc)
            with contextlib.suppress(OSError):
                messages.send(conn, ATTACH, ok=False, error=str(exc))
            conn.close()
            return
        finally:
            session.close()  # the pool keeps copies of its own
        control = self._pool.control
        try:
            messages.send(conn, ATTACH, [control.fd], ok=True, n_slots=control.n_slots,
                          io=io.to_wire(), service=self.name, pid=os.getpid())
        except OSError:  # the engine left already
            self._pool.end_session(ask_workers=True)
            conn.close()
            return
        conn.setblocking(False)
        self._link = conn
        self._engine, self._engine_pid = label, session.engine_pid
        self.attaches += 1
        log.info("mptier service %r: %s attached", self.name, label)

    def _serve_link(self) -> None:
        """A message from the attached engine (a status request) or its end."""
        assert self._link is not None and self._pool is not None
        malformed = None
        try:
            got = validate.receive(self._link, _LINK_OPS)
        except BlockingIOError:
            return
        except validate.Malformed as exc:
            got, malformed = None, exc
        except OSError:
            got = None
        if malformed is not None:  # the engine's session ends as if it had hung up
            log.warning("mptier service %r: closed %s (pid %s) that sent a malformed "
                        "message: %s", self.name, self._engine,
                        validate.peer_pid(self._link) or "unknown", malformed)
        if got is None:
            # The engine is gone: its workers detach by themselves (its lifeline ended).
            # Nobody waits for that, so neither does this loop: a worker hung in the
            # engine's last task must not hold up status replies and the next attach.
            log.info("mptier service %r: %s detached", self.name, self._engine)
            self._pool.end_session(timeout_s=0)
            self._drop_link()
            self._remove_leftovers()
            return
        message, fds = got
        messages.close_all(fds)
        op = message["op"]
        if op == STATUS:
            with contextlib.suppress(OSError):
                messages.send(self._link, STATUS, ok=True, figures=self.figures())
        elif op == DETACH:  # the engine closed its lifeline and waits for its workers
            self._pool.end_session()
            with contextlib.suppress(OSError):
                messages.send(self._link, DETACHED, ok=True)

    def _remove_leftovers(self) -> None:
        """After an engine's end: what a killed one left -- its status socket and lock
        in this run folder, its buffer in /dev/shm -- is removed now, not at the next
        start on the machine. Only objects whose lock is free go (the workers' mapping
        of the buffer stays valid); a few entries of a local folder, quick."""
        from mptier.monitor.endpoint import remove_stale
        from mptier.shm import cleanup_stale

        try:
            remove_stale(os.path.dirname(self.path), trust=self.trust)
            cleanup_stale()
        except OSError as exc:  # best effort: the next start removes them too
            log.warning("mptier service %r: could not remove what %s left: %s", self.name,
                        "the engine", exc)

    def _drop_link(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None
            self._engine, self._engine_pid = "", 0

    # -- figures -------------------------------------------------------------------------

    def figures(self) -> dict[str, Any]:
        """What ``status`` answers: the pool's counters and workers, who is attached."""
        assert self._pool is not None
        stats = self._pool.stats()
        return {"kind": "service", "name": self.name, "pid": os.getpid(),
                "root": ", ".join(self.config.roots()), "attached": self._engine or None,
                "attaches": self.attaches, "time": time.time(),
                "config": {k: v for k, v in asdict(self.config).items()
                           if k in SERVICE_FIELDS}, **stats}


# Requests a new connection may open with, and an attached engine may send.
_FIRST_OPS = frozenset({ATTACH, STATUS})
_LINK_OPS = frozenset({STATUS, DETACH})

def serve(name: str, config: TierConfig) -> int:
    """Run a service in the foreground (``mptier serve``). Returns the exit code."""
    return Service(name, config).run()

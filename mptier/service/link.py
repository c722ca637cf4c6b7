"""The engine's side of a ``mptier serve`` service: :class:`ServiceLink`.

A ``FileSystemTier(buffer, service="NAME")`` spawns no workers. Its :class:`ServiceLink`
connects to ``<run dir>/NAME.sock`` and hands the service the engine's queues, pipes and
buffer (descriptors over the socket), exactly what an in-engine pool would get; the
service's workers map the engine's own memory, and the engine keeps today's API,
completion pipe and ``stats()``. The link is a :class:`mptier.workers.Pool`, like the
pools that run workers in this process, so the tier does not care which it has.

A thread (``mptier-link``) owns the socket: it asks the service for its figures every
:data:`STATUS_INTERVAL_S` (what ``stats()`` shows) and notices at once when the service
goes (end of file). Then, without touching the engine's state, it marks the pool
*unavailable* in the engine's copy of the control block and bumps a message counter:
the scheduler thread, at its next call, fails every job in flight with an error naming
the service (:meth:`settle_lost`), answers lookups MISS and fails new jobs at once. When
the engine has done so, the thread tries to attach again every
:data:`RECONNECT_S` and the tier serves again by itself when the service is back; the
control block of the lost attachment is closed :data:`RETIRE_AFTER_S` later, so restarts
cost nothing that stays.

Trust (docs/security.md): the socket is looked for only in checked run folders, and after
``connect()`` the listener's credentials (``SO_PEERCRED``) must be our uid's, root's or
``service_user``'s before a byte or a descriptor is sent.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from mptier import messages
from mptier.errors import MptierError
from mptier.jobs import TaskKind
from mptier.rundir import RUN_DIR_ENV, Trust, UntrustedError, peer_of, warn_once
from mptier.service.names import locate
from mptier.service.server import ATTACH, DETACH, DETACHED, PROTOCOL_VERSION, STATUS
from mptier.workers import ControlBlock, IoSettings, Pool, PoolState, Session, root_figures

log = logging.getLogger("mptier.service")

# How often the link asks the service for its figures (what stats() shows of the pool).
STATUS_INTERVAL_S = 1.0
# attach() waits at most this long for the service's first figures, so stats() and
# worker_pids() describe the service from the start (a status round trip takes
# milliseconds; a service too busy to answer in time is described a moment later).
FIRST_FIGURES_S = 2.0
# How often a link whose service went away tries to attach again.
RECONNECT_S = 1.0
# How long one attach may take: the service prepares the root and its workers map the
# buffer (a large buffer is prefaulted).
ATTACH_TIMEOUT_S = 120.0
# errno on jobs failed because the service went away.
ERR_SERVICE_GONE = errno.ECONNRESET
# A control block replaced by a re-attach is closed this long after (its descriptors and
# mapping released): a call on the scheduler thread or a stats() reader that picked up
# the old block before the swap uses it for microseconds, far less than this.
RETIRE_AFTER_S = 2.0


class ServiceLink(Pool):
    """The engine's pool stand-in for a service (see module docstring)."""

    mode = "service"

    def __init__(self, name: str, wait_s: float, trust: Trust | None = None) -> None:
        self.name = name
        self._wait_s = wait_s  # how long the constructor waits for a service to appear
        # Whose run folders and listeners are believed (own uid, root, service_user).
        self._trust = trust or Trust.of()
        self.control: ControlBlock | None = None
        self.io: IoSettings | None = None
        # (closed after, block) replaced by a re-attach: the engine may be mid-read
        self._retired: list[tuple[float, ControlBlock]] = []
        self._session: Session | None = None  # our copy, to attach again
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._figures: dict[str, Any] = {}
        self._lost: str | None = None  # why the service is gone, until the engine took it
        self._lost_taken = threading.Event()
        self._stopping = False
        self._detach_requested = False
        self._detached = threading.Event()
        self._figures_arrived = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._run, name="mptier-link", daemon=True)
        self.reattaches = 0

    # -- the pool's methods --------------------------------------------------------------

    def start(self) -> None:
        """Nothing to boot here: the service's workers are up (or it is not running, which
        :meth:`attach` says)."""

    def attach(self, session: Session) -> IoSettings:
        """Attach to the service, waiting up to ``wait_s`` for it to appear. Raises
        ``MptierError`` naming the service when it is not there or refuses."""
        self._session = session.dup()
        deadline = time.monotonic() + self._wait_s
        while True:
            try:
                sock, control, io, _ = self._attach_once()
                break
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError,
                    BrokenPipeError) as exc:
                # Not there yet, or gone while it attached us (a restart): wait for it.
                if time.monotonic() >= deadline:
                    self._session.close()
                    path, refused = locate(self.name, self._trust)
                    skipped = "".join(f"; {r}" for r in refused)
                    raise MptierError(
                        f"no mptier service named {self.name!r} at "
                        f"{path or 'any usable run folder'} ({exc.strerror}){skipped}; "
                        f"start it with `mptier serve --name {self.name}`, or set "
                        f"{RUN_DIR_ENV} to where it runs") from None
                time.sleep(0.2)
            except UntrustedError as exc:
                self._session.close()
                raise MptierError(f"refused to attach to mptier service {self.name!r}: "
                                  f"{exc}") from None
            except OSError as exc:
                self._session.close()
                raise MptierError(f"could not attach to mptier service {self.name!r} at "
                                  f"{locate(self.name, self._trust)[0]}: {exc}") from exc
            except BaseException:
                self._session.close()
                raise
        self._sock, self.control, self.io = sock, control, io
        self._thread.start()  # it asks for the service's figures first thing
        self._figures_arrived.wait(FIRST_FIGURES_S)
        return io

    def _attach_once(self) -> tuple[socket.socket, ControlBlock, IoSettings, dict]:
        assert self._session is not None
        path, _ = locate(self.name, self._trust)  # in checked run folders only
        if not path:
            raise FileNotFoundError(errno.ENOENT, "no run folder to look in")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(ATTACH_TIMEOUT_S)
            sock.connect(path)
            # Before anything of ours crosses: is the listener the service's user?
            peer = peer_of(sock)
            problem = self._trust.listener_problem(peer)
            if problem:
                warn_once(f"refused service socket {path}: {problem}")
                raise UntrustedError(
                    f"the socket {path} is not trusted: {problem}; nothing was sent. "
                    "Remove it, or set service_user if the service runs as that user")
            s = self._session
            fds = [*(s.queues[k] for k in TaskKind), s.completion, s.lifeline, *s.doorbell,
                   *(seg.fd for seg in s.segments)]
            messages.send(sock, ATTACH, fds, version=PROTOCOL_VERSION,
                          engine_pid=s.engine_pid, label=s.label, nbytes=s.nbytes,
                          block_bytes=s.block_bytes, layout=s.layout,
                          segments=[{"file_offset": g.file_offset, "length": g.length,
                                     "buffer_offset": g.buffer_offset, "path": g.path}
                                    for g in s.segments])
            got = messages.receive(sock)
            if got is None:
                raise ConnectionResetError(errno.ECONNRESET, "the service hung up")
            reply, reply_fds = got
            if not reply.get("ok"):
                messages.close_all(reply_fds)
                raise MptierError(f"mptier service {self.name!r} refused to attach: "
                                  f"{reply.get('error')}")
            if len(reply_fds) != 1:
                messages.close_all(reply_fds)
                raise MptierError(f"mptier service {self.name!r} sent {len(reply_fds)} "
                                  "descriptors, expected its control block")
            control = ControlBlock(int(reply["n_slots"]), fd=reply_fds[0])
            sock.setblocking(False)
            return sock, control, IoSettings.from_wire(reply["io"]), reply
        except BaseException:
            sock.close()
            raise

    def settle_lost(self, fail_all: Callable[[str, int], object]) -> None:
        """(Scheduler thread.) Once per loss of the service: ``fail_all(reason, errno)``
        fails every job in flight and everything queued; then the link may attach
        again (nothing of the lost session is queued any more)."""
        lost = self._lost
        if lost is None or self._lost_taken.is_set():
            return
        fail_all(lost, ERR_SERVICE_GONE)
        self._lost_taken.set()
        self._wake()

    def serving(self) -> bool:
        control = self.control
        return control is not None and control.pool_serving()

    def refusal(self) -> tuple[int, str]:
        if self.control is None:
            return ERR_SERVICE_GONE, f"not attached to mptier service {self.name!r}"
        _, err, reason = self.control.pool_state()
        return err, reason

    def news(self) -> tuple[ControlBlock | None, bytes]:
        """The control block and its message counters: a re-attach hands over a new block
        whose counters may by chance equal the old one's last figures, and a new block
        is news."""
        control = self.control
        return control, control.counters_snapshot() if control is not None else b""

    def root_figures(self) -> list[dict[str, Any]]:
        control, io = self.control, self.io
        return root_figures(control, io) if control is not None and io is not None else []

    def end_session(self, ask_workers: bool = False, timeout_s: float = 10.0,
                    on_wait: Callable[[], object] | None = None) -> None:
        """After the engine closed its lifeline: wait (bounded) until the service says its
        workers detached, so no copy into the buffer is still running."""
        if self._sock is None or not self._thread.is_alive():
            return
        self._detach_requested = True
        self._wake()
        deadline = time.monotonic() + timeout_s
        while not self._detached.wait(0.02) and time.monotonic() < deadline:
            if on_wait is not None:
                on_wait()

    def unavailable(self) -> tuple[str, int]:
        if self._lost is not None:
            return self._lost, ERR_SERVICE_GONE
        if self.control is None:
            return "", 0
        state, err, reason = self.control.pool_state()
        return (reason, err) if state != PoolState.SERVING else ("", 0)

    def pids(self) -> list[int]:
        with self._lock:
            return [w["pid"] for w in self._figures.get("workers", []) if w.get("pid")]

    def stats(self) -> dict[str, Any]:
        """The service's last figures (at most :data:`STATUS_INTERVAL_S` old)."""
        with self._lock:
            figures = dict(self._figures)
        reason, _ = self.unavailable()
        return {"mode": self.mode, "service": self.name, "unavailable": reason,
                "reattaches": self.reattaches, "counters": figures.get("counters", {}),
                "workers": figures.get("workers", []),
                "written_bytes": figures.get("written_bytes", 0),
                "skipped_bytes": figures.get("skipped_bytes", 0),
                "service_pid": figures.get("pid"), "service_root": figures.get("root")}

    def stop(self, grace_s: float = 10.0,
             on_wait: Callable[[], object] | None = None) -> list[str]:
        """Hang up (the service's workers detach; the service stays up). Idempotent."""
        if self._stopping:
            return []
        self._stopping = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(5.0)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for _, control in self._retired:
            control.close()
        self._retired.clear()
        if self.control is not None:
            self.control.close()
        if self._session is not None:
            self._session.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        return []

    # -- the thread ----------------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        next_status = 0.0
        while not self._stopping:
            try:
                self._release_retired()
                if self._sock is None:
                    self._reattach()
                    continue
                timeout = max(0.0, next_status - time.monotonic())
                readable, _, _ = select.select([self._sock, self._wake_r], [], [], timeout)
                if self._wake_r in readable:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                if self._stopping:
                    break
                if self._detach_requested:
                    self._detach_requested = False
                    messages.send(self._sock, DETACH)
                if self._sock in readable:
                    self._read()
                if self._sock is not None and time.monotonic() >= next_status:
                    next_status = time.monotonic() + STATUS_INTERVAL_S
                    messages.send(self._sock, STATUS)
            except OSError as exc:
                self._lose(f"its socket failed: {exc}")
            except Exception:  # never let the link die
                log.exception("mptier link to service %r: unexpected error (continuing)",
                              self.name)
                time.sleep(0.1)

    def _release_retired(self, now: float | None = None) -> None:
        """Close the control blocks re-attaches replaced, once nobody can be reading
        them (:data:`RETIRE_AFTER_S`): every re-attach gives back what the last held."""
        now = time.monotonic() if now is None else now
        while self._retired and self._retired[0][0] <= now:
            _, control = self._retired.pop(0)
            control.close()

    def _read(self) -> None:
        assert self._sock is not None
        while True:
            try:
                got = messages.receive(self._sock)
            except BlockingIOError:
                return
            if got is None:
                self._lose("it closed the connection (stopped or died)")
                return
            message, fds = got
            messages.close_all(fds)
            op = message.get("op")
            if op == STATUS and message.get("ok"):
                with self._lock:
                    self._figures = message.get("figures", {})
                self._figures_arrived.set()
            elif op == DETACHED:
                self._detached.set()

    def _lose(self, why: str) -> None:
        if self._sock is None:
            return
        self._sock.close()
        self._sock = None
        self._detached.set()  # nobody is attached any more
        reason = (f"mptier service {self.name!r} went away ({why}); jobs fail until it is "
                  "back, then the tier attaches again by itself")
        log.error("%s", reason)
        self._lost_taken.clear()
        self._lost = reason
        control = self.control
        if control is not None:  # the engine's copy: wake its next call
            control.set_pool_state(PoolState.UNAVAILABLE, ERR_SERVICE_GONE, reason)
            control.bump(control.supervisor_counter)

    def _reattach(self) -> None:
        """Wait until the engine failed what the lost session held, then try to attach
        every RECONNECT_S."""
        if not self._lost_taken.wait(RECONNECT_S) or self._stopping:
            return
        try:
            sock, control, io, _ = self._attach_once()
        except (OSError, MptierError, ValueError) as exc:
            log.debug("mptier link: service %r not back yet: %s", self.name, exc)
            time.sleep(RECONNECT_S)
            return
        old = self.control
        if old is not None:
            self._retired.append((time.monotonic() + RETIRE_AFTER_S, old))
        # Counted before the new control block goes in: whoever sees the tier serve
        # again (its state is the new block's) sees the reattach counted too.
        self.reattaches += 1
        self.control, self.io, self._sock = control, io, sock
        self._lost = None
        self._detached.clear()
        log.warning("mptier: attached again to service %r", self.name)

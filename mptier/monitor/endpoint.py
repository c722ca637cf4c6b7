"""Status endpoints: a Unix socket per tier or service in the run directory.

::

    engine or service process                      operator
    ┌────────────────────────────────────┐         ┌──────────────────────────────┐
    │ scheduler thread: the tier (never  │         │ mptier status / monitor      │
    │   waits for this endpoint)         │         │   discover(): list run dir,  │
    │ mptier-status thread:              │◀─ JSON ─│   connect to each *.status.sock
    │   poll(listener, stop pipe)        │─ JSON ─▶│   query(name): one request,  │
    │   accept, read one line, call the  │         │   one reply, close           │
    │   provider, reply, close           │         └──────────────────────────────┘
    └────────────────────────────────────┘
        <run dir>/<name>.status.sock   the listening socket
        <run dir>/<name>.status.lock   flock held for the endpoint's life

The run directory (:mod:`mptier.rundir`) is ``$MPTIER_RUN_DIR``, else ``/run/mptier`` when
it can be created and written, else ``/tmp/mptier-<uid>``. A service's own socket there is
``<name>.sock``; status sockets end in ``.status.sock`` so the two never mix.

Liveness is proven by a held lock and a socket that accepts, never by a pid (containers
share the run directory across PID namespaces). A server takes ``<name>.status.lock`` with
``flock(LOCK_EX | LOCK_NB)`` before it binds, so a second endpoint of the same name is
refused while the first lives. Discovery connects to each socket; a socket that refuses
the connection is stale only if its lock can be taken -- then, holding that lock, the
stale socket and lock file are removed (no live server can be binding that name
meanwhile, so nothing live is ever unlinked).

Trust (docs/security.md): the run folder is checked before use and every entry in it is
reached through the folder's descriptor, never through a symlink
(:func:`mptier.rundir.open_folder`); the endpoint answers only peers of its own uid,
root, or the configured ``service_group`` (``SO_PEERCRED`` on every accept), and a client
believes only a listener of its own uid, root or ``service_user``. One thread serves at
most :data:`~mptier.monitor.bounded.MAX_CLIENTS` clients at once, each for at most
:data:`CLIENT_TIMEOUT_S` (:mod:`mptier.monitor.bounded`).

Protocol: the client sends one line of JSON, ``{"op": "status"}`` (or ``"ping"``), and
reads one line of JSON back: ``{"ok": true, "name", "pid", "kind", "version",
"figures"}`` (``figures`` only for ``status``), or ``{"ok": false, "error": "..."}``.

Long because both ends of one small protocol live here -- the serving thread and the
clients (query, discover, remove_stale) -- with the run-directory names and the lock
that tell a live endpoint from a stale one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mptier.errors import MptierError
from mptier.locks import still_named, try_flock
from mptier.monitor.bounded import CLIENT_TIMEOUT_S as CLIENT_TIMEOUT_S  # re-exported
from mptier.monitor.bounded import ClientLoop
from mptier.rundir import (
    NAME_RE,
    RUN_DIR_ENV,
    Trust,
    UntrustedError,
    check_folder,
    check_name,
    client_dirs,
    open_folder,
    open_lock,
    peer_of,
    remove_own_socket,
    run_dir,
    warn_once,
)

log = logging.getLogger(__name__)

# Status sockets end in ".status.sock": discovery must never connect to a socket that
# speaks another protocol (a service's attach socket, "<name>.sock", shares the folder).
SOCKET_SUFFIX = ".status.sock"
LOCK_SUFFIX = ".status.lock"
PROTOCOL_VERSION = 1
# A client gets CLIENT_TIMEOUT_S (mptier.monitor.bounded) to send its request and take
# the reply; a stuck client holds one of the endpoint's few client places that long.
# A request is one short JSON line; anything longer is not a client of ours.
MAX_REQUEST_BYTES = 4096
# close() waits this long for the thread; a request in progress may hold it up to
# CLIENT_TIMEOUT_S, and the thread finishes it on its own afterwards.
CLOSE_WAIT_S = 0.5
# Default wait of query(): the provider reads /proc for every worker (about 1 ms for 4
# workers, up to tens of ms when USS is due), on a machine that may be busy.
QUERY_TIMEOUT_S = 5.0
# Unix socket paths are limited to 107 bytes (sun_path is 108 with the NUL).
MAX_SOCKET_PATH = 107
# A name's lock held by discovery (removing a stale socket) is free again within
# microseconds; a live endpoint holds it for good. Retry briefly before calling it busy.
LOCK_TRIES = 3
LOCK_RETRY_S = 0.01
# How many "engine-<pid>-<n>" names one process tries when several tiers live in it.
MAX_AUTO_NAMES = 64
# Connections the kernel queues before the endpoint's thread accepts them.
LISTEN_BACKLOG = 16


# -- names and places ------------------------------------------------------------------
# The run directory and the rules for names are mptier.rundir's (services use them too).


def socket_path(name_or_path: str, directory: str | None = None,
                trust: Trust | None = None) -> str:
    """The socket of a name: ``<directory>/<name>.status.sock``, or without ``directory`` the
    first of :func:`client_dirs` that has it. A value containing '/' is a path already.
    The folder is checked (``UntrustedError`` naming it, its owner and mode)."""
    if "/" in name_or_path:
        check_folder(os.path.dirname(os.path.abspath(name_or_path)), trust)
        return name_or_path
    check_name(name_or_path)
    if directory:
        check_folder(directory, trust)
    dirs = [directory] if directory else client_dirs(trust) or [run_dir(False, trust)]
    paths = [os.path.join(d, name_or_path + SOCKET_SUFFIX) for d in dirs]
    return next((p for p in paths if os.path.exists(p)), paths[0])


# -- the server -------------------------------------------------------------------------

Provider = Callable[[], dict[str, Any]]


class EndpointBusyError(MptierError):
    """Another live endpoint holds this name."""


class StatusEndpoint:
    """A thread answering status requests on ``<run dir>/<name>.status.sock``.

    Construction binds the socket and starts the thread (raises ``EndpointBusyError`` if
    a live endpoint holds the name, ``MptierError``/``OSError`` naming the path if it
    cannot be made). ``provider`` is called on the endpoint's thread, once per status
    request; it must not block on the caller's threads (see
    :class:`~mptier.monitor.tier.Monitor`). :meth:`close` stops the thread and removes the
    socket and lock file; idempotent, also run at garbage collection.
    """

    def __init__(self, name: str, provider: Provider, *, kind: str = "engine",
                 directory: str | None = None, trust: Trust | None = None) -> None:
        self.name = check_name(name)
        self.kind = kind
        self._provider = provider
        # Who may ask: our uid, root, and members of the configured service_group.
        self.trust = trust or Trust.of()
        self.directory = directory or run_dir(trust=self.trust)
        self.path = os.path.join(self.directory, name + SOCKET_SUFFIX)
        self.lock_path = os.path.join(self.directory, name + LOCK_SUFFIX)
        if len(self.path.encode()) > MAX_SOCKET_PATH:
            raise MptierError(f"status socket path {self.path!r} is longer than "
                              f"{MAX_SOCKET_PATH} bytes (the Unix socket limit); set "
                              f"{RUN_DIR_ENV} to a shorter folder or use a shorter name")
        self._closed = False
        self._lock_fd: int | None = None
        self._folder_fd = open_folder(self.directory, self.trust, create=True)
        try:
            for _ in range(LOCK_TRIES):  # discovery holds a stale name's lock briefly
                self._lock_fd = _take_lock(self._folder_fd, name + LOCK_SUFFIX)
                if self._lock_fd is not None:
                    break
                time.sleep(LOCK_RETRY_S)
        except BaseException:
            os.close(self._folder_fd)
            raise
        if self._lock_fd is None:
            os.close(self._folder_fd)
            raise EndpointBusyError(
                f"status endpoint {name!r} is in use by a live process (it holds "
                f"{self.lock_path}); pick another name")
        self._listener: socket.socket | None = None
        self._stop_r = self._stop_w = -1
        try:
            # a stale socket (its lock was free): removed only if it is a socket of ours
            remove_own_socket(self._folder_fd, name + SOCKET_SUFFIX)
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM
                                           | socket.SOCK_CLOEXEC)
            self._listener.bind(self.path)  # in the checked folder nobody else writes
            if self.trust.gid is not None:
                os.chown(name + SOCKET_SUFFIX, -1, self.trust.gid, dir_fd=self._folder_fd,
                         follow_symlinks=False)
            os.chmod(name + SOCKET_SUFFIX, 0o600 if self.trust.gid is None else 0o660,
                     dir_fd=self._folder_fd)
            self._listener.listen(LISTEN_BACKLOG)
            self._listener.setblocking(False)
            self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            self.loop = ClientLoop(self._listener, self._respond,
                                   name=f"status endpoint {self.name}", admit=self._admit)
        except BaseException:
            self._release()
            raise
        self._thread = threading.Thread(target=self._serve, name=f"mptier-status-{name}",
                                        daemon=True)
        self._thread.start()

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Stop answering and remove the socket and lock file at once; wait at most
        ``timeout`` for the thread (it only ever waits for a request in progress, at most
        ``CLIENT_TIMEOUT_S``, and closes its descriptors itself when it leaves).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        self._unlink()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _unlink(self) -> None:
        # Unlink while still holding the lock: nobody else can be binding this name.
        if self._folder_fd < 0:
            return
        for entry in (self.name + SOCKET_SUFFIX, self.name + LOCK_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry, dir_fd=self._folder_fd)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        os.close(self._folder_fd)
        self._folder_fd = -1

    def _release(self) -> None:
        """Undo a constructor that failed before the thread started."""
        self._closed = True
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._unlink()
        self._close_pipe()

    def _close_pipe(self) -> None:
        for fd in (self._stop_r, self._stop_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._stop_r = self._stop_w = -1

    def __enter__(self) -> StatusEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.close(timeout=0)

    # -- thread --------------------------------------------------------------------------

    def _serve(self) -> None:
        """The thread: owns the listener and the stop pipe, and closes them on leaving."""
        listener, stop_r = self._listener, self._stop_r
        try:
            self._serve_until_stopped(listener, stop_r)
        finally:
            listener.close()
            self._listener = None
            self._close_pipe()

    def _serve_until_stopped(self, listener: socket.socket, stop_r: int) -> None:
        self.loop.serve(stop_r)

    def _admit(self, conn: socket.socket) -> str:
        peer = peer_of(conn)
        if self.trust.admits(peer):
            return ""
        group = "" if self.trust.gid is None else f", group {self.trust.gid}"
        return (f"{peer} may not read status (only uid {os.geteuid()}, root{group}; "
                "service_group admits a group)")

    def _respond(self, request: bytes) -> bytes | None:
        """The reply to one request line, or None until the line is complete."""
        if b"\n" not in request and len(request) < MAX_REQUEST_BYTES:
            return None
        line = request.split(b"\n", 1)[0].decode(errors="replace")
        try:
            message = json.loads(line)
            op = message.get("op") if isinstance(message, dict) else None
        except ValueError:
            op = None
        reply: dict[str, Any] = {"ok": True, "name": self.name, "pid": os.getpid(),
                                 "kind": self.kind, "version": PROTOCOL_VERSION}
        if op == "status":
            try:
                reply["figures"] = self._provider()
            except Exception as exc:
                log.debug("mptier status provider failed", exc_info=True)
                reply = {"ok": False, "name": self.name, "error": f"{type(exc).__name__}: "
                         f"{exc}"}
        elif op != "ping":
            reply = {"ok": False, "name": self.name,
                     "error": f"unknown request {line[:80]!r}: expected a JSON line "
                              '{"op": "status"} or {"op": "ping"}'}
        return json.dumps(reply, default=str).encode() + b"\n"


def _take_lock(folder_fd: int, name: str, *, create: bool = True) -> int | None:
    """Open and exclusively flock lock file ``name`` in the checked folder (non-blocking,
    never through a symlink, only a regular file of ours); ``None`` if someone holds it.

    Retries when the file was unlinked between open and flock (its remover held the
    lock), so the lock held is always the one at ``name``. ``create=False``: raises
    ``FileNotFoundError`` when there is none.
    """
    for _ in range(10):
        fd = open_lock(folder_fd, name, create=create)
        try:
            held = try_flock(fd)
            same = held and still_named(fd, name, folder_fd)
        except BaseException:
            os.close(fd)
            raise
        if not held:
            os.close(fd)
            return None
        if same:
            return fd
        os.close(fd)
    raise MptierError(f"could not take the lock {name}: it keeps being replaced")


def start_endpoint(name: str | None, provider: Provider, *, kind: str = "engine",
                   directory: str | None = None, trust: Trust | None = None
                   ) -> StatusEndpoint:
    """Start a status endpoint; ``name=None`` picks ``engine-<pid>`` (``engine-<pid>-2``,
    ... when this process already runs one). See :class:`StatusEndpoint` for what raises.

    First removes what killed processes left in the run directory (:func:`remove_stale`),
    as every tier start also removes stale shared memory.
    """
    directory = directory or run_dir(trust=trust)
    remove_stale(directory, trust=trust)
    if name is not None:
        return StatusEndpoint(name, provider, kind=kind, directory=directory, trust=trust)
    base = f"engine-{os.getpid()}"
    for n in range(1, MAX_AUTO_NAMES + 1):
        try:
            return StatusEndpoint(base if n == 1 else f"{base}-{n}", provider, kind=kind,
                                  directory=directory, trust=trust)
        except EndpointBusyError:
            continue
    raise EndpointBusyError(f"this process already runs {MAX_AUTO_NAMES} status endpoints")


# -- clients ----------------------------------------------------------------------------

def query(name_or_path: str, timeout: float = QUERY_TIMEOUT_S, *, op: str = "status",
          directory: str | None = None, trust: Trust | None = None) -> dict[str, Any]:
    """Ask one endpoint; returns its reply (see the module docstring). Blocks at most
    about ``timeout``. Raises ``MptierError`` naming the socket if nobody answers or the
    reply is not ours, and naming the endpoint's error if it could not produce figures;
    ``UntrustedError`` if its folder or its listener is not one ``trust`` believes.
    """
    trust = trust or Trust.of()
    path = socket_path(name_or_path, directory, trust)
    deadline = time.monotonic() + timeout
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(timeout)
            s.connect(path)
            problem = trust.listener_problem(peer_of(s))
            if problem:
                raise UntrustedError(f"status endpoint {path} is not trusted: {problem}; "
                                     "`--user` believes another user's endpoints")
            s.sendall(json.dumps({"op": op}).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                s.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
    except FileNotFoundError:
        raise MptierError(f"no status endpoint at {path}; `mptier status` lists the live "
                          "ones") from None
    except ConnectionRefusedError:
        raise MptierError(f"status endpoint {path} is not running (stale socket)") from None
    except TimeoutError:
        raise MptierError(f"status endpoint {path} did not answer within {timeout:g} s"
                          ) from None
    try:
        reply = json.loads(data)
    except ValueError:
        raise MptierError(f"status endpoint {path} sent an unreadable reply "
                          f"({data[:80]!r})") from None
    if not isinstance(reply, dict):
        raise MptierError(f"status endpoint {path} sent an unexpected reply {reply!r:.80}")
    if not reply.get("ok"):
        raise MptierError(f"status endpoint {path}: {reply.get('error', 'failed')}")
    return reply


@dataclass(frozen=True)
class EndpointInfo:
    name: str
    path: str


def discover(directory: str | None = None, *, remove_stale: bool = True,
             timeout: float = 1.0, trust: Trust | None = None) -> list[EndpointInfo]:
    """The live endpoints in ``directory`` (default: every one of :func:`client_dirs`).

    A socket that accepts a connection is live. One that refuses it is stale when its
    lock is free: with ``remove_stale`` its socket and lock file are removed (holding the
    lock, so a server starting under that name is never disturbed). A socket whose lock
    is held but that does not accept is being started or stopped: skipped, left alone.
    Blocks at most about ``timeout`` per socket. Only checked folders are read (an
    explicit ``directory`` that fails raises ``UntrustedError``), and a socket whose
    listener ``trust`` does not believe is skipped with a warning.
    """
    trust = trust or Trust.of()
    found = []
    if directory:
        with contextlib.suppress(FileNotFoundError):
            check_folder(directory, trust)
    for folder in [directory] if directory else client_dirs(trust):
        try:
            names = sorted(os.listdir(folder))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        for entry in names:
            if not entry.endswith(SOCKET_SUFFIX):
                continue
            name = entry[:-len(SOCKET_SUFFIX)]
            if NAME_RE.fullmatch(name) is None:
                continue
            path = os.path.join(folder, entry)
            answer = _accepts(path, timeout, trust)
            if answer == "live":
                found.append(EndpointInfo(name, path))
            elif answer == "dead" and remove_stale:
                _remove_if_stale(folder, name, trust)
    return found


def _accepts(path: str, timeout: float, trust: Trust) -> str:
    """"live", "dead" (refuses connections) or "untrusted" (a listener ``trust`` does
    not believe: skipped, with a warning)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK,
                                 errno.EAGAIN, errno.ETIMEDOUT) and \
                    not isinstance(exc, TimeoutError):
                log.debug("mptier: cannot connect to %s: %s", path, exc)
            return "dead"
        problem = trust.listener_problem(peer_of(s))
        if problem:
            warn_once(f"skipped status socket {path}: {problem}")
            return "untrusted"
        return "live"


def remove_stale(directory: str | None = None, trust: Trust | None = None) -> list[str]:
    """Remove the socket and lock file of every endpoint in ``directory`` (default: the
    run directory) whose lock is free: its process is gone. Connects to nothing, so live
    endpoints are not disturbed. Returns the names removed."""
    directory = directory or run_dir(create=False, trust=trust)
    try:
        entries = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    names = {e[:-len(LOCK_SUFFIX)] for e in entries if e.endswith(LOCK_SUFFIX)}
    names |= {e[:-len(SOCKET_SUFFIX)] for e in entries if e.endswith(SOCKET_SUFFIX)}
    return [n for n in sorted(names)
            if NAME_RE.fullmatch(n) and _remove_if_stale(directory, n, trust)]


def _remove_if_stale(directory: str, name: str, trust: Trust | None = None) -> bool:
    """Remove ``name``'s socket and lock file if its lock is free, reaching both through
    the checked folder's descriptor (no symlink is followed, nothing is created outside
    it, and only entries of this user are removed). A lock file is created only in a
    folder of this user's own."""
    try:
        folder_fd = open_folder(directory, trust)
    except OSError:
        return False
    try:
        own_folder = os.fstat(folder_fd).st_uid == os.geteuid()
        try:
            fd = _take_lock(folder_fd, name + LOCK_SUFFIX, create=own_folder)
        except (OSError, MptierError) as exc:
            if isinstance(exc, UntrustedError):
                warn_once(f"not removing status endpoint {name} in {directory}: {exc}")
            return False
        if fd is None:
            return False  # its owner lives (starting up or shutting down)
        try:
            remove_own_socket(folder_fd, name + SOCKET_SUFFIX)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name + LOCK_SUFFIX, dir_fd=folder_fd)
        except UntrustedError as exc:
            warn_once(f"not removing status endpoint {name} in {directory}: {exc}")
            return False
        finally:
            os.close(fd)
    finally:
        os.close(folder_fd)
    log.info("mptier: removed the stale status socket %s", name)
    return True

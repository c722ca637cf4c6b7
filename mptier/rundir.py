"""The run directory: where services and tiers put their sockets, and whom to trust there.

``$MPTIER_RUN_DIR`` when set (the only folder then), else ``/run/mptier`` when it can be
created and written, else ``/tmp/mptier-<euid>`` (created 0700). Every folder is checked
before anything is created in it or connected to through it (:func:`open_folder`): it
must be a real folder (not a symlink), owned by this user, by root or by a configured
service user, and writable by nobody else -- by its group only when that group is the
configured ``service_group``. A folder that fails is never used:

* a service (``run_dir``) refuses to start with an error naming the folder, its owner
  and mode, and the fix (``MPTIER_RUN_DIR``). In particular a ``/tmp/mptier-<uid>`` that
  another user made first does not make a service start elsewhere silently, and is never
  searched;
* clients (``client_dirs``) skip it with a warning naming the same.

Peers are checked too (``SO_PEERCRED``, :func:`peer_of`): a client connecting to a
service or status socket accepts only a listener whose uid :class:`Trust` allows; a
server accepting a connection serves only a peer of its own uid, root, or the configured
group. docs/security.md states the whole trust model.

A container that shares this folder (a volume) with the engine's container can be
attached to and watched from there.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import pwd
import re
import socket
import stat
import struct
from dataclasses import dataclass

from mptier.errors import ConfigError, MptierError

log = logging.getLogger("mptier.rundir")

RUN_DIR_ENV = "MPTIER_RUN_DIR"
SYSTEM_RUN_DIR = "/run/mptier"
# Names become file names in the run directory, and Unix socket paths are short (108
# bytes): letters, digits, ".", "_" and "-", not starting with ".".
MAX_NAME = 64
NAME_RE = re.compile(rf"[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{MAX_NAME - 1}}}")
# A folder this process creates: only its owner may enter it (0750 with a service group,
# whose members then reach the sockets in it).
FOLDER_MODE = 0o700
GROUP_FOLDER_MODE = 0o750
# Linux's SO_PEERGROUPS (4.13+; not exported by every Python): the peer's supplementary
# groups at connect time, so a member of service_group by a secondary group is admitted.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
# Most supplementary groups read from SO_PEERGROUPS (Linux allows 65536; more than a
# few hundred is unheard of, and a peer past this is judged by the groups read).
MAX_PEER_GROUPS = 1024
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class UntrustedError(MptierError, PermissionError):
    """A run folder, socket or peer that the trust model refuses (the message names it,
    its owner and mode or the peer's uid and pid, and the fix)."""


@dataclass(frozen=True)
class Trust:
    """Who may own a run folder or listen on a socket we connect to (``uids``: this
    process's effective uid, root, and a configured service user), and who may connect
    to ours (those uids, plus members of ``gid``, the configured service group)."""

    uids: frozenset[int]
    gid: int | None = None

    @classmethod
    def of(cls, group: str | int = "", user: str | int = "") -> Trust:
        """This process's trust: ``group`` (``service_group``: a name or number) may
        attach and read status; ``user`` (``service_user``) may run the services this
        process attaches to. Raises ``ConfigError`` naming an unknown user or group."""
        uids = {os.geteuid(), 0}
        if user not in ("", None):
            uids.add(resolve_uid(user))
        gid = resolve_gid(group) if group not in ("", None) else None
        return cls(frozenset(uids), gid)

    def admits(self, peer: Peer) -> bool:
        """May ``peer`` connect to a socket of ours (attach, ask for status)?"""
        return peer.uid in self.uids or (self.gid is not None and (
            peer.gid == self.gid or self.gid in peer.groups))

    def listener_problem(self, peer: Peer) -> str:
        """Why a socket we connected to is not to be trusted ("" if it is): its listener
        must run as one of ``uids`` (a group member is no service of ours)."""
        if peer.uid in self.uids:
            return ""
        return (f"it is served by uid {peer.uid} (pid {peer.pid}), not by "
                f"{_uid_list(self.uids)}")

    def folder_problem(self, st: os.stat_result) -> str:
        """Why a folder with this ``lstat`` is not to be used ("" if it may be)."""
        mode = stat.S_IMODE(st.st_mode)
        what = f"owner uid {st.st_uid}, group {st.st_gid}, mode {mode:04o}"
        if stat.S_ISLNK(st.st_mode):
            return f"is a symlink ({what})"
        if not stat.S_ISDIR(st.st_mode):
            return f"is not a folder ({what})"
        if st.st_uid not in self.uids:
            return f"is owned by uid {st.st_uid}, not by {_uid_list(self.uids)} ({what})"
        if mode & stat.S_IWOTH:
            return f"is writable by every user ({what})"
        if mode & stat.S_IWGRP and st.st_gid != self.gid:
            return (f"is writable by its group {st.st_gid}, which is not the configured "
                    f"service_group ({what})")
        return ""


@dataclass(frozen=True)
class Peer:
    """The process at the other end of a Unix socket (at connect time)."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()

    def __str__(self) -> str:
        return f"uid {self.uid} (pid {self.pid})"


def peer_of(sock: socket.socket) -> Peer:
    """The credentials the kernel recorded for ``sock``'s peer (``SO_PEERCRED``, and its
    supplementary groups where the kernel offers ``SO_PEERGROUPS``)."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  _UCRED.size))
    groups: frozenset[int] = frozenset()
    with contextlib.suppress(OSError):
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * MAX_PEER_GROUPS)
        groups = frozenset(struct.unpack(f"{len(raw) // 4}I", raw[:len(raw) // 4 * 4]))
    return Peer(pid, uid, gid, groups)


def resolve_uid(user: str | int) -> int:
    if isinstance(user, int) or str(user).isdigit():
        return int(user)
    try:
        return pwd.getpwnam(str(user)).pw_uid
    except KeyError:
        raise ConfigError(f"service_user {user!r} is not a known user: give a user name "
                          "or a numeric uid") from None


def resolve_gid(group: str | int) -> int:
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise ConfigError(f"service_group {group!r} is not a known group: give a group "
                          "name or a numeric gid") from None


def _uid_list(uids: frozenset[int]) -> str:
    own = os.geteuid()
    others = sorted(u for u in uids if u not in (own, 0))
    names = [f"uid {own} (you)"] + (["root"] if own != 0 else []) + \
        [f"uid {u} (service_user)" for u in others]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


# -- folders ------------------------------------------------------------------------------

def open_folder(path: str, trust: Trust | None = None, *, create: bool = False) -> int:
    """An ``O_DIRECTORY | O_NOFOLLOW`` descriptor of ``path`` after checking it against
    ``trust`` (default :meth:`Trust.of`); with ``create`` the folder is made first if
    missing (0700, or 0750 and the service group's with one). The caller closes the
    descriptor; use it as ``dir_fd`` so nothing in the folder is reached through a path
    someone could swap. Raises ``UntrustedError`` naming the folder, owner and mode, or
    ``FileNotFoundError``."""
    trust = trust or Trust.of()
    if create:
        _make_folder(path, trust)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.lexists(path):
            raise UntrustedError(f"run folder {path} {trust.folder_problem(os.lstat(path))}"
                                 f"; {_FIX}") from None
        raise
    problem = trust.folder_problem(os.fstat(fd))
    if problem:
        os.close(fd)
        raise UntrustedError(f"run folder {path} {problem}; {_FIX}")
    return fd


_FIX = (f"use a folder of your own (set {RUN_DIR_ENV}, e.g. to a 0700 folder you own), "
        "or remove this one as its owner or root")


def _make_folder(path: str, trust: Trust) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    mode = GROUP_FOLDER_MODE if trust.gid is not None else FOLDER_MODE
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return
    if trust.gid is not None:  # our new folder: lend it to the group (a member or root)
        with contextlib.suppress(OSError):
            os.chown(path, -1, trust.gid)


def check_folder(path: str, trust: Trust | None = None, *, create: bool = False) -> None:
    """:func:`open_folder` without keeping the descriptor."""
    os.close(open_folder(path, trust, create=create))


def run_dir(create: bool = True, trust: Trust | None = None) -> str:
    """The run directory (see the module docstring), checked; with ``create`` it is made
    if missing. Raises ``MptierError`` (``UntrustedError``) naming the folder, its owner
    and mode and the fix when it cannot be used."""
    trust = trust or Trust.of()
    chosen = os.environ.get(RUN_DIR_ENV)
    if chosen:
        try:
            check_folder(chosen, trust, create=create)
        except FileNotFoundError:
            if create:
                raise MptierError(f"{RUN_DIR_ENV}={chosen!r} cannot be created; point it "
                                  "at a writable folder") from None
        except UntrustedError as exc:
            raise UntrustedError(f"{RUN_DIR_ENV}: {exc}") from None
        except OSError as exc:
            raise MptierError(f"{RUN_DIR_ENV}={chosen!r} cannot be created: "
                              f"{exc.strerror}; point it at a writable folder") from None
        return chosen
    if _usable(SYSTEM_RUN_DIR, create, trust):
        return SYSTEM_RUN_DIR
    fallback = fallback_dir()
    try:
        check_folder(fallback, trust, create=create)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if isinstance(exc, UntrustedError):
            raise UntrustedError(
                f"{exc}. Another user may have made {fallback} first to catch this "
                f"user's sockets: set {RUN_DIR_ENV} to a folder of your own") from None
        raise MptierError(f"{fallback} cannot be created: {exc.strerror}; set "
                          f"{RUN_DIR_ENV} to a writable folder") from None
    return fallback


def fallback_dir() -> str:
    return f"/tmp/mptier-{os.geteuid()}"


def client_dirs(trust: Trust | None = None) -> list[str]:
    """Where clients look: ``$MPTIER_RUN_DIR`` alone when set, else each of
    ``/run/mptier`` and ``/tmp/mptier-<euid>`` that exists and passes the checks; a
    folder that does not is skipped with a warning naming it (see :func:`scan_dirs`)."""
    found, refused = scan_dirs(trust)
    for problem in refused:
        warn_once(problem)
    return found


def scan_dirs(trust: Trust | None = None) -> tuple[list[str], list[str]]:
    """``(folders that may be used, why each other one was refused)``."""
    trust = trust or Trust.of()
    chosen = os.environ.get(RUN_DIR_ENV)
    candidates = [chosen] if chosen else [SYSTEM_RUN_DIR, fallback_dir()]
    found, refused = [], []
    for folder in candidates:
        try:
            check_folder(folder, trust)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except UntrustedError as exc:
            refused.append(f"skipped {exc}")
            continue
        except OSError:
            continue
        found.append(folder)
    return found, refused


_warned: set[str] = set()


def warn_once(problem: str) -> None:
    """Log ``problem`` as a warning the first time this process meets it."""
    if problem not in _warned:  # clients retry every second: say it once per cause
        _warned.add(problem)
        log.warning("mptier: %s", problem)


def _usable(path: str, create: bool, trust: Trust) -> bool:
    if create:
        with contextlib.suppress(OSError):
            if not os.path.lexists(path) and os.access(os.path.dirname(path), os.W_OK):
                os.mkdir(path, 0o755)  # system-wide: root's, others search it
    try:
        check_folder(path, trust)
    except UntrustedError as exc:
        warn_once(f"not using {exc}")
        return False
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


# -- entries in a checked folder -------------------------------------------------------------

def open_lock(folder_fd: int, name: str, *, create: bool = True) -> int:
    """Open lock file ``name`` in the checked folder: never through a symlink, only a
    regular file owned by this user. Raises ``FileNotFoundError`` (``create=False`` and
    it is not there) or ``UntrustedError`` naming what is there instead."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    if create:
        flags |= os.O_CREAT
    try:
        fd = os.open(name, flags, 0o600, dir_fd=folder_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # symlink, socket, folder
            raise UntrustedError(f"lock file {name} is not a regular file "
                                 f"({exc.strerror}); remove it") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise UntrustedError(f"lock file {name} is not a regular file of uid "
                             f"{os.geteuid()} (owner uid {st.st_uid}, mode "
                             f"{stat.S_IMODE(st.st_mode):04o}); remove it")
    return fd


def remove_own_socket(folder_fd: int, name: str) -> None:
    """Remove a stale socket ``name`` (the caller holds its name's lock); anything else
    there -- not a socket, or another user's -- is refused with ``UntrustedError``."""
    try:
        st = os.lstat(name, dir_fd=folder_fd)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise UntrustedError(
            f"{name} in the run folder is not a socket of uid {os.geteuid()} (owner uid "
            f"{st.st_uid}, mode {st.st_mode:o}): not replacing it; remove it or use "
            "another name")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=folder_fd)


def check_name(name: object) -> str:
    """``name`` if it can name a service or endpoint, else ``ConfigError``."""
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise ConfigError(f"name {name!r} is invalid: use letters, digits, '.', '_' and "
                          f"'-' (at most {MAX_NAME} characters, not starting with '.')")
    return name

"""Writer leases, and the sweeper of temporary files their dead writers left behind.

    writer process                               sweeper (a worker, or `mptier gc`)
    ┌──────────────────────────────┐             ┌─────────────────────────────────────┐
    │ Lease.create(root)           │  flock held │ for each temp file the walk finds:  │
    │   .mptier/leases/<tag>.lease │◀──────────▶ │   lease missing, or flock(EX|NB)    │
    │ stores: <final>.<tag>.<n>.tmp│  while alive│   succeeds  -> writer dead: unlink  │
    │ lease.release() at exit      │             │   EWOULDBLOCK -> live: never touched│
    └──────────────────────────────┘             └─────────────────────────────────────┘

A lock, not a pid, proves a writer alive: flock works across PID namespaces on one
kernel, and across nodes on file systems that implement it (NFSv4 maps flock to its own
locks; JuiceFS and CephFS implement BSD locks). Where :func:`probe_locks` finds that
locks do not work, a temporary file is stale only once it is older than
``stale_temp_s`` by the file system's own clock (:func:`fs_now`); temporary names of
writers without a lease (``<final>.<pid>.<tid>.<n>.tmp``) are judged by age everywhere.

Creating a lease never leaves a window in which a sweeper could take a live lease for
dead: the file is created as ``<tag>.lease.new``, locked, filled, and only then renamed
to ``<tag>.lease``; a writer names temporary files after its tag only once that rename
is done, and releases the lease only after its last store returned. A sweeper removes a
``.lease.new`` file only when it is both lockable and older than
:data:`LEASE_CREATE_GRACE_S`.

The probe is one-node: it proves that two open files conflict here, not that another
node's lock is seen. Every node that sweeps a root must agree on whether locks work
(configure it when unsure); a node that wrongly takes a live lease for dead makes that
writer's store fail cleanly (its rename finds no file), never publishes wrong bytes.

Long because the lease and the sweeper are two halves of one rule (a temporary file is
removed only when the lock of its writer's lease is free, or by age where locks do not
work), and the rule is easier to check with both halves in view.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from mptier.errors import MptierError
from mptier.storage import names as N
from mptier.storage.walk import Entry, Kind, Walker, unlink_if_unchanged

# Where locks do not work, a temporary file untouched for this long is taken as
# abandoned. A block store takes well under a second even on a network mount; an hour
# lets a writer stall (a server failing over) without losing its file, and bounds how
# long a dead writer's garbage stays. A writer stalled past it sees its store fail.
DEFAULT_STALE_TEMP_S = 3600.0
# A lease file is created, then locked, then renamed into place; only a ".lease.new"
# older than this (and lockable) is a creator that died in those few system calls.
LEASE_CREATE_GRACE_S = 60.0
# Probe files (.mptier/lockprobe.*, clock.*) of a process that died mid-probe.
PROBE_PREFIXES = ("lockprobe.", "clock.")
# The file-system probes of mptier.native (O_DIRECT, user xattrs, O_TMPFILE) name a file
# .mpt_probe.<pid>.<n>.tmp in the folder they probe and hold its flock while it lives; a
# probe file whose lock is free and older than this is a prober's that died mid-probe
# (SIGKILLed while its tier started). The grace covers the O_TMPFILE probe's read-back,
# which opens its file by name again a few system calls after the descriptor holding
# the lock closed; a probe's file lives microseconds, so a few seconds are ample, and
# the next tier on the root removes a dead prober's file at its first walk after them.
# Where locks do not work, such a file goes by age, as the probes under .mptier do.
PROBE_TEMP_GRACE_S = 5.0
_LOCK_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def new_tag() -> str:
    """A fresh lease tag: :data:`~mptier.storage.names.TAG_LEN` random ``[0-9a-z]``."""
    return "".join(secrets.choice(N.TAG_ALPHABET) for _ in range(N.TAG_LEN))


def _ensure_meta_dir(root: str, *parts: str) -> str:
    """Create ``<root>/.mptier[/parts...]`` as real folders; refuse a symlink in the way."""
    path = f"{root}/{N.META_DIR}"
    for part in ("", *parts):
        if part:
            path = f"{path}/{part}"
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise MptierError(
                f"{path!r} is not a folder (a {'symlink' if stat.S_ISLNK(st.st_mode) else 'file'}"
                f"): mptier keeps its leases there; remove it and start again")
    return path


class Lease:
    """A writer's lease on ``root``: an exclusive flock held on ``<tag>.lease`` until
    :meth:`release` (or the process's death). Not shared across ``fork``: a child
    inherits the open file, so the lease then lives as long as either process."""

    def __init__(self, root: str, tag: str, fd: int, locked: bool) -> None:
        self.root = root
        self.tag = tag
        self.path = N.lease_path(root, tag)
        self.locked = locked
        self._fd: int | None = fd
        self._counter = 0

    @classmethod
    def create(cls, root: str | os.PathLike[str], tag: str | None = None) -> Lease:
        """Create and lock a new lease under ``root`` (which must exist).

        ``tag`` (default: a fresh random one) lets one writer hold leases of the same
        tag on several roots, so its temporary names carry one tag everywhere; a tag
        already leased on this root raises ``FileExistsError`` (pick another).
        Blocks on a few metadata calls. Raises ``OSError`` when the root cannot be
        written, ``MptierError`` when ``.mptier`` is not a folder and ``ValueError``
        for a malformed tag. Where the file system has no locks the lease is still made
        (``locked`` is False) and its temporary files are judged by age.
        """
        root = os.path.normpath(os.fspath(root))
        if tag is not None and not N.TAG_RE.match(tag):
            raise ValueError(f"lease tag {tag!r}: expected {N.TAG_LEN} characters of "
                             "[0-9a-z]")
        directory = _ensure_meta_dir(root, N.LEASES_DIR)
        while True:
            chosen = tag if tag is not None else new_tag()
            new = f"{directory}/{chosen}{N.LEASE_NEW_SUFFIX}"
            if tag is not None and os.path.lexists(N.lease_path(root, tag)):
                if lease_state(root, tag) != "free":
                    raise FileExistsError(errno.EEXIST, f"lease {tag} already exists", new)
                # Our tag's lease that nobody holds: ours, let go when this writer
                # followed its root to another folder (a mount over it) and left behind
                # there, now that the path leads back. Its files are stale: take it anew.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(N.lease_path(root, tag))
            try:
                fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o644)
            except FileExistsError:  # 36**16 tags: only a broken random source repeats
                if tag is not None:
                    raise
                continue
            break
        tag = chosen
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except OSError as exc:
                if exc.errno not in _LOCK_UNSUPPORTED:
                    raise
                locked = False
            record = {"host": socket.gethostname(), "pid": os.getpid(),
                      "created": time.time()}
            os.write(fd, json.dumps(record).encode())
            os.rename(new, N.lease_path(root, tag))
        except BaseException:
            os.close(fd)
            try:
                os.unlink(new)
            except OSError:
                pass
            raise
        return cls(root, tag, fd, locked)

    def temp_name(self, final: str) -> str:
        """The next temporary name for ``final`` under this lease (``<final>.<tag>.<n>.tmp``)."""
        self._counter += 1
        return N.temp_name(final, self.tag, self._counter)

    @property
    def released(self) -> bool:
        return self._fd is None

    def release(self) -> None:
        """Remove the lease file, then drop the lock. Call it only after this writer's
        last store returned: its leftover temporary files become stale at once.
        Idempotent; never raises for a file already gone."""
        if self._fd is None:
            return
        try:
            held, named = os.fstat(self._fd), os.stat(self.path, follow_symlinks=False)
            if (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
                os.unlink(self.path)  # only our own file (the path may lead elsewhere now)
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Lease({self.path!r}, {'released' if self.released else 'held'})"


def probe_locks(root: str | os.PathLike[str]) -> bool:
    """Whether flock works under ``root``: two open file descriptions of one file must
    conflict. False when the file system refuses locks (an errno of
    ``_LOCK_UNSUPPORTED``) or grants both; any other failure is the file system failing
    now, not an answer (a distributed file system's metadata engine busy under load
    fails a lock with EIO), and raises ``OSError``, so the caller asks again later
    rather than deciding for good that every tier must walk the root alone. Blocks on
    a few metadata calls; ``OSError`` also when ``root`` is unusable."""
    root = os.path.normpath(os.fspath(root))
    path = f"{_ensure_meta_dir(root)}/lockprobe.{new_tag()}"
    fd1 = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                  0o600)
    try:
        fd2 = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for fd, second in ((fd1, False), (fd2, True)):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if second:
                        return True  # the first lock holds the second off: locks work
                    raise  # a new file (O_EXCL) locked by someone: the fs is failing
                except OSError as exc:
                    if exc.errno in _LOCK_UNSUPPORTED:
                        return False
                    raise
            return False  # both granted: locks are accepted but do nothing here
        finally:
            os.close(fd2)
    finally:
        os.close(fd1)
        os.unlink(path)


def fs_now(root: str | os.PathLike[str]) -> int:
    """The file system's idea of now, in ns: the mtime of a file created for the
    purpose (on NFS the server sets it), so ages compare like with like whatever this
    host's clock says. Falls back to this host's clock when ``root`` cannot be written."""
    root = os.path.normpath(os.fspath(root))
    try:
        path = f"{_ensure_meta_dir(root)}/clock.{new_tag()}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
    except (OSError, MptierError):
        return time.time_ns()
    try:
        return os.fstat(fd).st_mtime_ns
    finally:
        os.close(fd)
        os.unlink(path)


def lease_state(root: str, tag: str) -> str:
    """``"held"`` (a live writer), ``"free"`` (lockable: its writer is dead),
    ``"missing"`` or ``"unknown"`` (not a regular file, or locks fail: keep its files)."""
    try:
        fd = os.open(N.lease_path(root, tag),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return "missing"
    except OSError:
        return "unknown"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "unknown"
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return "held"
    except OSError:
        return "unknown"
    finally:
        os.close(fd)
    return "free"


@dataclass
class SweepCounts:
    temps_removed: int = 0
    temp_bytes_removed: int = 0
    temps_kept: int = 0        # live writers' files (or too young, without locks)
    leases_removed: int = 0
    probes_removed: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class TempSweeper:
    """Removes stale temporary files, dead writers' leases and leftover probe files,
    as the walk offers them: feed it the entries of :meth:`Walker.step`.

    ``locks_work`` (None: :func:`probe_locks` on first use) chooses leases or age;
    ``now_ns`` (default :func:`fs_now` of the root, read at each :meth:`begin_pass`) is
    the reference for ages. With ``dry_run`` nothing is removed but counts say what
    would be. Blocks on a few metadata calls per offered entry; not thread-safe.
    """

    def __init__(self, root: str | os.PathLike[str], *, locks_work: bool | None = None,
                 stale_temp_s: float = DEFAULT_STALE_TEMP_S,
                 now_ns: Callable[[], int] | None = None, dry_run: bool = False) -> None:
        if not stale_temp_s >= 0:
            raise ValueError(f"stale_temp_s must be >= 0 seconds, got {stale_temp_s!r}")
        self.root = os.path.normpath(os.fspath(root))
        self._locks_work = locks_work
        self.stale_temp_ns = int(stale_temp_s * 1e9)
        self._now_fn = now_ns or (lambda: fs_now(self.root))
        self._now: int | None = None
        self.dry_run = dry_run
        self._dead: set[str] = set()      # tags whose writer is gone for good
        self._live: set[str] = set()      # tags seen held during this pass
        self.counts = SweepCounts()

    @property
    def locks_work(self) -> bool:
        if self._locks_work is None:
            self._locks_work = probe_locks(self.root)
        return self._locks_work

    def begin_pass(self) -> None:
        """Start a new pass: read the reference clock again and forget which leases were
        live (a live writer may have died since). Called by :meth:`offer` the first time."""
        self._now = self._now_fn()
        self._live.clear()

    def _age_stale(self, entry: Entry, grace_ns: int) -> bool:
        if self._now is None:
            self.begin_pass()
        assert self._now is not None
        return self._now - entry.mtime_ns > grace_ns

    def _tag_dead(self, tag: str) -> bool:
        if tag in self._dead:
            return True
        if tag in self._live:
            return False
        state = lease_state(self.root, tag)
        if state in ("missing", "free"):
            self._dead.add(tag)
            return True
        self._live.add(tag)
        return False

    def _remove(self, entry: Entry) -> bool:
        return True if self.dry_run else unlink_if_unchanged(entry)

    def offer(self, entry: Entry) -> bool:
        """Judge one walked entry; return whether it was (or, dry, would be) removed.
        Entries of other kinds are ignored."""
        if self._now is None:
            self.begin_pass()
        if entry.kind is Kind.TEMP:
            if entry.tag is None and N.PROBE_TEMP_RE.match(os.path.basename(entry.path)):
                return self._offer_probe(entry)
            if entry.tag is not None and self.locks_work:
                stale = self._tag_dead(entry.tag)
            else:
                stale = self._age_stale(entry, self.stale_temp_ns)
            if stale and self._remove(entry):
                self.counts.temps_removed += 1
                self.counts.temp_bytes_removed += entry.size
                return True
            self.counts.temps_kept += 1
            return False
        if entry.kind is Kind.LEASE and entry.tag is not None:
            return self._offer_lease(entry)
        if entry.kind is Kind.META and entry.folder == N.META_DIR \
                and os.path.basename(entry.path).startswith(PROBE_PREFIXES) \
                and self._age_stale(entry, int(LEASE_CREATE_GRACE_S * 1e9)) \
                and self._remove(entry):
            self.counts.probes_removed += 1
            return True
        return False

    def _offer_probe(self, entry: Entry) -> bool:
        """A native probe's file (:data:`~mptier.storage.names.PROBE_TEMP_RE`): removed
        once past :data:`PROBE_TEMP_GRACE_S` while its lock can be had, or, where locks
        do not work, once older than :data:`LEASE_CREATE_GRACE_S`."""
        if self.locks_work:
            removed = self._age_stale(entry, int(PROBE_TEMP_GRACE_S * 1e9)) \
                and self._reap_locked(entry)
        else:
            removed = self._age_stale(entry, int(LEASE_CREATE_GRACE_S * 1e9)) \
                and self._remove(entry)
        if removed:
            self.counts.probes_removed += 1
        return removed

    def _offer_lease(self, entry: Entry) -> bool:
        creating = entry.path.endswith(N.LEASE_NEW_SUFFIX)
        if creating and not self._age_stale(entry, int(LEASE_CREATE_GRACE_S * 1e9)):
            return False
        if not self.locks_work:
            # No lock can prove a writer alive here, and its temporary files are judged
            # by age anyway: an old lease file is only clutter.
            if self._age_stale(entry, self.stale_temp_ns) and self._remove(entry):
                self.counts.leases_removed += 1
                return True
            return False
        if self._reap_locked(entry):
            if not creating:
                self._dead.add(entry.tag)  # type: ignore[arg-type]
            self.counts.leases_removed += 1
            return True
        return False

    def _reap_locked(self, entry: Entry) -> bool:
        """Unlink a lease (or probe) file while holding its lock, if the lock can be had."""
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                         | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            if os.fstat(fd).st_ino != entry.ino:
                return False
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not self.dry_run:
                os.unlink(entry.path)
        except OSError:  # held (EWOULDBLOCK), gone, or no locks after all: keep it
            return False
        finally:
            os.close(fd)
        return True


@dataclass
class SweepReport:
    counts: SweepCounts
    locks_work: bool
    entries: int


def sweep_temps(root: str | os.PathLike[str], *, locks_work: bool | None = None,
                stale_temp_s: float = DEFAULT_STALE_TEMP_S, dry_run: bool = False,
                entries: Iterable[Entry] | None = None) -> SweepReport:
    """Sweep a whole root at once (offline tools, tests): walk it (or take ``entries``)
    and offer every entry to a :class:`TempSweeper`. Blocks until done; a worker should
    use the sweeper with its own incremental walk instead."""
    sweeper = TempSweeper(root, locks_work=locks_work, stale_temp_s=stale_temp_s,
                          dry_run=dry_run)
    seen = 0
    for entry in entries if entries is not None else Walker(root).walk_all():
        seen += 1
        sweeper.offer(entry)
    return SweepReport(sweeper.counts, sweeper.locks_work, seen)

"""One walker per root, however many tiers share it (issue 19 item 3).

    every tier's caretaker of a root                 <root>/.mptier/walk/
    ┌───────────────────────────────────────┐        seat.lock      flock(EX) held by
    │ RootShare.elect(): flock(EX|NB) on     │◀──────▶               the walker only
    │   seat.lock, retried every ELECT_GAP_S │        usage.json     the walker's figure
    │ walker: walks, evicts, folds the       │───────▶               (O_EXCL temp+rename)
    │   others' logs, publishes usage.json   │        <tag>.alive    flock held by a
    │ contributor: appends its new blocks to │───────▶               live contributor
    │   <tag>.<gen>.paths, its reservations  │        <tag>.json     {gen, reserved,
    │   and wants to <tag>.json; stores only │                        want, ack, limit}
    │   within the grant in usage.json       │        <tag>.<gen>.paths  "size path\\n"
    └───────────────────────────────────────┘

The walker is whoever holds the flock on ``seat.lock``: the kernel (or, across nodes, the
file system: JuiceFS keeps BSD locks in its metadata engine for every client) drops it
when the holder's process dies, and another caretaker's next try, at most
:data:`ELECT_GAP_S` later, takes the seat. A node that dies as a whole keeps its locks
until its file system declares its session dead (JuiceFS: a few missed heartbeats, about
a minute by default); that is the takeover bound there.

A walker can also be alive and stuck: its worker sits in a write to a sick mount, or is
frozen, and no signal ends it, so its lock stays held and nobody would walk the root
again (no dead writer's temporary file swept, no eviction). While other tiers
contribute, the walker publishes at its caretaker steps (between tasks, and every few
tenths of a second while idle): at most every :data:`PUBLISH_GAP_S` when it has news
for them, else every :data:`HEARTBEAT_S` (alone, only news, at most every
:data:`ALONE_PUBLISH_S`). So a seat whose publication (walker tag, ``seq``) has not
changed for :data:`SEAT_STALE_S` by a contributor's own clock is stale: that
contributor takes ``usurp.lock``, checks that ``seat.lock`` is still the file it judged
stale, unlinks it and creates a fresh one (``O_EXCL``) whose lock it holds. The stuck
walker, once it moves again, sees before its next walk or publication that the name no
longer points at its file (:meth:`RootShare.keep_seat`) and becomes a contributor. A
wrong judgment (a walker busy in one long task) costs a re-election, never two walkers
past one step.

A contributor never walks and never evicts. It hands the walker what only it knows:
the paths of the blocks its tier created (appended to its log, ``size relpath`` per
line, so the walker counts each exactly once against its own walk's position and can
evict it at once) and the room its stores hold reserved (in ``<tag>.json``). The walker
publishes the root's usage together with how many of each contributor's bytes it holds
(``folded``). Every file here is read bounded (:func:`mptier.rootfile.read_root_file`, at
most :data:`SHARE_FILE_LIMIT` bytes), every record published through a fresh
``O_EXCL`` temporary and a rename.

Room is lent, not guessed (the grant). Every figure a contributor reads is late by a
round trip (its step, FOLD_GAP_S, PUBLISH_GAP_S, READ_GAP_S, the file system's metadata):
had it trusted the usage, the root would pass the budget by what the other tiers store
meanwhile. Instead the walker publishes for each contributor a *limit*: cumulative bytes,
in the units of what it logged (``sent``) and the walker ``folded``, that its blocks ever
created plus its stores' reservations now may reach. The contributor's room checks stay
within its limit (``RootShare.room_held``), and the walker counts every limit as used:
its eviction and its own tier's room checks keep ::

    usage + sum over contributors of (limit in force - folded) + own stores <= capacity

so the root's bytes (the usage plus each contributor's created-not-folded) stay under
the capacity whatever the delays: a late figure only makes a contributor wait. Limits
only grow (a stale read then restricts), except to take back what an idle contributor
does not use: a smaller limit is published with the next number of that contributor's
grant sequence, and the walker keeps counting the larger one until the contributor
acknowledges (``ack`` in ``<tag>.json``) that number, which it does only once it has
adopted it (it adopts the highest number it reads), its room checks use it, and what it
created plus what it holds reserved fits in it. A contributor asks (``want``: its
reservations plus a headroom for what its stores will take before the next answer, 0
when idle: mptier.workers.caretaker.GRANT_WINDOW_S) beyond what it logged. The walker
evicts for what the contributors' stores hold and grants it from the room its own
tier's room checks do not hold, after lowering its own tier's figure by the ask (a store
of its own that looked before is then counted in the room it reads); the headroom it
grants only out of its slack (:meth:`RootShare.grant`), so the cache still settles at
the capacity less the slack. A new walker counts the limits the last record says are in
force; a dead contributor's stops counting once its log is folded.

A seat changing hands leaves room nobody published. The new walker's figure, until a
pass of its walk begun as the walker ends, is at least the last record's usage plus
what it created as a contributor that the last walker had not folded (``inherited``:
its own limit stops counting with its log; a tier that walked before keeps that stint's
pass, which holds nothing stored since: the caretaker's ``elected_at``). A walker whose
seat was taken over (it stood still) stores on under its own room checks until its next
:meth:`RootShare.keep_seat`, and logs none of it: its tier may fill all the room its
last record left free (the capacity less the usage and the limits in force not folded),
the very room the new walker's checks, from the same record, see free. Both passed for
one room: the root at up to 1 + that room's share of the capacity (30 blocks used of
40: 1.25x). So the new walker counts that room as held (``former_hold``: in
:meth:`RootShare.outstanding` and in what :meth:`RootShare.fold` returns, so eviction
makes it, up to that room evicted once per takeover, rather than wait on a stuck tier)
until the old walker let the old seat file go (its lock, tried at every fold) and a
pass of the walk begun after that ended (:meth:`RootShare.walked`). A walker whose
process died stores no more; its tier's other workers, storing on under their dead
caretaker's last figure until the tier's next caretaker joins as a contributor, are not
counted (each within the room that figure left).

Where locks do not work (``probe_locks`` false) there is no election: every tier walks
and evicts as before (the caller does not make a ``RootShare``).

Long because the seat, the contributors' logs and records, the grants and the published
figure are one protocol on the root: each side reads what the other writes, so both
sides live here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mptier.errors import RootFileError
from mptier.locks import still_named, try_flock
from mptier.rootfile import read_root_file
from mptier.storage import names as N
from mptier.storage.leases import _ensure_meta_dir, new_tag

log = logging.getLogger(__name__)

SHARE_DIR = "walk"
SEAT_NAME = "seat.lock"
USURP_NAME = "usurp.lock"
USAGE_NAME = "usage.json"
ALIVE_SUFFIX = ".alive"
STATE_SUFFIX = ".json"
LOG_SUFFIX = ".paths"
# A caretaker without the seat tries to take it this often: the takeover bound after a
# walker's process dies (its lock goes with it), on top of one caretaker step. A try is
# one open and one flock (a metadata round trip on a network file system).
ELECT_GAP_S = 0.5
# A walker whose publication has not moved for this long is taken to be stuck and its
# seat is taken over. With contributors it publishes every HEARTBEAT_S or more often
# (see below), so this is many missed publications, and well under the I/O timeout (60 s
# by default) after which its worker is declared hung. A takeover costs the room the
# stuck walker's last record left free, held (and evicted for) until a walk has seen
# what its tier stored meanwhile (module docstring).
SEAT_STALE_S = 10.0
# The walker reads the contributors' files and publishes its figure at most this often
# while other tiers contribute. A contributor's room check trusts a figure this old plus
# what it created since: the budget is exceeded by what other tiers' evictions would
# have freed in this time.
FOLD_GAP_S = 0.02
PUBLISH_GAP_S = 0.02
# Each publication is a new file renamed over the old one: on a disk mounted with
# ``discard`` the old file's block is a discard request, and those took up to 0.2 s of
# device time each on this machine's disk, 50 a second stalling the stores beside them
# (docs/performance.md, section 17). So the walker publishes less where nobody waits:
# - with contributors, a record with no news for them goes out only this often (the
#   heartbeat SEAT_STALE_S judges: many missed ones);
HEARTBEAT_S = 1.0
# - with none, a changed record only this often, an unchanged one never (nobody judges
#   its heartbeat: a newcomer is answered at the fold that first sees it, and its
#   judging starts then; tests and operators read the figure).
ALONE_PUBLISH_S = 5.0
# A contributor reads the published figure at most this often.
READ_GAP_S = 0.02
# How often the walker checks that a contributor still holds its ``.alive`` lock (a dead
# one's reservations and grant stop counting and its files are removed).
ALIVE_CHECK_S = 1.0
# Limits the walker keeps per contributor until acknowledged (past this, the two oldest
# are counted as one: the larger limit, retired with the later number). A contributor
# acknowledges within a round trip, so a few are pending at a time.
GRANT_HISTORY = 32
# The records here are a few hundred bytes (usage.json names each contributor: ~80
# bytes each); a log is read in pieces of this size.
SHARE_FILE_LIMIT = 256 << 10
LOG_READ_BYTES = 256 << 10
# A contributor starts a new log once the walker folded all of the current one and it
# is past this size: logs stay small whatever a tier stores.
LOG_ROTATE_BYTES = 1 << 20


def share_dir(root: str) -> str:
    return f"{root}/{N.META_DIR}/{SHARE_DIR}"


def publish_record(path: str, record: dict) -> None:
    """Write ``record`` as JSON at ``path`` atomically: a fresh ``O_EXCL`` temporary
    (never a name someone planted), then a rename over the old record."""
    tmp = f"{path}.{new_tag()}.new"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        try:
            os.write(fd, json.dumps(record, separators=(",", ":")).encode())
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_record(path: str) -> dict | None:
    """A record of this folder, or None when it is missing or not one of ours (a
    planted or half-written file is ignored, never trusted or followed)."""
    try:
        data = read_root_file(path, SHARE_FILE_LIMIT)
        if data is None:
            # Measured on JuiceFS: a record renamed into place through another mount is
            # ENOENT by name here (the kernel's entry for the old file) until the
            # folder is listed again -- even with every FUSE cache timeout at 0.
            os.listdir(os.path.dirname(path))
            data = read_root_file(path, SHARE_FILE_LIMIT)
    except (OSError, RootFileError):
        return None
    if data is None:
        return None
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _free_room(record: dict | None) -> int:
    """The room a walker's ``record`` left free under its budget: its capacity less its
    usage and the contributors' limits in force not folded (0 without a budget). Its own
    tier's room checks let its stores fill exactly that, beyond the record's usage."""
    record = record or {}
    try:
        capacity, usage = int(record.get("capacity_bytes") or 0), int(
            record.get("usage_bytes") or 0)
        lent = sum(max(0, int(e[6]) - int(e[2]))
                   for e in (record.get("folded") or {}).values() if len(e) >= 7)
    except (TypeError, ValueError, IndexError):
        return 0
    return max(0, capacity - usage - lent) if capacity and record.get("grants") else 0


def _walker_name(record: dict | None) -> str:
    record = record or {}
    if not record:
        return "nothing published"
    return f"tier {record.get('walker')}, pid {record.get('pid')} on {record.get('host')}"


def read_usage(root: str) -> dict | None:
    """The walker's last publication for ``root`` (``mptier du`` and tests read it)."""
    return read_record(f"{share_dir(root)}/{USAGE_NAME}")


def _locked_fd(path: str, create: bool) -> int | None:
    """An fd of ``path`` with flock(EX) held, or None when someone else holds it."""
    return _try_lock(path, create)[0]


def _try_lock(path: str, create: bool, exclusive: bool = False) -> tuple[int | None, int]:
    """``(fd with flock(EX) held, inode)``, or ``(None, inode)`` when someone else holds
    the lock of ``path``'s file. ``exclusive``: the file must be new (``O_EXCL``)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    if create:
        flags |= os.O_CREAT | (os.O_EXCL if exclusive else 0)
    fd = os.open(path, flags, 0o644)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file; remove it")
        held = try_flock(fd)
    except BaseException:
        os.close(fd)
        raise
    if not held:
        os.close(fd)
        return None, st.st_ino
    return fd, st.st_ino


@dataclass
class _Cursor:
    gen: int = 0
    offset: int = 0
    folded: int = 0          # bytes of blocks folded from this contributor, ever
    reserved: int = 0        # what its stores hold reserved now (its last record)
    alive_at: float = 0.0    # when its lock was last seen held
    # Its grant, cumulative bytes in the units of ``folded``: the newest limit published
    # and its number, and every (number, limit) from the one it acknowledged on: it may
    # still be using any of them, so the largest is in force.
    limit: int = 0
    grant_seq: int = 0
    ack: int = 0
    grants: list[tuple[int, int]] = field(default_factory=list)
    used: int = 0            # the limit its last record says it uses
    sent: int = 0            # what its log held when it wrote that record
    want: int = 0            # what it asks beyond its log: reserved plus a headroom

    @property
    def in_force(self) -> int:
        """The largest limit it may be storing under."""
        return max(self.used, self.limit, *(limit for _, limit in self.grants))

    @property
    def need(self) -> int:
        """The limit it asks for: what it created, holds and may take next."""
        return max(self.folded, self.sent) + self.want

    @property
    def hard(self) -> int:
        """The limit its stores need now: what it created and holds (no headroom)."""
        return max(self.folded, self.sent) + min(self.reserved, self.want)

    def set_limit(self, limit: int) -> None:
        self.grant_seq += 1
        self.limit = limit
        self.grants.append((self.grant_seq, limit))
        if len(self.grants) > GRANT_HISTORY:
            (_, first), (seq, second) = self.grants[:2]
            self.grants[:2] = [(seq, max(first, second))]

    def acknowledged(self, ack: int) -> None:
        """It uses no limit numbered below ``ack`` any more."""
        if ack > self.grant_seq:
            # Numbered by a walker whose last record we did not read: what it says it
            # uses is in force, and our numbers go on from its.
            self.grant_seq, self.limit = ack, max(self.limit, self.used)
            self.grants = [(ack, self.limit)]
        self.ack = max(self.ack, ack)
        self.grants = [(seq, limit) for seq, limit in self.grants if seq >= self.ack]


@dataclass
class RootShare:
    """One tier's part in the election of a root's walker (see the module docstring).
    Driven by the caretaker's thread; every method blocks on a few metadata calls."""

    root: str
    host: str = field(default_factory=socket.gethostname)
    tag: str = field(default_factory=new_tag)
    walker: bool = False
    # contributor
    gen: int = 0
    sent: int = 0                   # bytes of blocks appended to our logs, ever
    buffered: list[str] = field(default_factory=list)
    buffered_bytes: int = 0
    reserved: int = 0               # last published in our state record
    want: int = 0                   # (idem) reserved plus headroom: what we ask for
    log_size: int = 0
    published: dict | None = None   # the walker's last record we read
    read_at: float = 0.0
    granted: bool = False           # the walker lends room (it has a budget)
    limit: int = 0                  # our grant: sent + buffered + reserved stay within
    grant_seq: int = 0              # its number (we adopt only higher ones)
    ack: int = 0                    # the highest number we use and fit in
    shrunk: bool = False            # we adopted a smaller limit: the walker awaits our ack
    state_written: tuple | None = None
    # walker
    granting: bool = True           # lends room to the contributors (it has a budget)
    cursors: dict[str, _Cursor] = field(default_factory=dict)
    seq: int = 0
    others_reserved: int = 0        # the contributors' reservations, at the last fold
    grant_turn: int = 0             # whose ask grant() serves first
    unfolded_own: list[tuple[str, int]] = field(default_factory=list)  # see elect()
    inherited: int = 0              # the figure to trust until our walk ends (elect())
    former_hold: int = 0            # room a walker we took the seat from may fill
    former_gone_at: float | None = None  # when we saw it let the old seat go
    fold_at: float = 0.0
    publish_at: float = 0.0
    news: dict | None = None        # our last publication less its seq and time
    heartbeat_at: float = 0.0       # publish then even with no news (HEARTBEAT_S)
    elect_at: float = 0.0
    beat: tuple | None = None       # the walker's last (tag, seq) we saw, and when it
    beat_at: float | None = None    # changed (our clock): a stuck walker's stays put
    keep_at: float = 0.0
    _seat: int | None = None
    _alive: int | None = None
    _former: int | None = None      # the seat file we took over (its walker's lock)

    def __post_init__(self) -> None:
        self.root = os.path.normpath(self.root)
        self.dir = _ensure_meta_dir(self.root, SHARE_DIR)

    # -- election ----------------------------------------------------------------------

    def elect(self, now: float) -> bool:
        """Try the seat (at most every ELECT_GAP_S), or take it over from a walker whose
        publication stood still for SEAT_STALE_S; returns True when this call made this
        tier the walker. The seat is kept until :meth:`close`, the process's end, or a
        takeover (see :meth:`keep_seat`)."""
        if self.walker or now < self.elect_at:
            return False
        self.elect_at = now + ELECT_GAP_S
        fd, ino = _try_lock(f"{self.dir}/{SEAT_NAME}", create=True)
        former = None
        if fd is None and self._walker_stuck(now, ino):
            fd, former = self._usurp(ino)
        if fd is None:
            if self._alive is None:
                self._start_contributing()
            return False
        self._seat = fd
        self.walker = True
        self.keep_at = now + ELECT_GAP_S
        self.beat = self.beat_at = None
        self.news, self.publish_at = None, 0.0  # its first publication goes out at once
        # The last record read now, not the one we read as a contributor: the grants
        # it says are in force are counted (a contributor may store under them).
        last = read_usage(self.root) or self.published
        self.published = last
        # Carry on from what the last walker folded: the rest of each log is new to it.
        self.cursors.clear()
        for tag, entry in ((last or {}).get("folded") or {}).items():
            if str(tag) == self.tag:
                continue  # our own: unfolded_own below
            with contextlib.suppress(TypeError, ValueError, IndexError):
                cursor = _Cursor(int(entry[0]), int(entry[1]), int(entry[2]), alive_at=now)
                if len(entry) >= 7:
                    cursor.limit, cursor.grant_seq = int(entry[4]), int(entry[5])
                    cursor.grants = [(cursor.grant_seq, max(cursor.limit, int(entry[6])))]
                self.cursors[str(tag)] = cursor
        self.unfolded_own = self._unfolded_own(last)
        # What our figure must hold until our walk ends: the last one's, and the blocks
        # we created that it did not fold (our own grant stops counting with our log).
        self.inherited = self.last_usage + sum(n for _, n in self.unfolded_own)
        self._drop_former()
        if former is not None:
            # The walker we took the seat from stores on under its own room checks until
            # it sees the seat gone, and logs none of it: the room its last record left
            # free may be filled by it (module docstring, "A seat changing hands").
            self._former = former
            self.former_hold = _free_room(last)
        self._stop_contributing()
        return True

    def _unfolded_own(self, last: dict | None) -> list[tuple[str, int]]:
        """``(path, bytes)`` of the blocks this tier created as a contributor that the
        last walker did not fold (the rest of our log, and what we had not logged yet):
        the caller counts them, since our log goes now."""
        if self._alive is None:
            return []
        cursor = _Cursor(self.gen)
        entry = ((last or {}).get("folded") or {}).get(self.tag)
        with contextlib.suppress(TypeError, ValueError, IndexError):
            if int(entry[0]) == self.gen:  # type: ignore[index]
                cursor.offset = int(entry[1])  # type: ignore[index]
        found: list[tuple[str, int]] = []

        def add(path: str, nbytes: int) -> None:
            found.append((path, nbytes))

        self._read_log(self.tag, cursor, add)
        for line in self.buffered:
            self._fold_line(line.rstrip("\n").encode(), cursor, add)
        return found

    def _walker_stuck(self, now: float, seat_ino: int) -> bool:
        """Whether the walker's publication has stood still for SEAT_STALE_S (counted
        from when this tier first saw it, by its own clock: no clocks compared) while
        ``seat.lock`` stayed the same file (a new one is a new walker's)."""
        record = self.published or {}
        beat = (record.get("walker"), record.get("seq"), seat_ino)
        if beat != self.beat or self.beat_at is None:
            self.beat, self.beat_at = beat, now
            return False
        return now - self.beat_at >= SEAT_STALE_S

    def _usurp(self, stale_ino: int) -> tuple[int | None, int | None]:
        """Take the seat from a stuck walker: under ``usurp.lock``, replace ``seat.lock``
        if it is still the file judged stale (inode ``stale_ino``). Returns the new seat's
        fd (None when another tier got there first) and an fd of the stale file, whose
        lock tells when its walker let it go (None when it was gone already)."""
        guard = _locked_fd(f"{self.dir}/{USURP_NAME}", create=True)
        if guard is None:
            return None, None  # another tier is taking it over now
        seat = f"{self.dir}/{SEAT_NAME}"
        fd = old = None
        try:
            try:
                old = os.open(seat, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                              | os.O_CLOEXEC)
                if os.fstat(old).st_ino != stale_ino:
                    return None, None  # replaced already: whoever holds it is not judged
                os.unlink(seat)
            except FileNotFoundError:
                pass
            try:
                fd, _ = _try_lock(seat, create=True, exclusive=True)
            except FileExistsError:
                fd = None  # an ordinary election made it first: that tier walks
        finally:
            os.close(guard)
            if old is not None and fd is None:
                os.close(old)
        if fd is not None:
            log.warning(
                "mptier: the walker of root %s (%s) published nothing for %.0f s: tier %s "
                "takes its seat over", self.root, _walker_name(self.published), SEAT_STALE_S,
                self.tag)
        return fd, (old if fd is not None else None)

    def _drop_former(self) -> None:
        if self._former is not None:
            os.close(self._former)
        self._former, self.former_hold, self.former_gone_at = None, 0, None

    def _former_gone(self, now: float) -> None:
        """(Walker after a takeover.) Note when the walker we took the seat from let the
        old seat file go (it saw the seat gone and contributes, or its process ended):
        from then on its tier stores only within a grant, or not at all."""
        if self._former is not None and try_flock(self._former):
            os.close(self._former)
            self._former, self.former_gone_at = None, now

    def walked(self, began: float) -> None:
        """(Walker; the caller's walk ended a pass it began at ``began``, the clock of
        ``now``.) A pass begun after the walker we took the seat from let it go holds
        every block that walker's tier stored uncounted: its room stops counting."""
        if self.former_gone_at is not None and began >= self.former_gone_at:
            self._drop_former()

    def keep_seat(self, now: float) -> bool:
        """(Walker.) Whether the seat is still ours (checked at most every ELECT_GAP_S):
        False after another tier took it over while we stood still, and we are then a
        contributor again."""
        if not self.walker:
            return False
        if now < self.keep_at:
            return True
        self.keep_at = now + ELECT_GAP_S
        if still_named(self._seat, f"{self.dir}/{SEAT_NAME}"):
            return True
        os.close(self._seat)
        self._seat = None
        self.walker = False
        self.cursors.clear()
        self._drop_former()
        self.published = read_usage(self.root)
        self.elect_at = now + ELECT_GAP_S
        # A new contributor, under a new tag: the new walker knows nothing of our old
        # counts, and our grant starts at nothing.
        self.tag = new_tag()
        self._start_contributing()
        return False

    @property
    def last_usage(self) -> int:
        """The usage the last walker published (0 when none did)."""
        try:
            return max(0, int((self.published or {}).get("usage_bytes", 0)))
        except (TypeError, ValueError):
            return 0

    # -- contributor -------------------------------------------------------------------

    def _start_contributing(self) -> None:
        self.gen = self.sent = self.log_size = self.reserved = self.want = 0
        self.limit = self.grant_seq = self.ack = 0
        self.shrunk = False
        # Before any record is read the walker is taken to lend room (our stores wait
        # for its first answer), not to have no budget: a stepped-down walker's or a
        # first contributor's stores had the whole capacity by their own count else.
        self.granted = bool((self.published or {"grants": True}).get("grants"))
        self.state_written = None
        fd = os.open(f"{self.dir}/{self.tag}{ALIVE_SUFFIX}",
                     os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try_flock(fd)  # a new file (O_EXCL): nobody else holds it
        self._alive = fd
        self._write_state()

    def _stop_contributing(self) -> None:
        for name in self._own_files():
            with contextlib.suppress(OSError):
                os.unlink(name)
        if self._alive is not None:
            os.close(self._alive)
            self._alive = None
        self.buffered.clear()
        self.buffered_bytes = 0

    def _own_files(self) -> list[str]:
        d = self.dir
        return [f"{d}/{self.tag}{STATE_SUFFIX}", f"{d}/{self.tag}.{self.gen}{LOG_SUFFIX}",
                f"{d}/{self.tag}{ALIVE_SUFFIX}"]

    def _write_state(self) -> None:
        state = (self.gen, self.reserved, self.want, self.ack)
        publish_record(f"{self.dir}/{self.tag}{STATE_SUFFIX}",
                       {"gen": self.gen, "reserved": self.reserved, "want": self.want,
                        "sent": self.sent, "ack": self.ack, "limit": self.limit,
                        "host": self.host, "pid": os.getpid()})
        self.state_written = state
        if self.ack >= self.grant_seq:
            self.shrunk = False

    def created(self, relpath: str, nbytes: int) -> None:
        """(Contributor.) A block this tier created at ``relpath`` under the root."""
        self.buffered.append(f"{nbytes} {relpath}\n")
        self.buffered_bytes += nbytes

    def contribute(self, reserved: int, headroom: int = 0) -> None:
        """(Contributor.) Hand the walker the blocks created since the last call, the
        room reserved now (created and not logged yet, or reserved by stores), and ask
        for a limit that leaves ``headroom`` more (what the stores may take before the
        next answer: 0 when idle)."""
        if self.walker:
            return
        if self._alive is None:
            self._start_contributing()
        if self.buffered:
            log = f"{self.dir}/{self.tag}.{self.gen}{LOG_SUFFIX}"
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o644)
            try:
                data = "".join(self.buffered).encode()
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)  # close-to-open: the walker's next open sees it all
            self.log_size += len(data)
            self.sent += self.buffered_bytes
            self.buffered.clear()
            self.buffered_bytes = 0
        rotate = self.log_size >= LOG_ROTATE_BYTES and self._folded_here()[1] == (
            self.gen, self.log_size)
        if rotate:
            with contextlib.suppress(OSError):
                os.unlink(f"{self.dir}/{self.tag}.{self.gen}{LOG_SUFFIX}")
            self.gen += 1
            self.log_size = 0
        self.reserved, self.want = reserved, reserved + max(0, headroom)
        # An acknowledgement alone is worth a write only after a limit was taken back
        # (while limits only grow the largest is the newest, in force anyway): a write
        # is a few metadata round trips on a network file system.
        state = (self.gen, self.reserved, self.want, self.ack)
        written = self.state_written
        if rotate or written is None or state[:3] != written[:3] or (
                self.shrunk and self.ack != written[3]):
            self._write_state()

    def _folded_here(self) -> tuple[int, tuple[int, int]]:
        entry = ((self.published or {}).get("folded") or {}).get(self.tag)
        try:
            gen, offset, folded = entry[:3]  # type: ignore[index]
            return int(folded), (int(gen), int(offset))
        except (TypeError, ValueError):
            return 0, (-1, -1)

    def refresh(self, now: float) -> None:
        """(Contributor.) Read the walker's publication again (at most every READ_GAP_S)
        and adopt the grant it names for us if its number is higher than ours (a stale
        record, or one from a walker that did not know our grant yet, changes nothing)."""
        if now < self.read_at:
            return
        self.read_at = now + READ_GAP_S
        record = read_usage(self.root)
        if record is None:
            return
        self.published = record
        self.granted = bool(record.get("grants"))
        entry = (record.get("folded") or {}).get(self.tag)
        try:
            limit, seq = int(entry[4]), int(entry[5])  # type: ignore[index]
        except (TypeError, ValueError, IndexError):
            return
        if seq > self.grant_seq:
            self.shrunk = self.shrunk or limit < self.limit
            self.limit, self.grant_seq = max(0, limit), seq

    def grant_left(self) -> int:
        """(Contributor.) Bytes our stores may still reserve or create under our limit
        (less whatever they reserved or created since the last collection)."""
        return self.limit - self.sent - self.buffered_bytes

    def acknowledge(self, pending: int) -> None:
        """(Contributor.) Say, with the next record, that we use the newest limit we
        adopted, once our room checks count it (the caller published it first) and what
        we created plus ``pending`` (created and not logged yet, or reserved) fits in it:
        the walker then stops counting older, larger limits."""
        if self.grant_seq > self.ack and \
                self.sent + self.buffered_bytes + pending <= self.limit:
            self.ack = self.grant_seq

    def room_held(self, capacity: int) -> int:
        """Bytes of ``capacity`` this tier's room checks count as held beyond its usage
        figure (ControlBlock.usage_now): the walker's, every contributor's limit in force
        not yet folded; a contributor's, all the capacity but what its limit leaves it
        (with :meth:`usage_for_tier` as its usage, its room is then exactly
        :meth:`grant_left` less its stores' pending bytes). 0 without grants."""
        if self.walker:
            return self.outstanding() if self.granting else 0
        if not self.granted or not capacity:
            return 0
        return capacity - self.usage_for_tier() - self.grant_left()

    def usage_for_tier(self) -> int:
        """(Contributor.) The root's usage as this tier counts it: the walker's figure
        plus the blocks this tier created that the figure does not hold yet."""
        folded = self._folded_here()[0]
        return self.last_usage + max(0, self.sent + self.buffered_bytes - folded)

    @property
    def published_complete(self) -> bool:
        return bool((self.published or {}).get("complete"))

    # -- walker ------------------------------------------------------------------------

    def fold(self, now: float, record_store: Callable[[str, int], None]) -> int:
        """(Walker.) Count the blocks the contributors created since the last fold
        (``record_store(path, nbytes)`` for each), take in their records (reservations,
        asks, acknowledgements) and return the room their stores hold beyond the usage
        (what eviction must leave room for: created and not folded, or reserved; the
        headroom they ask for comes out of the walker's slack, see :meth:`grant`). At
        most every FOLD_GAP_S (else the figure of the last fold)."""
        if now < self.fold_at:
            return self._held_or_asked()
        self.fold_at = now + FOLD_GAP_S
        try:
            names = os.listdir(self.dir)
        except OSError:
            return self._held_or_asked()
        tags = {n[:-len(STATE_SUFFIX)] for n in names
                if n.endswith(STATE_SUFFIX) and n != USAGE_NAME and "." not in
                n[:-len(STATE_SUFFIX)]}
        for tag in tags:
            if tag == self.tag:
                continue
            state = read_record(f"{self.dir}/{tag}{STATE_SUFFIX}")
            cursor = self.cursors.get(tag)
            if cursor is None:  # a newcomer: answered at once, then at PUBLISH_GAP_S
                cursor = self.cursors[tag] = _Cursor(alive_at=now)
                self.publish_at = min(self.publish_at, now)
            if state is None:
                continue
            try:
                gen, cursor.reserved = int(state.get("gen", 0)), max(0, int(
                    state.get("reserved", 0)))
                cursor.want = max(0, int(state.get("want", cursor.reserved)))
                cursor.sent = max(0, int(state.get("sent", 0)))
                cursor.used = max(0, int(state.get("limit", 0)))
                cursor.acknowledged(max(0, int(state.get("ack", 0))))
            except (TypeError, ValueError):
                continue
            self._read_log(tag, cursor, record_store)
            if gen > cursor.gen:  # a new log: the old one was folded to its end
                cursor.gen, cursor.offset = gen, 0
                self._read_log(tag, cursor, record_store)
            if now - cursor.alive_at >= ALIVE_CHECK_S:
                if self._contributor_alive(tag):
                    cursor.alive_at = now
                else:
                    self._reap(tag, cursor)
        for tag in [t for t in self.cursors if t not in tags]:
            cursor = self.cursors[tag]
            if now - cursor.alive_at < ALIVE_CHECK_S:
                continue
            if self._contributor_alive(tag):  # its record gone, itself not: its grant
                cursor.alive_at = now         # still counts
            else:
                self._reap(tag, cursor)  # gone (closed, or dead and reaped): nothing more
        self.others_reserved = sum(c.reserved for c in self.cursors.values())
        self._former_gone(now)
        return self._held_or_asked()

    def _held_or_asked(self) -> int:
        if not self.granting:
            return self.others_reserved
        return self.former_hold + sum(max(0, c.hard - c.folded)
                                      for c in self.cursors.values())

    def outstanding(self) -> int:
        """(Walker.) The contributors' limits in force less what was folded of them,
        and the room a walker whose seat we took may fill (:attr:`former_hold`): room
        they may have used or may use without the walker's count holding it."""
        return self.former_hold + sum(max(0, c.in_force - c.folded)
                                      for c in self.cursors.values())

    def asking(self) -> int:
        """(Walker.) Bytes the contributors ask beyond their limits."""
        return sum(max(0, c.need - c.limit) for c in self.cursors.values())

    def grant(self, free: int, headroom: int) -> int:
        """(Walker, just before :meth:`publish`.) Raise the contributors' limits towards
        what they ask, by ``free`` bytes at most in all: first what their stores hold
        (``hard``), then their headroom, while the headroom given and not used stays
        within ``headroom`` (the walker's slack: eviction keeps that much free beyond
        what is held, so a store's hold can always be granted once eviction made room
        for it, and the room kept free is the slack, whatever the number of tiers).
        Then take back what an idle one does not ask for any more (only once it
        acknowledged the last one taken back: one in flight at a time). The limits given
        count at once (:meth:`outstanding`). Returns the bytes given."""
        give = max(0, free)
        given = 0
        # Whole asks, the contributor served first changing at each call: a store can
        # use only whole blocks, so shares of a short room would leave every one short.
        tags = list(self.cursors)
        self.grant_turn = (self.grant_turn + 1) % max(1, len(tags))
        order = [self.cursors[t] for t in tags[self.grant_turn:] + tags[:self.grant_turn]]
        for cursor in order:
            more = min(max(0, cursor.hard - cursor.limit), give - given)
            if more > 0:
                cursor.set_limit(cursor.limit + more)
                given += more
        unused = sum(max(0, c.in_force - c.hard) for c in order)
        for cursor in order:
            more = min(max(0, cursor.need - cursor.limit), give - given, headroom - unused)
            if more > 0:
                cursor.set_limit(cursor.limit + more)
                given += more
                unused += more
        for cursor in order:
            if cursor.need < cursor.limit == cursor.in_force:  # no smaller one pending
                cursor.set_limit(cursor.need)
        return given

    def publish_due(self, now: float) -> bool:
        """(Walker.) Whether :meth:`publish` may publish now (PUBLISH_GAP_S with
        contributors, ALONE_PUBLISH_S without)."""
        return now >= self.publish_at

    def _read_log(self, tag: str, cursor: _Cursor,
                  record_store: Callable[[str, int], None]) -> None:
        path = f"{self.dir}/{tag}.{cursor.gen}{LOG_SUFFIX}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return
            while True:
                data = os.pread(fd, LOG_READ_BYTES, cursor.offset)
                end = data.rfind(b"\n") + 1
                if not end:
                    return
                for line in data[:end].splitlines():
                    self._fold_line(line, cursor, record_store)
                cursor.offset += end
                if len(data) < LOG_READ_BYTES:
                    return
        except OSError:
            return
        finally:
            os.close(fd)

    def _fold_line(self, line: bytes, cursor: _Cursor,
                   record_store: Callable[[str, int], None]) -> None:
        size_text, _, rel = line.decode(errors="replace").partition(" ")
        try:
            size = int(size_text)
        except ValueError:
            return
        parts = rel.split("/")
        if size <= 0 or not rel or rel.startswith("/") or ".." in parts \
                or parts[0] == N.META_DIR:
            return  # not a block path under the root: ignored
        cursor.folded += size
        record_store(f"{self.root}/{rel}", size)

    def _contributor_alive(self, tag: str) -> bool:
        try:
            fd = _locked_fd(f"{self.dir}/{tag}{ALIVE_SUFFIX}", create=False)
        except OSError:
            return False  # no lock file: the contributor is gone
        if fd is None:
            return True
        os.close(fd)
        return False

    def _reap(self, tag: str, cursor: _Cursor) -> None:
        """A contributor whose lock is free died: its reservations and grant stop
        counting and its files go (what its log still held was folded just before)."""
        cursor.reserved = 0
        for name in (f"{tag}{STATE_SUFFIX}", f"{tag}.{cursor.gen}{LOG_SUFFIX}",
                     f"{tag}{ALIVE_SUFFIX}"):
            with contextlib.suppress(OSError):
                os.unlink(f"{self.dir}/{name}")
        self.cursors.pop(tag, None)

    def publish(self, now: float, usage_bytes: int, usage_blocks: int, complete: bool,
                capacity_bytes: int, held_bytes: int = 0, force: bool = False) -> None:
        """(Walker.) Publish the root's usage (at most every PUBLISH_GAP_S while other
        tiers contribute and it changed, else every HEARTBEAT_S; while none does, when
        it changed and at most every ALONE_PUBLISH_S) and
        ``held_bytes``, what the walker's own tier's stores hold beyond it (reserved, or
        created and not counted yet), plus the contributors' grants not folded; per
        contributor ``[gen, offset, folded, reserved, limit, its number, limit in
        force]``."""
        if not force and now < self.publish_at:
            return
        if not self.keep_seat(now):
            return  # taken over while we stood still: the new walker publishes
        self.publish_at = now + (PUBLISH_GAP_S if self.cursors else ALONE_PUBLISH_S)
        news = {"walker": self.tag, "host": self.host, "pid": os.getpid(),
                "usage_bytes": usage_bytes, "usage_blocks": usage_blocks,
                "complete": complete, "capacity_bytes": capacity_bytes,
                "grants": self.granting, "held_bytes": held_bytes + self.outstanding(),
                "folded": {t: [c.gen, c.offset, c.folded, c.reserved, c.limit,
                               c.grant_seq, c.in_force]
                           for t, c in self.cursors.items()}}
        if not force and news == self.news and (not self.cursors or now < self.heartbeat_at):
            return  # nothing new: alone nobody judges a heartbeat, else the next will do
        self.news, self.heartbeat_at = news, now + HEARTBEAT_S
        self.seq += 1
        record = {**news, "seq": self.seq, "at": time.time()}
        publish_record(f"{self.dir}/{USAGE_NAME}", record)
        self.published = record

    def close(self) -> None:
        """Give up the seat, or stop contributing (our files go)."""
        if self._alive is not None or not self.walker:
            self._stop_contributing()
        if self._seat is not None:
            os.close(self._seat)
            self._seat = None
        self._drop_former()
        self.walker = False

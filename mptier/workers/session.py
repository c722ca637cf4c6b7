"""A session: one engine's share of the work, as the pool and its workers see it.

An engine (a :class:`~mptier.manager.FileSystemTier`) owns its queues, its completion
pipe, its lifeline and its buffer. To get work done it hands the pool a :class:`Session`:
the descriptors of those, the buffer's layout and the file layout. The pool keeps its own
copies of the descriptors (so a replacement worker can be handed them later) and passes
them to each worker over its control socket. The session ends when the engine closes its
lifeline (shutdown, or the engine died): every worker detaches, unmaps the buffer and
waits for the next session -- in a service the same processes serve the next engine.

What travels is split in two: :class:`Session` (the engine's: channels, buffer, layout)
and :class:`IoSettings` (the pool's: root, O_DIRECT, backend, prefault), because in a
service the root and I/O settings come from the service's configuration while the file
layout comes from the engine.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar

from mptier.config import default_of
from mptier.jobs import TaskKind
from mptier.mapping import Segment

# Order in which a worker of each role looks at the queues: lookups gate the engine's
# scheduling and are tiny, so everyone takes them first; then its own priority's queue;
# then the other one, so neither side starves while the other has nothing to do.
QUEUE_ORDER = {
    "load": (TaskKind.LOOKUP, TaskKind.LOAD, TaskKind.STORE),
    "store": (TaskKind.LOOKUP, TaskKind.STORE, TaskKind.LOAD),
}


@dataclass
class RootIo:
    """What the probes found on one root (JSON-able)."""

    path: str
    use_o_direct: bool = False
    checksum: bool = False
    tmpfile: bool = False
    uring: bool = False
    bounce: bool = False  # process workers load through a bounce buffer (bounce.py)
    bounce_stores: bool = False  # ... and store through it (TierConfig.bounce_stores)
    # The caretaker makes the block folder's <h3> folders ahead and the walk keeps them
    # (TierConfig.folders_ahead as it came out for this root; mptier.storage.folders).
    folders_ahead: bool = False


@dataclass
class IoSettings:
    """The pool's side of how blocks are read and written (JSON-able).

    ``root_dir``, ``use_o_direct``, ``checksum`` and ``tmpfile`` describe the first root;
    ``roots`` has every root's (several roots: ``root_dirs``). Fields named as
    TierConfig's take its defaults, except :attr:`RESOLVED`: those hold what the probe
    (or the setting) came to on this machine, not the setting."""

    RESOLVED: ClassVar[frozenset[str]] = frozenset({"use_o_direct", "lease_locks"})

    root_dir: str
    use_o_direct: bool = False
    backend: str = "native"  # "native" or "python"
    prefault: bool = default_of("prefault")
    checksum: bool = False  # write and verify vLLM's CRC32C record (user xattr)
    touch: bool = True  # set a block's atime on load and store (LRU on shared roots)
    tmpfile: bool = False  # publish through O_TMPFILE files (probed: they survive close)
    uring: bool = False  # batches through io_uring, several blocks in flight
    bounce_waves: bool = default_of("bounce_waves")  # bounced loads read in waves
    ring_lookups: bool = default_of("ring_lookups")  # a lookup's opens in the ring at once
    roots: list[RootIo] = field(default_factory=list)  # empty: root_dir alone
    capacity_bytes: int = default_of("capacity_bytes")  # per root; 0 = unlimited
    eviction_policy: str = default_of("eviction_policy")
    high_watermark: float = default_of("high_watermark")
    low_watermark: float = default_of("low_watermark")
    stale_temp_s: float = default_of("stale_temp_s")
    lease_locks: bool | None = None  # None: probe each root (mptier.storage.probe_locks)
    # How long a store waits for the caretaker to make room before failing (ENOSPC).
    # A store waits at most this long for the caretaker to evict enough for it before
    # it fails with ENOSPC (TierConfig.room_wait_s, at most a quarter of io_timeout_s).
    room_wait_s: float = default_of("room_wait_s")

    def __post_init__(self) -> None:
        self.roots = [r if isinstance(r, RootIo) else RootIo(**r) for r in self.roots]
        if not self.roots:
            self.roots = [RootIo(self.root_dir, self.use_o_direct, self.checksum,
                                 self.tmpfile, self.uring)]

    @property
    def root_dirs(self) -> list[str]:
        return [r.path for r in self.roots]

    def flags(self, root: int = 0) -> int:
        """The native layer's flags for root ``root`` (index into ``roots``)."""
        from mptier import native

        r = self.roots[root]
        return ((native.O_DIRECT if r.use_o_direct else 0)
                | (native.CHECKSUM if r.checksum else 0)
                | (native.TOUCH if self.touch else 0)
                | (native.TMPFILE if r.tmpfile else 0)
                | (native.URING if r.uring else 0)
                | (0 if self.bounce_waves else native.WHOLE_BOUNCE)
                | (0 if self.ring_lookups else native.LOOP_LOOKUP))

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> IoSettings:
        return cls(**data)


@dataclass
class Session:
    """The engine's descriptors and layouts for one attachment (see module docstring).

    ``queues`` are read ends (workers take records from them; the supervisor drains
    them to fail queued work when the pool cannot serve), ``completion`` the write end
    of the engine's completion pipe, ``lifeline`` the read end of a pipe only
    the engine can write (end of file = the session is over), ``doorbell`` a pipe pair
    workers use to wake each other.
    """

    queues: dict[TaskKind, int]
    completion: int
    lifeline: int
    doorbell: tuple[int, int]
    segments: list[Segment]
    nbytes: int
    block_bytes: int
    layout: dict[str, Any]
    engine_pid: int
    label: str = ""  # who the engine is, for messages ("engine pid 1234")
    closed: bool = field(default=False, repr=False)

    # -- descriptors ---------------------------------------------------------------------

    def _worker_fds(self) -> list[int]:
        return [*(self.queues[k] for k in TaskKind), self.completion, self.lifeline,
                *self.doorbell, *(s.fd for s in self.segments)]

    def descriptors(self) -> list[int]:
        """Every descriptor the session holds."""
        return self._worker_fds()

    def dup(self) -> Session:
        """A copy holding descriptors of its own (the caller closes it)."""
        made: list[int] = []

        def d(fd: int) -> int:
            new = os.dup(fd)
            made.append(new)
            return new

        try:
            return replace(
                self, queues={k: d(fd) for k, fd in self.queues.items()},
                completion=d(self.completion), lifeline=d(self.lifeline),
                doorbell=(d(self.doorbell[0]), d(self.doorbell[1])),
                segments=[replace(s, fd=d(s.fd)) for s in self.segments], closed=False)
        except BaseException:
            for fd in made:
                os.close(fd)
            raise

    def close(self) -> None:
        """Close every descriptor this copy holds. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for fd in self.descriptors():
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- the wire (supervisor -> worker) -------------------------------------------------

    def to_worker(self) -> tuple[dict[str, Any], list[int]]:
        """What a worker gets: a JSON-able description and the descriptors it names
        (by position)."""
        fds = self._worker_fds()
        description = {
            "nbytes": self.nbytes, "block_bytes": self.block_bytes, "layout": self.layout,
            "engine_pid": self.engine_pid, "label": self.label,
            "segments": [{**asdict(s), "fd": None} for s in self.segments],
        }
        return description, fds


@dataclass
class WorkerSession:
    """A session as one worker received it: descriptors it owns and must close."""

    queues: dict[TaskKind, int]
    completion: int
    lifeline: int
    doorbell: tuple[int, int]
    segments: list[Segment]
    nbytes: int
    block_bytes: int
    layout: dict[str, Any]
    engine_pid: int
    label: str

    @classmethod
    def from_wire(cls, description: dict[str, Any], fds: list[int]) -> WorkerSession:
        n_queues = len(TaskKind)
        expected = n_queues + 4 + len(description["segments"])
        if len(fds) != expected:
            raise ValueError(f"session message carried {len(fds)} descriptors, "
                             f"expected {expected}")
        queues = dict(zip(TaskKind, fds[:n_queues]))
        completion, lifeline, bell_r, bell_w = fds[n_queues:n_queues + 4]
        segments = [Segment(**{**seg, "fd": fd}) for seg, fd in
                    zip(description["segments"], fds[n_queues + 4:])]
        return cls(queues=queues, completion=completion, lifeline=lifeline,
                   doorbell=(bell_r, bell_w), segments=segments,
                   nbytes=description["nbytes"], block_bytes=description["block_bytes"],
                   layout=description["layout"], engine_pid=description["engine_pid"],
                   label=description.get("label", ""))

    def close(self) -> None:
        """Close every descriptor still held (a mapped segment's is already closed and
        set to -1). Call once."""
        for fd in (*self.queues.values(), self.completion, self.lifeline, *self.doorbell,
                   *(s.fd for s in self.segments)):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

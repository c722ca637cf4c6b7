"""The pool contract: what the engine's manager may ask of its workers, and nothing more.

Three kinds of pool implement :class:`Pool`: :class:`~mptier.workers.pool.WorkerPool`
(worker processes kept by a supervisor thread), :class:`~mptier.workers.threads.ThreadWorkers`
(the same serving loop on threads, for a buffer other processes cannot map) and
:class:`~mptier.service.ServiceLink` (the workers of a ``mptier serve`` service). The
manager (:class:`~mptier.FileSystemTier`) talks to its pool through these members only;
the control block, the supervisor and the link's socket stay behind them.

Blocking: ``start``, ``attach``, ``end_session`` and ``stop`` block, each for a bounded
time, on the thread that builds or shuts down the tier. Every other member never blocks
and may be called from the engine's scheduler thread at any rate: ``serving`` and
``news`` are on the hot path (one shared-memory read each).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from mptier.workers.session import IoSettings, Session


@runtime_checkable
class Pool(Protocol):
    """The door between the manager and whatever runs its I/O (see module docstring)."""

    # "processes", "threads" or "service": what stats() calls the tier's mode.
    mode: str
    # What the workers do (probed per root at attach; the service's when attached to
    # one). None until attach() returned.
    io: IoSettings | None

    def start(self) -> None:
        """Boot the workers; blocks until they are ready. Raises ``MptierError`` naming
        why they cannot start."""
        ...

    def attach(self, session: Session) -> IoSettings:
        """Prepare the roots for ``session``'s layout and hand the session to the workers;
        blocks (bounded). The pool keeps its own copies of the session's descriptors.
        Raises ``MptierError``, ``OSError`` or ``ConfigError`` and keeps no session then."""
        ...

    def serving(self) -> bool:
        """Whether the pool takes work now (the engine queues tasks only then)."""
        ...

    def refusal(self) -> tuple[int, str]:
        """``(errno, reason)`` to fail work with while :meth:`serving` is False."""
        ...

    def news(self) -> Hashable:
        """A token that changes whenever a worker (or the supervisor) reported something
        on the completion pipe: while it stays equal, there is nothing to read."""
        ...

    def settle_lost(self, fail_all: Callable[[str, int], object]) -> None:
        """When the workers' side went away wholesale since the last call (a service
        stopped or died), call ``fail_all(reason, errno)`` -- the caller fails every job
        in flight and everything still queued -- and then let the pool attach again.

        The default is right for a pool in this process: its workers die one at a time
        and the supervisor retries or fails exactly the tasks each held, so nothing is
        ever lost wholesale and ``fail_all`` is never called."""
        return None

    def stats(self) -> dict[str, Any]:
        """Counters, state (``"unavailable"``: the reason or "") and one entry per worker;
        after :meth:`stop`, the last figures."""
        ...

    def root_figures(self) -> list[dict[str, Any]]:
        """Each root's health and usage now (empty before attach, and after stop)."""
        ...

    def pids(self) -> list[int]:
        """The workers' process ids (none for threads)."""
        ...

    def end_session(self, ask_workers: bool = False, timeout_s: float = 10.0,
                    on_wait: Callable[[], object] | None = None) -> None:
        """After the engine closed its lifeline (or with ``ask_workers``, to make them
        stop): wait, at most ``timeout_s``, until no worker serves the session;
        ``on_wait`` runs between checks (the manager reads completions there)."""
        ...

    def stop(self, grace_s: float = 10.0,
             on_wait: Callable[[], object] | None = None) -> list[str]:
        """Make the workers leave, escalating; returns descriptions of those that had to
        be forced or were left behind. Idempotent."""
        ...


# The members the manager may use: the Protocol's own (tests check both sides by it).
POOL_MEMBERS = frozenset(
    name for name in (*Pool.__dict__, *Pool.__annotations__)
    if not name.startswith("_"))

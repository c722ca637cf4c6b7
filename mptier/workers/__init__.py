"""mptier's workers: the processes that do the I/O, and the pool that keeps them.

This package has one door, :class:`Pool` (:mod:`mptier.workers.contract`): the engine's
manager talks to its pool through that contract and nothing else::

    from mptier.workers import PoolSettings, open_pool

    pool = open_pool(PoolSettings.from_config(cfg))   # or open_pool(..., memory) -> threads
    pool.start()                                      # boot the workers (blocks, bounded)
    io = pool.attach(session)                         # hand them the engine's channels
    pool.serving(), pool.news(), pool.stats()         # never block
    pool.end_session(); pool.stop()                   # detach, then leave

What else it exports is for the other side of a service: :class:`WorkerPool` (what
``mptier serve`` runs), :class:`Session` and :class:`IoSettings` (what crosses its
socket), :class:`ControlBlock`, :class:`PoolState` and :func:`root_figures` (the
service's control block, as its :class:`~mptier.service.ServiceLink` maps and reads it).

Inside: ``contract`` (the door), ``pool`` (the process pool and ``open_pool``),
``threads`` (the pool on the engine's threads), ``poolbase`` (what both share: their
settings), ``probe`` (preparing roots), ``figures`` (stats from the control block),
``supervisor`` (the thread that keeps the pool, in parts: ``spawning``, ``held``,
``watchdog``, ``assignment`` over ``supervised``), ``worker`` (the process: boot,
sessions; ``serving``, the task loop, over ``context`` and ``rootio``, the keys on
roots, with ``rootgate``, a root's health gate and block folder; ``orphan``, leaving
after the supervisor), ``launcher`` (starting one process), ``protocol`` (supervisor
<-> worker control messages), ``session`` (what an engine hands over), ``control``
(the shared control block). Names are imported on first use so that worker processes,
which import ``mptier.workers.worker``, do not pay for the pool's modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Pool": "mptier.workers.contract",
    "WorkerPool": "mptier.workers.pool",
    "PoolSettings": "mptier.workers.poolbase",
    "open_pool": "mptier.workers.pool",
    "root_figures": "mptier.workers.figures",
    "Session": "mptier.workers.session",
    "IoSettings": "mptier.workers.session",
    "ControlBlock": "mptier.workers.control",
    "PoolState": "mptier.workers.control",
}

__all__ = [
    "ControlBlock",
    "IoSettings",
    "Pool",
    "PoolSettings",
    "PoolState",
    "Session",
    "WorkerPool",
    "open_pool",
    "root_figures",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mptier.workers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from mptier.workers.contract import Pool
    from mptier.workers.control import ControlBlock, PoolState
    from mptier.workers.figures import root_figures
    from mptier.workers.pool import WorkerPool, open_pool
    from mptier.workers.poolbase import PoolSettings
    from mptier.workers.session import IoSettings, Session

"""mptier's workers: the processes that do the I/O, and the pool that keeps them.

This package has one door for the engine (and for ``mptier serve``)::

    from mptier.workers import PoolSettings, Session, open_pool

    pool = open_pool(PoolSettings.from_config(cfg))   # or open_pool(..., memory) -> threads
    pool.start()                                      # boot the workers (blocks, bounded)
    io = pool.attach(session)                         # hand them the engine's channels
    pool.control                                      # the shared control block
    pool.stats(), pool.unavailable()                  # never block
    pool.end_session(); pool.stop()                   # detach, then leave

Inside: ``pool`` (the door), ``supervisor`` (the thread that keeps the pool: deaths,
hangs, stuck workers, heartbeats), ``worker`` (the process: boot, sessions, the task
loop), ``launcher`` (starting one process), ``protocol`` (supervisor <-> worker control
messages), ``session`` (what an engine hands over), ``control`` (the shared control
block). Names are imported on first use so that worker processes, which import
``mptier.workers.worker``, do not pay for the pool's modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "WorkerPool": "mptier.workers.pool",
    "ThreadWorkers": "mptier.workers.pool",
    "PoolSettings": "mptier.workers.pool",
    "open_pool": "mptier.workers.pool",
    "backend_name": "mptier.workers.pool",
    "Session": "mptier.workers.session",
    "IoSettings": "mptier.workers.session",
    "ControlBlock": "mptier.workers.control",
    "PoolState": "mptier.workers.control",
}

__all__ = [
    "ControlBlock",
    "IoSettings",
    "PoolSettings",
    "PoolState",
    "Session",
    "ThreadWorkers",
    "WorkerPool",
    "backend_name",
    "open_pool",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mptier.workers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from mptier.workers.control import ControlBlock, PoolState
    from mptier.workers.pool import (
        PoolSettings,
        ThreadWorkers,
        WorkerPool,
        backend_name,
        open_pool,
    )
    from mptier.workers.session import IoSettings, Session

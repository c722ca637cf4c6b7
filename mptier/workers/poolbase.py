"""What the two pool kinds of this process share: the settings they run with, the
graces of their ``stop`` and ``end_session``, and the contract members they answer
from their own control block.

:class:`~mptier.workers.pool.WorkerPool` (processes) and
:class:`~mptier.workers.threads.ThreadWorkers` (threads of the engine) both build on
it; roots are prepared by :mod:`~mptier.workers.probe`, figures read by
:mod:`~mptier.workers.figures`.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from mptier import native
from mptier.config import default_of
from mptier.workers.control import ControlBlock
from mptier.workers.figures import root_figures
from mptier.workers.session import IoSettings
from mptier.workers.supervised import SupervisionSettings

if TYPE_CHECKING:
    from mptier.config import TierConfig

# stop(): how long workers get to finish their copy and leave when asked (the other
# graces, after SIGTERM and SIGKILL, are the process pool's: mptier.workers.pool).
STOP_GRACE_S = 10.0
# How long end_session() waits for workers to report they detached.
DETACH_GRACE_S = 10.0


@dataclass
class PoolSettings(SupervisionSettings):
    """How a pool runs; built from a :class:`~mptier.config.TierConfig` by
    :meth:`from_config` (a service's config in a service, the engine's otherwise).

    Every field but ``backend`` is the TierConfig field of the same name, with its
    default (:func:`~mptier.config.default_of`); ``backend`` is what ``native`` comes to
    in this process (:func:`backend_name`). The supervisor's own fields come from
    :class:`~mptier.workers.supervised.SupervisionSettings` (keyword arguments)."""

    root_dir: str  # the first root (or the only one)
    n_load_workers: int = default_of("n_load_workers")
    n_store_workers: int = default_of("n_store_workers")
    use_o_direct: bool | str = default_of("use_o_direct")
    checksum_blocks: bool | str = default_of("checksum_blocks")
    io_uring: bool | str = default_of("io_uring")
    bounce_loads: bool | str = default_of("bounce_loads")
    bounce_stores: bool | str = default_of("bounce_stores")
    bounce_waves: bool = default_of("bounce_waves")
    ring_lookups: bool = default_of("ring_lookups")
    folders_ahead: bool | str = default_of("folders_ahead")
    backend: str = "native"
    prefault: bool = default_of("prefault")
    worker_nice: int = default_of("worker_nice")
    worker_cpus: list[int] = field(default_factory=list)
    root_dirs: list[str] = field(default_factory=list)  # several roots (else root_dir)
    capacity_bytes: int = default_of("capacity_bytes")
    eviction_policy: str = default_of("eviction_policy")
    high_watermark: float = default_of("high_watermark")
    low_watermark: float = default_of("low_watermark")
    room_wait_s: float = default_of("room_wait_s")
    stale_temp_s: float = default_of("stale_temp_s")
    lease_locks: bool | str = default_of("lease_locks")

    @classmethod
    def from_config(cls, cfg: TierConfig) -> PoolSettings:
        """Every field from ``cfg``'s field of the same name (the roots normalised)."""
        roots = cfg.roots()
        same = {f.name: copy.copy(getattr(cfg, f.name)) for f in fields(cls)
                if f.name not in ("root_dir", "root_dirs", "backend")}
        return cls(root_dir=roots[0] if roots else "", root_dirs=roots,
                   backend=backend_name(cfg.native), **same)

    @property
    def roles(self) -> list[str]:
        return ["load"] * self.n_load_workers + ["store"] * self.n_store_workers

    @property
    def roots(self) -> list[str]:
        """Every root, normalised (``root_dirs``, else ``[root_dir]``)."""
        return [os.path.normpath(r) for r in (self.root_dirs or [self.root_dir])]

    @property
    def root_label(self) -> str:
        return ", ".join(self.roots)


def backend_name(prefer_native: bool) -> str:
    """The I/O backend a tier uses: native when asked for, built, and not switched off
    for the whole process with ``MPTIER_NATIVE=0``."""
    return "native" if prefer_native and native.BACKEND == "native" else "python"


class ControlDoor:
    """The :class:`~mptier.workers.contract.Pool` members a pool in this process answers
    from its own control block (never blocks: shared-memory reads)."""

    control: ControlBlock
    io: IoSettings | None

    def serving(self) -> bool:
        return self.control.pool_serving()

    def refusal(self) -> tuple[int, str]:
        _, err, reason = self.control.pool_state()
        return err, reason

    def news(self) -> bytes:
        return self.control.counters_snapshot()

    def root_figures(self) -> list[dict[str, Any]]:
        return root_figures(self.control, self.io) if self.io is not None else []

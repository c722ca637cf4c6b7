"""The one interface every compared design implements, so the harness drives them alike.

A design is set up on a fresh folder and the shared primary buffer, then fed jobs from
the harness's scheduler loop (see :mod:`mptier.bench.harness`). Every call below runs on
the harness's main thread -- the thread that plays the engine's scheduler -- and the
``submit_*``, ``get_finished``, ``lookup`` and ``on_schedule_end`` calls are the ones
whose cost the benchmark reports, so adapters add nothing around the design's own call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from mptier.jobs import TransferJob
from mptier.layout import FileMapper

MODEL_NAME = "bench-model"


@dataclass
class DesignContext:
    """What a design gets at set-up.

    ``array`` is the primary buffer, shape ``(num_blocks, block_bytes)``, ``uint8``;
    ``shared`` is the ``mptier.shm.SharedKVBuffer`` behind it when mptier's own buffer
    class was available (worker processes map that), else ``None``; ``root`` is a fresh
    folder of this design alone; ``mapper`` maps keys to block files under it.
    """

    array: np.ndarray
    shared: Any
    root: str
    block_bytes: int
    mapper: FileMapper

    @property
    def memory(self) -> memoryview:
        """The whole buffer as one flat writable byte view."""
        return memoryview(self.array).cast("B")


class FinishedJob(Protocol):
    job_id: int
    success: bool


class Design:
    """Base of the job-driven designs (a), (b), (c).

    ``letter`` says which column of the comparison it is (``"a"`` mptier, ``"b"`` the
    in-process reference, ``"c"`` the reference pool with native I/O); ``label`` names
    the variant in tables (``"mptier:nice=19"``).
    """

    letter = "?"
    kind = "design"
    supports_lookup = True

    def __init__(self, label: str, options: dict[str, str] | None = None) -> None:
        self.label = label
        self.options = dict(options or {})
        self.info: dict[str, Any] = {}
        self.notes: list[str] = []

    @classmethod
    def available(cls) -> str | None:
        """``None`` when this design can run here, else the reason it cannot."""
        return None

    def refusal(self) -> str | None:
        """``None``, or why this design must not run here although it could (an error
        the bench stops on before any work, where :meth:`available`'s reason skips)."""
        return None

    def setup(self, ctx: DesignContext) -> None:
        raise NotImplementedError

    def make_job(self, job_id: int, keys: list[bytes], block_ids: list[int],
                 kind: str = "store") -> Any:
        """The job record the design's ``submit_*`` takes (built outside the timed call);
        ``kind`` is ``"store"`` or ``"load"``."""
        return TransferJob(job_id, keys, block_ids)

    def block_path(self, ctx: DesignContext, key: bytes) -> str:
        """Where this design keeps the file of ``key`` (the harness removes or corrupts
        files by it)."""
        return ctx.mapper.path_for(key)

    def submit_store(self, job: Any) -> None:
        raise NotImplementedError

    def submit_load(self, job: Any) -> None:
        raise NotImplementedError

    def get_finished(self) -> list[FinishedJob]:
        raise NotImplementedError

    def lookup(self, key: bytes, req_id: str) -> Any:
        raise NotImplementedError

    def on_schedule_end(self) -> None:
        """Once per scheduler step (flushes batched lookups where the design has them)."""

    def drain(self) -> None:
        """Block until every submitted job finished."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


@dataclass
class RawOutcome:
    """What the raw limit (d) measured: bandwidths with a light scheduler, and with the
    busy scheduler loop beside it (whose iteration rates are kept too)."""

    store_gbps: float | None = None
    load_gbps: float | None = None
    store_gbps_busy: float | None = None
    load_gbps_busy: float | None = None
    store_loop_rate: float | None = None
    load_loop_rate: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def fresh_dir(parent: str, name: str) -> str:
    """Create ``parent/name`` (or ``name.1``, ``name.2``... if taken) and return it."""
    os.makedirs(parent, exist_ok=True)
    candidate = os.path.join(parent, name)
    n = 0
    while True:
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            n += 1
            candidate = os.path.join(parent, f"{name}.{n}")

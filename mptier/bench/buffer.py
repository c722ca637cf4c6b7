"""The primary buffer of a benchmark case.

Two regions of ``R`` slots each: source slots ``[0, R)`` filled with random bytes (every
4 KiB page stamped with 8 bytes of its own, so no two pages are alike), destination
slots ``[R, 2R)`` that loads write into. mptier's ``SharedKVBuffer`` when importable
(design (a)'s worker processes map it); otherwise a stand-in: a ``/dev/shm`` file
mapped shared and unlinked at once.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from typing import Any

import numpy as np


class CaseBuffer:
    """The primary buffer of a case: ``array`` of shape ``(2R, block_bytes)``.

    mptier's ``SharedKVBuffer`` when importable (design (a) needs it); otherwise a
    stand-in: a ``/dev/shm`` file mapped shared and unlinked at once.
    """

    def __init__(self, region_blocks: int, block_bytes: int) -> None:
        self.region = region_blocks
        self.block_bytes = block_bytes
        n = 2 * region_blocks
        self.shared: Any = None
        self._mmap: mmap.mmap | None = None
        try:
            from mptier.shm import SharedKVBuffer
        except ImportError:
            SharedKVBuffer = None
        if SharedKVBuffer is not None:
            self.shared = SharedKVBuffer.create(n, block_bytes)
            self.array = self.shared.view
            self.kind = "mptier.SharedKVBuffer"
        else:
            path = f"/dev/shm/mptier-bench.{os.getpid()}.{secrets.token_hex(4)}.buf"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.unlink(path)
                os.ftruncate(fd, n * block_bytes)
                self._mmap = mmap.mmap(fd, n * block_bytes)
            finally:
                os.close(fd)
            self.array = np.frombuffer(self._mmap, dtype=np.uint8).reshape(n, block_bytes)
            self.kind = "/dev/shm stand-in"
        self._fill_source()
        self.array[region_blocks:].fill(0)  # touch the destination pages now

    def _fill_source(self) -> None:
        """Random bytes, every 4 KiB page of every block stamped with its own 8 bytes."""
        rng = np.random.default_rng()
        src = self.array[:self.region]
        pattern_blocks = max(1, min(self.region, (32 << 20) // self.block_bytes))
        pattern = rng.integers(0, 256, size=(pattern_blocks, self.block_bytes),
                               dtype=np.uint8)
        for start in range(0, self.region, pattern_blocks):
            stop = min(start + pattern_blocks, self.region)
            src[start:stop] = pattern[:stop - start]
        page = 4096 if self.block_bytes % 4096 == 0 else self.block_bytes
        pages = src.reshape(self.region, self.block_bytes // page, page)
        pages[:, :, :8] = rng.integers(0, 256, size=(self.region, pages.shape[1], 8),
                                       dtype=np.uint8)

    def clear_destination(self) -> None:
        self.array[self.region:].fill(0)

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]
        if self.shared is not None:
            shared, self.shared = self.shared, None
            try:
                shared.close()
            finally:
                shared.unlink()
        if self._mmap is not None:
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None

    def verify(self, n_slots: int) -> dict[str, Any]:
        """Compare destination slots ``R .. R+n_slots`` with their sources, byte for byte."""
        arr, region = self.array, self.region
        step = max(1, (64 << 20) // self.block_bytes)
        bad: list[int] = []
        for start in range(0, n_slots, step):
            stop = min(start + step, n_slots)
            differs = np.any(arr[start:stop] != arr[region + start:region + stop], axis=1)
            bad.extend(int(i) + start for i in np.flatnonzero(differs))
        return {"mode": "full", "blocks_checked": n_slots, "mismatched": len(bad),
                "first_mismatched_slots": bad[:5], "ok": not bad}

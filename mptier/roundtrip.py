"""The main job (``mptier run``): a verified store/load round trip through the tier.

Fills a shared buffer with random blocks, stores them through a :class:`FileSystemTier`
into a temporary folder, drops the page cache where allowed, loads them back into other
slots, checks every byte, and prints store and load throughput.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from mptier.config import TierConfig
from mptier.jobs import TransferJob
from mptier.keys import make_key
from mptier.manager import FileSystemTier
from mptier.shm import SharedKVBuffer


@dataclass
class RoundTripReport:
    blocks: int
    block_bytes: int
    store_s: float
    load_s: float
    cache_dropped: bool
    o_direct: bool
    native: bool
    workers: str

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_bytes

    def lines(self) -> list[str]:
        gb = self.nbytes / 1e9
        return [
            f"round trip of {self.blocks} blocks x {self.block_bytes >> 10} KiB "
            f"({gb:.2f} GB), workers {self.workers}, O_DIRECT {'on' if self.o_direct else 'off'}"
            f", {'native' if self.native else 'pure-Python'} I/O",
            f"  store: {gb / self.store_s:6.2f} GB/s  ({self.store_s:.2f} s)",
            f"  load:  {gb / self.load_s:6.2f} GB/s  ({self.load_s:.2f} s)"
            f"{'' if self.cache_dropped else '  (page cache NOT dropped: needs root)'}",
            "  verified: every byte of every block matches",
        ]


def drop_page_cache() -> bool:
    """Write dirty pages and drop the page cache (root only). Returns whether it did."""
    try:
        subprocess.run(["sync"], check=True, timeout=120)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except (OSError, subprocess.SubprocessError):
        return False


def fill_random(view: np.ndarray, seed: int = 0) -> None:
    """Random blocks, each different, generated at memory speed (one random pool, a
    different rotation and a stamped header per block)."""
    rng = np.random.default_rng(seed)
    block_bytes = view.shape[1]
    pool = rng.integers(0, 256, size=2 * block_bytes, dtype=np.uint8)
    offsets = rng.integers(0, block_bytes, size=view.shape[0])
    for i, off in enumerate(offsets):
        view[i] = pool[off:off + block_bytes]
        view[i, :16] = np.frombuffer(rng.bytes(16), dtype=np.uint8)


def _progress(label: str, done: int, total: int, started: float) -> None:
    """A live counter on a terminal; a line per quarter otherwise (logs, CI)."""
    rate = done / max(time.perf_counter() - started, 1e-9)
    text = f"  {label}: {done}/{total} jobs ({rate:.0f} jobs/s)"
    if sys.stderr.isatty():
        sys.stderr.write(f"\r{text}   " + ("\n" if done == total else ""))
    else:
        sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _run_jobs(tier: FileSystemTier, kind: str, keys: list[bytes], slots: list[int],
              job_blocks: int, inflight: int, first_id: int) -> float:
    submit = tier.submit_store if kind == "store" else tier.submit_load
    jobs = [(keys[i:i + job_blocks], slots[i:i + job_blocks])
            for i in range(0, len(keys), job_blocks)]
    started = time.perf_counter()
    submitted = finished = 0
    last_report = 0.0
    tty = sys.stderr.isatty()
    reported_quarter = 0
    while finished < len(jobs):
        while submitted - finished < inflight and submitted < len(jobs):
            submit(TransferJob(first_id + submitted, *jobs[submitted]))
            submitted += 1
        results = tier.get_finished_jobs()
        for result in results:
            if not result.success:
                raise RuntimeError(f"{kind} job {result.job_id} failed: {result.error}")
        finished += len(results)
        now = time.perf_counter()
        quarter = finished * 4 // len(jobs)
        if results and (quarter > reported_quarter if not tty
                        else now - last_report > 0.25 or finished == len(jobs)):
            last_report, reported_quarter = now, quarter
            _progress(kind, finished, len(jobs), started)
        if not results:
            time.sleep(0.0002)
    return time.perf_counter() - started


def round_trip(total_bytes: int = 2 << 30, block_bytes: int = 2 << 20, job_blocks: int = 16,
               inflight: int = 8, root: str | None = None, config: TierConfig | None = None,
               keep: bool = False) -> RoundTripReport:
    """Run the round trip; raises ``AssertionError`` if any byte differs."""
    n = max(1, total_bytes // block_bytes)
    own_root = root is None
    root = root or tempfile.mkdtemp(prefix="mptier-run-", dir=os.environ.get("TMPDIR"))
    cfg = (config or TierConfig()).replace(root_dir=root)
    try:
        with SharedKVBuffer.create(2 * n, block_bytes) as buf:
            print(f"filling {n} random blocks of {block_bytes >> 10} KiB ...", file=sys.stderr)
            fill_random(buf.view[:n])
            keys = [make_key(os.urandom(32), 0) for _ in range(n)]
            with FileSystemTier(buf, cfg) as tier:
                store_s = _run_jobs(tier, "store", keys, list(range(n)), job_blocks,
                                    inflight, 1)
                dropped = drop_page_cache()
                load_s = _run_jobs(tier, "load", keys, list(range(n, 2 * n)), job_blocks,
                                   inflight, 1 << 40)
                stats = tier.stats()
            bad = [i for i in range(n) if not np.array_equal(buf.view[i], buf.view[n + i])]
            if bad:
                raise AssertionError(f"{len(bad)} of {n} blocks came back different "
                                     f"(first: block {bad[0]})")
    finally:
        if own_root and not keep:
            shutil.rmtree(root, ignore_errors=True)
    return RoundTripReport(n, block_bytes, store_s, load_s, dropped, stats["o_direct"],
                           stats["native"], f"{cfg.n_load_workers}+{cfg.n_store_workers}")

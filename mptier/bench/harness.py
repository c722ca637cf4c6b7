"""The harness: one workload, driven the same way through every design.

    harness main thread = the engine's scheduler               the design's I/O
    ┌─────────────────────────────────────────────────┐
    │ one step:                                        │
    │   lookup(key) for the next job's keys   [timed]  │
    │   submit_store / submit_load until      [timed]  │──▶ threads (b, c), worker
    │     --inflight-jobs are in flight                │    processes (a), fio (d)
    │   get_finished()                        [timed]  │◀── completions
    │   on_schedule_end()                              │
    │   light half: sleep --poll-us (GIL-free)         │
    │   busy half:  pure-Python counting loop for      │
    │               --busy-work-us, never sleeping     │
    └─────────────────────────────────────────────────┘

Every phase runs its first jobs under the *light* scheduler, which only polls -- the
design at full speed: throughput, job latency -- and the rest (``--busy-fraction``)
beside the *busy* scheduler, a pure-Python loop that never lets go of the interpreter.
The loop's rate there, divided by its rate with the design idle, is the scheduler
interference; the throughput there shows what that loop costs the design. Scheduler
calls are timed in both halves.

Per case (root x block size x job size) the harness makes one primary buffer of two
regions -- source slots ``[0, R)`` filled with random bytes, destination slots
``[R, 2R)`` -- and one list of keys. Phase key ``i`` is stored from slot ``i % R`` and
loaded into slot ``R + i % R``; keys ``i`` and ``i + R`` hold the same bytes, so the
destination is right whatever order jobs finish in. Per design, on a fresh folder of
its own: warm-up job, idle loop rate, store phase, page-cache drop, load phase (with
lookups), byte-for-byte verification of the destination region, then the 64-block job
alone under the light scheduler (store, drop, load), repeated.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import secrets
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mptier.bench.base import MODEL_NAME, Design, DesignContext, fresh_dir
from mptier.bench.measure import (
    CacheDrop,
    CpuSnapshot,
    SchedulerLoad,
    drop_page_cache,
    summarize,
)
from mptier.bench.raw import RawLimit
from mptier.keys import make_key
from mptier.layout import FileMapper

Progress = Callable[[str], None]


class StallError(RuntimeError):
    """A design reported no finished job for ``stall_timeout_s`` while jobs were due."""


@dataclass
class Workload:
    """One case of the benchmark and how to measure it."""

    root: str
    block_bytes: int
    job_blocks: int
    inflight_jobs: int
    total_bytes: int
    single_job_blocks: int = 64
    single_repeats: int = 3
    idle_seconds: float = 0.3
    poll_us: int = 500  # light scheduler: sleep between polls
    busy_work_us: int = 500  # busy scheduler: pure-Python work between polls
    busy_fraction: float = 0.5  # share of each phase's jobs run beside the busy loop
    drop_caches: bool = True
    verify: bool = True
    # Largest source region (the destination region is as large): beyond it keys reuse
    # slots and verification covers the last R loaded blocks.
    region_cap_bytes: int = 2 << 30
    keep_files: bool = False
    inject_corruption: int = 0  # corrupt this many stored files before the load phase
    stall_timeout_s: float = 120.0

    @property
    def n_blocks(self) -> int:
        return max(1, self.total_bytes // self.block_bytes)

    @property
    def region_blocks(self) -> int:
        capped = min(self.n_blocks, max(1, self.region_cap_bytes // self.block_bytes))
        return max(capped, self.single_job_blocks, self.job_blocks)


# -- the primary buffer ---------------------------------------------------------------

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


# -- the scheduler loop ---------------------------------------------------------------

@dataclass
class PhaseStats:
    jobs: int = 0
    failed: int = 0
    ok_bytes: int = 0
    elapsed_ns: int = 0
    latencies_ns: list[int] = field(default_factory=list)
    submit_ns: list[int] = field(default_factory=list)
    empty_poll_ns: list[int] = field(default_factory=list)
    lookup_ns: list[int] = field(default_factory=list)
    loop_iterations: int = 0
    loop_ns: int = 0
    duplicates: int = 0

    @property
    def gbps(self) -> float | None:
        return self.ok_bytes / self.elapsed_ns if self.elapsed_ns and self.ok_bytes else None

    @property
    def loop_rate(self) -> float | None:
        return self.loop_iterations / (self.loop_ns / 1e9) if self.loop_ns else None


def drive(design: Design, jobs: list[tuple[Any, int]], kind: str, inflight: int,
          load: SchedulerLoad, with_lookups: bool, stall_timeout_s: float) -> PhaseStats:
    """Run ``jobs`` (``(job record, bytes)``) through ``design`` as a scheduler would.

    Keeps ``inflight`` jobs in flight; between polls runs one step of ``load``.
    Raises :class:`StallError` when nothing finishes for ``stall_timeout_s``.
    """
    submit = design.submit_store if kind == "store" else design.submit_load
    get_finished = design.get_finished
    lookup = design.lookup
    end_step = design.on_schedule_end
    step = load.step
    clock = time.perf_counter_ns
    stats = PhaseStats(jobs=len(jobs))
    submit_ns, empty_ns, lookup_ns, lat = (stats.submit_ns, stats.empty_poll_ns,
                                          stats.lookup_ns, stats.latencies_ns)
    pending: dict[int, tuple[int, int]] = {}  # job_id -> (submitted at, bytes)
    n = len(jobs)
    nxt = done = 0
    stall_ns = int(stall_timeout_s * 1e9)
    gc.collect()
    start = last = clock()
    while done < n:
        while nxt < n and len(pending) < inflight:
            job, nbytes = jobs[nxt]
            if with_lookups:
                req = f"r{job.job_id}"
                for key in job.keys:
                    t0 = clock()
                    lookup(key, req)
                    lookup_ns.append(clock() - t0)
            t0 = clock()
            submit(job)
            submit_ns.append(clock() - t0)
            pending[job.job_id] = (t0, nbytes)
            nxt += 1
        t0 = clock()
        finished = get_finished()
        t1 = clock()
        if finished:
            for result in finished:
                entry = pending.pop(result.job_id, None)
                if entry is None:
                    stats.duplicates += 1
                    continue
                lat.append(t1 - entry[0])
                done += 1
                if result.success:
                    stats.ok_bytes += entry[1]
                else:
                    stats.failed += 1
            last = t1
        else:
            empty_ns.append(t1 - t0)
            if t1 - last > stall_ns:
                raise StallError(f"{design.label}: no {kind} job finished for "
                                 f"{stall_timeout_s:.0f} s ({n - done} of {n} outstanding)")
        end_step()
        iterations, spent = step()
        stats.loop_iterations += iterations
        stats.loop_ns += spent
    stats.elapsed_ns = last - start
    return stats


# -- a case ---------------------------------------------------------------------------

@dataclass
class CaseKeys:
    phase: list[bytes]
    warmup: list[bytes]
    single: list[list[bytes]]

    @classmethod
    def make(cls, w: Workload) -> CaseKeys:
        def keys(n: int) -> list[bytes]:
            return [make_key(os.urandom(32), 0) for _ in range(n)]
        return cls(keys(w.n_blocks), keys(w.job_blocks),
                   [keys(w.single_job_blocks) for _ in range(max(1, w.single_repeats))])


class Case:
    """One workload run against a list of designs, sharing buffer and keys."""

    def __init__(self, workload: Workload, progress: Progress | None = None) -> None:
        self.w = workload
        self.progress = progress or (lambda _msg: None)
        self.buffer = CaseBuffer(workload.region_blocks, workload.block_bytes)
        self.keys = CaseKeys.make(workload)
        self.light = SchedulerLoad(0, workload.poll_us * 1000)
        self.busy = SchedulerLoad(workload.busy_work_us * 1000, 0)
        self._next_job_id = 1

    def close(self) -> None:
        self.buffer.close()

    # jobs ---------------------------------------------------------------------------
    def _jobs(self, design: Design, keys: list[bytes], first_slot: int, job_blocks: int,
              dest: bool) -> list[tuple[Any, int]]:
        region = self.buffer.region
        base = region if dest else 0
        out = []
        for start in range(0, len(keys), job_blocks):
            chunk = keys[start:start + job_blocks]
            slots = [base + (first_slot + start + i) % region for i in range(len(chunk))]
            out.append((design.make_job(self._next_job_id, chunk, slots),
                        len(chunk) * self.w.block_bytes))
            self._next_job_id += 1
        return out

    def _drop(self) -> CacheDrop | None:
        return drop_page_cache() if self.w.drop_caches else None

    # designs ------------------------------------------------------------------------
    def run_design(self, design: Design) -> dict[str, Any]:
        w = self.w
        root = fresh_dir(w.root, f"mptier-bench-{os.getpid()}-{design.letter}")
        ctx = DesignContext(self.buffer.array, self.buffer.shared, root, w.block_bytes,
                            FileMapper(root, MODEL_NAME))
        out: dict[str, Any] = {"root": root}
        try:
            self.progress(f"{design.label}: setting up")
            design.setup(ctx)
            self._run_phases(design, ctx, out)
        except Exception as exc:  # one broken design must not sink the comparison
            out["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            try:
                design.close()
            except Exception as exc:
                out.setdefault("error", f"close failed: {type(exc).__name__}: {exc}")
            if not w.keep_files:
                shutil.rmtree(root, ignore_errors=True)
        return out

    def _run_phases(self, design: Design, ctx: DesignContext, out: dict[str, Any]) -> None:
        w, keys = self.w, self.keys
        run = self._run_jobs
        run(design, self._jobs(design, keys.warmup, 0, w.job_blocks, False), "store", False)
        run(design, self._jobs(design, keys.warmup, 0, w.job_blocks, True), "load", False)
        self._idle(out)

        self.progress(f"{design.label}: store phase")
        jobs = self._jobs(design, keys.phase, 0, w.job_blocks, False)
        split = self._split(len(jobs))
        out["store"] = run(design, jobs[:split], "store", False, w.inflight_jobs)
        out["store_busy"] = run(design, jobs[split:], "store", False, w.inflight_jobs,
                                self.busy)
        design.drain()
        if w.inject_corruption:
            out["corrupted_files"] = self._corrupt(ctx.mapper, w.inject_corruption)
        self.buffer.clear_destination()
        self.progress(f"{design.label}: dropping the page cache")
        out["drop"] = self._drop()
        self.progress(f"{design.label}: load phase")
        jobs = self._jobs(design, keys.phase, 0, w.job_blocks, True)
        out["load"] = run(design, jobs[:split], "load", design.supports_lookup,
                          w.inflight_jobs)
        out["load_busy"] = run(design, jobs[split:], "load", design.supports_lookup,
                               w.inflight_jobs, self.busy)
        design.drain()
        out["verify"] = self._verify(min(w.n_blocks, self.buffer.region))

        self.progress(f"{design.label}: {w.single_job_blocks}-block job alone")
        singles_store, singles_load = [], []
        for single_keys in keys.single:
            store = run(design, self._jobs(design, single_keys, 0, len(single_keys), False),
                        "store", False)
            self._drop()
            region = self.buffer.region
            self.buffer.array[region:region + len(single_keys)].fill(0)
            load = run(design, self._jobs(design, single_keys, 0, len(single_keys), True),
                       "load", False)
            if store.failed == 0:
                singles_store.append(store.latencies_ns[0])
            if load.failed == 0:
                singles_load.append(load.latencies_ns[0])
        design.drain()
        single_verify = self._verify(len(keys.single[-1]))
        out["single_store_ns"] = singles_store
        out["single_load_ns"] = singles_load
        out["single_verify"] = single_verify

    def _run_jobs(self, design: Design, jobs: list[tuple[Any, int]], kind: str,
                  lookups: bool, inflight: int = 1,
                  load: SchedulerLoad | None = None) -> PhaseStats:
        return drive(design, jobs, kind, inflight, load or self.light, lookups,
                     self.w.stall_timeout_s)

    def _split(self, n_jobs: int) -> int:
        """How many of a phase's ``n_jobs`` run under the light scheduler."""
        return n_jobs - round(n_jobs * min(1.0, max(0.0, self.w.busy_fraction)))

    def run_raw(self, raw: RawLimit) -> dict[str, Any]:
        w = self.w
        root = fresh_dir(w.root, f"mptier-bench-{os.getpid()}-d")
        out: dict[str, Any] = {"root": root}
        drops: list[CacheDrop | None] = []

        def drop() -> CacheDrop:
            result = self._drop() or CacheDrop(False, "disabled (--no-drop-caches)")
            drops.append(result)
            return result

        def wait(proc: subprocess.Popen, busy: bool) -> tuple[int, int]:
            step = (self.busy if busy else self.light).step
            iterations = elapsed = 0
            while proc.poll() is None:
                n, dt = step()
                iterations += n
                elapsed += dt
            return iterations, elapsed

        try:
            self._idle(out)
            self.progress(f"{raw.label}: {raw.chosen_tool()} store + load")
            n_busy = round(w.n_blocks * min(1.0, max(0.0, w.busy_fraction)))
            out["raw"] = raw.run(root, w.block_bytes, w.n_blocks - n_busy, n_busy,
                                 w.inflight_jobs, wait, drop)
            out["drop"] = drops[0] if drops else None
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if not w.keep_files:
                shutil.rmtree(root, ignore_errors=True)
        return out

    def _idle(self, out: dict[str, Any]) -> None:
        """Idle rate of the scheduler loop, and how busy the rest of the machine was."""
        before = CpuSnapshot.take()
        out["idle_loop_rate"] = self.busy.idle_rate(self.w.idle_seconds)
        out["background_cpus"] = CpuSnapshot.take().others_since(before)

    # checks -------------------------------------------------------------------------
    def _verify(self, n_slots: int) -> dict[str, Any]:
        """Compare destination slots ``R .. R+n_slots`` with their sources, byte for byte."""
        if not self.w.verify:
            return {"mode": "off"}
        arr, region = self.buffer.array, self.buffer.region
        step = max(1, (64 << 20) // self.w.block_bytes)
        bad: list[int] = []
        for start in range(0, n_slots, step):
            stop = min(start + step, n_slots)
            differs = np.any(arr[start:stop] != arr[region + start:region + stop], axis=1)
            bad.extend(int(i) + start for i in np.flatnonzero(differs))
        return {"mode": "full", "blocks_checked": n_slots, "mismatched": len(bad),
                "first_mismatched_slots": bad[:5], "ok": not bad}

    def _corrupt(self, mapper: FileMapper, count: int) -> int:
        """Flip bytes in the middle of the first ``count`` stored block files."""
        done = 0
        for key in self.keys.phase[:count]:
            path = mapper.path_for(key)
            try:
                with open(path, "r+b") as f:
                    f.seek(self.w.block_bytes // 2)
                    chunk = f.read(16)
                    f.seek(self.w.block_bytes // 2)
                    f.write(bytes(b ^ 0xFF for b in chunk))
                done += 1
            except OSError:
                continue
        return done


def median_ms(values_ns: list[int]) -> float | None:
    return statistics.median(values_ns) / 1e6 if values_ns else None


def us_summary(values_ns: list[int]) -> dict[str, float | None]:
    s = summarize(values_ns)
    return {k: (v / 1e3 if v is not None and k != "n" else v) for k, v in s.items()}


def ms_summary(values_ns: list[int]) -> dict[str, float | None]:
    s = summarize(values_ns)
    return {k: (v / 1e6 if v is not None and k != "n" else v) for k, v in s.items()}

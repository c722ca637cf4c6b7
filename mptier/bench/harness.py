"""The harness: one workload, driven the same way through every design.

    harness main thread = the engine's scheduler               the design's I/O
    ┌─────────────────────────────────────────────────┐
    │ one step:                                        │
    │   lookup(key) for the next job's keys   [timed]  │
    │     (and again until answered: answer time)      │
    │   submit_store / submit_load until      [timed]  │──▶ threads (b, c), worker
    │     --inflight-jobs are in flight (a load        │    processes (a), fio (d)
    │     once its keys are answered, as an engine)    │
    │   get_finished()                        [timed]  │◀── completions
    │   on_schedule_end()                              │
    │   light half: sleep --poll-us (GIL-free)         │
    │   busy half:  sleep --busy-wait-us (GIL-free),   │
    │               then a pure-Python counting loop   │
    │               for --busy-work-us                 │
    └─────────────────────────────────────────────────┘

Every phase runs its first jobs under the *light* scheduler, which only polls -- the
design at full speed: throughput, job latency -- and the rest (``--busy-fraction``)
beside the *busy* scheduler, which alternates a GIL-free wait (the model's forward pass
in a real engine) with pure-Python work, half and half by default. The work's rate
there, counted from the moment each wait should have ended, divided by its rate with
the design idle (in windows right before and after that busy part), is the scheduler
interference: it charges both a CPU taken away and the time to get the interpreter
back from the design's threads. The throughput there shows what the busy scheduler
costs the design. ``--busy-wait-us 0`` makes a loop that never lets go of the
interpreter: in-process threads then starve rather than slow the loop. Scheduler calls
are timed in both halves.

Per case (root x block size x job size) the harness makes one primary buffer of two
regions -- source slots ``[0, R)`` filled with random bytes, destination slots
``[R, 2R)`` -- and one list of keys. Phase key ``i`` is stored from slot ``i % R`` and
loaded into slot ``R + i % R``; keys ``i`` and ``i + R`` hold the same bytes, so the
destination is right whatever order jobs finish in. Per design, on a fresh folder of
its own:

1. the *cold pass* (unless ``cold_pass`` is off): right after the design started, one
   store and one load of every slot of the region with keys of their own, under the
   light scheduler -- the first time the design's I/O touches the buffer's pages (a
   worker process that did not pre-fault its mapping pays a fault per page here);
   verified, and in memory its files removed again (the warm pass needs the memory);
2. warm-up job, store phase, page-cache drop, load phase (with lookups), each phase's
   busy part between two windows of the busy loop alone; byte-for-byte verification
   of the destination region (the *warm* pass);
3. the 64-block job alone under the light scheduler (store, drop, load), repeated.

A design's files go right after it in memory, and at the end of the run on a disk root
(:mod:`mptier.bench.cleanup`: ext4 without a journal allocates inodes slowly for a minute
or more after deletions, and the design after another one's cleanup measured that).

Before every store (and right after each page-cache drop) the harness allocates and
frees as much memory as the phase will write (:func:`~mptier.bench.measure.
warm_free_memory`), so each design's files get the same recently freed pages, whatever
design ran before it. On a VM that reports free memory to its host, pages the host has
taken back cost 4x more on first touch; without this the design that follows another
one's cleanup wins a tmpfs store phase by up to 5x. Each phase records the machine's
page counters (pages allocated, faults, memory reported to the host) beside it.

Long because every phase of a case (cold pass, warm pass, lone jobs, the raw limit)
shares one buffer, one key list and the two schedules, and what makes the designs'
figures comparable is that one reader sees them all drive a design the same way.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mptier.bench import cleanup
from mptier.bench.base import MODEL_NAME, Design, DesignContext, fresh_dir
from mptier.bench.buffer import CaseBuffer
from mptier.bench.measure import (
    CacheDrop,
    CpuSnapshot,
    MemorySnapshot,
    SchedulerLoad,
    drop_page_cache,
    warm_free_memory,
)
from mptier.bench.raw import RawLimit
from mptier.bench.saturation import Saturation
from mptier.bench.scheduler import PhaseStats, drive
from mptier.keys import make_key
from mptier.layout import FileMapper

Progress = Callable[..., None]


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
    busy_wait_us: int = 500  # busy scheduler: GIL-free wait before the work (0: none)
    busy_fraction: float = 0.5  # share of each phase's jobs run beside the busy loop
    drop_caches: bool = True
    verify: bool = True
    # Largest source region (the destination region is as large): beyond it keys reuse
    # slots and verification covers the last R loaded blocks.
    region_cap_bytes: int = 2 << 30
    keep_files: bool = False
    # On a disk root, remove the designs' files at the end of the run rather than after
    # each design (mptier.bench.cleanup).
    defer_removal: bool = True
    # Pin the harness's main thread (the "engine") to this CPU while designs run; worker
    # processes and threads started before keep their own CPUs.
    engine_cpu: int | None = None
    inject_corruption: int = 0  # corrupt this many stored files before the load phase
    stall_timeout_s: float = 120.0
    # Hand every phase the same recently freed memory (see the module docstring).
    warm_memory: bool = True
    # Run the cold pass (first touch of the buffer by the design's I/O) first.
    cold_pass: bool = True
    # Load phases: submit a job only once its keys' lookups are answered (an engine's
    # order), or right after asking (the order before 2026-12-06; scheduler.drive).
    await_lookups: bool = True

    @property
    def n_blocks(self) -> int:
        return max(1, self.total_bytes // self.block_bytes)

    @property
    def region_blocks(self) -> int:
        capped = min(self.n_blocks, max(1, self.region_cap_bytes // self.block_bytes))
        return max(capped, self.single_job_blocks, self.job_blocks)

    @property
    def design_bytes(self) -> int:
        """What one design writes to the root: cold pass, warm-up, phase, lone jobs."""
        cold = min(self.n_blocks, self.region_blocks) if self.cold_pass else 0
        lone = self.single_job_blocks * max(1, self.single_repeats)
        return (cold + self.job_blocks + self.n_blocks + lone) * self.block_bytes

    @property
    def warm_bytes(self) -> int:
        """Memory handed back before a phase: what it writes, plus a quarter (folders,
        page tables, the kernel's own allocations meanwhile)."""
        return self.n_blocks * self.block_bytes * 5 // 4


# -- a case ---------------------------------------------------------------------------

@dataclass
class CaseKeys:
    phase: list[bytes]
    warmup: list[bytes]
    single: list[list[bytes]]
    cold: list[bytes]

    @classmethod
    def make(cls, w: Workload) -> CaseKeys:
        def keys(n: int) -> list[bytes]:
            return [make_key(os.urandom(32), 0) for _ in range(n)]
        return cls(keys(w.n_blocks), keys(w.job_blocks),
                   [keys(w.single_job_blocks) for _ in range(max(1, w.single_repeats))],
                   keys(min(w.n_blocks, w.region_blocks) if w.cold_pass else 0))


class Case:
    """One workload run against a list of designs, sharing buffer and keys."""

    def __init__(self, workload: Workload, progress: Progress | None = None,
                 kept: cleanup.KeptFiles | None = None) -> None:
        self.w = workload
        self.progress = progress or (lambda _msg: None)
        self.buffer = CaseBuffer(workload.region_blocks, workload.block_bytes)
        self.keys = CaseKeys.make(workload)
        self.light = SchedulerLoad(0, workload.poll_us * 1000)
        self.busy = SchedulerLoad(workload.busy_work_us * 1000,
                                  workload.busy_wait_us * 1000)
        self._next_job_id = 1
        self.removal = cleanup.removal_rule(workload.root, workload.defer_removal)
        # Folders kept for later: the run's (shared by its cases) or this case's own.
        self.kept = kept if kept is not None else cleanup.KeptFiles()
        self._own_kept = kept is None

    def close(self) -> None:
        try:
            if self._own_kept:
                self.kept.remove_all()
        finally:
            self.buffer.close()

    # files --------------------------------------------------------------------------
    def remove(self, path: str) -> None:
        """Remove a design's folder now (in memory), or keep it for the end of the run
        (on a disk: :mod:`mptier.bench.cleanup` says why)."""
        if self.w.keep_files:
            return
        if self.removal == cleanup.REMOVE_AT_END:
            self.kept.add(path)
        else:
            cleanup.remove_path(path)

    def _make_room(self) -> None:
        self.kept.make_room(self.w.root, self.w.design_bytes, self.progress)

    # jobs ---------------------------------------------------------------------------
    def _jobs(self, design: Design, keys: list[bytes], job_blocks: int,
              dest: bool) -> list[tuple[Any, int]]:
        """Jobs of ``job_blocks`` keys: key ``i`` from source slot ``i % R`` (or into
        destination slot ``R + i % R``), as ``(job record, bytes)``."""
        region = self.buffer.region
        base = region if dest else 0
        kind = "load" if dest else "store"
        out = []
        for start in range(0, len(keys), job_blocks):
            chunk = keys[start:start + job_blocks]
            slots = [base + (start + i) % region for i in range(len(chunk))]
            out.append((design.make_job(self._next_job_id, chunk, slots, kind),
                        len(chunk) * self.w.block_bytes))
            self._next_job_id += 1
        return out

    def _drop(self) -> CacheDrop | None:
        return drop_page_cache() if self.w.drop_caches else None

    def _warm(self, out: dict[str, Any], name: str, nbytes: int | None = None) -> None:
        """Hand the next phase recently freed memory (when ``warm_memory`` is on)."""
        if self.w.warm_memory:
            out.setdefault("warm_memory", {})[name] = warm_free_memory(
                self.w.warm_bytes if nbytes is None else nbytes)

    # designs ------------------------------------------------------------------------
    def run_design(self, design: Design) -> dict[str, Any]:
        w = self.w
        self._make_room()
        root = fresh_dir(w.root, f"mptier-bench-{os.getpid()}-{design.letter}")
        ctx = DesignContext(self.buffer.array, self.buffer.shared, root, w.block_bytes,
                            FileMapper(root, MODEL_NAME))
        out: dict[str, Any] = {"root": root}
        try:
            self.progress(f"{design.label}: setting up")
            design.setup(ctx)
            with pinned(w.engine_cpu):
                self._run_phases(design, ctx, out)
        except Exception as exc:  # one broken design must not sink the comparison
            out["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            try:
                design.close()
            except Exception as exc:
                out.setdefault("error", f"close failed: {type(exc).__name__}: {exc}")
            self.remove(root)
        return out

    def _run_phases(self, design: Design, ctx: DesignContext, out: dict[str, Any]) -> None:
        w, keys = self.w, self.keys
        run = self._run_jobs
        if keys.cold:
            self._cold_pass(design, ctx, out)
        run(design, self._jobs(design, keys.warmup, w.job_blocks, False), "store", False)
        run(design, self._jobs(design, keys.warmup, w.job_blocks, True), "load", False)

        self.progress(f"{design.label}: store phase")
        jobs = self._jobs(design, keys.phase, w.job_blocks, False)
        split = self._split(len(jobs))
        self._warm(out, "store")
        out["store"] = run(design, jobs[:split], "store", False, w.inflight_jobs)
        self._idle(out, "store")
        out["store_busy"] = run(design, jobs[split:], "store", False, w.inflight_jobs,
                                self.busy)
        design.drain()
        self._idle(out, "store")
        if w.inject_corruption:
            out["corrupted_files"] = self._corrupt(design, ctx, w.inject_corruption)
        self.buffer.clear_destination()
        self.progress(f"{design.label}: dropping the page cache")
        out["drop"] = self._drop()
        self._warm(out, "load")
        self.progress(f"{design.label}: load phase")
        jobs = self._jobs(design, keys.phase, w.job_blocks, True)
        out["load"] = run(design, jobs[:split], "load", design.supports_lookup,
                          w.inflight_jobs, await_lookups=w.await_lookups)
        self._idle(out, "load")
        out["load_busy"] = run(design, jobs[split:], "load", design.supports_lookup,
                               w.inflight_jobs, self.busy, await_lookups=w.await_lookups)
        design.drain()
        self._idle(out, "load")
        out["verify"] = self._verify(min(w.n_blocks, self.buffer.region))

        self.progress(f"{design.label}: {w.single_job_blocks}-block job alone")
        singles_store, singles_load, singles_busy, checks = [], [], [], []
        for single_keys in keys.single:
            self._warm(out, "single", len(single_keys) * w.block_bytes * 5 // 4)
            store = run(design, self._jobs(design, single_keys, len(single_keys), False),
                        "store", False)
            self._drop()
            region = self.buffer.region
            self.buffer.array[region:region + len(single_keys)].fill(0)
            load = run(design, self._jobs(design, single_keys, len(single_keys), True),
                       "load", False)
            if store.failed == 0:
                singles_store.append(store.latencies_ns[0])
            if load.failed == 0:
                singles_load.append(load.latencies_ns[0])
                singles_busy.append(load.saturation)
            checks.append(self._verify(len(single_keys)))
        design.drain()
        out["single_store_ns"] = singles_store
        out["single_load_ns"] = singles_load
        out["single_load_saturation"] = singles_busy
        out["single_verify"] = checks[0] if len(checks) == 1 or checks[0]["mode"] == "off" \
            else {"mode": "full", "blocks_checked": sum(c["blocks_checked"] for c in checks),
                  "mismatched": sum(c["mismatched"] for c in checks),
                  "ok": all(c["ok"] for c in checks)}

    def _cold_pass(self, design: Design, ctx: DesignContext, out: dict[str, Any]) -> None:
        """Store and load every slot of the region once, first thing after set-up."""
        w, keys = self.w, self.keys.cold
        self.progress(f"{design.label}: cold pass")
        self._warm(out, "store_cold")
        out["store_cold"] = self._run_jobs(
            design, self._jobs(design, keys, w.job_blocks, False), "store", False,
            w.inflight_jobs)
        design.drain()
        self.buffer.clear_destination()
        self._drop()
        self._warm(out, "load_cold")
        out["load_cold"] = self._run_jobs(
            design, self._jobs(design, keys, w.job_blocks, True), "load", False,
            w.inflight_jobs)
        design.drain()
        out["cold_verify"] = self._verify(len(keys))
        if self.removal == cleanup.REMOVE_EACH:  # their memory goes back before the warm pass
            for key in keys:
                with contextlib.suppress(OSError):
                    os.unlink(design.block_path(ctx, key))

    def _run_jobs(self, design: Design, jobs: list[tuple[Any, int]], kind: str,
                  lookups: bool, inflight: int = 1,
                  load: SchedulerLoad | None = None, await_lookups: bool = False
                  ) -> PhaseStats:
        before, busy_before = MemorySnapshot.take(), Saturation.take(self.w.root)
        stats = drive(design, jobs, kind, inflight, load or self.light, lookups,
                      self.w.stall_timeout_s, await_lookups)
        stats.saturation = Saturation.take(self.w.root).since(busy_before)
        stats.memory = MemorySnapshot.take().since(before)
        return stats

    def _split(self, n_jobs: int) -> int:
        """How many of a phase's ``n_jobs`` run under the light scheduler."""
        return n_jobs - round(n_jobs * min(1.0, max(0.0, self.w.busy_fraction)))

    def run_raw(self, raw: RawLimit) -> dict[str, Any]:
        w = self.w
        self._make_room()
        root = fresh_dir(w.root, f"mptier-bench-{os.getpid()}-d")
        out: dict[str, Any] = {"root": root}
        drops: list[CacheDrop | None] = []

        def drop() -> CacheDrop | None:
            result = self._drop()
            drops.append(result)
            self._warm(out, "load")
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
            self.progress(f"{raw.label}: {raw.chosen_tool()} store + load")
            n_busy = round(w.n_blocks * min(1.0, max(0.0, w.busy_fraction)))
            with pinned(w.engine_cpu):
                self._idle(out)
                self._warm(out, "store")
                out["raw"] = raw.run(root, w.block_bytes, w.n_blocks - n_busy, n_busy,
                                     w.inflight_jobs, wait, drop, w.job_blocks)
                self._idle(out)
            out["drop"] = drops[0] if drops else None
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            self.remove(root)
        return out

    def _idle(self, out: dict[str, Any], phase: str = "") -> None:
        """One window of the scheduler loop with the design idle: its rate joins
        ``out["idle_rates"]`` (and ``out[phase + "_idle"]``), whose mean is
        ``out["idle_loop_rate"]``; ``out["background_cpus"]`` is the busiest the rest of
        the machine was in any window. A phase's busy part is bracketed by two windows,
        right before and after it: one window of 0.3 s alone swings 0.6-1.07 of
        its median on this VM (docs/performance.md section 26), and the machine drifts
        between a store phase and its load phase."""
        before = CpuSnapshot.take()
        rate = self.busy.idle_rate(self.w.idle_seconds)
        others = CpuSnapshot.take().others_since(before)
        rates = out.setdefault("idle_rates", [])
        rates.append(rate)
        out["idle_loop_rate"] = sum(rates) / len(rates)
        if phase:
            out.setdefault(f"{phase}_idle", []).append(rate)
        if others is not None:
            out["background_cpus"] = max(others, out.get("background_cpus") or 0.0)

    # checks -------------------------------------------------------------------------
    def _verify(self, n_slots: int) -> dict[str, Any]:
        """Byte-for-byte check of the first ``n_slots`` destination slots."""
        return self.buffer.verify(n_slots) if self.w.verify else {"mode": "off"}

    def _corrupt(self, design: Design, ctx: DesignContext, count: int) -> int:
        """Flip bytes in the middle of the first ``count`` stored block files."""
        done = 0
        for key in self.keys.phase[:count]:
            path = design.block_path(ctx, key)
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


@contextlib.contextmanager
def pinned(cpu: int | None) -> Iterator[None]:
    """Run the calling thread on ``cpu`` alone inside the block (no-op for ``None``)."""
    if cpu is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)

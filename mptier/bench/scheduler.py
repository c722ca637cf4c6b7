"""The scheduler loop: how the harness's main thread drives a design, as an engine would.

Each step: ``lookup`` the next job's keys, ``submit_*`` until ``inflight`` jobs are in
flight, ``get_finished()``, ``on_schedule_end()``, then one step of a
:class:`~mptier.bench.measure.SchedulerLoad` (a GIL-free sleep, or pure-Python work).
Every scheduler call is timed with ``perf_counter_ns``; a job's latency runs from just
before its submit to the poll that returned it (so it includes up to one step).
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from typing import Any

from mptier.bench.base import Design
from mptier.bench.measure import SchedulerLoad


class StallError(RuntimeError):
    """A design reported no finished job for ``stall_timeout_s`` while jobs were due."""


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
    # Why the first failed job failed (its errno and error text): a failed run names it.
    first_failure: str = ""
    # The machine's page counters over the phase (MemorySnapshot.since), set by the harness.
    memory: dict[str, Any] | None = None
    # The machine's CPUs and the root's device over the phase (Saturation.since), set
    # by the harness.
    saturation: dict[str, float] | None = None

    @property
    def gbps(self) -> float | None:
        return self.ok_bytes / self.elapsed_ns if self.elapsed_ns and self.ok_bytes else None

    @property
    def loop_rate(self) -> float | None:
        return self.loop_iterations / (self.loop_ns / 1e9) if self.loop_ns else None


def describe_failure(result: Any) -> str:
    """``"job 7: [Errno 110] Connection timed out: <the tier's text>"`` for a failed
    job of any design (a design's result may lack the errno or the text)."""
    err = getattr(result, "errno", 0) or 0
    text = getattr(result, "error", None) or ""
    parts = [f"job {result.job_id}:"]
    if err:
        parts.append(f"[Errno {err}] {os.strerror(err)}" + (":" if text else ""))
    parts.append(text or ("no cause reported" if not err else ""))
    return " ".join(p for p in parts if p)


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
                    if not stats.first_failure:
                        stats.first_failure = describe_failure(result)
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

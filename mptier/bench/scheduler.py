"""The scheduler loop: how the harness's main thread drives a design, as an engine would.

Each step: ``lookup`` again the keys not answered yet, ``lookup`` the next job's keys,
``submit_*`` until ``inflight`` jobs are in flight (with ``await_lookups``, a load only
once its keys are answered), ``get_finished()``, ``on_schedule_end()``, then one step of a
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
    # Per job with lookups: its first question to its last key's answer.
    answer_ns: list[int] = field(default_factory=list)
    lookup_misses: int = 0  # keys answered absent (every phase key was stored)
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


def answered(result: Any) -> bool:
    """Whether a design's ``lookup`` answer is final: not ``None`` (the in-process
    references' "ask again") and not a ``RETRY`` member (mptier's and vLLM's enums)."""
    return result is not None and getattr(result, "name", None) != "RETRY"


def hit(result: Any) -> bool:
    """Whether a final answer says the key is there (``True`` or a ``HIT`` member)."""
    return result is True or getattr(result, "name", None) == "HIT"


def drive(design: Design, jobs: list[tuple[Any, int]], kind: str, inflight: int,
          load: SchedulerLoad, with_lookups: bool, stall_timeout_s: float,
          await_lookups: bool = False) -> PhaseStats:
    """Run ``jobs`` (``(job record, bytes)``) through ``design`` as a scheduler would.

    Keeps ``inflight`` jobs in flight; between polls runs one step of ``load``. With
    lookups, a job's keys are asked for right before it is submitted and asked again
    every step until each is answered (as an engine does for a waiting request); the
    time from the first question to the last answer is the job's ``answer_ns``. With
    ``await_lookups`` the job is submitted only then (an engine's order: it loads what
    it knows is there), and counts as in flight while it waits.
    Raises :class:`StallError` when nothing finishes or is answered for
    ``stall_timeout_s``.
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
    # job_id -> (first asked at, keys not yet answered, request, job, bytes)
    asking: dict[int, tuple[int, list[bytes], str, Any, int]] = {}
    n = len(jobs)
    nxt = done = 0
    stall_ns = int(stall_timeout_s * 1e9)

    def send(job: Any, nbytes: int) -> None:
        t0 = clock()
        submit(job)
        submit_ns.append(clock() - t0)
        pending[job.job_id] = (t0, nbytes)

    def ask(keys: list[bytes], req: str, timed: bool) -> list[bytes]:
        """Ask for ``keys``; the ones not answered yet."""
        left = []
        for key in keys:
            t0 = clock()
            got = lookup(key, req)
            if timed:  # the per-call figure counts first questions only, as before
                lookup_ns.append(clock() - t0)
            if not answered(got):
                left.append(key)
            elif not hit(got):
                stats.lookup_misses += 1
        return left

    gc.collect()
    start = last = progress = clock()
    while done < n or asking:  # the last jobs' answers are waited for too
        for job_id, (asked, keys, req, job, nbytes) in list(asking.items()):
            left = ask(keys, req, False)
            if left:
                keys[:] = left
                continue
            progress = clock()
            stats.answer_ns.append(progress - asked)
            del asking[job_id]
            if await_lookups:
                send(job, nbytes)
        while nxt < n and len(pending) + (len(asking) if await_lookups else 0) < inflight:
            job, nbytes = jobs[nxt]
            nxt += 1
            if with_lookups:
                req = f"r{job.job_id}"
                asked = clock()
                left = ask(list(job.keys), req, True)
                if left:
                    asking[job.job_id] = (asked, left, req, job, nbytes)
                    if await_lookups:
                        continue
                else:
                    stats.answer_ns.append(clock() - asked)
            send(job, nbytes)
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
            last = progress = t1
        else:
            empty_ns.append(t1 - t0)
            if t1 - progress > stall_ns:
                what = f"no {kind} job finished" + (" and no lookup was answered"
                                                   if asking else "")
                raise StallError(f"{design.label}: {what} for {stall_timeout_s:.0f} s "
                                 f"({n - done} of {n} outstanding)")
        end_step()
        iterations, spent = step()
        stats.loop_iterations += iterations
        stats.loop_ns += spent
    stats.elapsed_ns = last - start
    return stats

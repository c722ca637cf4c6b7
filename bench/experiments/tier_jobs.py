"""What the tier experiments that drive a real tier share (tier_loop.py,
worker_states.py): jobs of ``job`` blocks kept ``inflight`` at a time, as the bench's
light scheduler keeps them (a poll, then a 0.5 ms sleep), optionally each load's keys
looked up first."""

from __future__ import annotations

import time

from mptier import TransferJob

POLL_SLEEP_S = 0.0005  # the bench's light scheduler: --poll-us 500


def drive(tier, op: str, keys: list, slots: list, job: int = 16, inflight: int = 16,
          lookups: bool = False) -> float:
    """Store or load (``op``) ``keys`` into or from ``slots`` through ``tier``; every job
    must succeed. Returns the wall seconds it took."""
    jobs = [(keys[i:i + job], slots[i:i + job]) for i in range(0, len(keys), job)]
    submit = tier.submit_load if op == "load" else tier.submit_store
    job_id, pending, todo = 0, set(), iter(jobs)
    start = time.perf_counter()
    while True:
        while len(pending) < inflight:
            nxt = next(todo, None)
            if nxt is None:
                break
            job_id += 1
            if lookups and op == "load":
                for key in nxt[0]:
                    tier.lookup(key, f"r{job_id}")
            submit(TransferJob(job_id, nxt[0], nxt[1]))
            pending.add(job_id)
        if not pending:
            return time.perf_counter() - start
        for result in tier.get_finished_jobs():
            assert result.success, result.error
            pending.discard(result.job_id)
        if lookups:
            tier.on_schedule_end()
        time.sleep(POLL_SLEEP_S)

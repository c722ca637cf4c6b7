"""Test support: what a test sees of, and does to, the mptier tiers inside a vLLM engine
core, wherever vLLM runs it (the test's process, or an EngineCore process of its own).

    front end (support.engine_scenario)          engine core (this module, imported by
    ───────────────────────────────────           support.memmove_spec wherever vLLM runs
    llm.collective_rpc("mptier_stats") ──────────▶ the scheduler and the model)
    llm.collective_rpc("mptier_arm_kill") ───────▶ TIERS: every MPFileSystemTierManager
                                                    made here; their stores recorded
    waits for the journal, SIGKILLs its pid ◀──── once armed: the first step end after a
                                                    step that submitted stores to mptier
                                                    waits until the workers hold them,
                                                    writes the journal, waits to be killed

The front end reaches the engine core through vLLM's ``collective_rpc``: on the CPU
platform, with one worker, vLLM's executor runs the model in the engine core's process,
so the methods of :class:`ProbeWorkerExtension` (vLLM's ``worker_extension_cls``) run
beside the scheduler and its tiers. Results cross the process boundary as JSON text.

Which blocks the last step stored: :func:`_recorded_store` records every store job vLLM
submits to an mptier tier once the kill is armed (its keys, their block files, and a
SHA-256 of each block's bytes read from vLLM's primary buffer when the job is
submitted); the stores of one step are those submitted between two step ends
(``on_schedule_end``: vLLM submits its cascades to the secondary tiers as the previous
step's transfers complete, before the next step's schedule ends).

The held stores must still be running when the engine dies, or the test could not tell
a worker that finishes them from one that died with the engine: arming creates the file
named by ``MPTIER_FAULT_STALL_WHILE`` (``mptier.workers.serving``), so the engine's
workers, started with ``MPTIER_FAULT_STALL=store:S`` in their environment, sleep S
seconds at the start of every store they take from then on -- before writing a byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

# Once armed: every store job submitted to an mptier tier, until the kill point.
_KILL: dict[str, Any] = {"journal": None, "jobs": [], "started": None}
# Every MPFileSystemTierManager vLLM's factory built in this process, in order (found
# where it is made: vLLM freezes its engine's objects out of the garbage collector's
# sight).
TIERS: list = []
# How long the kill point waits for the workers to hold the step's stores (they take a
# task within milliseconds of its submission; a loaded machine may take longer).
HOLD_TIMEOUT_S = 30.0
# How long the engine core waits, frozen at the kill point, for the SIGKILL.
KILL_WAIT_S = 60.0
# How often the kill point looks at the workers' slots.
HOLD_POLL_S = 0.005


def install() -> None:
    """Track every mptier tier made in this process and record its stores (once)."""
    from mptier.integrations.vllm import MPFileSystemTierManager as Tier

    if getattr(Tier, "_probed", False):
        return
    init, submit_store, on_schedule_end = Tier.__init__, Tier.submit_store, \
        Tier.on_schedule_end

    def tracked_init(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        TIERS.append(self)

    def recorded_submit_store(self, job_metadata) -> None:
        if _KILL["journal"] is not None:
            _recorded_store(self, job_metadata)
        submit_store(self, job_metadata)

    def watched_on_schedule_end(self, context) -> None:
        on_schedule_end(self, context)
        if _KILL["journal"] is not None and _KILL["jobs"]:
            _kill_point(self)

    Tier.__init__ = tracked_init
    Tier.submit_store = recorded_submit_store
    Tier.on_schedule_end = watched_on_schedule_end
    Tier._probed = True


def _recorded_store(tier, job) -> None:
    # vLLM's primary buffer: one row of block_size_bytes per chunk.
    flat, row = tier._primary_kv_view.cast("B"), tier.block_size_bytes
    keys = [bytes(k) for k in job.keys]
    _KILL["jobs"].append({
        "job_id": job.job_id,
        "keys": [k.hex() for k in keys],
        "paths": [tier.tier.path_for(k) for k in keys],
        "sha256": [hashlib.sha256(flat[int(c) * row:(int(c) + 1) * row]).hexdigest()
                   for c in job.chunk_ids],
    })


def _kill_point(tier) -> None:
    """(In the engine core, at the step end after the stores.) Wait until the workers
    hold every store task (none queued, a worker busy), write the journal, and wait for
    the front end's SIGKILL."""
    journal, jobs = _KILL["journal"], _KILL["jobs"]
    _KILL["journal"] = None
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while True:
        stats = tier.tier.stats()
        queued = sum(stats["queued_tasks"].values())
        busy = [w["pid"] for w in stats["workers"] if w["state"] == "busy"]
        if queued == 0 and busy:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the workers did not take the last step's stores within "
                               f"{HOLD_TIMEOUT_S} s: {stats['queued_tasks']}, "
                               f"{stats['workers']}")
        time.sleep(HOLD_POLL_S)
    record = {
        "pid": os.getpid(),
        "armed_s": _KILL["started"],
        "held_s": time.monotonic(),
        "jobs": jobs,
        "workers": [w["pid"] for w in stats["workers"]],
        "busy": busy,
        "tasks_in_flight": stats["tasks_in_flight"],
        "on_disk_before_kill": [os.path.exists(p) for j in jobs for p in j["paths"]],
        "stats": stats,
    }
    with open(journal + ".tmp", "w") as f:
        json.dump(record, f, default=str)
    os.replace(journal + ".tmp", journal)
    time.sleep(KILL_WAIT_S)
    raise RuntimeError(f"the engine core was not killed within {KILL_WAIT_S} s of "
                       f"writing {journal}")


class ProbeWorkerExtension:
    """Methods vLLM mixes into its worker (``worker_extension_cls``), called from the
    front end with ``llm.collective_rpc(name, args=...)``; they run in the engine
    core's process."""

    def mptier_stats(self) -> str:
        """Every mptier tier's ``FileSystemTier.stats()`` (JSON)."""
        return json.dumps([t.tier.stats() for t in TIERS], default=str)

    def mptier_arm_kill(self, journal: str, stall_path: str) -> int:
        """From now on record the stores submitted to mptier; the first step end after
        some were submitted is the kill point (see the module docstring). Creates
        ``stall_path``: the workers' stores stall from here on. Returns this process's
        pid."""
        with open(stall_path, "w"):
            pass
        _KILL.update(journal=journal, jobs=[], started=time.monotonic())
        return os.getpid()

"""The pool's figures as ``stats()`` reports them, read from its control block: task
latency, bytes written and skipped, each root's health and usage, each slot's waits for
room. Shared-memory reads: they never block, in any process (a service's link reads
its service's control block through them).
"""

from __future__ import annotations

import time
from typing import Any

from mptier.jobs import TaskKind
from mptier.workers.control import (
    LATENCY_BUCKETS,
    ROOT_COMPLETE,
    ROOT_EVICTING,
    ROOT_INODES_LOW,
    ROOT_WALKER,
    ControlBlock,
    RootState,
    latency_percentiles,
)
from mptier.workers.session import IoSettings


def task_latency(control: ControlBlock) -> dict[str, dict[str, Any]]:
    """Task latency per kind ("store", "load", "lookup": ``p50_s``, ``p99_s``, ``count``)
    over every slot and the pool's whole life, from the workers' latency buckets in the
    control block: what a service reports, which never sees the engine's completions."""
    out = {}
    for kind in TaskKind:
        counts = [0] * LATENCY_BUCKETS
        for slot in range(control.n_slots):
            for i, n in enumerate(control.slot_latency(slot, kind)):
                counts[i] += n
        out[kind.name.lower()] = latency_percentiles(counts)
    return out


def store_figures(control: ControlBlock) -> dict[str, int]:
    """``written_bytes``: bytes of blocks the pool's stores wrote; ``skipped_bytes``:
    bytes of blocks they found on disk already and did not write (over the pool's life,
    from the control block: a service reports them too)."""
    written, skipped = control.store_bytes()
    return {"written_bytes": written, "skipped_bytes": skipped}


def root_figures(control: ControlBlock, io: IoSettings) -> list[dict[str, Any]]:
    """Each root's health and usage as ``stats()`` reports them (from the control block:
    never blocks, any process)."""
    out = []
    now = time.monotonic_ns()
    for index, path in enumerate(io.root_dirs):
        rec = control.root(index)
        out.append({
            "path": path, "in_rotation": rec.state is not RootState.OUT,
            "read_only": rec.state is RootState.READ_ONLY,
            "read_only_stores": control.read_only_stores(index),
            "o_direct": io.roots[index].use_o_direct, "io_uring": io.roots[index].uring,
            "bounce_loads": io.roots[index].bounce,
            "bounce_stores": io.roots[index].bounce_stores,
            "folders_ahead": io.roots[index].folders_ahead,
            "errno": rec.err, "failures": rec.failures, "times_out": rec.outs,
            "probe_in_s": max(0.0, (rec.retry_at_ns - now) / 1e9)
            if rec.state is not RootState.IN else None,
            # the caretaker's figure plus blocks created since it last looked
            "usage_bytes": control.usage_now(index, reserved=False),
            "blocks": rec.usage_blocks,
            "capacity_bytes": io.capacity_bytes,
            "usage_complete": bool(rec.flags & ROOT_COMPLETE),
            "evicting": bool(rec.flags & ROOT_EVICTING),
            "evicted_blocks": rec.evicted_blocks, "evicted_bytes": rec.evicted_bytes,
            "temps_removed": rec.temps_removed, "walk_passes": rec.pass_id,
            "walker": bool(rec.flags & ROOT_WALKER),
            "walked_entries": control.walked_entries(index),
            **_inode_figures(control, index),
            "caretaker_pid": rec.caretaker_pid or None})
    return out


def _inode_figures(control: ControlBlock, index: int) -> dict[str, Any]:
    total, free, folders, flags = control.root_extra(index)
    return {"inodes_total": total or None, "inodes_free": free if total else None,
            "inodes_low": bool(flags & ROOT_INODES_LOW), "folders_removed": folders,
            "no_space_stores": control.no_space_stores(index)}


def room_waits(control: ControlBlock, slot: int) -> dict[str, Any]:
    waits, ns = control.slot_waits(slot)
    return {"room_waits": waits, "room_wait_s": ns / 1e9}

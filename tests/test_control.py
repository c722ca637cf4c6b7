"""The control block: the workers' task-latency buckets and the percentiles read from
them, and the block shared with a real worker process -- what a worker killed mid-task
leaves in its slot for the supervisor, the pool state it reads, root usage, bounds."""

from __future__ import annotations

import math
import random
import signal
import subprocess
import sys

import pytest

from mptier.jobs import TaskKind
from mptier.workers.control import (
    LATENCY_BUCKETS,
    ControlBlock,
    PoolState,
    SlotState,
    SlotWriter,
    latency_bucket,
    latency_percentiles,
)
from mptier.workers.figures import task_latency


def test_latency_buckets_are_powers_of_two_of_microseconds():
    assert latency_bucket(0) == 0 and latency_bucket(999) == 0  # under 1 us
    assert latency_bucket(1_000) == 0 and latency_bucket(1_999) == 0
    assert latency_bucket(2_000) == 1 and latency_bucket(3_999) == 1
    assert latency_bucket(10 ** 9) == 19  # 1 s: 2^19 us <= 1e6 us < 2^20 us
    assert latency_bucket(10 ** 15) == LATENCY_BUCKETS - 1  # the last takes the rest


def test_percentiles_are_within_a_factor_of_sqrt_two_of_the_truth():
    rng = random.Random(17)
    samples = sorted(rng.lognormvariate(math.log(2e-3), 1.2) for _ in range(5000))
    counts = [0] * LATENCY_BUCKETS
    for s in samples:
        counts[latency_bucket(int(s * 1e9))] += 1
    got = latency_percentiles(counts)
    assert got["count"] == len(samples)
    for q, key in ((0.5, "p50_s"), (0.99, "p99_s")):
        truth = samples[int(q * len(samples)) - 1]
        assert truth / math.sqrt(2) <= got[key] <= truth * math.sqrt(2), (key, got, truth)
    assert latency_percentiles([0] * LATENCY_BUCKETS) == {"p50_s": None, "p99_s": None,
                                                           "count": 0}


def test_each_slot_counts_its_tasks_by_kind_and_the_pool_sums_them():
    control = ControlBlock(3)
    try:
        writers = [SlotWriter(control, slot, "store") for slot in range(2)]
        for writer in writers:
            for ms in (1, 2, 4):
                writer.account(0, ms * 1_000_000, False, 0, TaskKind.STORE)
        writers[1].account(0, 300_000, False, 0, TaskKind.LOAD)
        writers[0].account(0, 5_000_000, False, 0)  # kind unknown: counted, not timed
        assert sum(control.slot_latency(0, TaskKind.STORE)) == 3
        assert sum(control.slot_latency(2, TaskKind.STORE)) == 0
        figures = task_latency(control)
        assert figures["store"]["count"] == 6 and figures["load"]["count"] == 1
        assert figures["lookup"]["count"] == 0 and figures["lookup"]["p50_s"] is None
        assert 2e-3 / math.sqrt(2) <= figures["store"]["p50_s"] <= 2e-3 * math.sqrt(2)
        assert 0.3e-3 / math.sqrt(2) <= figures["load"]["p99_s"] <= 0.3e-3 * math.sqrt(2)
    finally:
        control.close()


WORKER = """
import os, signal, sys, time
from mptier.jobs import TaskKind, encode_task
from mptier.workers.control import ControlBlock, SlotState, SlotWriter
control = ControlBlock(4, fd=int(sys.argv[1]))
state, err, reason = control.pool_state()
writer = SlotWriter(control, 2, "load")
writer.record[:] = encode_task(TaskKind.LOAD, 77, [b"k" * 36], [5], attempt=1).ljust(
    len(writer.record), b"\\0")
writer.mark_started(123)
writer.account(4096, 2_000_000, False, 123, TaskKind.LOAD)
writer.message_sent(3)
control.set_root_usage(1, usage_bytes=8192, usage_blocks=2, evicted_blocks=1,
                       evicted_bytes=4096, temps_removed=0, pass_id=4, top_position=9,
                       flags=0, caretaker_pid=os.getpid())
print(state.name, err, reason, flush=True)
time.sleep(60)  # killed here, mid-task
"""


def test_what_a_worker_writes_in_its_slot_is_what_the_supervisor_reads_after_it_dies():
    """The block shared with a real worker process: the worker sees the pool state the
    supervisor published, and once it is SIGKILLed mid-task its slot still says which
    task it held (kind, id, attempt), its pid and role, and what it counted."""
    control = ControlBlock(4)
    try:
        control.set_pool_state(PoolState.UNAVAILABLE, 5, "no worker could boot")
        control.reset(2, "load")
        worker = subprocess.Popen([sys.executable, "-c", WORKER, str(control.fd)],
                                  pass_fds=(control.fd,), stdout=subprocess.PIPE, text=True)
        assert worker.stdout.readline().split() == ["UNAVAILABLE", "5", "no", "worker",
                                                    "could", "boot"]
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)
        worker.stdout.close()
        snap = control.snapshot(2)
        assert snap.state == SlotState.BUSY and snap.started_ns == 123
        assert (snap.pid, snap.role) == (worker.pid, "load")
        assert (snap.tasks_done, snap.bytes_done, snap.tasks_failed) == (1, 4096, 0)
        assert snap.held_task == (TaskKind.LOAD, 77, 1)
        assert sum(control.slot_latency(2, TaskKind.LOAD)) == 1
        assert control.counters[2] == 3
        root = control.root(1)
        assert (root.usage_bytes, root.usage_blocks, root.evicted_bytes) == (8192, 2, 4096)
        assert root.caretaker_pid == worker.pid and control.walk_state(1)[:2] == (4, 9)
        assert control.snapshot(0).state == SlotState.EMPTY  # untouched slots stay empty
        control.release_slot(2)
        assert control.snapshot(2).held_task is None
        assert control.snapshot(2).state == SlotState.EMPTY
    finally:
        control.close()
        control.close()  # idempotent


def test_slots_and_roots_outside_the_block_are_refused_naming_the_range():
    control = ControlBlock(2)
    try:
        with pytest.raises(IndexError, match=r"slot 2 outside 0\.\.1"):
            control.snapshot(2)
        with pytest.raises(IndexError, match="root -1 outside"):
            control.root(-1)
    finally:
        control.close()


def test_usage_now_reads_a_publication_whole():
    """The caretaker publishes usage, stamp and freed stamp between begin_publish and
    end_publish; a reader sees the figures of one publication. A torn read (the new
    stamp beside the old usage) counted the last collection's blocks nowhere."""
    control = ControlBlock(2)
    try:
        writer = SlotWriter(control, 0, "store")
        control.set_root_usage(0, usage_bytes=100, usage_blocks=1, evicted_blocks=0,
                               evicted_bytes=0, temps_removed=0, pass_id=0,
                               top_position=-1, flags=0, caretaker_pid=1)
        writer.add_made(0, 50)  # created, not collected: usage_now counts it
        assert control.usage_now(0) == 150
        # A caretaker that collected the 50 and died half way through publishing: the
        # stamp is new, the usage old, and the sequence says so.
        control.begin_publish(0)
        control.set_root_extra(0, inodes_total=0, inodes_free=0, folders_removed=0,
                               flags=0, stamp=50)
        assert control._publish_seq(0) & 1
        assert control.usage_now(0) == 100  # retried, then taken as read: bounded
        # Its successor publishes whole: odd while writing, even after.
        control.begin_publish(0)
        assert control._publish_seq(0) & 1
        control.set_root_usage(0, usage_bytes=150, usage_blocks=2, evicted_blocks=0,
                               evicted_bytes=0, temps_removed=0, pass_id=0,
                               top_position=-1, flags=0, caretaker_pid=2)
        control.end_publish(0)
        assert not control._publish_seq(0) & 1
        assert control.usage_now(0) == 150
    finally:
        control.close()

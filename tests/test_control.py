"""The control block's own arithmetic: the workers' task-latency buckets and the
percentiles read from them (the rest of the block is exercised by every pool test)."""

from __future__ import annotations

import math
import random

from mptier.jobs import TaskKind
from mptier.workers.control import (
    LATENCY_BUCKETS,
    ControlBlock,
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

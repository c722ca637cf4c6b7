"""Usage totals, deltas merged into a walk in progress, LRU eviction plans, evict()'s
checks, and the maintainer a worker steps."""

from __future__ import annotations

import os
import random
import time

import pytest
from storage_tree import (
    change_block,
    file_totals,
    key_for,
    make_cache,
    start_lease_holder,
    write_block,
)

from mptier.storage import (
    Kind,
    OldestBlocks,
    RootMaintainer,
    UsageTracker,
    Walker,
    evict,
    key_of_block_path,
    plan_eviction,
)

BB = 4096
T0 = 1_700_000_000 * 10**9   # a fixed epoch for atimes: tests never read the clock


def _run_pass(tracker, budget=7):
    passes = tracker.passes
    while tracker.passes == passes:
        tracker.step(budget)


def test_usage_totals_equal_the_files(tmp_path):
    root = str(tmp_path)
    small = make_cache(root, "a", block_bytes=BB)
    big = make_cache(root, "b", block_bytes=2 * BB)
    for i in range(40):
        write_block(small, key_for(i))
    for i in range(25):
        write_block(big, key_for(i), block_bytes=2 * BB)
    write_block(small, key_for(99), size=10)   # bad size: not usage
    tracker = UsageTracker(root)
    assert not tracker.complete
    _run_pass(tracker)
    usage = tracker.usage
    assert tracker.complete
    assert (usage.blocks, usage.bytes) == (65, 40 * BB + 25 * 2 * BB)
    assert usage.folders == {os.path.basename(small.blocks_dir): [40 * BB, 40],
                             os.path.basename(big.blocks_dir): [25 * 2 * BB, 25]}
    assert (file_totals(root, BB)[1] + file_totals(root, 2 * BB)[1]) == usage.bytes


def test_own_stores_and_removals_during_a_pass_are_counted_once(tmp_path):
    root = str(tmp_path)
    mapper = make_cache(root, block_bytes=BB)
    for i in range(0, 200, 2):
        write_block(mapper, key_for(i))
    tracker = UsageTracker(root)
    _run_pass(tracker)
    # Half-way through the next pass, store and remove both behind and ahead of it.
    seen = []
    while len(seen) < 50:
        seen.extend(e for e in tracker.step(1) if e.kind is Kind.BLOCK)
    walker = tracker.walker
    new_behind = new_ahead = 0
    for i in range(0, 200, 2):
        # A neighbour of block i (same folders, last hash byte flipped), and a block in
        # folders of its own.
        old = key_for(i)
        for key in (old[:-5] + bytes([old[-5] ^ 1]) + old[-4:], key_for(i + 1)):
            path = mapper.path_for(key)
            behind = not walker.will_visit(path)
            write_block(mapper, key)
            tracker.record_store(path, BB)
            new_behind += behind
            new_ahead += not behind
    removed_seen = seen[:10]
    blocks = [e for e in Walker(root).walk_all() if e.kind is Kind.BLOCK]
    removed_ahead = [e for e in blocks if walker.will_visit(e.path)][-10:]
    for entry in removed_seen + removed_ahead:
        os.unlink(entry.path)
        tracker.record_remove(entry.path, BB)
    assert new_behind and new_ahead, "the test must store on both sides of the walk"
    assert len(removed_ahead) == 10
    truth = file_totals(root, BB)
    assert (tracker.usage.blocks, tracker.usage_bytes) == truth   # last pass + deltas
    _run_pass(tracker, budget=13)
    assert (tracker.usage.blocks, tracker.usage_bytes) == truth   # the new pass, merged


def _aged_tree(root, n, seed=0):
    """``n`` blocks with distinct atimes in a random order; returns {path: atime_ns}."""
    mapper = make_cache(root, block_bytes=BB)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    atimes = {}
    for i, rank in enumerate(order):
        atimes[write_block(mapper, key_for(i), atime_ns=T0 + rank * 10**9)] = \
            T0 + rank * 10**9
    return mapper, atimes


def test_plan_brings_usage_under_low_with_the_oldest_atimes(tmp_path):
    root = str(tmp_path)
    _, atimes = _aged_tree(root, 500)
    usage = 500 * BB
    capacity = 480 * BB          # 104 % of capacity: past high (95 %)
    plan = plan_eviction(Walker(root).walk_all(), usage, capacity, 0.95, 0.85)
    low = 0.85 * capacity
    assert plan.complete and usage - plan.bytes_planned <= low
    assert usage - plan.bytes_planned + BB > low         # no more than needed
    oldest = sorted(atimes, key=atimes.get)[:len(plan.entries)]
    assert [e.path for e in plan.entries] == oldest
    assert [e.atime_ns for e in plan.entries] == sorted(e.atime_ns for e in plan.entries)
    for entry in plan.entries:
        assert evict(entry)
    assert file_totals(root, BB)[1] <= low
    # Under the high watermark, nothing is planned.
    assert plan_eviction(Walker(root).walk_all(), int(0.95 * capacity), capacity,
                         0.95, 0.85).entries == []


def test_bounded_candidates_make_a_partial_plan(tmp_path):
    root = str(tmp_path)
    _, atimes = _aged_tree(root, 300, seed=3)
    plan = plan_eviction(Walker(root).walk_all(), 300 * BB, 100 * BB, 0.9, 0.5,
                         max_entries=20)
    assert len(plan.entries) == 20 and not plan.complete
    assert [e.path for e in plan.entries] == sorted(atimes, key=atimes.get)[:20]


def test_oldest_blocks_keeps_only_what_covers_the_target(tmp_path):
    root = str(tmp_path)
    _aged_tree(root, 400, seed=5)
    oldest = OldestBlocks(target_bytes=10 * BB)
    sizes = []
    for entry in Walker(root).walk_all():
        if entry.kind is Kind.BLOCK:
            oldest.offer(entry)
            sizes.append(len(oldest))
    assert max(sizes) <= 11 and len(oldest) == 10 and oldest.offered == 400
    assert [e.atime_ns for e in oldest.oldest_first()] == [T0 + r * 10**9 for r in range(10)]


def test_bad_watermarks_are_named():
    with pytest.raises(ValueError, match="need 0 < low < high <= 1"):
        plan_eviction([], 10, 10, 0.8, 0.9)
    with pytest.raises(ValueError, match="capacity_bytes must be positive"):
        plan_eviction([], 10, 0, 0.9, 0.8)


def _one_block(tmp_path):
    mapper = make_cache(str(tmp_path), block_bytes=BB)
    path = write_block(mapper, key_for(1), atime_ns=T0)
    entry = next(e for e in Walker(str(tmp_path)).walk_all() if e.kind is Kind.BLOCK)
    return mapper, path, entry


@pytest.mark.parametrize("change", ["used since", "atime older (clock skew)",
                                    "replaced by a new file", "gone"])
def test_evict_refuses_a_block_that_changed(tmp_path, change):
    _mapper, path, entry = _one_block(tmp_path)
    change_block(path, change, str(tmp_path), T0)
    assert evict(entry) is False
    if change != "gone":
        assert os.path.exists(path)


def test_evict_removes_an_unchanged_block(tmp_path):
    _, path, entry = _one_block(tmp_path)
    assert evict(entry) is True
    assert not os.path.exists(path)
    assert evict(entry) is False


def test_maintainer_evicts_oldest_just_the_excess_and_reports_keys(tmp_path):
    root = str(tmp_path)
    mapper, atimes = _aged_tree(root, 300, seed=7)
    capacity = 280 * BB     # 300 blocks: 20 past it, and a slack of 2 blocks
    recent = sorted(atimes, key=atimes.get)[:5]   # the five oldest, then used again
    for path in recent:
        os.utime(path, ns=(T0 + 10**12, os.stat(path).st_mtime_ns))
        atimes[path] = T0 + 10**12
    maint = RootMaintainer(root, capacity_bytes=capacity, slack_bytes=2 * BB,
                           locks_work=True)
    removed = []
    for _ in range(10_000):
        report = maint.step(64)
        removed.extend(report.removed)
        if maint.complete and not maint.evicting:
            break
    blocks, total = file_totals(root, BB)
    # Near the budget, not in bands: exactly down to capacity - slack.
    assert total == capacity - 2 * BB and maint.usage_bytes == total
    assert all(os.path.exists(p) for p in recent), "recently used blocks must survive"
    gone = [p for p in atimes if not os.path.exists(p)]
    assert len(gone) == len(removed) == 300 - blocks == 22
    survivors_oldest = min(atimes[p] for p in atimes if os.path.exists(p))
    assert max(atimes[p] for p in gone) < survivors_oldest      # LRU order held
    folder = os.path.basename(mapper.blocks_dir)
    assert sorted(removed) == sorted((folder, key_of_block_path(p)) for p in gone)
    assert {key_of_block_path(p) for p in gone} <= {key_for(i) for i in range(300)}
    # The used blocks were looked at again and went back into the index, newer.
    assert maint.rechecked >= 0 and maint.candidates_left == blocks


def test_maintainer_unlimited_never_evicts_and_counts(tmp_path):
    root = str(tmp_path)
    _aged_tree(root, 50)
    maint = RootMaintainer(root, locks_work=True)
    while not maint.complete:
        assert maint.step(16).removed == []
    assert maint.usage_bytes == 50 * BB and maint.fits(1 << 40)
    assert maint.usage()["folders"]


def test_maintainer_over_capacity_at_start_evicts_before_the_first_pass_ends(tmp_path):
    root = str(tmp_path)
    _aged_tree(root, 300, seed=9)
    maint = RootMaintainer(root, capacity_bytes=200 * BB, slack_bytes=BB, locks_work=True)
    evicted_early = 0
    while not maint.complete:
        evicted_early += len(maint.step(16).removed)
    assert evicted_early > 0
    for _ in range(1000):
        maint.step(16)
        if not maint.evicting:
            break
    _blocks, total = file_totals(root, BB)
    assert total == 199 * BB and maint.usage_bytes == total


def test_maintainer_sweeps_a_killed_writers_temps_in_its_steps(tmp_path):
    root = str(tmp_path)
    mapper, _ = _aged_tree(root, 40)
    final = mapper.path_for(key_for(1000))
    os.makedirs(os.path.dirname(final), exist_ok=True)
    dead, dead_tag = start_lease_holder(root, final, n_temps=3)
    live, live_tag = start_lease_holder(root, final, n_temps=2)
    try:
        dead.kill()
        dead.wait()
        maint = RootMaintainer(root)     # probes the root's locks itself
        removed = 0
        while not maint.complete:
            report = maint.step(8)
            assert report.walked <= 8
            removed += report.temps_removed
        assert removed == 3 and maint.sweeper.locks_work
        names = os.listdir(os.path.dirname(final))
        assert not any(dead_tag in n for n in names)
        assert sum(live_tag in n for n in names) == 2
        assert not os.path.exists(f"{root}/.mptier/leases/{dead_tag}.lease")
        assert maint.usage_bytes == 40 * BB
    finally:
        live.kill()
        live.wait()


def test_eviction_does_not_wait_for_the_walk_pass(tmp_path):
    """Blocks another writer adds mid-pass are evictable the step the walk lists them:
    by the end of the pass the root is at its budget (a design that evicts from the
    last complete pass would end it with every new block still there)."""
    root = str(tmp_path)
    mapper, _ = _aged_tree(root, 40, seed=3)
    maint = RootMaintainer(root, capacity_bytes=50 * BB, slack_bytes=0, locks_work=True)
    while not maint.complete:
        maint.step(16)
    assert maint.usage_bytes == 40 * BB and not maint.evicting
    # Another writer (not this tier: only the walk sees it) adds 200 older blocks.
    for i in range(200):
        write_block(mapper, key_for(1000 + i), atime_ns=T0 - 10**12 + i)
    passes = maint.tracker.passes
    steps = worst = 0
    while maint.tracker.passes == passes:
        maint.step(16)
        steps += 1
        worst = max(worst, maint.usage_bytes)
    assert steps > 20, "the pass must take many steps for this to mean anything"
    # Never more over the budget than one step's walk finds (16 entries: a few blocks).
    assert worst <= 50 * BB + 16 * BB
    assert file_totals(root, BB)[1] == maint.usage_bytes == 50 * BB


def test_blocks_told_about_are_evicted_before_any_walk_finds_them(tmp_path):
    """record_created: a tier's own new blocks enter the index at once (placed by when
    they were told, milliseconds after their store), each looked at (lstat) when it
    comes up; walked blocks that are older go first."""
    root = str(tmp_path)
    mapper = make_cache(root, block_bytes=BB)
    walked = [write_block(mapper, key_for(i), atime_ns=T0 + i * 10**9) for i in range(6)]
    maint = RootMaintainer(root, capacity_bytes=8 * BB, slack_bytes=0, locks_work=True)
    while not maint.complete:
        maint.step(64)          # the walk saw the six, and now rests
    told = []
    for i in range(6):
        told.append(write_block(mapper, key_for(100 + i), atime_ns=time.time_ns()))
        maint.record_told(told[-1], BB)  # counted (the next pass finds them)
        maint.record_created(told[-1], BB)
    report = maint.step(64, walk=False)
    assert sorted(p for p in walked + told if not os.path.exists(p)) == sorted(walked[:4])
    assert len(report.removed) == 4 and maint.usage_bytes == 8 * BB
    maint.capacity_bytes = 4 * BB
    maint.step(64, walk=False)
    gone = sorted(p for p in walked + told if not os.path.exists(p))
    assert gone == sorted(walked + told[:2]), "then the oldest of the told ones"
    assert file_totals(root, BB)[1] == maint.usage_bytes == 4 * BB


def test_blocks_of_one_atime_leave_deepest_first_and_keep_their_rank(tmp_path):
    """A store's blocks share the kernel's clock tick: among them the one placed last
    in its store (the highest rank) leaves first, so a prefix loses its tail before its
    head; a block looked at again (used since, new atime) keeps its rank; older atimes
    still go first whatever their rank."""
    from mptier.storage.maintain import BlockIndex
    from mptier.storage.walk import Entry

    def entry(name: str, atime: int) -> Entry:
        return Entry(str(tmp_path / name), Kind.BLOCK, BB, atime, 0, 1, "f", None)

    index = BlockIndex()
    for rank, name in enumerate("abcd"):
        index.know(entry(name, T0 + 5), rank)
    index.know(entry("old", T0), rank=9)
    index.know(entry("b", T0 + 5 + 10))  # b used again: newer, rank 1 kept
    index.know(entry("e", T0 + 5 + 10), rank=0)
    order = []
    while (e := index.pop_oldest()) is not None:
        order.append(os.path.basename(e.path))
    assert order == ["old", "d", "c", "a", "b", "e"]


def _entry(tmp_path, name: str, atime: int, mtime: int | None = None, ino: int = 1):
    from mptier.storage.walk import Entry

    return Entry(str(tmp_path / name), Kind.BLOCK, BB, atime,
                 atime if mtime is None else mtime, ino, "f", None)


def _drain(index) -> list[str]:
    order = []
    while (e := index.pop_oldest()) is not None:
        order.append(os.path.basename(e.path))
    return order


@pytest.mark.parametrize("policy", ["two-queue", "lru"])
def test_two_queue_keeps_used_blocks_ahead_of_unused_ones_and_lru_does_not(
        tmp_path, policy):
    """a..f stored in that order; b used again (its atime moved while it was known) before
    e and f were stored. LRU takes the oldest atime: a c d b e f. Two-queue takes the
    oldest never-used block while those are more than half the index, then the oldest
    used one: a c d e, then b (used, 1 of 2 left), then f."""
    from mptier.storage.maintain import BlockIndex

    index = BlockIndex(policy=policy)
    for i, name in enumerate("abcd"):
        index.know(_entry(tmp_path, name, T0 + i))
    index.know(_entry(tmp_path, "b", T0 + 10, mtime=T0 + 1))  # loaded at T0 + 10
    for i, name in enumerate("ef"):
        index.know(_entry(tmp_path, name, T0 + 20 + i))
    assert index.used_blocks == (1 if policy == "two-queue" else 0)
    want = {"lru": list("acdbef"), "two-queue": list("acdebf")}[policy]
    assert _drain(index) == want


def test_two_queue_marks_blocks_stored_again_after_their_eviction_and_walked_used_ones(
        tmp_path):
    """The ghost: a path evicted (forgotten) and then known again is a block the cache
    let go too early, so it comes back used. A block the walk meets first with its atime
    well past its mtime (USED_GAP_NS) was loaded after its store: used too. A refused
    candidate re-known with used=True (its atime moved while out) is used."""
    from mptier.storage.maintain import USED_GAP_NS, BlockIndex

    index = BlockIndex(policy="two-queue")
    index.know(_entry(tmp_path, "x", T0))
    assert index.pop_oldest().path.endswith("x")
    index.forget(str(tmp_path / "x"))                       # evicted
    index.know(_entry(tmp_path, "y", T0 + 1))
    index.know(_entry(tmp_path, "x", T0 + 2, ino=2))        # stored again
    index.know(_entry(tmp_path, "old", T0 - USED_GAP_NS, mtime=T0 - 2 * USED_GAP_NS - 1))
    index.know(_entry(tmp_path, "fresh", T0 + 3, mtime=T0 + 3 - USED_GAP_NS // 2))
    assert index.used_blocks == 2, "x (ghost) and old (loaded long after its store)"
    out = index.pop_oldest()                                # probation 2 of 4: used first
    assert out.path.endswith("old")
    index.know(out._replace(atime_ns=T0 + 9), used=True)    # refused: used while out
    assert index.used_blocks == 2
    # x (used; probation 2 of 4), y (probation 2 of 3), old (1 of 2), fresh
    assert _drain(index) == ["x", "y", "old", "fresh"]


def test_an_unknown_eviction_policy_is_refused_naming_the_choices(tmp_path):
    from mptier import ConfigError, TierConfig
    from mptier.storage.maintain import BlockIndex

    with pytest.raises(ValueError, match=r"'mru'.*two-queue, lru"):
        BlockIndex(policy="mru")
    with pytest.raises(ConfigError, match=r"eviction_policy = 'mru'.*two-queue.* or .*lru"):
        TierConfig(root_dir=str(tmp_path), eviction_policy="mru").validate()

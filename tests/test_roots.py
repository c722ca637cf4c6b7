"""Several roots: each key on exactly one root by rendezvous hashing (even spread,
stable when a root is added), routing in the workers with the engine's prefix semantics,
and a root that keeps failing taken out of rotation and brought back by a probe."""

from __future__ import annotations

import errno
import itertools
import os
import time
from collections import Counter

import pytest
from conftest import wait_for
from test_capacity import Driver, blocks_on_disk, keys_for

from mptier import ConfigError, LookupResult, TierConfig, make_key
from mptier.storage.roots import RootRouter

KB = 1 << 10
BLOCK = 16 * KB


def test_keys_spread_over_three_roots_within_ten_percent_of_even():
    router = RootRouter(["/mnt/nvme0/kv", "/mnt/nvme1/kv", "/mnt/nvme2/kv"])
    n = 30_000
    keys = keys_for(b"spread", n)
    counts = Counter(router.index_of(k) for k in keys)
    assert sorted(counts) == [0, 1, 2]
    for count in counts.values():
        assert abs(count - n / 3) <= 0.1 * n / 3, counts
    # Every group of a block lives with it; the order of the list does not matter.
    assert all(router.index_of(make_key(k[:-4], 7)) == router.index_of(k) for k in keys[:500])
    shuffled = RootRouter(["/mnt/nvme2/kv", "/mnt/nvme0/kv", "/mnt/nvme1/kv"])
    assert all(shuffled.roots[shuffled.index_of(k)] == router.roots[router.index_of(k)]
               for k in keys[:2000])


def test_adding_a_root_moves_only_about_one_in_n_plus_one_keys_and_only_to_it():
    three = RootRouter(["/a/kv", "/b/kv", "/c/kv"])
    four = RootRouter(["/a/kv", "/b/kv", "/c/kv", "/d/kv"])
    keys = keys_for(b"grow", 20_000)
    moved = [k for k in keys if three.roots[three.index_of(k)] != four.roots[four.index_of(k)]]
    assert all(four.roots[four.index_of(k)] == "/d/kv" for k in moved)
    assert abs(len(moved) / len(keys) - 0.25) < 0.025


def test_runs_keep_the_order_of_keys():
    router = RootRouter(["/a", "/b", "/c"])
    keys = keys_for(b"runs", 200)
    runs = router.runs(keys)
    assert runs[0][1] == 0 and runs[-1][2] == len(keys)
    assert all(a[2] == b[1] for a, b in itertools.pairwise(runs))
    assert all(router.index_of(k) == r for r, s, e in runs for k in keys[s:e])
    assert all(a[0] != b[0] for a, b in itertools.pairwise(runs))


def test_root_dir_and_root_dirs_together_are_refused_naming_both():
    with pytest.raises(ConfigError, match=r"root_dir.*root_dirs"):
        TierConfig(root_dir="/x", root_dirs=["/y", "/z"])
    with pytest.raises(ConfigError, match="root_dirs"):
        TierConfig(root_dirs=["/y", "/y/"])
    with pytest.raises(ConfigError, match="low_watermark"):
        TierConfig(root_dir="/x", high_watermark=0.8, low_watermark=0.9)
    with pytest.raises(ConfigError, match="high_watermark"):
        TierConfig(root_dir="/x", high_watermark=1.5)
    with pytest.raises(ConfigError, match="capacity_bytes"):
        TierConfig(root_dir="/x", capacity_bytes="lots")
    assert TierConfig(root_dir="/x", capacity_bytes="10G").capacity_bytes == 10 << 30
    cfg = TierConfig(root_dirs=["/a/", "/b"])
    assert cfg.roots() == ["/a", "/b"] and cfg.replace(n_load_workers=1).roots() == cfg.roots()


def test_a_tier_on_three_roots_puts_each_key_on_its_root(make_buffer, make_tier, tmp_path):
    roots = [str(tmp_path / f"nvme{i}") for i in range(3)]
    buf = make_buffer(16, BLOCK)
    tier = make_tier(buf, root_dir="", root_dirs=roots, task_bytes=16 * BLOCK)
    run = Driver(tier, buf)
    keys = keys_for(b"three", 96)
    router = RootRouter(roots)
    for i in range(0, len(keys), 16):  # each task spans all three roots
        assert run.store(keys[i:i + 16]).success
    for key in keys:
        home = router.roots[router.index_of(key)]
        assert tier.root_of(key) == home and tier.path_for(key).startswith(home + "/")
        assert os.path.getsize(tier.path_for(key)) == BLOCK
        for other in roots:
            if other != home:
                assert not os.path.exists(tier.path_for(key).replace(home, other, 1))
    assert sum(blocks_on_disk(r)[0] for r in roots) == len(keys)
    for key in keys:
        tier.lookup(key, "req")
    tier.on_schedule_end()
    wait_for(lambda: all(tier.lookup(k, "req") is LookupResult.HIT for k in keys), 10,
             "every key found on its root")
    for i in range(0, len(keys), 16):
        assert run.load(keys[i:i + 16]).success
    # A load stops at its first missing block, across roots: n_done is a prefix.
    missing = keys_for(b"absent", 1)[0]
    mixed = [*keys[:5], missing, *keys[5:9]]
    result = run.load(mixed)
    assert not result.success and result.errno == errno.ENOENT
    assert set(result.successful_keys) == set(keys[:5])
    stats = tier.stats()
    assert [r["path"] for r in stats["roots"]] == roots
    wait_for(lambda: all(r["usage_complete"] for r in tier.stats()["roots"]), 20, "walks")
    wait_for(lambda: tier.stats()["usage_bytes"] == len(keys) * BLOCK, 20,
             "usage summed over roots")


@pytest.mark.fuse
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_a_root_made_unusable_leaves_rotation_and_comes_back(make_buffer, make_tier,
                                                             tmp_path, fuse_fs):
    roots = [str(tmp_path / "local0"), str(tmp_path / "local1"), str(fuse_fs.path("kv"))]
    buf = make_buffer(8, BLOCK)
    tier = make_tier(buf, root_dir="", root_dirs=roots, task_bytes=BLOCK,
                     root_failures_to_fail=2, root_retry_s=1.0)
    run = Driver(tier, buf)
    router = RootRouter(roots)
    keys = keys_for(b"health", 60)
    on = {i: [k for k in keys if router.index_of(k) == i] for i in range(3)}
    assert all(len(v) >= 8 for v in on.values())
    sick = on[2]
    for key in keys:
        assert run.store([key]).success
    rule = fuse_fs.fail("*", errno.EIO, "/kv*")
    for key in sick[:2]:  # two EIO results in a row take it out
        result = run.load([key])
        assert not result.success and result.errno == errno.EIO
    wait_for(lambda: not tier.stats()["roots"][2]["in_rotation"], 5, "the root out")
    stats = tier.stats()["roots"]
    assert stats[0]["in_rotation"] and stats[1]["in_rotation"]
    assert stats[2]["times_out"] == 1 and stats[2]["errno"] == errno.EIO
    # Out of rotation: loads fail at once naming the root, lookups miss, stores of its
    # keys fail and land nowhere else; the other roots serve as before.
    calls = fuse_fs.calls("read")
    result = run.load([sick[2]])
    assert not result.success and roots[2] in result.error and "out of rotation" in result.error
    assert fuse_fs.calls("read") == calls, "no I/O on a root out of rotation"
    new_sick = [k for k in keys_for(b"new", 40) if router.index_of(k) == 2][:2]
    result = run.store(new_sick)
    assert not result.success and roots[2] in result.error
    for mapper in tier.mappers[:2]:  # never written to another root
        assert not any(os.path.exists(mapper.path_for(k)) for k in new_sick)
    tier.lookup(sick[3], "q")
    tier.on_schedule_end()
    wait_for(lambda: tier.lookup(sick[3], "q") is LookupResult.MISS, 5, "a miss")
    for key in on[0][:3] + on[1][:3]:
        assert run.load([key]).success
    # The file system recovers; after root_retry_s the next operation probes it.
    fuse_fs.release(rule)
    time.sleep(1.2)
    wait_for(lambda: run.load([sick[4]]).success, 10, "the root back in rotation")
    assert tier.stats()["roots"][2]["in_rotation"]
    for key in sick:
        assert run.load([key]).success
    assert run.store(new_sick).success


@pytest.mark.fuse
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_a_hung_root_times_out_and_leaves_rotation(make_buffer, make_tier, tmp_path,
                                                   fuse_fs):
    """A worker killed for io_timeout_s on a root counts against that root: one timeout
    (root_failures_to_fail=1) takes it out, and the next loads of its keys fail at once
    instead of hanging another worker."""
    roots = [str(tmp_path / "local"), str(fuse_fs.path("kv"))]
    buf = make_buffer(8, BLOCK)
    tier = make_tier(buf, root_dir="", root_dirs=roots, task_bytes=BLOCK, io_timeout_s=1.5,
                     root_failures_to_fail=1, root_retry_s=60.0)
    run = Driver(tier, buf)
    router = RootRouter(roots)
    hung = [k for k in keys_for(b"hang", 40) if router.index_of(k) == 1][:3]
    for key in hung:
        assert run.store([key]).success
    # Block files only: the root's caretaker opens lease files when it sweeps, and may
    # hang there too (its own timeout); this test is about loads.
    rule = fuse_fs.block("open", "/kv/*.bin")
    try:
        result = run.load([hung[0]])
        assert not result.success and result.errno == errno.ETIMEDOUT
        wait_for(lambda: not tier.stats()["roots"][1]["in_rotation"], 5, "the root out")
        result = run.load([hung[1]])
        assert not result.success and "out of rotation" in result.error
        assert rule.waiting == 1, "no second worker went into the hung mount"
        local = [k for k in keys_for(b"ok", 20) if router.index_of(k) == 0][:2]
        assert run.store(local).success and run.load(local).success
    finally:
        fuse_fs.release(rule)

"""Leases in the running tier (issue 9, item 3): each worker holds a lease per root and
names its temporary files after it; a killed engine's temporary files are swept by the
next tier on the root, a live tier's are never touched -- with real processes on a FUSE
root, where O_TMPFILE is refused and temporaries are named."""

from __future__ import annotations

import glob
import hashlib
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
from conftest import wait_for, wait_results
from test_capacity import BLOCK, Driver, content, keys_for

from mptier import TransferJob, make_key
from mptier.keys import key_block_hash
from mptier.storage import lease_state
from mptier.storage.roots import RootRouter

ENGINE = textwrap.dedent("""
    import hashlib, sys, time
    from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
    root, n = sys.argv[1], int(sys.argv[2])
    keys = [make_key(hashlib.sha256(b"dead" + i.to_bytes(4, "little")).digest(), 0)
            for i in range(n)]
    buf = SharedKVBuffer.create(n, {block})
    tier = FileSystemTier(buf, root_dir=root, n_load_workers=0, n_store_workers=n,
                          task_bytes={block}, prefault=False, status_socket="")
    for i, key in enumerate(keys):
        buf.view[i] = i + 1
        tier.submit_store(TransferJob(i, [key], [i]))
    print("submitted", flush=True)
    time.sleep(600)
""").format(block=BLOCK)


def temp_pattern(key: bytes) -> str:
    """FUSE rule pattern: the temporary files of ``key``'s block."""
    return f"/kv/*/{key_block_hash(key).hex()}.bin.*.tmp"


def temps_of(root: str, key: bytes) -> list[str]:
    h = key_block_hash(key).hex()
    return glob.glob(f"{root}/*_r0/{h[:3]}/{h[3:5]}_g0/{h}.bin.*.tmp")


@pytest.mark.fuse
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_engine_sigkill_mid_store_then_a_new_tier_sweeps_its_temps_not_a_live_tiers(
        make_buffer, make_tier, fuse_fs):
    root = str(fuse_fs.path("kv"))
    # A live tier whose store sits mid-write: its temporary file exists, its lease is held.
    live_key = keys_for(b"live", 1)[0]
    live_rule = fuse_fs.block("write", temp_pattern(live_key))
    buf = make_buffer(4, BLOCK)
    live = make_tier(buf, root_dir=root, n_load_workers=1, n_store_workers=1)
    buf.view[0] = content(live_key)
    live.submit_store(TransferJob(1, [live_key], [0]))
    fuse_fs.wait_blocked(live_rule, 1)
    [live_temp] = temps_of(root, live_key)
    live_tag = live_temp.rsplit(".", 3)[1]
    assert lease_state(root, live_tag) == "held"
    # An engine killed while its two store workers are mid-write.
    dead_keys = [make_key(hashlib.sha256(b"dead" + i.to_bytes(4, "little")).digest(), 0)
                 for i in range(2)]  # the engine's keys (same recipe as its script)
    dead_rules = [fuse_fs.block("write", temp_pattern(k)) for k in dead_keys]
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, root, "2"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout.readline().strip() == "submitted"
        for rule in dead_rules:
            fuse_fs.wait_blocked(rule, 1, timeout=30)
        # Each store sits in the write of its named temporary file, under a held lease.
        dead_temps = [t for k in dead_keys for t in temps_of(root, k)]
        assert len(dead_temps) == 2, dead_temps
        dead_tags = {t.rsplit(".", 3)[1] for t in dead_temps}
        assert all(lease_state(root, tag) == "held" for tag in dead_tags)
        workers = psutil.Process(engine.pid).children()
        assert len(workers) == 2
        # The whole tree killed (an OOM kill of its container): a worker whose engine
        # alone died would finish its store and leave nothing (test_engine_exit.py).
        engine.send_signal(signal.SIGKILL)
        for w in workers:
            w.send_signal(signal.SIGKILL)
        engine.wait()
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
        engine.stdout.close()
    for rule in dead_rules:  # the writes finish; the killed workers die after them
        fuse_fs.release(rule)
    wait_for(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE
                             for w in workers), 10, "the dead engine's workers gone")
    # The dead writers' files and leases are swept -- by the live tier's caretaker on its
    # next pass (it walks the shared root periodically), or by the new tier's first one --
    # and the live writer's are left alone.
    new_buf = make_buffer(4, BLOCK)
    new = make_tier(new_buf, root_dir=root)
    wait_for(lambda: not any(os.path.exists(t) for t in dead_temps), 30,
             "the dead engine's temporary files swept")
    wait_for(lambda: all(lease_state(root, tag) == "missing" for tag in dead_tags), 30,
             "the dead engine's leases removed")
    assert os.path.exists(live_temp), "a live writer's temporary file is never touched"
    assert lease_state(root, live_tag) == "held"
    fuse_fs.release(live_rule)
    assert wait_results(live, [1])[1].success
    assert not temps_of(root, live_key)
    run = Driver(new, new_buf)
    assert run.load([live_key]).success  # the live tier's block, whole, via the new tier
    swept = sum(t.stats()["roots"][0]["temps_removed"] for t in (live, new))
    assert swept >= 2, swept


@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_each_worker_holds_a_lease_per_root_and_gives_it_up_at_shutdown(
        make_buffer, make_tier, tmp_path):
    """A worker leases a root at its first store there (docs/storage.md: one lease per
    root it wrote to). The keys are picked four per root: a root's share of a key is
    seeded by its path, which is tmp_path's, and 8 keys of one fixed recipe all fell on
    one root about once in 128 runs, leaving the other without a writer, so no lease."""
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    router = RootRouter(roots)
    on = [[k for k in keys_for(b"lease", 64) if router.index_of(k) == i][:4] for i in (0, 1)]
    assert [len(k) for k in on] == [4, 4]  # fewer than 4 of 64 on a root: ~1e-14
    keys = on[0] + on[1]
    buf = make_buffer(8, BLOCK)
    tier = make_tier(buf, root_dir="", root_dirs=roots, n_load_workers=1,
                     n_store_workers=1, task_bytes=8 * BLOCK)
    run = Driver(tier, buf)
    assert run.store(keys).success  # one task: one worker writes both roots
    leases = {r: glob.glob(f"{r}/.mptier/leases/*.lease") for r in roots}
    assert all(leases.values())
    tags = {os.path.basename(p)[:-len(".lease")] for r in roots for p in leases[r]}
    assert all(lease_state(r, t) == "held" for r in roots for t in tags
               if os.path.exists(f"{r}/.mptier/leases/{t}.lease"))
    # One tag per worker on every root it wrote to.
    per_root = [{os.path.basename(p) for p in leases[r]} for r in roots]
    assert per_root[0] & per_root[1]
    tier.shutdown()
    assert not any(glob.glob(f"{r}/.mptier/leases/*.lease*") for r in roots)


@pytest.mark.parametrize("backend", ["native"], indirect=True)
@pytest.mark.parametrize("lease_locks", ["auto", False])
def test_lease_locks_false_judges_temporaries_by_age_only(make_buffer, make_tier, root,
                                                          lease_locks):
    """A temporary file whose lease is gone is a dead writer's: removed at once where
    lease locks are trusted; with lease_locks=false (node-local locks) only once older
    than stale_temp_s -- a young one stays."""
    from mptier.layout import FileMapper
    from mptier.storage import temp_name

    mapper = FileMapper(root, model_name="model")
    mapper.prepare(BLOCK)
    key = keys_for(b"orphan", 1)[0]
    final = mapper.path_for(key)
    os.makedirs(os.path.dirname(final))
    young = temp_name(final, "deadbeef00000000", 1)
    old = temp_name(final, "deadbeef00000000", 2)
    for path in (young, old):
        with open(path, "wb") as f:
            f.write(b"x" * 100)
    os.utime(old, (1, 1))  # 1970: older than any stale_temp_s
    tier = make_tier(make_buffer(4, BLOCK), lease_locks=lease_locks, stale_temp_s=600)
    wait_for(lambda: not os.path.exists(old), 20, "the old orphan swept")
    wait_for(lambda: tier.stats()["roots"][0]["usage_complete"], 20, "a whole pass")
    assert os.path.exists(young) == (lease_locks is False)

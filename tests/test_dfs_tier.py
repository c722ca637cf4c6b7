"""The tier on a real distributed file system: JuiceFS mounted twice, each mount a node.

Two tiers, one per mount, share one small budget for 30 s of concurrent stores, loads
and evictions over overlapping keys; every successful load must return exactly the bytes
stored under its key (content derived from the key), and no temporary file may remain.
A cache written through one mount loads through the other."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import pytest
from conftest import wait_for
from support.nodes import run_nodes
from test_capacity import Driver, blocks_on_disk, content, keys_for

from mptier import LookupResult

pytestmark = pytest.mark.dfs

KB = 1 << 10
BLOCK = 64 * KB

# One node: a tier on its mount, driving stores, loads and lookups of a shared key space
# for SECONDS, with up to INFLIGHT jobs at once; prints a JSON summary at the end.
NODE = textwrap.dedent("""
    import hashlib, json, random, sys, time
    import numpy as np
    from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
    root, seconds, seed, capacity = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    settle = float(sys.argv[5])
    BLOCK, N_KEYS, INFLIGHT, JOB = {block}, 160, 8, 4
    keys = [make_key(hashlib.sha256(b"shared" + i.to_bytes(4, "little")).digest(), 0)
            for i in range(N_KEYS)]
    def content(key):
        return np.frombuffer(hashlib.shake_128(key).digest(BLOCK), dtype=np.uint8)
    rng = random.Random(seed)
    buf = SharedKVBuffer.create(INFLIGHT * JOB, BLOCK)
    tier = FileSystemTier(buf, root_dir=root, capacity_bytes=capacity, task_bytes=2 * BLOCK,
                          n_load_workers=2, n_store_workers=2, prefault=False,
                          status_socket="")
    out = dict(blocks_stored=0, stores_ok=0, stores_failed=0, loads_ok=0, loads_failed=0,
               keys_loaded=0, wrong=0, errors={{}})
    free = list(range(INFLIGHT))
    pending = {{}}
    next_id = 0
    deadline = time.monotonic() + seconds
    def finish(result):
        kind, job_keys, slot = pending.pop(result.job_id)
        free.append(slot)
        if not result.success:
            out[kind + "s_failed"] += 1
            name = f"{{kind}} errno {{result.errno}}"
            out["errors"][name] = out["errors"].get(name, 0) + 1
        else:
            out[kind + "s_ok"] += 1
            if kind == "store":
                out["blocks_stored"] += len(job_keys)
        if kind == "load":
            good = job_keys if result.success else (result.successful_keys or ())
            for i, key in enumerate(job_keys):
                if key in good:
                    out["keys_loaded"] += 1
                    if not np.array_equal(buf.view[slot * JOB + i], content(key)):
                        out["wrong"] += 1
    while time.monotonic() < deadline or pending:
        for result in tier.get_finished_jobs():
            finish(result)
        if free and time.monotonic() < deadline:
            slot = free.pop()
            job_keys = rng.sample(keys, rng.randint(1, JOB))
            ids = [slot * JOB + i for i in range(len(job_keys))]
            next_id += 1
            if rng.random() < 0.5:
                for i, key in zip(ids, job_keys):
                    buf.view[i] = content(key)
                pending[next_id] = ("store", job_keys, slot)
                tier.submit_store(TransferJob(next_id, job_keys, ids))
            else:
                buf.view[ids[0]:ids[-1] + 1] = 0
                pending[next_id] = ("load", job_keys, slot)
                tier.submit_load(TransferJob(next_id, job_keys, ids))
            tier.lookup(rng.choice(keys), next_id)  # lookups run beside, as in an engine
            tier.on_schedule_end()
            tier.on_request_finished(next_id)
        else:
            time.sleep(0.002)
    # Settle: idle, so each node's walk sees the other's last stores and evicts.
    settle_until = time.monotonic() + settle
    while time.monotonic() < settle_until:
        tier.get_finished_jobs()
        time.sleep(0.05)
    stats = tier.stats()
    out["evicted_keys"] = stats["evicted_keys"]
    out["roots"] = stats["roots"]
    tier.shutdown()
    buf.close()
    buf.unlink()
    print(json.dumps(out), flush=True)
""").format(block=BLOCK)


# After the traffic each node idles this long: a few walk passes (a pass over this root
# takes well under a second on the mounts; the rest after one is at most 4x that).
SETTLE_S = 6.0


@pytest.mark.slow
def test_two_tiers_on_two_mounts_share_a_small_budget_for_30_s(dfs_dirs):
    capacity = 48 * BLOCK
    run = run_nodes(
        [[sys.executable, "-c", NODE, str(path), "30", str(seed), str(capacity),
          str(SETTLE_S)] for seed, path in enumerate((dfs_dirs.a, dfs_dirs.b))],
        lambda: blocks_on_disk(str(dfs_dirs.a))[1], sample_for_s=180, limit_s=180,
        every_s=0.5, exit_timeout_s=10)
    peak, summaries = run.peak, run.summaries
    for s in summaries:
        assert s["wrong"] == 0, s
        # A load job asks for 1-4 random keys of 160 and the budget holds 48 blocks, so
        # a job finds all its keys only ~7 % of the time (15-57 whole successes of
        # 240-760 loads per node in two runs here; 4 of ~100 in a loaded CI run): too
        # few to count on. The keys loaded (verified, from whole and partial results)
        # say the loads work.
        assert s["stores_ok"] > 20 and s["keys_loaded"] >= 10, s
    assert sum(s["evicted_keys"] for s in summaries) > 0, summaries
    _, size, temps = blocks_on_disk(str(dfs_dirs.a))
    assert not temps, f"temporary files left on the shared root: {temps[:5]}"
    # Once the traffic stops, the walks see everything: the root is back within budget.
    assert size <= capacity, (size, capacity, peak, summaries)
    # Under traffic, each node sees the other's stores only through its walk: between
    # two looks at a folder lie a pass and a rest (at most ~2 periods of walk_passes
    # over the run), so the root may pass the budget by what the other node stored in
    # that time -- bounded by the store rate, never running away.
    seconds = 30 + SETTLE_S
    unseen = 0.0
    for me, other in ((0, 1), (1, 0)):
        period = seconds / max(1, summaries[me]["roots"][0]["walk_passes"])
        rate = summaries[other]["blocks_stored"] * BLOCK / 30
        unseen += 2 * period * rate
    assert peak <= capacity + unseen + 8 * 2 * BLOCK, (peak, capacity, unseen, summaries)
    print(json.dumps({"peak_bytes": peak, "final_bytes": size, "capacity": capacity,
                      "unseen_bound": unseen,
                      "nodes": summaries}, indent=1))


def test_a_cache_written_through_one_mount_loads_through_the_other(dfs_dirs, make_buffer,
                                                                     make_tier):
    keys = keys_for(b"across", 16)
    a_buf = make_buffer(16, BLOCK)
    writer = make_tier(a_buf, root_dir=str(dfs_dirs.a), task_bytes=4 * BLOCK)
    b_buf = make_buffer(16, BLOCK)
    reader = make_tier(b_buf, root_dir=str(dfs_dirs.b), task_bytes=4 * BLOCK)
    assert Driver(writer, a_buf).store(keys).success
    for key in keys:
        reader.lookup(key, "req")
    reader.on_schedule_end()
    wait_for(lambda: all(reader.lookup(k, "req") is LookupResult.HIT for k in keys), 15,
             "the reader's lookups see the writer's blocks")
    assert Driver(reader, b_buf).load(keys).success  # Driver.load checks every byte
    assert os.path.samefile(writer.path_for(keys[0]).replace(str(dfs_dirs.a), str(dfs_dirs.b)),
                            reader.path_for(keys[0]))


@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_every_tier_started_on_juicefs_keeps_what_it_stored(dfs_dirs, make_buffer,
                                                             make_tier):
    """JuiceFS accepts O_TMPFILE and its inode outlives close() just long enough for a
    read-back probe to pass (it did for 2 of 4 starts here): a tier trusting it reported
    every store done into files that vanished. Each start probes afresh; every one must
    keep its blocks (checked through the other mount, after its caches expired)."""
    stored = []
    for i in range(8):
        buf = make_buffer(4, BLOCK)
        tier = make_tier(buf, root_dir=str(dfs_dirs.a / f"start{i}"))  # a new folder
        keys = keys_for(b"start%d" % i, 4)
        assert Driver(tier, buf).store(keys).success
        stored += [(tier.path_for(k), k) for k in keys]
        tier.shutdown()
    time.sleep(1.5)  # the other mount's entry and attribute caches (1 s)
    for path, key in stored:
        other = path.replace(str(dfs_dirs.a), str(dfs_dirs.b), 1)
        with open(other, "rb") as f:
            assert f.read() == content(key).tobytes(), other

"""One walker per root on a real distributed file system (issue 19 item 3): four tiers,
two on each of two JuiceFS mounts of one volume (two "nodes"), store at full speed into
one root with one budget. The four elect one walker through the seat's flock (JuiceFS
keeps BSD locks across clients); it alone walks and evicts, the others hand it their new
blocks. The root's files stay within 5 % of the budget under the traffic, and end within
5 % under it once the traffic stops. Half the tiers run the native core, half the pure
Python twin."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
from support.nodes import run_nodes
from test_capacity import blocks_on_disk

from mptier.storage.election import read_usage

pytestmark = [pytest.mark.dfs, pytest.mark.slow]

KB = 1 << 10
BLOCK = 256 * KB
MB = 1 << 20
# Large enough that one task (one block) per writer in flight (4 tiers x 2 writers:
# 2 MiB) is inside 5 % of it.
CAPACITY = 48 * MB
STORE_S = 30.0
SETTLE_S = 8.0
TOLERANCE = 0.05  # issue 19's target
# The bound on the sampled peak. By construction the files stay under the budget: a
# contributor stores only within the room the walker granted it, and the walker counts
# every grant as used until the contributor's blocks are folded (its usage plus the
# grants plus its own tier's stores stay within the capacity; election.py), so a late
# figure makes a store wait instead of the root overshoot. Each sample is one instant of
# the volume, read from JuiceFS's metadata database in one statement. (It was a walk of
# the mount until CI sampled 1.16x once: a walk of ~0.3-1 s while ~10 MiB/s is stored and
# evicted adds up folders listed at different moments. Side by side in four runs at load
# 5-12, walk peaks 0.98-1.04x, instants 0.99-1.02x.) Measured with the grants, the
# instants (seven runs at load 5-12): 0.99-1.02x. Before the grants the tiers trusted a
# figure a round trip late: walked peaks 1.09-1.11x on a quiet machine, 1.27x at load
# ~10; before the election, every tier evicting on its own: 1.56x.
PEAK_BOUND = 1 + TOLERANCE

# How long a node waits at the start line for the others' tiers to be up.
START_LINE_S = 120.0

# One tier storing distinct blocks as fast as it can for STORE_S (INFLIGHT jobs of JOB
# blocks at a time), then idling SETTLE_S; prints a JSON summary. The nodes start
# storing together: each marks its tier up in the start-line folder and waits for all
# of them. (Without it each node's window began when its own tier was up, seconds apart
# on a loaded machine, so one tier could still store after the walker's tier had left:
# the seat passes on under traffic and a second tier evicts, which the test counts as
# two walkers. CI saw that once: the walker evicted 1,887 blocks in 18 passes, a second
# tier 1 block in 3, and no caretaker warned of the election.)
NODE = textwrap.dedent("""
    import hashlib, json, os, sys, time
    from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
    root, seconds, settle, capacity, name = (sys.argv[1], float(sys.argv[2]),
                                             float(sys.argv[3]), int(sys.argv[4]),
                                             sys.argv[5])
    start_line, nodes = sys.argv[6], int(sys.argv[7])
    BLOCK, INFLIGHT, JOB = {block}, 8, 1
    buf = SharedKVBuffer.create(INFLIGHT * JOB, BLOCK)
    buf.view[:] = 7
    tier = FileSystemTier(buf, root_dir=root, capacity_bytes=capacity,
                          task_bytes=JOB * BLOCK, n_load_workers=1, n_store_workers=2,
                          prefault=False, status_socket="")
    out = dict(stored=0, failed=0, errors={{}})
    free, pending, n = list(range(INFLIGHT)), {{}}, 0
    open(os.path.join(start_line, name), "w").close()
    give_up = time.monotonic() + {start_line_s}
    while len(os.listdir(start_line)) < nodes and time.monotonic() < give_up:
        time.sleep(0.01)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or pending:
        for result in tier.get_finished_jobs():
            free.append(pending.pop(result.job_id))
            if result.success:
                out["stored"] += 1
            else:
                out["failed"] += 1
                if len(out["errors"]) < 3:
                    out["errors"][str(n)] = result.error
        if free and time.monotonic() < deadline:
            slot = free.pop()
            keys = [make_key(hashlib.sha256(f"{{name}}-{{n}}-{{i}}".encode()).digest(), 0)
                    for i in range(JOB)]
            n += 1
            pending[n] = slot
            tier.submit_store(TransferJob(n, keys, [slot * JOB + i for i in range(JOB)]))
        else:
            time.sleep(0.001)
    until = time.monotonic() + settle
    while time.monotonic() < until:
        time.sleep(0.05)
    out["root"] = tier.stats()["roots"][0]
    out["pids"] = tier.worker_pids()
    tier.shutdown()
    buf.close()
    buf.unlink()
    print(json.dumps(out), flush=True)
""").format(block=BLOCK, start_line_s=START_LINE_S)


def test_four_tiers_on_two_mounts_hold_the_budget_within_5_percent(juicefs_volume, dfs_dirs,
                                                                   tmp_path):
    mounts = (dfs_dirs.a, dfs_dirs.a, dfs_dirs.b, dfs_dirs.b)
    start_line = tmp_path / "start-line"
    start_line.mkdir()

    def block_bytes() -> int:
        return sum(length for name, length in juicefs_volume.files_below(dfs_dirs.a)
                   if name.endswith(".bin"))

    run = run_nodes(
        [[sys.executable, "-c", NODE, str(path), str(STORE_S), str(SETTLE_S),
          str(CAPACITY), f"tier{i}", str(start_line), str(len(mounts))]
         for i, path in enumerate(mounts)],
        block_bytes,
        sample_for_s=STORE_S + SETTLE_S,
        limit_s=STORE_S + SETTLE_S + START_LINE_S + 120, every_s=0.2,
        envs=[dict(os.environ, MPTIER_NATIVE="1" if i % 2 == 0 else "0")
              for i in range(len(mounts))])
    peak, samples, summaries = run.peak, run.samples, run.summaries
    stored = sum(s["stored"] for s in summaries) * BLOCK
    print(json.dumps([{k: s[k] for k in ("stored", "failed", "errors")} | {
        "evicted": s["root"]["evicted_blocks"], "passes": s["root"]["walk_passes"]}
        for s in summaries]))
    assert stored > 2 * CAPACITY, f"the tiers stored only {stored} bytes: {summaries}"
    # Not yet at the issue's target of no failed store: at load ~10-20 the other tiers'
    # stores still wait past room_wait_s for the walker now and then (measured: 0 to 25
    # of ~1,000-1,300 per run, in bursts: the walker stalls for seconds at times), and
    # a store across mounts can meet its folder removed by eviction (ENOENT: issue 19
    # item 1's folder removal; JuiceFS resolves the name through the other mount's old
    # entry). Those are printed; any other failure fails the test.
    failures = [e for s in summaries for e in s["errors"].values()]
    print(json.dumps(failures))
    assert all("could not make room" in e or "ENOENT" in e for e in failures), failures
    record = read_usage(str(dfs_dirs.a))
    assert record is not None
    walkers = [i for i, s in enumerate(summaries) if s["root"]["evicted_blocks"]]
    # (The seat may pass on while the tiers shut down one by one: the last record can be
    # a later walker's, so only the evictions say who walked during the traffic.)
    assert len(walkers) == 1, (f"tiers {walkers} evicted; what their caretakers said of "
                               f"the election: {run.warnings('walk', 'elect', 'seat')}; "
                               f"summaries: {summaries}")
    _, final, temps = blocks_on_disk(str(dfs_dirs.a))
    assert not temps, temps[:5]
    figures = {"peak": peak / CAPACITY, "final": final / CAPACITY,
               "stored": stored / CAPACITY, "samples": len(samples),
               "published": record["usage_bytes"] / CAPACITY}
    print(json.dumps(figures))
    # When the peak passes the bound, what the caretakers said of the seat tells a
    # takeover in the traffic (two tiers judging room a moment each) from a wrong count.
    assert peak <= PEAK_BOUND * CAPACITY, (
        figures, run.warnings("walk", "elect", "seat"),
        [round(s / CAPACITY, 3) for s in samples if s > CAPACITY])
    # The final is the walker's eviction target (the capacity less its slack, one store
    # per writer here) less the unlinks it overshot by: 0.964-0.974x in four runs since
    # the slack counts one store (0.92-0.97x before, a slot's blocks told at one look).
    # The target is 1 - TOLERANCE; enforced with one more TOLERANCE for a loaded CI.
    assert (1 - 2 * TOLERANCE) * CAPACITY <= final <= CAPACITY, figures

"""Usage kept exact between walk passes from other processes' counts (sorted against the
published walk position), eviction handed out to another thread, and the REMOVED
messages that carry evicted keys to the engine."""

from __future__ import annotations

import os
import random

from storage_tree import file_totals, key_for, make_cache, write_block

from mptier.jobs import LookupResult, Message, MessageType, pack_keys, unpack_keys
from mptier.ledger import JobLedger
from mptier.lookup import LookupTable
from mptier.storage import RootMaintainer, evict
from mptier.storage.walk import TOP_NOT_REACHED, TOP_PASSED

BB = 4096


def sort_against(m: RootMaintainer, folder: str, paths: list[str]
                 ) -> tuple[tuple[int, int], tuple[int, int]]:
    """What a worker does with the published position: (ahead, behind) as (bytes,
    blocks)."""
    position = m.top_position(folder)
    listing = m.top_listing(folder)
    tops = [int(p.split("/")[-3], 16) for p in paths]
    if position != TOP_PASSED and listing is None:  # not listed yet: all ahead
        ahead = len(paths)
    else:
        ahead = sum(1 for t in tops if t > position and listing[t >> 3] & (1 << (t & 7)))
    behind = len(paths) - ahead
    return (ahead * BB, ahead), (behind * BB, behind)


def test_other_processes_stores_keep_usage_exact_whatever_the_walk_is_doing(tmp_path):
    root = str(tmp_path)
    mapper = make_cache(root, block_bytes=BB)
    folder = os.path.basename(mapper.blocks_dir)
    rng = random.Random(7)
    next_key = iter(range(10**6))
    for _ in range(300):
        write_block(mapper, key_for(next(next_key)))
    m = RootMaintainer(root, sweep=False)
    assert m.top_position(folder) == TOP_NOT_REACHED
    checked_during = 0
    while m.tracker.passes < 4:
        m.step(rng.randint(3, 40))
        # Another process stores a few blocks now, sorts them against the position it
        # reads, and the caretaker applies the counts (a step or two later).
        pass_id = m.pass_id
        paths = [write_block(mapper, key_for(next(next_key))) for _ in range(rng.randint(0, 3))]
        ahead, behind = sort_against(m, folder, paths)
        if rng.random() < 0.5:
            m.step(rng.randint(1, 10))  # the walk moves on before the counts arrive
        m.record_other_stores(pass_id, folder, ahead, behind)
        if m.complete:
            checked_during += 1
            assert m.usage_bytes >= file_totals(root, BB)[1], "never below the files"
    # Once a pass has walked everything since, the total is exact: no count is lost,
    # none is doubled (except blocks stored into the folder being walked: none now).
    while True:
        before = m.tracker.passes
        while m.tracker.passes == before:
            m.step(50)
        if m.tracker.passes >= 6:
            break
    assert checked_during > 10
    assert m.usage_bytes == file_totals(root, BB)[1]
    assert m.top_position(folder) == TOP_NOT_REACHED  # between passes: all ahead


def test_counts_are_exact_at_the_end_of_the_pass_they_were_made_in(tmp_path):
    """Blocks stored behind the walk are counted in the pass in progress, those ahead are
    found by it: the pass's own total, published when it completes, is exact."""
    root = str(tmp_path)
    mapper = make_cache(root, block_bytes=BB)
    folder = os.path.basename(mapper.blocks_dir)
    for i in range(400):
        write_block(mapper, key_for(i))
    m = RootMaintainer(root, sweep=False)
    while not m.complete:
        m.step(64)
    passes = m.tracker.passes
    n = 400
    while m.tracker.passes == passes:
        m.step(30)
        position = m.top_position(folder)
        if position in (TOP_NOT_REACHED, TOP_PASSED):
            continue
        paths = [write_block(mapper, key_for(n + j)) for j in range(2)]
        n += 2
        ahead, behind = sort_against(m, folder, paths)
        m.record_other_stores(m.pass_id, folder, ahead, behind)
        # Exact as a finished total plus counts, at every moment.
        assert m.usage_bytes == file_totals(root, BB)[1]
    assert n > 400
    assert m.usage_bytes == file_totals(root, BB)[1] == n * BB


def test_hand_out_mode_gives_the_oldest_blocks_and_counts_what_came_back(tmp_path):
    root = str(tmp_path)
    mapper = make_cache(root, block_bytes=BB)
    paths = [write_block(mapper, key_for(i), atime_ns=(1_700_000_000 + i) * 10**9)
             for i in range(20)]
    m = RootMaintainer(root, capacity_bytes=12 * BB, slack_bytes=4 * BB, hand_out=True,
                       sweep=False)
    handed = []
    while not m.complete:
        handed += m.step(1000).to_evict
    handed += m.step(1000, walk=False).to_evict
    # 20 blocks, capacity - slack 8: the 12 oldest handed out, none removed yet.
    assert [e.path for e in handed] == paths[:12]
    assert all(os.path.exists(p) for p in paths)
    assert m.step(1000, walk=False).to_evict == [], "handed-out bytes count as freed"
    used_again = handed[0]
    os.utime(used_again.path, ns=(2_000_000_000 * 10**9, used_again.mtime_ns))
    keys = [m.evicted(e, evict(e)) for e in handed]
    assert keys[0] is None and all(keys[1:])
    assert m.refused == 1 and m.evicted_blocks == 11
    assert m.usage_bytes == file_totals(root, BB)[1] == 9 * BB
    assert m.handed_bytes == 0
    # The one used again is back in the index with its new atime: the youngest, so the
    # next block out is the oldest of the rest, and it only after them.
    assert m.rechecked == 1 and m.candidates_left == 9
    assert [e.path for e in m.step(1000, walk=False).to_evict] == [paths[12]]


def test_removed_messages_become_events_and_misses():
    keys = [key_for(i) for i in range(300)]
    payloads = pack_keys(keys)
    assert len(payloads) > 1 and sum(n for _, n in payloads) == len(keys)
    assert [k for p, _ in payloads for k in unpack_keys(p)] == keys
    lookups = LookupTable()
    ledger = JobLedger(BB, lookups, stored_events=False)
    assert lookups.lookup(keys[0], "req") is LookupResult.RETRY
    first = ledger.add_lookups(lookups.take_unsent(), 1)
    ledger.task_finished(Message(MessageType.DONE, 0, 0, task_id=first, payload=b"\1"))
    assert lookups.lookup(keys[0], "req") is LookupResult.HIT
    for payload, n in payloads:
        ledger.keys_removed(Message(MessageType.REMOVED, 3, 1, n_done=n, payload=payload))
    events = ledger.take_events()
    assert [k for e in events for k in e.keys] == keys
    assert {e.kind for e in events} == {"removed"}
    assert {e.extra["reason"] for e in events} == {"evicted"}
    assert ledger.counters.evicted_keys == len(keys)
    assert lookups.lookup(keys[0], "req") is LookupResult.MISS, "a HIT held becomes a MISS"


def test_a_block_unlinked_while_handed_out_is_uncounted_once(tmp_path):
    """Handed out ahead of the walk, unlinked, and the walk passes its place before the
    unlink is reported: the pass never saw it, so its removal comes off once -- the
    usage equals the files at the pass's end (it came off twice before)."""
    root = str(tmp_path)
    mapper = make_cache(root, block_bytes=BB)
    keys = [key_for(i) for i in range(30)]
    paths = [write_block(mapper, k, atime_ns=(1_700_000_000 + i) * 10**9)
             for i, k in enumerate(keys)]
    last = max(paths)          # the walk reaches it last; make it the oldest block
    os.utime(last, ns=(1_600_000_000 * 10**9, os.stat(last).st_mtime_ns))
    m = RootMaintainer(root, capacity_bytes=100 * BB, hand_out=True, sweep=False)
    while not m.complete:
        m.step(1000)
    passes = m.tracker.passes
    m.step(4)                  # the next pass has begun, far from the last block
    m.capacity_bytes = 29 * BB + m.slack_bytes  # one block too many
    handed = m.step(4, walk=False).to_evict
    assert [e.path for e in handed] == [last]
    assert evict(handed[0])    # unlinked by an unlink thread...
    while m.tracker.passes == passes:
        m.step(4)              # ...while the walk passes its place
    m.evicted(handed[0], True)  # reported only now
    assert m.usage_bytes == file_totals(root, BB)[1] == 29 * BB
    m.step(1000)               # and the pass after agrees
    while m.tracker.passes == passes + 1:
        m.step(1000)
    assert m.usage_bytes == file_totals(root, BB)[1] == 29 * BB

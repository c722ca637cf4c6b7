"""Usage kept exact between walk passes from other processes' new blocks (told by path,
late), eviction handed out to another thread, and the REMOVED messages that carry
evicted keys to the engine."""

from __future__ import annotations

import os
import random

from storage_tree import file_totals, key_for, make_cache, write_block

from mptier.jobs import LookupResult, Message, MessageType, pack_keys, unpack_keys
from mptier.ledger import JobLedger
from mptier.lookup import LookupTable
from mptier.storage import RootMaintainer, evict

BB = 4096


def test_blocks_told_late_keep_usage_exact_whatever_the_walk_did_meanwhile(tmp_path):
    """Other processes' new blocks reach the caretaker by path a step or a few later
    (their rings): counted once, whether the walk listed them before, after, or not at
    all in the meantime, across pass ends. Exact at every moment once a pass is done."""
    root = str(tmp_path)
    mapper = make_cache(root, block_bytes=BB)
    rng = random.Random(7)
    next_key = iter(range(10**6))
    for _ in range(300):
        write_block(mapper, key_for(next(next_key)))
    written = 300  # nothing removes a block here: the files are what was written
    m = RootMaintainer(root, sweep=False)
    while not m.complete:
        m.step(64)
    untold: list[list[str]] = []
    checked, passes = 0, m.tracker.passes
    while m.tracker.passes < 8:
        m.step(rng.randint(1, 40))
        batch = [write_block(mapper, key_for(next(next_key)))
                 for _ in range(rng.randint(0, 3))]
        untold.append(batch)
        written += len(batch)
        # The caretaker reads the ring a few steps later: the walk moves meanwhile.
        while untold and (len(untold) > 3 or rng.random() < 0.5):
            for path in untold.pop(0):
                m.record_told(path, BB)
        not_yet = sum(len(batch) for batch in untold)
        assert m.tracker.current is not None
        assert m.tracker.current.bytes == (written - not_yet) * BB
        if m.tracker.passes != passes:  # the files themselves, counted by os.walk (a
            passes = m.tracker.passes   # walk per step made this test take 48 s)
            assert file_totals(root, BB) == (written, written * BB)
        checked += 1
    assert checked > 20
    assert file_totals(root, BB) == (written, written * BB)


def test_a_pass_total_is_exact_with_blocks_told_after_the_walk_passed_them(tmp_path):
    """Blocks stored behind the walk and told later are in the pass's own total, those
    the walk listed are not counted twice: the total published at the pass's end is
    exact."""
    root = str(tmp_path)
    mapper = make_cache(root, block_bytes=BB)
    for i in range(400):
        write_block(mapper, key_for(i))
    m = RootMaintainer(root, sweep=False)
    while not m.complete:
        m.step(64)
    passes = m.tracker.passes
    n = 400
    pending: list[str] = []
    while m.tracker.passes == passes:
        m.step(30)
        for path in pending:
            m.record_told(path, BB)
        pending = [write_block(mapper, key_for(n + j)) for j in range(2)]
        n += 2
    for path in pending:
        m.record_told(path, BB)
    assert n > 400
    assert m.usage_bytes == file_totals(root, BB)[1] == n * BB
    assert m.tracker.current is not None and m.tracker.current.bytes == n * BB


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


def test_a_block_stored_again_after_its_eviction_is_counted_once(tmp_path):
    """A path the walk listed, evicted and then stored again is a new file: told, it is
    counted, not taken for the one the walk listed (stats() read low until the next
    pass's end when it was)."""
    root = str(tmp_path)
    mapper = make_cache(root, block_bytes=BB)
    paths = [write_block(mapper, key_for(i), atime_ns=(1_600_000_000 + i) * 10**9)
             for i in range(20)]
    m = RootMaintainer(root, capacity_bytes=20 * BB, slack_bytes=0, sweep=False)
    while not m.complete:
        m.step(64)
    while m.tracker.walker.started:  # listed again by the pass in progress
        m.step(64)
    m.capacity_bytes = 15 * BB
    m.step(64, walk=False)
    assert not os.path.exists(paths[0]) and m.usage_bytes == 15 * BB
    write_block(mapper, key_for(0))  # the same key again: a new file at the old path
    m.record_told(paths[0], BB)
    assert m.usage_bytes == file_totals(root, BB)[1] == 16 * BB

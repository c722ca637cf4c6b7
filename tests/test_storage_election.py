"""mptier.storage.election, one RootShare at a time on a real folder and real locks: the
seat goes to one tier; a walker whose publication stands still for SEAT_STALE_S loses it
to a contributor, steps down when it moves again, and two contributors judging the same
stuck walker end with one walker. Time is the caller's clock (``now``), so nothing sleeps;
the process-level case (a store worker stuck in a FUSE write holds the seat, and a new
tier sweeps the root anyway) is tests/test_leases_live.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mptier.storage.election import (
    ALIVE_CHECK_S,
    ALONE_PUBLISH_S,
    ELECT_GAP_S,
    FOLD_GAP_S,
    HEARTBEAT_S,
    PUBLISH_GAP_S,
    SEAT_NAME,
    SEAT_STALE_S,
    USAGE_NAME,
    RootShare,
    publish_record,
    read_usage,
    share_dir,
)


@pytest.fixture
def shares(tmp_path):
    made: list[RootShare] = []

    def factory() -> RootShare:
        share = RootShare(str(tmp_path))
        made.append(share)
        return share

    yield factory
    for share in made:
        share.close()
    leftovers = [n for n in os.listdir(share_dir(str(tmp_path)))
                 if n not in (SEAT_NAME, "usage.json", "usurp.lock")]
    assert leftovers == [], f"files of closed shares left: {leftovers}"


def publish(share: RootShare, now: float, usage: int = 0) -> None:
    share.publish(now, usage, 0, True, 1 << 30, force=True)


def contributor_step(share: RootShare, now: float) -> bool:
    """What a caretaker's step does without the seat: try it, then read the figure."""
    won = share.elect(now)
    if not won:
        share.refresh(now)
        share.read_at = 0.0  # the next step reads again, whatever its clock says
    return won


def test_one_seat_for_two_tiers(shares):
    a, b = shares(), shares()
    assert a.elect(0.0) and a.walker
    assert not b.elect(0.0) and not b.walker
    publish(a, 0.0, 123)
    b.refresh(0.0)
    assert b.last_usage == 123


def test_a_walker_that_keeps_publishing_keeps_its_seat(shares):
    a, b = shares(), shares()
    assert a.elect(0.0)
    now = 0.0
    while now < 3 * SEAT_STALE_S:
        publish(a, now)
        assert not contributor_step(b, now)
        assert a.keep_seat(now)
        now += ELECT_GAP_S
    assert read_usage(a.root)["walker"] == a.tag


def test_a_stuck_walker_loses_its_seat_and_steps_down_when_it_moves(shares):
    a, b = shares(), shares()
    assert a.elect(0.0)
    publish(a, 0.0, 4096)
    now = 0.0
    while not contributor_step(b, now):  # a publishes nothing more: it is stuck
        now += ELECT_GAP_S
        assert now <= SEAT_STALE_S + 3 * ELECT_GAP_S, "the stuck walker's seat was never taken"
    assert now >= SEAT_STALE_S, f"taken over after {now} s, before SEAT_STALE_S"
    assert b.walker and b.last_usage == 4096  # carries on from the last figure
    # a moves again: its next publication is refused, and it contributes instead.
    publish(a, now + SEAT_STALE_S, 1)
    assert not a.walker
    assert read_usage(a.root)["usage_bytes"] == 4096, "a stepped-down walker published"
    publish(b, now + SEAT_STALE_S + 1, 8192)
    assert read_usage(a.root)["walker"] == b.tag
    # ... and it contributes to the new walker, which folds its blocks.
    a.created("kv/ab/block", 64)
    a.contribute(reserved=0)
    folded: list[tuple[str, int]] = []
    b.fold_at = 0.0
    b.fold(now + 2 * SEAT_STALE_S, lambda path, n: folded.append((path, n)))
    assert folded == [(f"{a.root}/kv/ab/block", 64)]


def test_two_contributors_judging_one_stuck_walker_make_one_walker(shares):
    a, b, c = shares(), shares(), shares()
    assert a.elect(0.0)
    publish(a, 0.0)
    for now in (0.0, ELECT_GAP_S):  # the first step reads the figure, the second judges
        for share in (b, c):
            assert not contributor_step(share, now)
    now = SEAT_STALE_S + 2 * ELECT_GAP_S  # both have seen the figure stand still
    won = [contributor_step(b, now), contributor_step(c, now)]
    assert won == [True, False], won
    # c judged the same stuck seat, but the seat is b's now and b publishes: c waits.
    for _ in range(int(3 * SEAT_STALE_S / ELECT_GAP_S)):
        now += ELECT_GAP_S
        publish(b, now)
        assert not contributor_step(c, now)
    assert [s.walker for s in (a, b, c)] == [True, True, False]  # a has not moved yet
    assert not a.keep_seat(now + ELECT_GAP_S) and b.keep_seat(now + ELECT_GAP_S)


def test_a_dead_walkers_seat_is_taken_at_once(shares):
    a, b = shares(), shares()
    assert a.elect(0.0)
    publish(a, 0.0)
    a.close()  # its lock goes, as with its process
    assert b.elect(ELECT_GAP_S), "a free seat was not taken at the next try"


def test_the_walker_publishes_often_only_news_for_contributors(shares):
    """Every publication is a file renamed over the last (a discard request on a disk
    mounted with ``discard``). With nobody contributing the walker publishes every
    ALONE_PUBLISH_S while its usage moves, and not while it stands still; the fold that
    first sees a contributor
    makes the next publication due at once; from then on a changed figure goes out every
    PUBLISH_GAP_S and an unchanged one every HEARTBEAT_S."""
    w = shares()
    assert w.elect(0.0)
    step, now = PUBLISH_GAP_S / 2, 0.0

    def publications_until(end: float, moving: bool) -> int:
        nonlocal now
        seq = w.seq
        while now < end:
            w.fold(now, lambda path, n: None)
            w.publish(now, int(now * 1000) if moving else 0, 0, True, 1 << 30)
            now += step
        return w.seq - seq

    # (steps of float seconds: a gap may take one step more than it lasts)
    alone = publications_until(3 * ALONE_PUBLISH_S, moving=True)
    assert 2 <= alone <= 3, f"{alone} publications in {3 * ALONE_PUBLISH_S} s alone"
    assert read_usage(w.root)["seq"] == w.seq  # what it publishes reaches the file
    still = publications_until(now + 3 * ALONE_PUBLISH_S, moving=False)
    # (one: the change to the still figure)
    assert still <= 1, f"{still} publications of an unchanged record alone"
    c = shares()
    assert not c.elect(now)
    c.contribute(0, 4 << 16)  # its record appears: it asks for room
    seq, now = w.seq, now + FOLD_GAP_S  # the walker's next fold
    w.fold(now, lambda path, n: None)
    w.publish(now, 0, 0, True, 1 << 30)
    assert w.seq == seq + 1, "the walker's first fold with a newcomer did not publish at once"
    now += step
    busy = publications_until(now + 10 * PUBLISH_GAP_S, moving=True)
    assert 5 <= busy <= 10, f"{busy} publications in {10 * PUBLISH_GAP_S} s with news"
    quiet = publications_until(now + 3 * HEARTBEAT_S, moving=False)
    assert 2 <= quiet <= 4, f"{quiet} publications in {3 * HEARTBEAT_S} s without news"


# -- grants: a contributor stores only within the room the walker lent it -------------

BLOCK = 1 << 16
CAP = 40 * BLOCK


class Disk:
    """The blocks on the root, and the walker's side of them: the blocks it folded (its
    usage, evicted oldest first) and its share. The walker has no stores of its own; its
    slack (what eviction keeps free beyond what stores hold) is room for the
    contributors' headroom."""

    def __init__(self, walker: RootShare, slack: int = 8 * BLOCK) -> None:
        self.walker = walker
        self.slack = slack
        self.files: dict[str, int] = {}   # every block on the root
        self.counted: dict[str, int] = {}  # those the walker folded (its usage)
        self.made = 0

    @property
    def usage(self) -> int:
        return sum(self.counted.values())

    def fold(self, now: float) -> int:
        self.walker.fold_at = 0.0
        return self.walker.fold(now, self.counted.__setitem__)

    def step(self, now: float) -> None:
        """Fold, evict what the contributors' stores hold room for, grant, publish."""
        held = self.fold(now)
        while self.counted and self.usage + held > CAP - self.slack:
            path = next(iter(self.counted))
            del self.counted[path], self.files[path]
        self.walker.grant(CAP - self.usage - self.walker.outstanding(), self.slack)
        self.walker.publish(now, self.usage, len(self.counted), True, CAP, force=True)
        self.check()

    def store(self, share: RootShare, blocks: int) -> int:
        """A contributor's stores: as many of ``blocks`` as its grant leaves room for."""
        done = 0
        while done < blocks and share.grant_left() >= BLOCK:
            self.made += 1
            path = f"{share.root}/kv/{self.made:06d}.bin"
            share.created(path[len(share.root) + 1:], BLOCK)
            self.files[path] = BLOCK
            done += 1
        self.check()
        return done

    def check(self) -> None:
        on_root = sum(self.files.values())
        counted = self.usage + self.walker.outstanding()
        assert on_root <= counted <= CAP, (on_root, counted, CAP)


def contribute(share: RootShare, now: float, reserved: int = 0, headroom: int = 0,
               record: dict | None = None) -> None:
    """A contributor's step: its record, a read of the walker's (``record``: a stale one
    the file system still shows instead), its acknowledgement."""
    share.contribute(reserved, headroom)
    if record is not None:
        publish_record(f"{share_dir(share.root)}/{USAGE_NAME}", record)
    share.read_at = 0.0
    share.refresh(now)
    share.acknowledge(reserved)


def grant_of(record: dict, share: RootShare) -> tuple[int, int]:
    """(limit, its number) of ``share`` in a walker's ``record``."""
    entry = record["folded"][share.tag]
    return entry[4], entry[5]


def test_a_contributor_stores_within_its_grant_whatever_record_it_reads(shares):
    w, c = shares(), shares()
    assert w.elect(0.0) and not c.elect(0.0)
    disk = Disk(w)
    now = 0.0
    contribute(c, now, headroom=8 * BLOCK)  # its stores ask for 8 blocks of room
    disk.step(now)
    big = read_usage(w.root)
    contribute(c, now)
    assert c.grant_left() == 8 * BLOCK, "the grant is the room it may use: 8 blocks"
    assert disk.store(c, 3) == 3
    for _ in range(3):  # idle now: the walker takes the rest back
        now += 1.0
        contribute(c, now)
        disk.step(now)
    limit, seq = grant_of(read_usage(w.root), c)
    assert limit == 3 * BLOCK and seq > grant_of(big, c)[1]
    assert w.outstanding() == 0 and c.grant_left() == 0
    # The file system shows the old record (5 blocks of room left then): it names an
    # older grant, which the contributor must not take for its own again.
    contribute(c, now + 1.0, record=big)
    assert c.limit == limit and disk.store(c, 100) == 0
    # Its stores ask again; a stale record keeps showing meanwhile: no room...
    contribute(c, now + 2.0, reserved=4 * BLOCK, record=big)
    assert disk.store(c, 4) == 0
    # ...until the walker's answer shows through.
    disk.step(now + 2.0)
    contribute(c, now + 3.0, reserved=4 * BLOCK)
    assert disk.store(c, 4) == 4


def test_a_grant_taken_back_counts_until_the_contributor_acknowledges_it(shares):
    w, c = shares(), shares()
    assert w.elect(0.0) and not c.elect(0.0)
    disk = Disk(w)
    contribute(c, 0.0, headroom=8 * BLOCK)
    disk.step(0.0)
    contribute(c, 0.0)
    assert c.limit == 8 * BLOCK and w.outstanding() == 8 * BLOCK
    # Idle: the walker takes the room back...
    contribute(c, 1.0)
    disk.step(1.0)
    assert grant_of(read_usage(w.root), c)[0] == 0
    # ...but counts the 8 blocks while the contributor may still store under them.
    assert w.outstanding() == 8 * BLOCK
    assert disk.store(c, 2) == 2  # a store that looked at the old figure writes
    disk.step(2.0)
    assert w.outstanding() == 8 * BLOCK
    # It reads the smaller limit, but what it created does not fit in it: no ack.
    contribute(c, 3.0)
    assert c.limit < 2 * BLOCK and c.ack < c.grant_seq
    disk.step(3.0)
    assert w.outstanding() >= 6 * BLOCK, "a limit it may be using stopped counting"
    # The walker gives it what it created; it acknowledges that, and the rest goes.
    contribute(c, 4.0)
    assert c.ack == c.grant_seq and c.limit == 2 * BLOCK
    contribute(c, 5.0)
    disk.step(5.0)
    assert w.outstanding() == 0 and disk.usage == 2 * BLOCK


def test_a_new_walker_counts_the_grants_the_last_one_published(shares):
    w, c, d = shares(), shares(), shares()
    assert w.elect(0.0) and not c.elect(0.0) and not d.elect(0.0)
    disk = Disk(w)
    contribute(c, 0.0, headroom=8 * BLOCK)
    disk.step(0.0)
    contribute(c, 0.0)
    assert disk.store(c, 3) == 3
    c.contribute(0, 5 * BLOCK)  # logged, not folded yet; the rest of its room wanted
    w.close()  # the walker's process dies: its seat goes
    assert d.elect(ELECT_GAP_S)
    disk.walker = d
    # Before reading anything of the contributor's, the new walker counts its grant.
    assert d.outstanding() == 8 * BLOCK
    disk.fold(2 * ELECT_GAP_S)  # its 3 blocks are folded now
    assert disk.usage == 3 * BLOCK and d.outstanding() == 5 * BLOCK
    disk.step(3 * ELECT_GAP_S)
    contribute(c, 3 * ELECT_GAP_S)
    assert disk.store(c, 100) == 5
    # The new walker numbers its grants after the last one's: the contributor takes them.
    contribute(c, 4 * ELECT_GAP_S, headroom=8 * BLOCK)
    disk.step(4 * ELECT_GAP_S)
    contribute(c, 4 * ELECT_GAP_S, headroom=8 * BLOCK)
    assert disk.store(c, 100) == 8


CHILD = """
import sys
from mptier.storage.election import RootShare
share = RootShare(sys.argv[1])
assert not share.elect(0.0)
for line in sys.stdin:
    if line.startswith("ask"):
        share.contribute(0, int(line.split()[1]))
    elif line.startswith("store"):
        share.read_at = 0.0
        share.refresh(1.0)
        for i in range(int(line.split()[1])):
            share.created(f"kv/child{i}.bin", int(line.split()[2]))
        share.contribute(0, 0)
    print("ok", flush=True)
"""


def test_a_dead_contributors_grant_stops_counting_once_its_log_is_folded(shares, tmp_path):
    w = shares()
    assert w.elect(0.0)
    disk = Disk(w)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        child.stdin.write(f"ask {8 * BLOCK}\n")
        child.stdin.flush()
        assert child.stdout.readline() == "ok\n"
        disk.step(0.0)
        child.stdin.write(f"store 3 {BLOCK}\n")  # it takes the grant, stores 3 blocks
        child.stdin.flush()
        assert child.stdout.readline() == "ok\n"
    finally:
        child.stdin.close()
        child.wait(10)  # it dies with its files left and its lock gone
    tag = next(t for t in w.cursors)
    assert w.outstanding() == 8 * BLOCK
    disk.fold(ALIVE_CHECK_S / 2)
    assert disk.usage == 3 * BLOCK and w.outstanding() == 5 * BLOCK
    disk.fold(ALIVE_CHECK_S)
    assert tag not in w.cursors and w.outstanding() == 0, "a dead contributor's grant counts"
    assert disk.usage == 3 * BLOCK  # its blocks were folded before
    assert not [n for n in os.listdir(share_dir(w.root)) if n.startswith(tag)]


def test_an_idle_contributors_room_goes_back_to_the_cache(shares):
    """A contributor that stored with headroom and stopped: within a few steps the
    walker counts nothing for it, so the cache may fill to the budget again: its own
    tier's room checks (room_held) and eviction (fold) keep nothing free for it."""
    w, c = shares(), shares()
    assert w.elect(0.0) and not c.elect(0.0)
    disk = Disk(w)
    now = 0.0
    for _ in range(60):  # four budgets' worth, in steps of its headroom
        contribute(c, now, headroom=8 * BLOCK)
        disk.store(c, 8)
        c.contribute(0, 8 * BLOCK)
        disk.step(now)
        now += 0.1
    assert disk.made >= 4 * CAP // BLOCK
    assert w.outstanding() >= 8 * BLOCK
    for _ in range(4):  # it stops: its headroom goes to 0
        contribute(c, now)
        disk.step(now)
        now += 0.1
    w.fold_at = 0.0
    assert w.room_held(CAP) == 0 and disk.fold(now) == 0


# -- a seat changing hands: the new walker counts what nobody published ----------------

def test_a_takeover_counts_the_room_the_stuck_walkers_own_stores_may_take(shares):
    """The stuck walker's own tier stores on under its walker's room checks (its usage,
    the grants it counts, its stores) until it sees the seat gone; none of those blocks
    is logged, so the new walker's first figure (the last record) misses them. Both
    tiers' checks passed for the same free room: 30 blocks used of 40, 10 + 10 stored,
    the root at 1.25x. The new walker counts the free room of the last record as the
    old walker's until it has stepped down and a walk begun since has ended."""
    a, b = shares(), shares()
    assert a.elect(0.0) and not b.elect(0.0)
    used = 30 * BLOCK  # a's own tier's blocks (its walk and its stores count them)
    a.publish(0.0, used, 30, True, CAP, force=True)
    now = 0.0
    while not contributor_step(b, now):  # a stands still: b takes its seat over
        now += ELECT_GAP_S
    assert a.walker and b.walker and b.inherited == used
    # Until a's next keep_seat, each tier's stores take what its own checks leave.
    a_stores = CAP - used - a.room_held(CAP)
    b_stores = CAP - b.inherited - b.room_held(CAP)
    assert a_stores == 10 * BLOCK  # (nothing tells a yet)
    assert used + a_stores + b_stores <= CAP, (
        f"the root at {(used + a_stores + b_stores) / CAP:.2f}x its capacity")
    # b evicts for that room rather than wait on a stuck tier for good.
    b.fold_at = 0.0
    assert b.fold(now, lambda path, n: None) == 10 * BLOCK
    # a moves, steps down; a walk b began before that counts nothing of it...
    began = now
    assert not a.keep_seat(now + ELECT_GAP_S) and not a.walker
    # A contributor now, before it read a grant: its room checks leave it nothing.
    assert CAP - a.usage_for_tier() - a.room_held(CAP) == a.grant_left() == 0
    b.fold_at = 0.0
    b.fold(now + 2 * ELECT_GAP_S, lambda path, n: None)
    b.walked(began)
    assert b.room_held(CAP) == 10 * BLOCK, "released before a walk saw a's last blocks"
    # ...a walk begun after it stepped down holds every block a stored as the walker.
    b.walked(now + 2 * ELECT_GAP_S)
    assert b.room_held(CAP) == 0 and b.outstanding() == 0


def test_a_contributor_stores_nothing_before_the_walkers_first_answer(shares):
    """A contributor that has read no record yet (the walker elected a moment before
    publishing) has no grant: its room checks must not take the root for empty."""
    w, c = shares(), shares()
    assert w.elect(0.0) and not c.elect(0.0)
    c.contribute(0, 8 * BLOCK)
    c.refresh(0.0)  # nothing published yet
    assert c.grant_left() == 0
    assert CAP - c.usage_for_tier() - c.room_held(CAP) == 0, "the whole capacity is its"
    publish(w, 0.0)
    c.read_at = 0.0
    c.refresh(0.0)
    assert c.granted and CAP - c.usage_for_tier() - c.room_held(CAP) == 0


def test_a_new_walker_counts_its_own_blocks_the_last_walker_did_not_fold(shares):
    """A contributor elected after the walker's death: what it created and the last
    walker had not folded is in no published figure and no longer in any grant counted
    (its own limit stops counting with its log), so the figure it trusts until its walk
    ends must hold it."""
    w, c = shares(), shares()
    assert w.elect(0.0) and not c.elect(0.0)
    disk = Disk(w)
    contribute(c, 0.0, headroom=8 * BLOCK)
    disk.step(0.0)
    contribute(c, 0.0)
    assert disk.store(c, 2) == 2
    c.contribute(0, 8 * BLOCK)
    disk.step(0.1)  # folded: in the published usage
    contribute(c, 0.1, headroom=8 * BLOCK)
    assert disk.store(c, 3) == 3
    c.contribute(0, 8 * BLOCK)  # logged, not folded
    assert disk.store(c, 1) == 1  # not even logged
    w.close()  # the walker's process dies: its seat goes
    assert c.elect(ELECT_GAP_S)
    on_root = sum(disk.files.values())
    assert on_root == 6 * BLOCK and c.outstanding() == 0
    assert c.inherited + c.outstanding() >= on_root, (c.inherited, on_root)
    assert sum(n for _, n in c.unfolded_own) == 4 * BLOCK

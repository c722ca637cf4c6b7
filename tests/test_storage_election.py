"""mptier.storage.election, one RootShare at a time on a real folder and real locks: the
seat goes to one tier; a walker whose publication stands still for SEAT_STALE_S loses it
to a contributor, steps down when it moves again, and two contributors judging the same
stuck walker end with one walker. Time is the caller's clock (``now``), so nothing sleeps;
the process-level case (a store worker stuck in a FUSE write holds the seat, and a new
tier sweeps the root anyway) is tests/test_leases_live.py."""

from __future__ import annotations

import os

import pytest

from mptier.storage.election import (
    ELECT_GAP_S,
    SEAT_NAME,
    SEAT_STALE_S,
    RootShare,
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

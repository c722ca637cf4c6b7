"""The lookup table (mptier/lookup.py): RETRY until a batch answers, one check per key
however many requests ask, answers kept per request, a failed load turning HITs into
MISSes, and forgetting a finished request."""

from __future__ import annotations

from mptier.jobs import LookupResult
from mptier.lookup import LookupTable

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


def test_an_unknown_key_answers_retry_until_its_batch_comes_back():
    table = LookupTable()
    assert table.lookup(b"k1", "r") == RETRY
    assert table.lookup(b"k2", "r") == RETRY
    assert table.lookup(b"k1", "r") == RETRY  # asked again before the answer: not re-sent
    assert table.take_unsent() == [b"k1", b"k2"]
    assert table.take_unsent() == []
    assert table.pending_keys == 2
    table.answer([b"k1", b"k2"], [True, False])
    assert table.lookup(b"k1", "r") == HIT
    assert table.lookup(b"k2", "r") == MISS
    assert table.pending_keys == 0 and table.take_unsent() == []


def test_many_requests_asking_one_key_share_one_check_and_all_get_the_answer():
    table = LookupTable()
    for req in range(5):
        assert table.lookup(b"k", req) == RETRY
    assert table.take_unsent() == [b"k"]
    table.answer([b"k"], [True])
    assert [table.lookup(b"k", req) for req in range(5)] == [HIT] * 5
    assert table.requests == 5


def test_a_request_that_asks_after_the_check_was_sent_waits_for_that_answer():
    table = LookupTable()
    table.lookup(b"k", "early")
    assert table.take_unsent() == [b"k"]
    assert table.lookup(b"k", "late") == RETRY
    assert table.take_unsent() == []  # joins the check in flight
    table.answer([b"k"], [True])
    assert table.lookup(b"k", "late") == HIT


def test_answers_belong_to_the_requests_that_asked():
    table = LookupTable()
    table.lookup(b"k", "a")
    table.answer(table.take_unsent(), [True])
    assert table.lookup(b"k", "b") == RETRY  # b never asked: it is checked anew
    assert table.take_unsent() == [b"k"]
    table.answer([b"k"], [False])  # the block went meanwhile
    assert table.lookup(b"k", "a") == HIT and table.lookup(b"k", "b") == MISS


def test_a_failed_load_turns_every_hit_on_its_keys_into_a_miss():
    table = LookupTable()
    for req in ("a", "b"):
        table.lookup(b"k", req)
        table.lookup(b"other", req)
    table.answer(table.take_unsent(), [True, True])
    table.mark_miss([b"k"])
    assert [table.lookup(b"k", r) for r in "ab"] == [MISS, MISS]
    assert [table.lookup(b"other", r) for r in "ab"] == [HIT, HIT]


def test_a_forgotten_request_drops_its_answers_and_a_late_answer_for_it_is_ignored():
    table = LookupTable()
    table.lookup(b"k", "gone")
    keys = table.take_unsent()
    table.forget("gone")
    assert table.requests == 0
    table.answer(keys, [True])
    assert table.requests == 0 and table.pending_keys == 0
    assert table.lookup(b"k", "gone") == RETRY  # a new request of the same id starts over
    table.forget("never-seen")  # idempotent

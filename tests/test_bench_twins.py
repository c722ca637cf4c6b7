"""``mptier.bench.twins``: the A/A control's spread and the verdicts it allows, on
records with known figures (the bench end to end: tests/test_bench.py)."""

from __future__ import annotations

import pytest

from mptier.bench.twins import (
    AHEAD,
    BEHIND,
    UNRESOLVED,
    twin_lines,
    twin_spreads,
    verdicts,
)


def record(label: str, stores: list[float], loads: list[float], **extra) -> dict:
    rounds = [{"store_gbps": s, "load_gbps": x} for s, x in zip(stores, loads)]
    return {"label": label, "rounds": rounds, "figures": rounds[0], **extra}


def case_of(*records: dict) -> dict:
    pairs = [(r["label"], r["label"].split(":twin=")[0]) for r in records
             if ":twin=" in r["label"]]
    spreads = twin_spreads(list(records), pairs)
    return {"designs": list(records), "twins": spreads,
            "verdicts": verdicts(list(records), spreads)}


def test_the_spread_is_each_rounds_twin_over_its_original():
    case = case_of(record("a", [1.0, 2.0], [4.0, 4.0]), record("a:twin=1", [1.1, 1.0], [2.0, 5.0]))
    (entry,) = case["twins"]
    assert entry["store"] == pytest.approx([1.1, 0.5])
    assert entry["load"] == pytest.approx([0.5, 1.25])
    assert case["verdicts"] == []  # one family: nothing to compare


def test_a_design_above_every_twin_ratio_in_every_round_is_ahead():
    case = case_of(record("a", [2.0, 2.2, 2.1], [3.0, 3.0, 3.0]),
                   record("a:twin=1", [2.1, 2.2, 2.0], [3.1, 2.9, 3.0]),
                   record("b", [1.0, 1.0, 1.0], [3.0, 3.1, 2.9]),
                   record("b:twin=1", [1.05, 0.95, 1.0], [2.9, 3.0, 3.1]))
    (v,) = case["verdicts"]
    assert (v["a"], v["b"]) == ("a", "b")
    assert v["store"]["verdict"] == AHEAD
    # round 1: the median of 2.0/1.0, 2.0/1.05, 2.1/1.0, 2.1/1.05 (a's family over b's)
    assert v["store"]["rounds"][0] == pytest.approx((2.0 / 1.0 + 2.1 / 1.05) / 2)
    lo, hi = v["store"]["band"]
    # the widest twin ratio is b's second round, 0.95, and its inverse
    assert lo == pytest.approx(0.95) and hi == pytest.approx(1 / 0.95)
    assert v["load"]["verdict"] == UNRESOLVED


def test_below_the_band_in_every_round_is_behind_and_one_round_inside_is_not_resolved():
    slow = [record("a", [1.0, 1.0], [1.0, 1.0]), record("a:twin=1", [1.0, 1.0], [1.0, 1.0])]
    fast = [record("b", [2.0, 2.0], [2.0, 1.0]), record("b:twin=1", [2.0, 2.0], [2.0, 1.0])]
    (v,) = case_of(*slow, *fast)["verdicts"]
    assert v["store"]["verdict"] == BEHIND
    assert v["load"]["rounds"] == pytest.approx([0.5, 1.0])
    assert v["load"]["verdict"] == UNRESOLVED  # the second round is inside the band


def test_a_wide_twin_spread_leaves_a_large_difference_unresolved():
    # b's twins differ by 2x between themselves; a's lead of 1.5x is inside that noise
    case = case_of(record("a", [3.0, 3.0], [1, 1]), record("a:twin=1", [3.0, 3.0], [1, 1]),
                   record("b", [2.0, 2.0], [1, 1]), record("b:twin=1", [1.0, 4.0], [1, 1]))
    (v,) = case["verdicts"]
    assert v["store"]["band"] == pytest.approx([0.5, 2.0])
    assert v["store"]["verdict"] == UNRESOLVED


def test_one_round_gives_no_verdict_and_errors_give_no_spread():
    one = case_of(record("a", [9.0], [9.0]), record("a:twin=1", [9.0], [9.0]),
                  record("b", [1.0], [1.0]), record("b:twin=1", [1.0], [1.0]))
    assert one["verdicts"][0]["store"]["verdict"] == UNRESOLVED
    broken = case_of(record("a", [1.0], [1.0]), record("a:twin=1", [1.0], [1.0], error="boom"))
    assert broken["twins"] == [] and broken["verdicts"] == []


def test_the_lines_name_each_round_the_band_and_the_verdict():
    case = case_of(record("a", [2.0, 2.0], [1.0, 1.0]), record("a:twin=1", [2.0, 2.0], [1.0, 1.0]),
                   record("b", [1.0, 1.0], [1.0, 1.0]), record("b:twin=1", [1.0, 1.0], [1.0, 1.0]))
    lines = twin_lines(case)
    assert lines[0].startswith("A/A control: a:twin=1 ÷ a, round by round: store 1.00 1.00")
    assert lines[-1] == ("A/A verdict: a ÷ b (each with its twins), round by round: "
                         "store 2.00 2.00 against the twins' 1.00-1.00: ahead; "
                         "load 1.00 1.00 against the twins' 1.00-1.00: not resolved")

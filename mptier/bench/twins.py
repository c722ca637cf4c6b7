"""A/A controls: a design run twice under two labels (``SPEC:twin=N``), and what they let
a run decide about two designs.

The twins of one design differ only by the machine: the disk's mood, the memory the host
took back, the round's place in the run. So their ratio, round by round, is the run's
noise (``twin_spreads``). Two designs that each have a twin can then be compared against
that noise (``verdicts``): a design is *ahead* only when its ratio to the other lies
above every ratio the twins showed, in every round; *behind* likewise below; otherwise
the run has *not resolved* them, whatever the medians say (docs/performance.md,
sections 15 and 22, compared by hand before this was written down).
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

# Figures an A/A control is reported on: (figure key, name in the report and the JSON).
TWIN_FIGURES = (("store_gbps", "store"), ("load_gbps", "load"))
# A verdict needs a design's ratio in this many rounds at least: one round against one
# twin ratio says nothing about how far rounds wander.
MIN_VERDICT_ROUNDS = 2
AHEAD, BEHIND, UNRESOLVED = "ahead", "behind", "not resolved"


def rounds_of(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A design record's figures round by round (a one-round run keeps no list)."""
    return record.get("rounds") or [record["figures"]]


def _usable(record: dict[str, Any] | None) -> bool:
    return record is not None and not record.get("error")


def twin_spreads(records: list[dict[str, Any]],
                 pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """For each (twin, original) pair of labels: the twin's figure over the original's,
    round by round (``{"twin", "of", "store": [...], "load": [...]}``, rounds where
    either lacks the figure left out). The two are one design, so the spread of these
    ratios is how far apart this run puts designs that do not differ."""
    by_label = {r["label"]: r for r in records}
    out = []
    for twin, of in pairs:
        a, b = by_label.get(twin), by_label.get(of)
        if not (_usable(a) and _usable(b)):
            continue
        entry: dict[str, Any] = {"twin": twin, "of": of}
        for key, name in TWIN_FIGURES:
            entry[name] = [x[key] / y[key] for x, y in zip(rounds_of(a), rounds_of(b))
                           if x.get(key) and y.get(key)]
        out.append(entry)
    return out


def verdicts(records: list[dict[str, Any]],
             spreads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pair of designs that both have twins, in the order the run lists them: A ÷ B.

    Per figure and round, the median of every member of A's family (A and its twins)
    over every member of B's in that round (``rounds``); the twins' spread as a band
    holding each twin ratio and its inverse (``band``: the twins are interchangeable, so
    0.8 says 1.25 as much); and the verdict: ``ahead`` when every round lies above the
    band, ``behind`` when every round lies below it, ``not resolved`` otherwise, or with
    fewer than MIN_VERDICT_ROUNDS rounds."""
    by_label = {r["label"]: r for r in records}
    families: dict[str, list[dict[str, Any]]] = {}
    noise: dict[str, dict[str, list[float]]] = {}
    for entry in spreads:
        family = families.setdefault(entry["of"], [by_label[entry["of"]]])
        family.append(by_label[entry["twin"]])
        for _, name in TWIN_FIGURES:
            noise.setdefault(entry["of"], {}).setdefault(name, []).extend(entry[name])
    order = [r["label"] for r in records if r["label"] in families]
    out = []
    for a, b in itertools.combinations(order, 2):
        entry: dict[str, Any] = {"a": a, "b": b}
        for key, name in TWIN_FIGURES:
            per_round = []
            for members in zip(*(rounds_of(r) for r in families[a] + families[b])):
                ours, theirs = members[:len(families[a])], members[len(families[a]):]
                ratios = [x[key] / y[key] for x in ours for y in theirs
                          if x.get(key) and y.get(key)]
                if ratios:
                    per_round.append(statistics.median(ratios))
            twins = [v for v in noise[a][name] + noise[b][name] if v > 0]
            band = sorted(itertools.chain(twins, (1 / v for v in twins)))
            verdict = UNRESOLVED
            if band and len(per_round) >= MIN_VERDICT_ROUNDS:
                if min(per_round) > band[-1]:
                    verdict = AHEAD
                elif max(per_round) < band[0]:
                    verdict = BEHIND
            entry[name] = {"rounds": per_round,
                           "band": [band[0], band[-1]] if band else None,
                           "verdict": verdict}
        out.append(entry)
    return out


def twin_lines(case: dict[str, Any]) -> list[str]:
    """The case's A/A controls, one line each (their ratios round by round), then one
    line per verdict between two designs with twins."""
    lines = []
    for t in case.get("twins") or []:
        figures = "; ".join(f"{name} " + " ".join(f"{v:.2f}" for v in t[name])
                            for _, name in TWIN_FIGURES if t[name])
        lines.append(f"A/A control: {t['twin']} ÷ {t['of']}, round by round: {figures}. "
                     "One design twice: differences between designs inside this spread "
                     "are not resolved by this run")
    for v in case.get("verdicts") or []:
        parts = []
        for _, name in TWIN_FIGURES:
            fig = v[name]
            if not fig["rounds"]:
                continue
            band = (f"the twins' {fig['band'][0]:.2f}-{fig['band'][1]:.2f}"
                    if fig["band"] else "no twin ratio")
            parts.append(f"{name} " + " ".join(f"{x:.2f}" for x in fig["rounds"])
                         + f" against {band}: {fig['verdict']}")
        if parts:
            lines.append(f"A/A verdict: {v['a']} ÷ {v['b']} (each with its twins), round "
                         "by round: " + "; ".join(parts))
    return lines

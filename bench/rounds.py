"""Per-round figures of an ``mptier bench --json`` file: how far the rounds spread.

    .venv/bin/python bench/rounds.py RESULT.json [--figures store_gbps,load_gbps] \
        [--pair A,B ...] [--verdicts]

The tables report medians over rounds; on a shared machine the spread says how much a
difference between two designs can be trusted. With ``--verdicts`` a run whose designs
have twins (``SPEC:twin=N``) also gets its A/A lines, worked out again from the rounds
(so a run older than the bench's own verdicts gets them too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from mptier.bench import twins


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("json")
    p.add_argument("--figures", default="store_gbps,load_gbps")
    p.add_argument("--pair", action="append", default=[], metavar="A,B",
                   help="also each round's A / B (designs by label) and their median: a "
                        "paired ratio, steadier than a ratio of medians when the machine "
                        "drifts between rounds (repeatable)")
    p.add_argument("--verdicts", action="store_true",
                   help="also the A/A controls and, for each two designs with twins, "
                        "whether the run resolved them (mptier.bench.twins)")
    args = p.parse_args()
    with open(args.json, encoding="utf-8") as f:
        doc = json.load(f)
    keys = args.figures.split(",")
    for case in doc["cases"]:
        w = case["workload"]
        print(f"{case['root_fs']} {w['block_bytes'] >> 10} KiB, {w['inflight_jobs']} in flight")
        by_label = {r["label"]: twins.rounds_of(r) for r in case["designs"]}
        for r in case["designs"]:
            rounds = by_label[r["label"]]
            cells = []
            for key in keys:
                vals = [x.get(key) for x in rounds]
                cells.append(f"{key} " + " ".join("-" if v is None else f"{v:.2f}"
                                                  for v in vals))
            print(f"  {r['label']:32s} " + " | ".join(cells)
                  + f" | background CPUs {r.get('background_cpus_max') or 0:.1f}")
        for pair in args.pair:
            a, b = pair.split(",")
            if a not in by_label or b not in by_label:
                continue
            ra, rb = by_label[a], by_label[b]
            cells = []
            for key in keys:
                ratios = sorted(x[key] / y[key] for x, y in zip(ra, rb)
                                if x.get(key) and y.get(key))
                if ratios:
                    cells.append(f"{key} median x{statistics.median(ratios):.2f} (" +
                                 " ".join(f"{v:.2f}" for v in ratios) + ")")
            print(f"  {a} / {b}: " + " | ".join(cells))
        if args.verdicts:
            spreads = case.get("twins") or []
            judged = {**case, "verdicts": twins.verdicts(case["designs"], spreads)}
            for line in twins.twin_lines(judged):
                print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

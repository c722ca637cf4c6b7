"""``mptier bench --trace FILE --budget FRACTION``: a request trace replayed through a
real tier with a byte budget, beside simulated LRU and Belady caches of the same budget.

The budget is FRACTION x the trace's footprint (its distinct blocks x the block size);
the simulators get as many whole blocks. What is replayed and how hits are counted:
:mod:`mptier.bench.trace_replay` and :mod:`mptier.bench.tracesim`; the trace format:
:mod:`mptier.bench.tracefile`. Exit status 0 when the run completed with no wrong byte,
1 when a byte was wrong or the replay stopped, 2 for bad options or a bad trace.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from typing import Any

from mptier.bench.measure import filesystem_of, format_size, parse_size
from mptier.bench.trace_replay import SERIES_POINTS, Replay
from mptier.bench.tracefile import (
    TRACE_TOKENS_PER_BLOCK,
    TraceError,
    footprint_blocks,
    read_trace,
)
from mptier.bench.tracesim import (
    simulate_belady,
    simulate_lru,
    simulate_two_queue,
    simulate_unbounded,
)
from mptier.storage.maintain import DEFAULT_POLICY, POLICIES

TRACE_SCHEMA = 1
DEFAULT_BLOCK = "64K"
# A progress line on stderr this often during a replay.
PROGRESS_EVERY_S = 5.0
TIMESTAMPS = ("order only: requests replayed one after another, each lookup, load and "
              "store finished before the next request starts (every gap compressed to 0)")


def parse_budget(text: str) -> float:
    """``--budget``: a fraction of the trace's footprint in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--budget {text!r} is not a number; give a fraction of the trace's "
            "footprint, e.g. 0.1 for 10 %") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"--budget {text}: need a fraction above 0 and at most 1 (0.25 = a quarter "
            "of the trace's distinct blocks)")
    return value


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--trace", metavar="FILE",
        help="replay this request trace (JSONL: timestamp, input_length, output_length, "
             "hash_ids) through a tier with a budget, beside simulated LRU and Belady; "
             "uses --root (one), --block-bytes (one, default 64K), --json, --no-progress")
    add("--budget", type=parse_budget, metavar="FRACTION",
        help="with --trace: the tier's byte budget as a fraction of the trace's footprint")
    add("--requests", type=int, metavar="N",
        help="with --trace: replay the first N requests (default: all)")
    add("--eviction-policy", choices=POLICIES, default=DEFAULT_POLICY,
        help=f"with --trace: the tier's eviction_policy (default {DEFAULT_POLICY}); "
             "both are simulated beside it")


def _amount(n: int) -> str:
    """Bytes for a person: ``254201036`` -> ``"242.4 MiB"`` (exact sizes as format_size)."""
    exact = format_size(n)
    return exact if exact.endswith("iB") or n < (1 << 20) else f"{n / (1 << 20):.1f} MiB"


def _error(message: str) -> int:
    print(f"mptier bench: {message}", file=sys.stderr)
    return 2


def run_trace(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the trace bench from parsed ``args``; return the exit status."""
    if args.budget is None:
        return _error("--trace needs --budget FRACTION, e.g. --budget 0.1")
    blocks = [b for group in args.block_bytes or [] for b in group]
    if len(blocks) > 1:
        return _error(f"--trace replays at one block size; got {len(blocks)} "
                      f"({', '.join(format_size(b) for b in blocks)})")
    block_bytes = blocks[0] if blocks else parse_size(DEFAULT_BLOCK)
    if block_bytes % 4096:
        return _error(f"--block-bytes {block_bytes}: the trace bench needs a multiple "
                      "of 4 KiB")
    if args.root and len(args.root) > 1:
        return _error("--trace replays on one root; give --root once")
    root = os.path.abspath((args.root or [tempfile.gettempdir()])[0])
    if not os.path.isdir(root):
        return _error(f"--root {root} is not a folder")
    try:
        requests = read_trace(args.trace, args.requests)
    except TraceError as exc:
        return _error(str(exc))
    except OSError as exc:
        return _error(f"cannot read the trace {args.trace}: {exc.strerror or exc}")
    doc = trace_doc(requests, args, block_bytes, root, argv)
    if doc is None:
        return 1
    print_report(doc)
    if args.json:
        _write_json(args.json, doc)
        print(f"json: {args.json}", file=sys.stderr)
    wrong = doc["tier"]["wrong_bytes"]
    if wrong:
        print(f"mptier bench: FAILED: {wrong} loaded bytes were wrong", file=sys.stderr)
        return 1
    return 0


def trace_doc(requests: list, args: argparse.Namespace, block_bytes: int, root: str,
              argv: list[str]) -> dict[str, Any] | None:
    """Simulate, replay and gather the figures; None when the replay stopped."""
    footprint = footprint_blocks(requests)
    budget_bytes = int(args.budget * footprint * block_bytes)
    budget_blocks = budget_bytes // block_bytes
    if budget_blocks < 1:
        print(f"mptier bench: --budget {args.budget} of {footprint} blocks is less than "
              "one block; give a larger fraction or more --requests", file=sys.stderr)
        return None
    streams = [list(r.hash_ids) for r in requests]
    tokens = [r.block_tokens() for r in requests]
    simulated = {sim.policy: sim.as_dict() for sim in (
        simulate_lru(streams, budget_blocks, tokens),
        simulate_two_queue(streams, budget_blocks, tokens),
        simulate_belady(streams, budget_blocks, tokens),
        simulate_unbounded(streams, tokens))}
    fs_type, _mount = filesystem_of(root)
    load_before = list(os.getloadavg())
    folder = tempfile.mkdtemp(prefix="mptier-trace-", dir=root)
    show = not args.no_progress
    last = [time.monotonic()]

    def progress(done: int, c: dict[str, Any], elapsed: float) -> None:
        if not show or (time.monotonic() - last[0] < PROGRESS_EVERY_S
                        and done != len(requests)):
            return
        last[0] = time.monotonic()
        ratio = c["blocks_hit"] / c["blocks_requested"] if c["blocks_requested"] else 0
        print(f"[{elapsed:6.1f}s] {done}/{len(requests)} requests, block hit ratio "
              f"{ratio:.3f}, {c['failed_jobs']['store']} failed stores", file=sys.stderr,
              flush=True)

    if show:
        print(f"replaying {len(requests)} requests ({footprint} distinct blocks of "
              f"{format_size(block_bytes)}) into {folder}, budget "
              f"{_amount(budget_bytes)}", file=sys.stderr, flush=True)
    try:
        tier = Replay(requests, block_bytes, folder, budget_bytes,
                      {"eviction_policy": args.eviction_policy}).run(progress)
    except Exception as exc:  # the tier or a wait failed: say where, keep the cause
        print(f"mptier bench: FAILED: the replay stopped: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    served = tier["bytes_served"]
    tier["hit_ratio"] = tier["blocks_hit"] / tier["blocks_requested"]
    tier["token_hit_ratio"] = tier["tokens_hit"] / max(1, tier["tokens_requested"])
    tier["written_per_served"] = tier["bytes_written"] / served if served else None
    tier["usage"]["peak_walked_over_budget"] = tier["usage"]["peak_walked_bytes"] / \
        budget_bytes
    tier["usage"]["peak_published_over_budget"] = \
        tier["usage"]["peak_published_bytes"] / budget_bytes
    return {
        "schema": TRACE_SCHEMA, "kind": "trace",
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "mptier bench " + shlex.join(argv),
        "load_average": {"start": load_before, "end": list(os.getloadavg())},
        "trace": {"path": os.path.abspath(args.trace), "requests": len(requests),
                  "first_line": requests[0].line, "last_line": requests[-1].line,
                  "span_ms": requests[-1].timestamp - requests[0].timestamp,
                  "tokens_per_block": TRACE_TOKENS_PER_BLOCK,
                  "footprint_blocks": footprint, "timestamps": TIMESTAMPS},
        "block_bytes": block_bytes, "root": root, "root_fs": fs_type,
        "budget": {"fraction": args.budget, "bytes": budget_bytes, "blocks": budget_blocks,
                   "footprint_bytes": footprint * block_bytes},
        "eviction_policy": args.eviction_policy, "tier": tier, "simulated": simulated,
    }


def print_report(doc: dict[str, Any]) -> None:
    t, sim, budget = doc["tier"], doc["simulated"], doc["budget"]
    tr = doc["trace"]
    print(f"trace {tr['path']}: {tr['requests']} requests (lines {tr['first_line']}-"
          f"{tr['last_line']}, {tr['span_ms'] / 1000:.0f} s of arrivals replayed in "
          f"{t['run_s']:.1f} s; timestamps: order only)")
    print(f"blocks of {format_size(doc['block_bytes'])} on {doc['root']} "
          f"({doc['root_fs']}); budget {budget['fraction']:g} x {tr['footprint_blocks']} "
          f"distinct blocks = {_amount(budget['bytes'])} ({budget['blocks']} blocks); "
          f"load average {doc['load_average']['start'][0]:.2f} -> "
          f"{doc['load_average']['end'][0]:.2f}")
    print()
    print(f"{'':18}{'block hits':>12}{'hit ratio':>11}{'token ratio':>13}{'vs LRU':>8}")
    lru = sim["lru"]["hit_ratio"]
    rows = [(f"tier ({doc.get('eviction_policy', 'lru')})", t["blocks_hit"],
             t["hit_ratio"], t["token_hit_ratio"])]
    rows += [(name, s["blocks_hit"], s["hit_ratio"], s["token_hit_ratio"])
             for name, s in (("LRU (sim)", sim["lru"]),
                             ("two-queue (sim)", sim.get("two-queue")),
                             ("Belady (sim)", sim["belady"]),
                             ("unbounded", sim["unbounded"])) if s is not None]
    for name, hits, ratio, tokens in rows:
        versus = f"{ratio / lru:.2f}x" if lru else "-"
        print(f"{name:18}{hits:>12}{ratio:>11.3f}{tokens:>13.3f}{versus:>8}")
    print(f"({t['blocks_requested']} blocks asked for: {t['blocks_hit']} hit + "
          f"{t['blocks_requested'] - t['blocks_hit']} missed; tier lookups "
          f"{t['lookups']} = {t['lookup_hits']} hits + {t['lookup_misses']} first misses)")
    print()
    u = t["usage"]
    print(f"usage / budget: peak {u['peak_walked_over_budget']:.3f} on disk (walked "
          f"{u['walks']} times), {u['peak_published_over_budget']:.3f} as the tier "
          f"published it; final {u['final_walked_bytes'] / budget['bytes']:.3f}")
    sd = u.get("stats_vs_disk")
    if sd:
        print(f"stats() usage against the files, {sd['checks']} checks after a store: "
              f"worst {sd['worst_low_bytes'] // doc['block_bytes']} blocks low, "
              f"{sd['worst_high_bytes'] // doc['block_bytes']} blocks high")
    series = u["walked"]
    if series:
        picks = [series[round(i * (len(series) - 1) / (SERIES_POINTS - 1))]
                 for i in range(SERIES_POINTS)] if len(series) > SERIES_POINTS else series
        print("  on disk over time: " + "  ".join(
            f"{s:.0f}s {b / budget['bytes']:.2f}" for s, b in picks))
    print(f"failed jobs: {t['failed_jobs']['store']} stores ({t['enospc_jobs']} ENOSPC), "
          f"{t['failed_jobs']['load']} loads ({t['blocks_lost_on_load']} blocks gone "
          f"between lookup and load)" + "".join(
              f"; {k} x{v}" for k, v in sorted(t["errors"].items())))
    print(f"store room waits: {t['room_waits']}, {t['room_wait_s']:.2f} s "
          f"({100 * t['room_wait_fraction']:.1f} % of the run); evicted "
          f"{t['evicted_blocks']} blocks")
    wps = t["written_per_served"]
    print(f"bytes written per byte served: {'-' if wps is None else f'{wps:.2f}'} "
          f"({_amount(t['bytes_written'])} written, {_amount(t['bytes_served'])} "
          f"served)")
    print(f"wrong bytes: {t['wrong_bytes']}")


def _write_json(path: str, doc: dict[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)

"""Figures, ratios and the terminal / Markdown tables of a benchmark run.

Every design of a case gets the same figure keys (``None`` where a figure does not
apply, e.g. job latency for fio), and every figure also as a ratio to the baseline (b),
to vLLM's own tier (v, when it ran) and to the raw limit (d) of the same case:
``ratio = value / value of (b, v or d)``. Whether higher or lower is better is stated
per figure.

Long because a run's figures go from design records to ratios to the terminal and
Markdown tables here, all from one table of figures (FIGURES: key, unit, which way is
better), so the two tables cannot disagree.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from typing import Any

from mptier.bench.measure import format_size, ms_summary, us_summary
from mptier.bench.saturation import saturation_figures
from mptier.bench.scheduler import PhaseStats
from mptier.bench.twins import twin_lines
from mptier.units import MiB


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    unit: str
    better: str  # "higher" or "lower"
    digits: int = 2


FIGURES: tuple[Figure, ...] = (
    Figure("store_gbps", "store throughput", "GB/s", "higher"),
    Figure("load_gbps", "load throughput", "GB/s", "higher"),
    Figure("store_gbps_busy", "store beside busy loop", "GB/s", "higher"),
    Figure("load_gbps_busy", "load beside busy loop", "GB/s", "higher"),
    Figure("store_cold_gbps", "store, cold buffer (first pass)", "GB/s", "higher"),
    Figure("load_cold_gbps", "load, cold buffer (first pass)", "GB/s", "higher"),
    Figure("store_job_p50_ms", "store job latency p50", "ms", "lower", 1),
    Figure("store_job_p99_ms", "store job latency p99", "ms", "lower", 1),
    Figure("load_job_p50_ms", "load job latency p50", "ms", "lower", 1),
    Figure("load_job_p99_ms", "load job latency p99", "ms", "lower", 1),
    Figure("single_store_ms", "large job alone: store", "ms", "lower", 1),
    Figure("single_load_ms", "large job alone: load", "ms", "lower", 1),
    # What each design ran out of (measure.Saturation): the machine's CPUs busy on
    # average (of the "cpus" the run's machine line names), the fraction of the time
    # the root's block device had a request in flight, and how many bytes of the phase's
    # own kind (written for stores, read for loads) it had in flight on average.
    Figure("store_cpus", "CPUs busy: store", "CPUs", "lower"),
    Figure("load_cpus", "CPUs busy: load", "CPUs", "lower"),
    Figure("single_load_cpus", "CPUs busy: large job alone, load", "CPUs", "lower"),
    # CPUs a virtual machine's host took from this one while they had work (steal):
    # time no process here ran, that the busy loop loses all the same.
    Figure("store_steal_cpus", "host steal: store", "CPUs", "lower"),
    Figure("load_steal_cpus", "host steal: load", "CPUs", "lower"),
    Figure("store_disk_busy", "disk busy: store", "x", "lower"),
    Figure("load_disk_busy", "disk busy: load", "x", "lower"),
    Figure("single_load_disk_busy", "disk busy: large job alone, load", "x", "lower"),
    Figure("store_disk_mib", "written in flight: store", "MiB", "higher", 1),
    Figure("load_disk_mib", "read in flight: load", "MiB", "higher", 1),
    Figure("single_load_disk_mib", "read in flight: large job alone, load", "MiB",
           "higher", 1),
    Figure("submit_store_us_p50", "submit_store p50", "µs", "lower", 1),
    Figure("submit_store_us_p99", "submit_store p99", "µs", "lower", 1),
    Figure("submit_store_us_max", "submit_store max", "µs", "lower", 0),
    Figure("submit_load_us_p50", "submit_load p50", "µs", "lower", 1),
    Figure("submit_load_us_p99", "submit_load p99", "µs", "lower", 1),
    Figure("submit_load_us_max", "submit_load max", "µs", "lower", 0),
    Figure("get_finished_empty_us_p50", "get_finished (empty) p50", "µs", "lower", 1),
    Figure("get_finished_empty_us_p99", "get_finished (empty) p99", "µs", "lower", 1),
    Figure("get_finished_empty_us_max", "get_finished (empty) max", "µs", "lower", 0),
    Figure("lookup_us_p50", "lookup per key p50", "µs", "lower", 2),
    Figure("lookup_us_p99", "lookup per key p99", "µs", "lower", 1),
    Figure("lookup_us_max", "lookup per key max", "µs", "lower", 0),
    # A load job's keys, first question to last answer, loads streaming beside (light
    # scheduler): how soon an engine learns a request's blocks are on the tier.
    Figure("lookup_answer_ms_p50", "lookups answered p50", "ms", "lower", 2),
    Figure("lookup_answer_ms_p99", "lookups answered p99", "ms", "lower", 1),
    Figure("interference", "scheduler loop rate busy/idle", "x", "higher"),
    Figure("interference_store", "  during stores", "x", "higher"),
    Figure("interference_load", "  during loads", "x", "higher"),
    # Of the busy loop's lost time, what it spent runnable on a run queue while the
    # design ran (the busy part; milliseconds per second): time the CPUs were taken by
    # the design's threads or processes, as against time stolen or a slower loop.
    Figure("store_loop_waited_ms", "  loop waited for a CPU: stores", "ms/s", "lower", 1),
    Figure("load_loop_waited_ms", "  loop waited for a CPU: loads", "ms/s", "lower", 1),
)
FIGURE_KEYS = tuple(f.key for f in FIGURES)
# Background load (CPUs busy with other processes while the design idled) above which
# the table warns that the machine was not quiet.
BUSY_MACHINE_CPUS = 0.25
# A loop rate over a shorter busy part is noisy: on a 2-vCPU VM the loop alone swings
# 0.58-1.16 of its median over 0.1 s windows and 0.94-1.01 over 1 s ones
# (docs/performance.md section 26).
MIN_BUSY_SECONDS = 1.0
# Designs every other design is compared with, by letter: the in-process baseline, vLLM's
# own tier, the raw limit.
REFERENCE_LETTERS = ("b", "v", "d")


def _mib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / MiB


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def design_record(label: str, letter: str, kind: str, info: dict[str, Any],
                  notes: list[str], out: dict[str, Any]) -> dict[str, Any]:
    """Turn what :class:`~mptier.bench.harness.Case` measured into one JSON record."""
    figures: dict[str, float | None] = dict.fromkeys(FIGURE_KEYS)
    record: dict[str, Any] = {"label": label, "letter": letter, "kind": kind,
                              "info": info, "notes": list(notes), "error": out.get("error"),
                              "figures": figures}
    idle = out.get("idle_loop_rate")
    record["idle_loop_rate"] = idle
    record["idle_rates"] = out.get("idle_rates")
    record["background_cpus"] = out.get("background_cpus")
    drop = out.get("drop")
    record["page_cache_dropped"] = None if drop is None else drop.dropped
    if drop is not None and drop.error:
        record["notes"].append(f"page cache not dropped: {drop.error}")

    raw = out.get("raw")
    if raw is not None:
        for key in ("store_gbps", "load_gbps", "store_gbps_busy", "load_gbps_busy"):
            figures[key] = getattr(raw, key)
        figures["interference_store"] = _ratio(raw.store_loop_rate, idle)
        figures["interference_load"] = _ratio(raw.load_loop_rate, idle)
        rates = [r for r in (raw.store_loop_rate, raw.load_loop_rate) if r is not None]
        figures["interference"] = _ratio(statistics.mean(rates), idle) if rates else None
        record["info"] = {**info, **raw.info}
        record["notes"].extend(raw.notes)
        record["warm_memory"] = out.get("warm_memory")
        return record

    for kind in ("store", "load"):
        cold = out.get(f"{kind}_cold")
        if cold is not None:
            figures[f"{kind}_cold_gbps"] = cold.gbps
    record["warm_memory"] = out.get("warm_memory")
    record["memory"] = {name: out[name].memory for name in
                        ("store_cold", "load_cold", "store", "store_busy", "load", "load_busy")
                        if name in out and out[name].memory is not None}
    record["cold_verify"] = out.get("cold_verify")
    phases: dict[str, PhaseStats] = {
        name: out[name] for name in ("store", "store_busy", "load", "load_busy") if name in out}
    for kind in ("store", "load"):
        light, busy = phases.get(kind), phases.get(f"{kind}_busy")
        both = [p for p in (light, busy) if p is not None]
        if light is not None:
            figures[f"{kind}_gbps"] = light.gbps
            if light.saturation is not None:
                used = saturation_figures([light.saturation])
                figures[f"{kind}_cpus"] = used["cpus_busy"]
                figures[f"{kind}_steal_cpus"] = used["steal_cpus"]
                figures[f"{kind}_disk_busy"] = used["disk_busy"]
                figures[f"{kind}_disk_mib"] = _mib(used[
                    "disk_write_in_flight" if kind == "store" else "disk_read_in_flight"])
            lat = ms_summary(light.latencies_ns)
            figures[f"{kind}_job_p50_ms"] = lat["p50"]
            figures[f"{kind}_job_p99_ms"] = lat["p99"]
            if kind == "load" and light.answer_ns:
                answers = ms_summary(light.answer_ns)
                figures["lookup_answer_ms_p50"] = answers["p50"]
                figures["lookup_answer_ms_p99"] = answers["p99"]
        if busy is not None:
            figures[f"{kind}_gbps_busy"] = busy.gbps
            around = out.get(f"{kind}_idle") or [idle]
            figures[f"interference_{kind}"] = _ratio(
                busy.loop_rate, statistics.mean(around) if None not in around else None)
            if busy.saturation is not None:
                figures[f"{kind}_loop_waited_ms"] = \
                    saturation_figures([busy.saturation])["waited_ms_per_s"]
            record.setdefault("busy_seconds", {})[kind] = busy.elapsed_ns / 1e9
            if busy.loop_ns and busy.elapsed_ns < MIN_BUSY_SECONDS * 1e9:
                record["notes"].append(
                    f"the busy part of the {kind} phase lasted under {MIN_BUSY_SECONDS:g} s, "
                    f"so interference_{kind} is noisy; raise --total-bytes or "
                    "--busy-fraction")
        if both:
            _put(figures, f"submit_{kind}_us", us_summary([x for p in both for x in p.submit_ns]))
        if kind == "load" and any(p.lookup_ns for p in both):
            _put(figures, "lookup_us", us_summary([x for p in both for x in p.lookup_ns]))
    if phases:
        _put(figures, "get_finished_empty_us",
             us_summary([x for p in phases.values() for x in p.empty_poll_ns]))
        busy_phases = [p for name, p in phases.items() if name.endswith("_busy")]
        loop_ns = sum(p.loop_ns for p in busy_phases)
        if loop_ns:
            rate = sum(p.loop_iterations for p in busy_phases) / (loop_ns / 1e9)
            figures["interference"] = _ratio(rate, idle)
        record["jobs"] = {}
        for kind in ("store", "load"):
            both = [p for name, p in phases.items() if name.startswith(kind)]
            if both:
                record["jobs"][kind] = {
                    "jobs": sum(p.jobs for p in both), "failed": sum(p.failed for p in both),
                    "duplicates": sum(p.duplicates for p in both),
                    "bytes_ok": sum(p.ok_bytes for p in both),
                    "lookup_misses": sum(p.lookup_misses for p in both),
                    "first_failure": next((p.first_failure for p in both
                                           if p.first_failure), "")}
        record["phase_seconds"] = {name: p.elapsed_ns / 1e9 for name, p in phases.items()}
    singles = {"store": out.get("single_store_ns") or [], "load": out.get("single_load_ns")
               or []}
    if singles["store"]:
        figures["single_store_ms"] = statistics.median(singles["store"]) / 1e6
    if singles["load"]:
        figures["single_load_ms"] = statistics.median(singles["load"]) / 1e6
    record["single_job_runs"] = {k: [v / 1e6 for v in vs] for k, vs in singles.items()}
    if out.get("single_load_saturation"):
        used = saturation_figures(out["single_load_saturation"])
        figures["single_load_cpus"] = used["cpus_busy"]
        figures["single_load_disk_busy"] = used["disk_busy"]
        figures["single_load_disk_mib"] = _mib(used["disk_read_in_flight"])
    record["verify"] = out.get("verify")
    record["single_verify"] = out.get("single_verify")
    if "corrupted_files" in out:
        record["corrupted_files"] = out["corrupted_files"]
    return record


def merge_rounds(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from the same design's records of several rounds: each figure the
    median of the rounds that have it; jobs and verification summed; per-round figures
    kept under ``"rounds"``."""
    if len(records) == 1:
        return records[0]
    first = records[0]
    merged = {**first, "notes": [], "rounds": [r["figures"] for r in records]}
    merged["figures"] = {
        key: (statistics.median(vals) if (vals := [r["figures"][key] for r in records
                                                   if r["figures"][key] is not None])
              else None)
        for key in FIGURE_KEYS}
    for r in records:
        merged["notes"].extend(n for n in r["notes"] if n not in merged["notes"])
    merged["error"] = next((r["error"] for r in records if r.get("error")), None)
    for name in ("idle_loop_rate", "background_cpus"):
        vals = [r[name] for r in records if r.get(name) is not None]
        merged[name] = statistics.median(vals) if vals else None
    busy = [r["background_cpus"] for r in records if r.get("background_cpus") is not None]
    merged["background_cpus_max"] = max(busy) if busy else None
    drops = [r["page_cache_dropped"] for r in records if r["page_cache_dropped"] is not None]
    merged["page_cache_dropped"] = all(drops) if drops else None
    if all(r.get("jobs") for r in records):
        merged["jobs"] = {
            phase: {k: (next((r["jobs"][phase][k] for r in records if r["jobs"][phase][k]),
                             "") if isinstance(v, str)
                        else sum(r["jobs"][phase][k] for r in records))
                    for k, v in j.items()}
            for phase, j in first["jobs"].items()}
    for which in ("warm_memory", "memory", "position"):
        merged[which] = [r.get(which) for r in records]
    for which in ("verify", "single_verify", "cold_verify"):
        checks = [r.get(which) for r in records if r.get(which)]
        if checks and all(v.get("mode") == "full" for v in checks):
            merged[which] = {
                "mode": "full", "rounds": len(checks),
                "blocks_checked": sum(v["blocks_checked"] for v in checks),
                "mismatched": sum(v["mismatched"] for v in checks),
                "ok": all(v["ok"] for v in checks)}
    if "single_job_runs" in first:
        merged["single_job_runs"] = {
            k: [x for r in records for x in r.get("single_job_runs", {}).get(k, [])]
            for k in first["single_job_runs"]}
    return merged


def _put(figures: dict[str, float | None], prefix: str, summary: dict[str, Any]) -> None:
    for q in ("p50", "p99", "max"):
        figures[f"{prefix}_{q}"] = summary[q]


def pick_reference(records: list[dict[str, Any]], letter: str) -> dict[str, Any] | None:
    """The plain design of ``letter`` (no variant options) if any, else the first one."""
    same = [r for r in records if r["letter"] == letter and not r.get("error")]
    plain = [r for r in same if ":" not in r["label"]]
    return (plain or same or [None])[0]


def add_ratios(records: list[dict[str, Any]]) -> dict[str, str | None]:
    """Fill ``ratio_to_<letter>`` of every record for each of :data:`REFERENCE_LETTERS`;
    return ``{letter: label of the reference design or None}``."""
    labels = {}
    for letter in REFERENCE_LETTERS:
        ref = pick_reference(records, letter)
        labels[letter] = ref["label"] if ref else None
        for record in records:
            record[f"ratio_to_{letter}"] = {
                key: (_ratio(record["figures"][key], ref["figures"][key]) if ref else None)
                for key in FIGURE_KEYS}
    return labels


def problems(case: dict[str, Any]) -> list[str]:
    """Failures worth a non-zero exit: errors, failed jobs, bytes that did not verify."""
    out = []
    for r in case["designs"]:
        name = r["label"]
        if r.get("error"):
            out.append(f"{name}: {r['error']}")
        for phase, j in (r.get("jobs") or {}).items():
            if j["failed"] or j["duplicates"]:
                cause = j.get("first_failure") or ""
                out.append(f"{name}: {j['failed']} {phase} job(s) failed, "
                           f"{j['duplicates']} reported twice"
                           + (f"; the first failure: {cause}" if cause else ""))
        jobs = r.get("jobs") or {}
        stored = "store" in jobs and not jobs["store"]["failed"]
        load = jobs.get("load") or {}
        if stored and load.get("lookup_misses"):
            out.append(f"{name}: every key was stored, yet lookups answered "
                       f"{load['lookup_misses']} of them absent")
        for which in ("verify", "single_verify", "cold_verify"):
            v = r.get(which)
            if v and v.get("mode") == "full" and not v["ok"]:
                out.append(f"{name}: {v['mismatched']} of {v['blocks_checked']} loaded "
                           f"blocks differ from what was stored ({which})")
    return out


# -- rendering ------------------------------------------------------------------------

def fmt(value: float | None, digits: int) -> str:
    if value is None:
        return "—"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def cells(record: dict[str, Any], fig: Figure) -> tuple[str, str]:
    """``(value, "b 1.00 · d 0.85")`` for one design and figure."""
    value = fmt(record["figures"].get(fig.key), fig.digits)
    parts = []
    for letter in REFERENCE_LETTERS:
        r = (record.get(f"ratio_to_{letter}") or {}).get(fig.key)
        if r is not None:
            parts.append(f"{letter} {r:.2f}")
    return value, " · ".join(parts)


def case_title(case: dict[str, Any]) -> str:
    w = case["workload"]
    return (f"{w['root']} ({case['root_fs']}, O_DIRECT {'yes' if case['o_direct'] else 'no'})"
            f" · {format_size(w['block_bytes'])} blocks · {w['job_blocks']}-block jobs · "
            f"{w['inflight_jobs']} in flight · {format_size(w['total_bytes'])} per phase"
            + ("" if w.get("await_lookups") else " · loads beside their lookups"))


# A phase's throughput is a steady-state figure only when its jobs are several times
# the jobs kept in flight; below this multiple, ramp-up and the last jobs' tail dominate.
STEADY_STATE_MULTIPLE = 4


def short_phase(case: dict[str, Any]) -> str | None:
    """A warning when the light half of a phase is too short for a steady state."""
    w = case["workload"]
    n_jobs = -(-w["blocks_per_phase"] // w["job_blocks"])
    light = n_jobs - round(n_jobs * min(1.0, max(0.0, w["busy_fraction"])))
    if light >= STEADY_STATE_MULTIPLE * w["inflight_jobs"]:
        return None
    need = STEADY_STATE_MULTIPLE * w["inflight_jobs"] * w["job_blocks"] * w["block_bytes"]
    need = int(need / max(1e-9, 1 - w["busy_fraction"]))
    return (f"each phase runs only {light} jobs under the light scheduler with "
            f"{w['inflight_jobs']} in flight, so its GB/s include ramp-up and tail; use "
            f"--total-bytes {format_size(need) if need % (1 << 20) == 0 else need} or more "
            "for steady-state figures")


def case_caption(case: dict[str, Any]) -> str:
    drop = case.get("page_cache_dropped")
    dropped = {True: "page cache dropped between store and load",
               False: "page cache NOT dropped (not permitted here)",
               None: "page cache drop disabled"}[drop]
    refs = ", ".join(f"'{letter}' = ÷ {case.get(f'reference_{letter}')}"
                     for letter in REFERENCE_LETTERS if case.get(f"reference_{letter}"))
    removal = case.get("removal")
    if removal:
        dropped += f"; files removed {removal}" if removal != "kept" else "; files kept"
    text = (f"{dropped}; loads verified byte for byte ({case['verified']}); ratios: "
            f"{refs or 'none'}; higher is better for GB/s and loop rate, lower for times; "
            "CPUs busy counts the whole machine (the engine too), disk busy the share of "
            "the phase the root's device had a request in flight, read (written) in "
            "flight the bytes the device had on its queue on average: a design near the "
            "machine's CPUs ran out of CPU, one with less in flight than another on a "
            "disk that serves more was not asking for more")
    short = short_phase(case)
    if short:
        text += f". WARNING: {short}"
    busy = case.get("background_cpus_max")
    if busy is not None and busy > BUSY_MACHINE_CPUS:
        text += (f". WARNING: other processes kept up to {busy:.1f} CPUs busy during the "
                 "run; the figures are noisy")
    return text


def markdown_table(case: dict[str, Any]) -> str:
    designs = case["designs"]
    head = "| figure | " + " | ".join(f"{r['letter']}: {r['label']}" for r in designs) + " |"
    lines = [f"**{case_title(case)}**", "", head,
             "|---|" + "---|" * len(designs)]
    for fig in FIGURES:
        row = []
        for r in designs:
            value, ratios = cells(r, fig)
            row.append(f"{value} ({ratios})" if ratios and value != "—" else value)
        lines.append(f"| {fig.label.strip()} ({fig.unit}) | " + " | ".join(row) + " |")
    lines += ["", case_caption(case), *(f"\n{line}" for line in twin_lines(case))]
    for r in designs:
        if r.get("error"):
            lines.append(f"- {r['label']}: **error** {r['error']}")
    return "\n".join(lines)


def summary_markdown(doc: dict[str, Any]) -> str:
    """One compact Markdown table of the headline figures of every case and design
    (the full per-case tables carry the rest)."""
    def v(r: dict[str, Any], key: str, digits: int = 2) -> str:
        return fmt(r["figures"].get(key), digits)

    def with_ratios(r: dict[str, Any], key: str) -> str:
        parts = [f"{letter} {x:.2f}" for letter in REFERENCE_LETTERS
                 if (x := (r.get(f"ratio_to_{letter}") or {}).get(key)) is not None]
        return v(r, key) + (f" ({', '.join(parts)})" if parts and r["letter"] not in "bvd"
                            else "")

    lines = ["| case | design | store GB/s | load GB/s | store / load GB/s beside busy loop "
             "| loop rate busy/idle | 64-block job alone: store / load ms "
             "| submit_store p50 / max µs | get_finished (empty) p50 µs "
             "| lookups answered p50 ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for case in doc["cases"]:
        w = case["workload"]
        name = f"{case['root_fs']} {format_size(w['block_bytes'])} x{w['job_blocks']}"
        for r in case["designs"]:
            lines.append(
                f"| {name} | {r['letter']}: {r['label']} | {with_ratios(r, 'store_gbps')} "
                f"| {with_ratios(r, 'load_gbps')} "
                f"| {v(r, 'store_gbps_busy')} / {v(r, 'load_gbps_busy')} "
                f"| {v(r, 'interference')} "
                f"| {v(r, 'single_store_ms', 1)} / {v(r, 'single_load_ms', 1)} "
                f"| {v(r, 'submit_store_us_p50', 1)} / {v(r, 'submit_store_us_max', 0)} "
                f"| {v(r, 'get_finished_empty_us_p50', 1)} "
                f"| {with_ratios(r, 'lookup_answer_ms_p50')} |")
    return "\n".join(lines)


def _checksum_setting(label: str) -> bool | None:
    """True / False for a variant that sets block checksums on / off, else None."""
    for part in label.split(":")[1:]:
        key, _, value = part.partition("=")
        if key in ("checksum_blocks", "checksum"):
            return value.lower() in ("true", "1", "yes", "on")
    return None


def checksum_notes(doc: dict[str, Any]) -> list[str]:
    """The CRC32C speed of one core, and per case the cost of block checksums: each
    design run with checksums on divided by the same design with them off (same run)."""
    crc = doc.get("crc32c") or {}
    lines = []
    if crc.get("gbps"):
        lines.append(f"CRC32C on one core, a 2 MiB block in cache: {crc['gbps']:.1f} GB/s "
                     f"({crc.get('impl')}, {crc.get('backend')} backend)")
    for case in doc.get("cases", []):
        by_setting: dict[tuple[str, bool], dict[str, Any]] = {}
        for r in case["designs"]:
            setting = _checksum_setting(r["label"])
            if setting is not None:
                base = ":".join(p for p in r["label"].split(":")
                                if p.partition("=")[0] not in ("checksum_blocks", "checksum"))
                by_setting[(base, setting)] = r
        for (base, setting), on in sorted(by_setting.items()):
            off = by_setting.get((base, False))
            if not setting or off is None:
                continue
            parts = []
            for key, name in (("store_gbps", "store"), ("load_gbps", "load")):
                a, b = on["figures"].get(key), off["figures"].get(key)
                parts.append(f"{name} x{a / b:.2f}" if a and b else f"{name} -")
            lines.append(f"checksums on / off, {case_title(case)}, {base}: "
                         + ", ".join(parts))
    return lines


def plain_table(case: dict[str, Any]) -> str:
    designs = case["designs"]
    header = ["figure"] + [f"{r['letter']}: {r['label']}" for r in designs]
    rows = []
    for fig in FIGURES:
        row = [f"{fig.label} ({fig.unit})"]
        for r in designs:
            value, ratios = cells(r, fig)
            row.append(f"{value} [{ratios}]" if ratios and value != "—" else value)
        rows.append(row)
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    out = [case_title(case)]
    for row in [header, *rows]:
        out.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
    out.append(case_caption(case))
    out.extend(twin_lines(case))
    out.extend(f"  {r['label']}: error {r['error']}" for r in designs if r.get("error"))
    out.extend(f"  {r['label']}: {n}" for r in designs for n in r.get("notes", []))
    return "\n".join(out)


def print_case(case: dict[str, Any], console: Any = None) -> None:
    """Print a case table: with rich on a terminal when it is installed, else plain text
    (which a pipe or a log file keeps unwrapped)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is None or (console is None and not sys.stdout.isatty()):
        print(plain_table(case))
        return
    console = console or Console()
    designs = case["designs"]
    table = Table(title=case_title(case), caption=case_caption(case), caption_justify="left",
                  title_justify="left")
    table.add_column("figure", style="bold")
    for r in designs:
        table.add_column(f"{r['letter']}: {r['label']}", justify="right")
    for fig in FIGURES:
        row = [f"{fig.label} ({fig.unit})"]
        for r in designs:
            value, ratios = cells(r, fig)
            row.append(f"{value}\n[dim]{ratios}[/dim]" if ratios and value != "—" else value)
        table.add_row(*row)
    console.print(table)
    for line in twin_lines(case):
        console.print(line)
    for r in designs:
        if r.get("error"):
            console.print(f"[red]{r['label']}: error {r['error']}[/red]")
        for note in r.get("notes", []):
            console.print(f"[yellow]{r['label']}: {note}[/yellow]")


# -- sweeps ---------------------------------------------------------------------------

SWEPT_FIELDS = {"block_bytes": "block size", "inflight_jobs": "jobs in flight"}


def _sweep_value(field: str, value: int) -> str:
    return format_size(value) if field == "block_bytes" else str(value)


def sweep_tables(doc: dict[str, Any]) -> list[dict[str, str]]:
    """Tables of store / load GB/s against each swept workload field.

    Cases that differ in exactly one of :data:`SWEPT_FIELDS` (and nothing else) form a
    sweep; each gives ``{"title", "markdown", "text"}`` with one row per design and one
    column per value of the field. A sweep of jobs in flight also gives a table of load
    job latency (:func:`_latency_table`).
    """
    out = []
    cases = doc.get("cases", [])
    for field, name in SWEPT_FIELDS.items():
        groups: dict[tuple, list[dict[str, Any]]] = {}
        for case in cases:
            w = case["workload"]
            rest = tuple(sorted((k, str(v)) for k, v in w.items()
                                if k not in (field, "blocks_per_phase")))
            groups.setdefault(rest, []).append(case)
        for group in groups.values():
            values = sorted({c["workload"][field] for c in group})
            if len(values) < 2:
                continue
            by_value = {c["workload"][field]: c for c in group}
            labels: list[str] = []
            for c in group:
                labels.extend(r["label"] for r in c["designs"] if r["label"] not in labels)
            w = group[0]["workload"]
            fixed = (f"{group[0]['root_fs']} {w['root']}, "
                     + ", ".join(f"{SWEPT_FIELDS[f]} {_sweep_value(f, w[f])}"
                                 for f in SWEPT_FIELDS if f != field)
                     + f", {w['job_blocks']}-block jobs, {format_size(w['total_bytes'])}"
                     " per phase")
            title = f"Sweep of {name} ({fixed}): store / load GB/s"
            header = ["design", *(_sweep_value(field, v) for v in values)]
            rows = []
            for label in labels:
                row = [label]
                for v in values:
                    rec = next((r for r in by_value[v]["designs"] if r["label"] == label),
                               None)
                    row.append("—" if rec is None else
                               f"{fmt(rec['figures'].get('store_gbps'), 2)} / "
                               f"{fmt(rec['figures'].get('load_gbps'), 2)}")
                rows.append(row)
            markdown = "\n".join(["| " + " | ".join(header) + " |",
                                  "|---" * len(header) + "|",
                                  *("| " + " | ".join(r) + " |" for r in rows)])
            widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
            text = "\n".join([title, *("  ".join(c.ljust(widths[i]) for i, c in
                                                 enumerate(r)).rstrip()
                                       for r in [header, *rows])])
            out.append({"title": title, "markdown": markdown, "text": text})
            if field == "inflight_jobs":
                out.append(_latency_table(fixed, values, by_value, labels))
    return out


def _latency_cell(rec: dict[str, Any] | None, key: str) -> str:
    if rec is None:
        return "—"
    ratio = (rec.get("ratio_to_v") or {}).get(key)
    return fmt(rec["figures"].get(key), 1) + ("" if ratio is None else f" ({ratio:.2f} v)")


def _latency_table(fixed: str, values: list[int], by_value: dict[int, dict[str, Any]],
                   labels: list[str]) -> dict[str, str]:
    """Load job latency (p50 ms) against jobs in flight, and the large job alone (timed
    in each case: the column shows the one-in-flight case's, else the first), each with
    its ratio to vLLM's tier (v) of the same case where it ran: vLLM runs a whole job on
    one thread, mptier splits it across workers, so this is where the designs differ."""
    title = f"Load job latency against jobs in flight ({fixed}): p50 ms (ratio to v)"
    alone = by_value.get(1) or by_value[values[0]]
    header = ["design", *(str(v) for v in values), "large job alone: load ms"]
    rows = []
    def rec_in(case: dict[str, Any], label: str) -> dict[str, Any] | None:
        return next((r for r in case["designs"] if r["label"] == label), None)

    for label in labels:
        rows.append([label, *(_latency_cell(rec_in(by_value[v], label), "load_job_p50_ms")
                              for v in values),
                     _latency_cell(rec_in(alone, label), "single_load_ms")])
    markdown = "\n".join(["| " + " | ".join(header) + " |", "|---" * len(header) + "|",
                          *("| " + " | ".join(r) + " |" for r in rows)])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    text = "\n".join([title, *("  ".join(c.ljust(widths[i]) for i, c in
                                         enumerate(r)).rstrip() for r in [header, *rows])])
    return {"title": title, "markdown": markdown, "text": text}

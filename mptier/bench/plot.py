"""The PNG chart: one panel per figure, cases along the x axis, one bar per design.

matplotlib is imported here only (the ``bench`` extra), with the Agg backend so no
display is needed.
"""

from __future__ import annotations

from typing import Any

from mptier.bench.measure import format_size

# (title, bar figure, marker figures drawn on top of the bar, log scale)
PANELS: tuple[tuple[str, str, tuple[str, ...], bool], ...] = (
    ("store GB/s: bar at full speed, dot beside busy loop", "store_gbps",
     ("store_gbps_busy",), False),
    ("load GB/s: bar at full speed, dot beside busy loop", "load_gbps",
     ("load_gbps_busy",), False),
    ("load job latency ms: p50 bar, p99 dot", "load_job_p50_ms", ("load_job_p99_ms",), True),
    ("64-block job alone, ms: load bar, store dot", "single_load_ms", ("single_store_ms",),
     True),
    ("submit_store µs: p50 bar, p99 dot, max x", "submit_store_us_p50",
     ("submit_store_us_p99", "submit_store_us_max"), True),
    ("get_finished (empty) µs: p50, p99, max", "get_finished_empty_us_p50",
     ("get_finished_empty_us_p99", "get_finished_empty_us_max"), True),
    ("lookup per key µs: p50, p99, max", "lookup_us_p50", ("lookup_us_p99", "lookup_us_max"),
     True),
    ("a load job's lookups answered, ms: p50 bar, p99 dot", "lookup_answer_ms_p50",
     ("lookup_answer_ms_p99",), True),
    ("scheduler loop rate busy/idle (1 = no interference)", "interference", (), False),
)
_MARKERS = ("o", "x")


def case_short(case: dict[str, Any]) -> str:
    w = case["workload"]
    return f"{case['root_fs']}\n{format_size(w['block_bytes'])} x{w['job_blocks']}"


def write_png(report: dict[str, Any], path: str) -> None:
    """Draw every case of ``report`` (the JSON document) into one PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = report["cases"]
    labels: list[str] = []
    for case in cases:
        for r in case["designs"]:
            name = f"{r['letter']}: {r['label']}"
            if name not in labels:
                labels.append(name)
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(labels)}
    fig, axes = plt.subplots(3, 3, figsize=(17, 13))
    width = 0.8 / max(1, len(labels))
    for ax, (title, key, markers, log) in zip(axes.flat, PANELS, strict=True):
        for ci, case in enumerate(cases):
            by_name = {f"{r['letter']}: {r['label']}": r for r in case["designs"]}
            for li, name in enumerate(labels):
                record = by_name.get(name)
                if record is None:
                    continue
                x = ci - 0.4 + width * (li + 0.5)
                value = record["figures"].get(key)
                if value is not None and value > 0:
                    ax.bar(x, value, width, color=colors[name],
                           label=name if ci == 0 else None)
                    ax.annotate(f"{value:.3g}", (x, value), ha="center", va="bottom",
                                fontsize=6, rotation=90 if len(labels) > 4 else 0)
                for marker, mkey in zip(_MARKERS, markers, strict=False):
                    mval = record["figures"].get(mkey)
                    if mval is not None and mval > 0:
                        ax.plot([x], [mval], marker=marker, color="black", markersize=4)
        if key == "interference":
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([case_short(c) for c in cases], fontsize=8)
        if log:
            ax.set_yscale("log")
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in labels]
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.965),
               ncol=min(len(labels), 6), fontsize=9)
    machine = report.get("machine", {})
    fig.suptitle(
        f"mptier bench · {machine.get('cpus', '?')} CPUs · {machine.get('cpu_model', '')} · "
        f"{report.get('created', '')}", y=0.995, fontsize=10)
    fig.text(0.01, 0.005, "command: " + report.get("command", ""), fontsize=7, family="monospace")
    fig.tight_layout(rect=(0, 0.02, 1, 0.92))
    fig.savefig(path, dpi=110)
    plt.close(fig)

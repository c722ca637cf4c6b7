"""The Grafana dashboard of the mptier_* metrics, as code.

    python -m mptier.monitor.grafana > configs/grafana-mptier.json

``configs/grafana-mptier.json`` is this module's output (a test keeps them equal), so a
new metric is charted by adding a panel here. Import it in Grafana (Dashboards -> Import)
and pick a Prometheus data source; the ``tier`` variable selects tiers and services.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
TIER = 'tier=~"$tier"'
RATE = "$__rate_interval"
PER_WORKER = "{{tier}} {{role}}/{{slot}}"
# Grafana's grid is 24 columns wide; three panels of 8 to a line, 8 units high.
PANEL_W = 8
PANEL_H = 8


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str
    description: str = ""


def _rate(metric: str, by: str = "") -> str:
    inner = f"rate({metric}{{{TIER}}}[{RATE}])"
    return f"sum by ({by}) ({inner})" if by else inner


TIER_PANELS = [
    Panel("Jobs submitted per second",
          [(_rate("mptier_jobs_submitted_total", "tier, kind"), "{{tier}} {{kind}}")], "ops"),
    Panel("Bytes moved per second",
          [(_rate("mptier_transferred_bytes_total", "tier, kind"), "{{tier}} {{kind}}")],
          "Bps", "Blocks stored or loaded successfully by finished jobs"),
    Panel("Stores: bytes written and skipped per second",
          [(_rate("mptier_written_bytes_total", "tier"), "{{tier}} written"),
           (_rate("mptier_skipped_bytes_total", "tier"), "{{tier}} skipped")],
          "Bps", "Blocks stores wrote, and blocks they found on disk already and skipped"),
    Panel("Job latency (submit to finish)",
          [(f"mptier_job_latency_seconds{{{TIER}}}", "{{tier}} {{kind}} p{{quantile}}")], "s",
          "Quantiles over the last 4096 jobs of each kind"),
    Panel("Task latency (in the workers)",
          [(f"mptier_task_latency_seconds{{{TIER}}}", "{{tier}} {{kind}} p{{quantile}}")],
          "s", "Quantiles over the pool's life, within a factor of 1.41 (a service's too)"),
    Panel("Queued tasks",
          [(f"mptier_queued_tasks{{{TIER}}}", "{{tier}} {{queue}}"),
           (f"mptier_jobs_in_flight{{{TIER}}}", "{{tier}} jobs in flight")], "short"),
    Panel("Failed jobs per second",
          [(_rate("mptier_jobs_failed_total", "tier, kind"), "{{tier}} {{kind}}")], "ops"),
    Panel("Damaged blocks and bad entries (per hour)",
          [(f"increase({m}{{{TIER}}}[1h])", f"{{{{tier}}}} {legend}") for m, legend in (
              ("mptier_corrupt_blocks_removed_total", "corrupt removed"),
              ("mptier_checksum_failures_total", "checksum failures"),
              ("mptier_bad_entries_total", "bad entries"))], "short",
          "Blocks removed on load (short, or failing their CRC32C record) and non-block "
          "entries at block paths"),
    Panel("Lookup hit ratio",
          [(f"{_rate('mptier_lookup_keys_found_total', 'tier')} / "
            f"{_rate('mptier_lookup_keys_checked_total', 'tier')}", "{{tier}}")],
          "percentunit", "Checked keys that were found"),
    Panel("Disk of the root",
          [(f"mptier_disk_used_bytes{{{TIER}}}", "{{tier}} used"),
           (f"mptier_disk_size_bytes{{{TIER}}}", "{{tier}} size"),
           (f"mptier_disk_avail_bytes{{{TIER}}}", "{{tier}} available"),
           (f"mptier_tier_usage_bytes{{{TIER}}}", "{{tier}} tier's blocks"),
           (f"mptier_tier_capacity_bytes{{{TIER}}}", "{{tier}} tier budget")], "bytes"),
    Panel("Worker deaths, kills, retries (per hour)",
          [(f"increase({m}{{{TIER}}}[1h])", f"{{{{tier}}}} {legend}") for m, legend in (
              ("mptier_worker_deaths_total", "deaths"),
              ("mptier_worker_timeouts_total", "timeouts"),
              ("mptier_worker_boot_failures_total", "boot failures"),
              ("mptier_worker_heartbeat_kills_total", "heartbeat kills"),
              ("mptier_worker_memory_kills_total", "memory kills"),
              ("mptier_tasks_retried_total", "tasks retried"),
              ("mptier_tasks_lost_total", "tasks lost"))], "short"),
    Panel("Engine / service process CPU",
          [(_rate("mptier_process_cpu_seconds_total", "tier"), "{{tier}}")], "percentunit",
          "CPU of the process the tier runs in (1 = one full core)"),
]

WORKER_PANELS = [
    Panel("Worker CPU",
          [(_rate("mptier_worker_cpu_seconds_total", "tier, role, slot"), PER_WORKER)],
          "percentunit", "Cores used per worker, user + system (1 = one full core)"),
    Panel("Worker tasks per second",
          [(_rate("mptier_worker_tasks_total"), PER_WORKER),
           (_rate("mptier_worker_task_failures_total"), PER_WORKER + " failed")], "ops"),
    Panel("Worker busy fraction",
          [(_rate("mptier_worker_busy_seconds_total"), PER_WORKER)], "percentunit",
          "Share of time spent running tasks"),
    Panel("Device writes / reads",
          [(_rate("mptier_worker_io_write_bytes_total"), PER_WORKER + " write"),
           (_rate("mptier_worker_io_read_bytes_total"), PER_WORKER + " read")], "Bps",
          "Bytes to/from a block device (psutil io_counters): 0 for a root on tmpfs; "
          "see write() bytes"),
    Panel("write() / read() bytes",
          [(_rate("mptier_worker_io_write_chars_total"), PER_WORKER + " write()"),
           (_rate("mptier_worker_io_read_chars_total"), PER_WORKER + " read()")], "Bps",
          "Bytes through write()/read() calls on any file system, pipes included"),
    Panel("Age of the running task",
          [(f"mptier_worker_task_age_seconds{{{TIER}}}", PER_WORKER)], "s",
          "Compare with io_timeout_s: a task older than that gets its worker killed"),
    Panel("Worker memory",
          [(f"mptier_worker_resident_bytes{{{TIER}}}", PER_WORKER + " rss"),
           (f"mptier_worker_private_bytes{{{TIER}}}", PER_WORKER + " private"),
           (f"mptier_worker_unique_bytes{{{TIER}}}", PER_WORKER + " uss")], "bytes",
          "RSS includes the shared KV buffer pages the worker touched; private and USS "
          "do not"),
    Panel("Workers up / busy / stuck",
          [(f"sum by (tier) (mptier_worker_up{{{TIER}}})", "{{tier}} up"),
           (f"sum by (tier) (mptier_worker_busy{{{TIER}}})", "{{tier}} busy"),
           (f"mptier_workers_stuck{{{TIER}}}", "{{tier}} stuck (parked)"),
           (f"mptier_unavailable{{{TIER}}}", "{{tier}} unavailable")], "short",
          "unavailable = 1: the pool cannot serve and jobs fail at once (reason: mptier "
          "status)"),
    Panel("Open descriptors",
          [(f"mptier_worker_open_fds{{{TIER}}}", PER_WORKER)], "short"),
]


def dashboard() -> dict[str, Any]:
    """The dashboard as a dict (JSON model of Grafana 9 and later)."""
    panels: list[dict[str, Any]] = []
    y = 0
    for title, group in (("Tier", TIER_PANELS), ("Workers", WORKER_PANELS)):
        panels.append({"type": "row", "title": title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        y += 1
        for n, panel in enumerate(group):
            x = (n % 3) * PANEL_W
            if n and x == 0:
                y += PANEL_H
            panels.append(_timeseries(panel, x, y))
        y += PANEL_H
    for number, panel in enumerate(panels, 1):
        panel["id"] = number
    return {
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "9.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus",
             "version": "1.0.0"},
            {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""}],
        "title": "mptier",
        "uid": "mptier-overview",
        "description": "mptier tiers and services: jobs, bytes, latency, queues, disk, and "
                       "per-worker CPU, memory and I/O (metrics: docs/monitoring.md)",
        "tags": ["mptier", "kv-cache"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []},
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Prometheus",
             "query": "prometheus", "hide": 0, "current": {}},
            {"type": "query", "name": "tier", "label": "tier", "datasource": DATASOURCE,
             "query": {"query": "label_values(mptier_up, tier)", "refId": "tier"},
             "definition": "label_values(mptier_up, tier)", "refresh": 2,
             "includeAll": True, "multi": True, "allValue": ".*", "current": {},
             "sort": 1, "hide": 0}]},
        "panels": panels,
    }


def _timeseries(panel: Panel, x: int, y: int) -> dict[str, Any]:
    return {
        "type": "timeseries", "title": panel.title, "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": PANEL_H, "w": PANEL_W, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"}},
        "targets": [{"datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
                     "refId": chr(ord("A") + i)}
                    for i, (expr, legend) in enumerate(panel.targets)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    print(render(), end="")

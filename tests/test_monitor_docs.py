"""docs/monitoring.md lists every figure and metric; the Grafana dashboard is valid and
charts only metrics that exist."""

from __future__ import annotations

import json
import os
import pathlib
import re

from mptier.monitor import Sampler
from mptier.monitor.prom import METRIC_NAMES, METRICS

REPO = pathlib.Path(__file__).parent.parent
DOC = (REPO / "docs" / "monitoring.md").read_text()
DASHBOARD = REPO / "configs" / "grafana-mptier.json"


def test_every_metric_is_documented_with_its_type_and_labels():
    for m in METRICS:
        row = next((line for line in DOC.splitlines() if line.startswith(f"| `{m.name}` |")),
                   None)
        assert row, f"{m.name} is not in docs/monitoring.md"
        assert f"| {m.type} |" in row and ", ".join(m.labels) in row, row
    assert all(m.name.startswith("mptier_") for m in METRICS)
    assert all(m.name.endswith("_total") == (m.type == "counter") for m in METRICS)


def test_every_status_field_is_documented(tmp_path):
    stats = {"root": str(tmp_path), "queued_tasks": {}, "latency": {},
             "workers": [{"pid": os.getpid(), "role": "load", "slot": 0, "alive": True,
                          "ready": True, "state": "idle", "tasks_done": 0, "bytes_done": 0,
                          "busy_s": 0.0, "tasks_failed": 0, "generation": 0,
                          "task_age_s": None, "backend": "native"}]}
    figures = {"name": "x", "kind": "engine", "pid": 1, **Sampler().sample(stats)}
    documented = set(re.findall(r"`([a-z_.0-9]+)`", DOC))
    names = {k for k, v in figures.items() if not isinstance(v, dict)}
    for group in ("totals", "rates", "disk"):
        names |= {f"{group}.{k}" for k in figures[group]}
    names |= set(figures["workers"][0]) | {"latency.store", "latency.load", "disk.error"}
    missing = sorted(n for n in names if n not in documented)
    assert not missing, f"fields missing from docs/monitoring.md: {missing}"


def test_grafana_dashboard_file_is_the_generators_output():
    from mptier.monitor import grafana

    assert DASHBOARD.read_text() == grafana.render(), \
        "run: python -m mptier.monitor.grafana > configs/grafana-mptier.json"


def test_grafana_dashboard_is_valid_and_queries_real_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 10
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert "mptier_up" in variables["tier"]["definition"]
    charted = set(re.findall(r"\bmptier_[a-z_]+", variables["tier"]["definition"]))
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")"), expr
            names = set(re.findall(r"\bmptier_[a-z_]+", expr))
            assert names, f"{panel['title']}: no mptier metric in {expr}"
            unknown = names - METRIC_NAMES
            assert not unknown, f"{panel['title']}: unknown metrics {unknown}"
            charted |= names
            if "rate(" in expr or "increase(" in expr:  # only counters are rated
                rated = re.findall(r"(?:rate|increase)\((mptier_[a-z_]+)", expr)
                assert all(n.endswith("_total") for n in rated), expr
    # Every metric a dashboard user would look for is on it, except pure labels/levels
    # that are only useful in ad-hoc queries.
    not_charted = METRIC_NAMES - charted
    assert not_charted <= {"mptier_info", "mptier_worker_generation",
                           "mptier_corrupt_blocks_removed_total",
                           "mptier_tasks_in_flight", "mptier_lookup_keys_pending",
                           "mptier_workers_spawned_total", "mptier_process_resident_bytes",
                           "mptier_worker_task_bytes_total"}, not_charted

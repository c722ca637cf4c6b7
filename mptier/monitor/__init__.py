"""Monitoring: per-process figures (psutil), status sockets, Prometheus metrics.

::

    tier.stats() ─▶ Monitor ─┬─ figures() ─▶ StatusEndpoint (<run dir>/<name>.status.sock)
    (or a service's)         │                 ◀── mptier status / mptier monitor
                             └─ scrape() ──▶ MetricsServer (/metrics, mptier_* metrics)
                                               ◀── Prometheus

Hooks for code that owns a stats source:

* ``attach_tier(tier)``: what ``FileSystemTier`` calls; starts what ``status_socket``
  and ``metrics_port`` ask for; returns a handle with ``close()``.
* ``Monitor(stats_fn, name=..., kind="service")`` then
  ``start_endpoint(name, monitor.figures, kind="service")`` and
  ``start_metrics_server(monitor, port, addr)``: the same for a service.

Clients: ``discover()``, ``query(name_or_path)``. Field names: docs/monitoring.md.
"""

from __future__ import annotations

from mptier.monitor.endpoint import (
    EndpointBusyError,
    EndpointInfo,
    StatusEndpoint,
    client_dirs,
    discover,
    query,
    remove_stale,
    run_dir,
    start_endpoint,
)
from mptier.monitor.procstats import ProcessTable, Sampler
from mptier.monitor.tier import Monitor, TierMonitoring, attach_tier, read_stats

__all__ = [
    "EndpointBusyError",
    "EndpointInfo",
    "Monitor",
    "ProcessTable",
    "Sampler",
    "StatusEndpoint",
    "TierMonitoring",
    "attach_tier",
    "client_dirs",
    "discover",
    "query",
    "read_stats",
    "remove_stale",
    "run_dir",
    "start_endpoint",
]


def start_metrics_server(*args, **kwargs):  # type: ignore[no-untyped-def]
    """See :func:`mptier.monitor.prom.start_metrics_server` (imports prometheus_client
    only when metrics are wanted)."""
    from mptier.monitor.prom import start_metrics_server as start

    return start(*args, **kwargs)

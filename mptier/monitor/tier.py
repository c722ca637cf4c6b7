"""The hook between a stats source (a tier, a service) and its status socket and metrics.

:class:`Monitor` wraps a ``stats()`` function: its figures feed the status endpoint
(:meth:`Monitor.figures`) and Prometheus (:meth:`Monitor.scrape`), each with its own
sampler so a scrape never shortens the interval a ``mptier monitor`` rate covers.
:func:`attach_tier` starts both for a :class:`~mptier.FileSystemTier` as its config says.

Reading ``stats()`` from another thread: the tier's scheduler thread keeps mutating the
dicts and deques ``stats()`` walks, which can raise ``RuntimeError`` ("dictionary changed
size during iteration", "deque mutated during iteration"). :func:`read_stats` retries;
nothing here takes a lock the scheduler thread could wait for, so the scheduler thread
never waits on monitoring. The cost to it is the GIL this thread holds while it builds
figures (about a millisecond per request for a 4-worker tier), and only when asked.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from mptier.errors import MptierError
from mptier.monitor.endpoint import StatusEndpoint, start_endpoint
from mptier.monitor.procstats import USS_INTERVAL_S, ProcessTable, Sampler

log = logging.getLogger(__name__)

# A stats() call loses the race with the scheduler thread only when a dict it walks is
# resized under it, which takes a busy engine; a few tries are plenty.
STATS_TRIES = 20


def read_stats(stats: Callable[[], dict[str, Any]], tries: int = STATS_TRIES
               ) -> dict[str, Any]:
    """``stats()``, called from a thread other than the owner's: retried when the owner
    changed a container during the walk. Raises ``MptierError`` after ``tries`` losses."""
    last: Exception | None = None
    for attempt in range(tries):
        try:
            return stats()
        except RuntimeError as exc:
            text = str(exc)
            if "changed size" not in text and "mutated" not in text:
                raise
            last = exc
            time.sleep(0.0005 * attempt)  # let the owner finish what it was doing
    raise MptierError(f"stats() kept changing under the reader ({tries} tries): {last}")


class Monitor:
    """Figures of one stats source, for the status endpoint and for Prometheus.

    ``stats`` is called on the caller's thread (the endpoint's or the metrics server's);
    calls are serialised by a lock only monitoring threads take. ``name`` labels the
    figures (``figures()["name"]``, Prometheus label ``tier``); ``kind`` is "engine" or
    "service".
    """

    def __init__(self, stats: Callable[[], dict[str, Any]], *, name: str,
                 kind: str = "engine", uss_interval_s: float = USS_INTERVAL_S) -> None:
        self._stats = stats
        self.name = name
        self.kind = kind
        self._lock = threading.Lock()
        procs = ProcessTable(uss_interval_s=uss_interval_s)
        self._status = Sampler(procs)
        self._scrape = Sampler(procs)

    def figures(self) -> dict[str, Any]:
        """Figures for the status endpoint: rates over the time since the last call."""
        return self._sample(self._status)

    def scrape(self) -> dict[str, Any]:
        """Figures for a Prometheus scrape (its own interval; it reads counters)."""
        return self._sample(self._scrape)

    def _sample(self, sampler: Sampler) -> dict[str, Any]:
        with self._lock:
            figures = sampler.sample(read_stats(self._stats))
        return {"name": self.name, "kind": self.kind, "pid": os.getpid(), **figures}


class TierMonitoring:
    """What :func:`attach_tier` started; :meth:`close` stops it (idempotent)."""

    def __init__(self, monitor: Monitor, endpoint: StatusEndpoint | None,
                 metrics: Any | None) -> None:
        self.monitor = monitor
        self.endpoint = endpoint
        self.metrics = metrics

    @property
    def name(self) -> str:
        return self.monitor.name

    def close(self) -> None:
        endpoint, self.endpoint = self.endpoint, None
        metrics, self.metrics = self.metrics, None
        if endpoint is not None:
            endpoint.close()
        if metrics is not None:
            metrics.close()


def attach_tier(tier: Any) -> TierMonitoring:
    """Start the status endpoint and metrics server ``tier.config`` asks for.

    ``status_socket``: "auto" names the endpoint ``engine-<pid>`` (``-2``, ``-3``... for
    further tiers of the process), "" starts none, anything else is the name.
    ``metrics_port`` > 0 serves Prometheus on ``metrics_addr``. Monitoring never stops an
    engine: a socket or port that cannot be had is logged (naming it and the fix) and the
    tier runs without it. Called once by the tier's constructor, from its thread.
    """
    cfg = tier.config
    monitor = Monitor(tier.stats, name=f"engine-{os.getpid()}", kind="engine")
    endpoint = None
    if cfg.status_socket:
        try:
            from mptier.rundir import Trust

            endpoint = start_endpoint(None if cfg.status_socket == "auto"
                                      else cfg.status_socket, monitor.figures,
                                      trust=Trust.of(group=cfg.service_group))
            monitor.name = endpoint.name
        except (MptierError, OSError) as exc:
            log.warning("mptier: no status socket for this tier (%s); set "
                        "status_socket=\"\" to silence this, or MPTIER_RUN_DIR to a "
                        "writable folder", exc)
    metrics = None
    if cfg.metrics_port:
        from mptier.monitor.prom import start_metrics_server
        try:
            metrics = start_metrics_server(monitor, cfg.metrics_port, cfg.metrics_addr)
        except OSError as exc:
            log.error("mptier: cannot serve metrics on %s:%d (%s); pick a free "
                      "metrics_port (each tier needs its own) or 0 for none",
                      cfg.metrics_addr, cfg.metrics_port, exc.strerror or exc)
    return TierMonitoring(monitor, endpoint, metrics)

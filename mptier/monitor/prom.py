"""Prometheus metrics: the figures of :mod:`mptier.monitor.procstats`, read at scrape time.

A custom collector (no metric objects to keep in step with the tier): each scrape asks
the :class:`~mptier.monitor.tier.Monitor` for fresh figures and turns them into metric
families named ``mptier_*`` -- counters (``*_total``) for totals, gauges for levels --
labelled with the tier's name and, per worker, its role and slot (its slot in the pool's
control block: a replacement normally takes the slot of the worker it replaces, and its
counters restart from zero, which Prometheus' ``rate()`` treats as a reset).
:data:`METRICS` is the list; docs/monitoring.md explains each and
configs/grafana-mptier.json charts them.

:class:`MetricsServer` serves ``/metrics`` over HTTP from its own thread, which sleeps in
``epoll`` until a scrape comes (no periodic wake-up taking the GIL from the engine). It
is a small HTTP/1.0-style server of its own around ``prometheus_client.generate_latest``
(one request per connection) on :class:`~mptier.monitor.bounded.ClientLoop`: one thread,
at most ``MAX_CLIENTS`` connections, each closed after ``CLIENT_TIMEOUT_S``, and none
accepted when descriptors run low -- idle connections can neither add threads nor take
the descriptors the engine's pool needs to replace a worker.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from mptier.monitor.bounded import ClientLoop


@dataclass(frozen=True)
class MetricDef:
    name: str          # as exposed (counters end in _total)
    type: str          # "counter" or "gauge"
    labels: tuple[str, ...]
    help: str


T = ("tier",)
W = ("tier", "role", "slot")

METRICS: tuple[MetricDef, ...] = (
    MetricDef("mptier_up", "gauge", T, "1 while the tier is open (0 once it shut down)"),
    MetricDef("mptier_info", "gauge", ("tier", "kind", "mode", "root", "fs_type", "o_direct",
                                       "native"),
              "Always 1; the labels describe the tier (kind engine/service, workers as "
              "processes or threads, root folder, its file system type, O_DIRECT in use, "
              "native C core in use)"),
    MetricDef("mptier_unavailable", "gauge", T,
              "1 while the pool cannot serve (workers fail to boot, the file system does "
              "not respond): jobs fail at once; the reason is in `mptier status`"),
    MetricDef("mptier_jobs_submitted_total", "counter", ("tier", "kind"),
              "Jobs submitted, by kind (store, load)"),
    MetricDef("mptier_jobs_failed_total", "counter", ("tier", "kind"),
              "Jobs that finished with at least one block failed, by kind"),
    MetricDef("mptier_transferred_bytes_total", "counter", ("tier", "kind"),
              "Bytes of blocks stored or loaded successfully by finished jobs"),
    MetricDef("mptier_written_bytes_total", "counter", T,
              "Bytes of blocks stores wrote to files"),
    MetricDef("mptier_skipped_bytes_total", "counter", T,
              "Bytes of blocks stores found on disk already and did not write"),
    MetricDef("mptier_lookup_keys_checked_total", "counter", T,
              "Keys whose existence workers checked (batched lookups)"),
    MetricDef("mptier_lookup_keys_found_total", "counter", T,
              "Checked keys that were found (hits); found / checked is the hit ratio"),
    MetricDef("mptier_corrupt_blocks_removed_total", "counter", T,
              "Blocks found corrupt (short, bad checksum) on load and removed"),
    MetricDef("mptier_checksum_failures_total", "counter", T,
              "Blocks whose CRC32C record did not match on load (removed; now a miss)"),
    MetricDef("mptier_bad_entries_total", "counter", T,
              "Entries at block paths that are not block files (symlinks, directories, "
              "FIFOs, wrong sizes)"),
    MetricDef("mptier_jobs_in_flight", "gauge", T, "Jobs submitted and not yet finished"),
    MetricDef("mptier_tasks_in_flight", "gauge", T,
              "Tasks (pieces of jobs and lookup batches) not yet reported"),
    MetricDef("mptier_lookup_keys_pending", "gauge", T,
              "Keys waiting for the next batched existence check"),
    MetricDef("mptier_queued_tasks", "gauge", ("tier", "queue"),
              "Tasks waiting in a queue (lookup, load, store) for a worker"),
    MetricDef("mptier_job_latency_seconds", "gauge", ("tier", "kind", "quantile"),
              "Job latency, submission to finish, at quantile 0.5 and 0.99 over the last "
              "4096 jobs of that kind (absent before the first job)"),
    MetricDef("mptier_task_latency_seconds", "gauge", ("tier", "kind", "quantile"),
              "Task latency in the workers, at quantile 0.5 and 0.99 over the pool's life "
              "(power-of-two buckets: within a factor of 1.41; absent before the first "
              "task); a service reports it too"),
    MetricDef("mptier_workers_spawned_total", "counter", T,
              "Worker processes started (the first ones and every replacement)"),
    MetricDef("mptier_worker_deaths_total", "counter", T,
              "Workers that died unexpectedly (crash, SIGKILL, OOM)"),
    MetricDef("mptier_worker_timeouts_total", "counter", T,
              "Workers killed because a task ran past io_timeout_s (hung file system)"),
    MetricDef("mptier_worker_boot_failures_total", "counter", T,
              "Workers that died before reporting ready"),
    MetricDef("mptier_worker_heartbeat_kills_total", "counter", T,
              "Idle workers replaced because they stopped answering the heartbeat"),
    MetricDef("mptier_worker_memory_kills_total", "counter", T,
              "Workers replaced because their private memory passed max_worker_rss_bytes"),
    MetricDef("mptier_workers_stuck", "gauge", T,
              "Workers SIGKILL could not end (stuck in the kernel), parked in their slot"),
    MetricDef("mptier_tasks_retried_total", "counter", T,
              "Store tasks put back on the queue after their worker died"),
    MetricDef("mptier_tasks_lost_total", "counter", T,
              "Tasks failed because their worker died or timed out (no retry left)"),
    MetricDef("mptier_disk_size_bytes", "gauge", T,
              "Size of the file system holding the root (statvfs)"),
    MetricDef("mptier_disk_used_bytes", "gauge", T,
              "Bytes in use on that file system, by anyone (statvfs)"),
    MetricDef("mptier_disk_avail_bytes", "gauge", T,
              "Bytes still available to unprivileged writers on it (statvfs)"),
    MetricDef("mptier_tier_usage_bytes", "gauge", T,
              "Bytes of blocks the tier counts under its root (when the tier reports it)"),
    MetricDef("mptier_tier_capacity_bytes", "gauge", T,
              "The tier's byte budget (when it has one)"),
    MetricDef("mptier_process_cpu_seconds_total", "counter", ("tier", "mode"),
              "CPU time of the engine or service process itself, user and system"),
    MetricDef("mptier_process_resident_bytes", "gauge", T,
              "Resident memory of the engine or service process (RSS)"),
    MetricDef("mptier_worker_up", "gauge", W, "1 when the worker is alive and ready"),
    MetricDef("mptier_worker_busy", "gauge", W, "1 while the worker runs a task"),
    MetricDef("mptier_worker_generation", "gauge", W,
              "How many workers came before this one in its line of replacements"),
    MetricDef("mptier_worker_tasks_total", "counter", W,
              "Tasks the current worker process finished (failed ones included)"),
    MetricDef("mptier_worker_task_failures_total", "counter", W,
              "Tasks the current worker process finished with an error"),
    MetricDef("mptier_worker_task_bytes_total", "counter", W,
              "Block bytes the current worker process stored or loaded"),
    MetricDef("mptier_worker_busy_seconds_total", "counter", W,
              "Seconds the current worker process spent running tasks"),
    MetricDef("mptier_worker_task_age_seconds", "gauge", W,
              "How long the running task has run (0 when idle)"),
    MetricDef("mptier_worker_cpu_seconds_total", "counter", ("tier", "role", "slot", "mode"),
              "CPU time of the worker process, user and system (psutil)"),
    MetricDef("mptier_worker_resident_bytes", "gauge", W,
              "Resident memory (RSS) of the worker, shared KV buffer pages included"),
    MetricDef("mptier_worker_private_bytes", "gauge", W,
              "RSS less file-backed and shared pages: the worker's own memory (cheap)"),
    MetricDef("mptier_worker_unique_bytes", "gauge", W,
              "USS: memory only this worker maps (read at most every 10 s; costly)"),
    MetricDef("mptier_worker_io_read_bytes_total", "counter", W,
              "Bytes the worker read from a block device (psutil; 0 for tmpfs and for "
              "page-cache hits)"),
    MetricDef("mptier_worker_io_write_bytes_total", "counter", W,
              "Bytes the worker sent to a block device (psutil; stays 0 on tmpfs)"),
    MetricDef("mptier_worker_io_read_chars_total", "counter", W,
              "Bytes the worker passed through read() calls, any file system, pipes too"),
    MetricDef("mptier_worker_io_write_chars_total", "counter", W,
              "Bytes the worker passed through write() calls, any file system, pipes too"),
    MetricDef("mptier_worker_open_fds", "gauge", W, "Open file descriptors of the worker"),
)
METRIC_NAMES = frozenset(m.name for m in METRICS)
_BY_NAME = {m.name: m for m in METRICS}


def _family(name: str) -> Metric:
    m = _BY_NAME[name]
    if m.type == "counter":
        return CounterMetricFamily(m.name, m.help, labels=list(m.labels))
    return GaugeMetricFamily(m.name, m.help, labels=list(m.labels))


class TierCollector(Collector):
    """A prometheus_client collector of the figures ``source()`` returns (one figures
    dict, or a list of them for several tiers). Runs on the scrape's thread."""

    def __init__(self, source: Callable[[], dict[str, Any] | list[dict[str, Any]]]) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []  # names are fixed, but reading figures at registration is not wanted

    def collect(self) -> Iterator[Metric]:
        got = self._source()
        figures_list = got if isinstance(got, list) else [got]
        families = {m.name: _family(m.name) for m in METRICS}
        for figures in figures_list:
            _fill(families, figures)
        yield from (f for f in families.values() if f.samples)


def _fill(fam: dict[str, Metric], f: dict[str, Any]) -> None:
    tier = str(f.get("name", ""))

    def put(name: str, value: Any, *labels: Any) -> None:
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)):
            fam[name].add_metric([tier, *map(str, labels)], value)

    disk = f.get("disk") or {}
    put("mptier_up", 0 if f.get("closed") else 1)
    put("mptier_unavailable", bool(f.get("unavailable")))
    put("mptier_info", 1, f.get("kind", ""), f.get("mode", ""), f.get("root", ""),
        disk.get("fs_type") or "", str(bool(f.get("o_direct"))).lower(),
        str(bool(f.get("native"))).lower())
    totals = f.get("totals", {})
    for kind in ("store", "load"):
        put("mptier_jobs_submitted_total", totals.get("jobs_submitted", {}).get(kind), kind)
        put("mptier_jobs_failed_total", totals.get("jobs_failed", {}).get(kind), kind)
        put("mptier_transferred_bytes_total", totals.get("bytes", {}).get(kind), kind)
        latency = f.get("latency", {}).get(kind, {})
        put("mptier_job_latency_seconds", latency.get("p50_s"), kind, "0.5")
        put("mptier_job_latency_seconds", latency.get("p99_s"), kind, "0.99")
    put("mptier_written_bytes_total", totals.get("written_bytes"))
    put("mptier_skipped_bytes_total", totals.get("skipped_bytes"))
    for kind in ("store", "load", "lookup"):
        tasks = f.get("task_latency", {}).get(kind, {})
        put("mptier_task_latency_seconds", tasks.get("p50_s"), kind, "0.5")
        put("mptier_task_latency_seconds", tasks.get("p99_s"), kind, "0.99")
    put("mptier_lookup_keys_checked_total", totals.get("lookup_keys_checked"))
    put("mptier_lookup_keys_found_total", totals.get("lookup_keys_found"))
    put("mptier_corrupt_blocks_removed_total", totals.get("corrupt_removed"))
    put("mptier_checksum_failures_total", totals.get("checksum_failures"))
    put("mptier_bad_entries_total", totals.get("bad_entries"))
    put("mptier_jobs_in_flight", f.get("jobs_in_flight"))
    put("mptier_tasks_in_flight", f.get("tasks_in_flight"))
    put("mptier_lookup_keys_pending", f.get("lookup_keys_pending"))
    for queue, depth in (f.get("queues") or {}).items():
        put("mptier_queued_tasks", depth, queue)
    pool = f.get("pool") or {}
    for name, key in (("mptier_workers_spawned_total", "spawned"),
                      ("mptier_worker_deaths_total", "deaths"),
                      ("mptier_worker_timeouts_total", "timeouts"),
                      ("mptier_worker_boot_failures_total", "boot_failures"),
                      ("mptier_worker_heartbeat_kills_total", "heartbeat_kills"),
                      ("mptier_worker_memory_kills_total", "memory_kills"),
                      ("mptier_workers_stuck", "stuck"),
                      ("mptier_tasks_retried_total", "tasks_retried"),
                      ("mptier_tasks_lost_total", "tasks_lost")):
        put(name, pool.get(key))
    put("mptier_disk_size_bytes", disk.get("total_bytes"))
    put("mptier_disk_used_bytes", disk.get("used_bytes"))
    put("mptier_disk_avail_bytes", disk.get("avail_bytes"))
    put("mptier_tier_usage_bytes", disk.get("tier_usage_bytes"))
    put("mptier_tier_capacity_bytes", disk.get("tier_capacity_bytes"))
    proc = f.get("process") or {}
    put("mptier_process_cpu_seconds_total", proc.get("cpu_user_s"), "user")
    put("mptier_process_cpu_seconds_total", proc.get("cpu_system_s"), "system")
    put("mptier_process_resident_bytes", proc.get("rss_bytes"))
    for w in f.get("workers", []):
        who = (w.get("role", ""), w.get("slot", ""))
        put("mptier_worker_up", bool(w.get("alive") and w.get("ready")), *who)
        put("mptier_worker_busy", w.get("state") == "busy", *who)
        put("mptier_worker_generation", w.get("generation"), *who)
        put("mptier_worker_tasks_total", w.get("tasks_done"), *who)
        put("mptier_worker_task_failures_total", w.get("tasks_failed"), *who)
        put("mptier_worker_task_bytes_total", w.get("bytes_done"), *who)
        put("mptier_worker_busy_seconds_total", w.get("busy_s"), *who)
        put("mptier_worker_task_age_seconds", w.get("task_age_s") or 0.0, *who)
        put("mptier_worker_cpu_seconds_total", w.get("cpu_user_s"), *who, "user")
        put("mptier_worker_cpu_seconds_total", w.get("cpu_system_s"), *who, "system")
        put("mptier_worker_resident_bytes", w.get("rss_bytes"), *who)
        put("mptier_worker_private_bytes", w.get("private_bytes"), *who)
        put("mptier_worker_unique_bytes", w.get("uss_bytes"), *who)
        put("mptier_worker_io_read_bytes_total", w.get("read_bytes"), *who)
        put("mptier_worker_io_write_bytes_total", w.get("write_bytes"), *who)
        put("mptier_worker_io_read_chars_total", w.get("read_chars"), *who)
        put("mptier_worker_io_write_chars_total", w.get("write_chars"), *who)
        put("mptier_worker_open_fds", w.get("open_fds"), *who)


# -- the HTTP server ----------------------------------------------------------------------

# A request is a request line and a few headers; anything longer is not a scraper.
MAX_REQUEST_BYTES = 8192
# Connections the kernel queues before the server's thread accepts them.
LISTEN_BACKLOG = 16
# The paths that answer with the metrics (Prometheus asks for /metrics).
METRICS_PATHS = ("/metrics", "/")


class MetricsServer:
    """``/metrics`` on ``addr:port``, served from one thread (see module docstring).

    Construction binds (raises ``OSError`` naming nothing but the errno when the port is
    taken: callers add the address) and starts the thread; :meth:`close` stops it and
    closes the socket (idempotent). ``port=0`` binds a free port: see :attr:`port`.
    """

    def __init__(self, source: Callable[[], Any], port: int, addr: str = "127.0.0.1"
                 ) -> None:
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(TierCollector(source))
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((addr, port))
            self._listener.listen(LISTEN_BACKLOG)
            self._listener.setblocking(False)
        except BaseException:
            self._listener.close()
            raise
        self.addr = addr
        self.port = self._listener.getsockname()[1]
        self.loop = ClientLoop(self._listener, self._respond,
                               name=f"metrics server :{self.port}")
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._closed = False
        self._thread = threading.Thread(target=self.loop.serve, args=(self._stop_r,),
                                        name=f"mptier-metrics-{port}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def _respond(self, request: bytes) -> bytes | None:
        """The HTTP reply to ``request``, or None until its headers are complete."""
        if b"\r\n\r\n" not in request and b"\n\n" not in request:
            if len(request) < MAX_REQUEST_BYTES:
                return None
            return _http(431, b"request headers too large\n")
        parts = request.split(b"\n", 1)[0].decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _http(400, b"not an HTTP request\n")
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return _http(405, b"only GET\n", extra="Allow: GET, HEAD\r\n")
        if target not in METRICS_PATHS:
            return _http(404, b"metrics are at /metrics\n")
        body = generate_latest(self._registry)
        return _http(200, body, CONTENT_TYPE_LATEST, head=method == "HEAD")

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        self._thread.join(timeout)
        self._listener.close()
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.close(timeout=0)


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large"}


def _http(status: int, body: bytes, content_type: str = "text/plain; charset=utf-8", *,
          head: bool = False, extra: str = "") -> bytes:
    header = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
              f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n")
    return header.encode("latin-1") + (b"" if head else body)


def start_metrics_server(monitors: Any, port: int, addr: str = "127.0.0.1"
                         ) -> MetricsServer:
    """Serve Prometheus metrics on ``addr:port`` (``port=0``: a free one, see
    :attr:`MetricsServer.port`) and return the running :class:`MetricsServer`.

    ``monitors``: a :class:`~mptier.monitor.tier.Monitor`, or a function returning the
    list of monitors to report at each scrape (a service whose engines come and go).
    Raises ``OSError`` if the address cannot be bound.
    """
    if hasattr(monitors, "scrape"):
        source: Callable[[], Any] = monitors.scrape
    elif callable(monitors):
        def source() -> list[dict[str, Any]]:
            return [m.scrape() for m in monitors()]
    else:
        raise TypeError(f"start_metrics_server: expected a Monitor or a function returning "
                        f"monitors, got {type(monitors).__name__}")
    return MetricsServer(source, port, addr)

"""Figures for operators: per-process readings (psutil) and rates between samples.

``tier.stats()`` (a dict of counters, queue depths and one entry per worker) is what the
tier knows about itself; the operating system knows the rest. A :class:`Sampler` turns
successive ``stats()`` dicts into *figures*: the same facts plus, per worker process, CPU,
memory, I/O bytes and descriptors from psutil, and per tier, rates over the interval
since the previous sample, and the disk use of the root::

    stats() ──▶ Sampler.sample() ──▶ figures (a JSON-able dict, documented in
                   │    ▲                       docs/monitoring.md)
                   ▼    │
               ProcessTable: one psutil.Process per worker pid, kept between samples
               (pid reuse is caught by create time); CPU % comes from the CPU-time
               delta since this sampler's previous reading of the same process

What a reading costs (measured on the 2-core dev machine, psutil 7.2, one worker): CPU
times, RSS, I/O counters, descriptor count and the liveness check together ~80-160 us per
process (``/proc/<pid>/{stat,statm,io,fd}``); USS walks the page tables of every mapping
(``/proc/<pid>/smaps_rollup``): ~0.8 ms for a 64 MiB mapping, ~30 ms for 2 GiB, i.e. about
15 us per MiB mapped -- a worker maps the whole KV buffer, so USS is read at most every
``uss_interval_s`` per process and reported with its age. ``private_bytes`` (RSS less
file-backed and shared pages, from ``statm``) is the cheap stand-in read every time.

psutil's ``write_bytes`` counts bytes sent to a block device: it stays 0 for files on
tmpfs (and counts page-cache writeback only once it happens). ``write_chars`` counts every
byte passed to ``write()`` (pipes included) and is filled on any file system.

Threads: a sampler is not thread-safe; :class:`~mptier.monitor.tier.Monitor` serialises
its callers. Nothing here blocks on anything but ``/proc`` reads; ``statvfs`` of the
root runs on a helper thread and is waited for at most :data:`STATVFS_WAIT_S` (on a hung
mount it never returns: the figures then say so, and status keeps answering).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from mptier import fskind

# USS needs a page-table walk of every mapping (~15 us per MiB mapped, see above); a
# worker that maps a 64 GiB buffer would cost ~1 s of kernel time per reading.
USS_INTERVAL_S = 10.0
# A rate over less than this is mostly timer noise; such a sample reports no rates.
MIN_RATE_INTERVAL_S = 0.05
# Mount tables rarely change; re-read the file system type of a root this often.
MOUNT_CACHE_S = 60.0
# How long a sample waits for statvfs (and the mount lookup) of the root. On a hung mount
# (a dead NFS server, a stalled FUSE daemon) the call never returns: the sample goes on
# without disk figures rather than leaving `mptier status` unanswered for ever.
STATVFS_WAIT_S = 0.5

NOTE_WRITE_BYTES = ("write_bytes/read_bytes count bytes sent to/from a block device "
                    "(psutil io_counters): they stay 0 for files on tmpfs; write_chars/"
                    "read_chars count every byte passed to write()/read() on any file system")
NOTE_TMPFS = "the root is on tmpfs: workers' write_bytes stay 0 there (see write_chars)"


@dataclass
class _Tracked:
    proc: psutil.Process
    create_time: float
    uss: int | None = None
    uss_at: float = 0.0


class ProcessTable:
    """psutil readings of processes by pid, kept between samples (and USS cached).

    ``read(pid)`` returns a dict of figures or ``None`` when the process is gone (or the
    pid now belongs to another process: psutil compares create times). Not thread-safe.
    """

    def __init__(self, *, uss_interval_s: float = USS_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.uss_interval_s = uss_interval_s
        self._clock = clock
        self._procs: dict[int, _Tracked] = {}

    def read(self, pid: int, *, with_uss: bool = True) -> dict[str, Any] | None:
        tracked = self._track(pid)
        if tracked is None:
            return None
        proc = tracked.proc
        now = self._clock()
        try:
            with proc.oneshot():
                cpu = proc.cpu_times()
                mem = proc.memory_info()
                try:
                    io = proc.io_counters()
                except (psutil.AccessDenied, AttributeError):
                    io = None
                fds = proc.num_fds()
                threads = proc.num_threads()
            if with_uss and (tracked.uss is None
                             or now - tracked.uss_at >= self.uss_interval_s):
                with contextlib.suppress(psutil.AccessDenied):
                    tracked.uss = proc.memory_full_info().uss
                    tracked.uss_at = now
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            self._procs.pop(pid, None)
            return None
        except psutil.AccessDenied:  # another user's process: nothing we may read
            return None
        return {
            "cpu_user_s": cpu.user,
            "cpu_system_s": cpu.system,
            "rss_bytes": mem.rss,
            "private_bytes": max(0, mem.rss - getattr(mem, "shared", 0)),
            "uss_bytes": tracked.uss if with_uss else None,
            "uss_age_s": (now - tracked.uss_at) if with_uss and tracked.uss is not None
            else None,
            "read_bytes": io.read_bytes if io else None,
            "write_bytes": io.write_bytes if io else None,
            "read_chars": getattr(io, "read_chars", None) if io else None,
            "write_chars": getattr(io, "write_chars", None) if io else None,
            "open_fds": fds,
            "threads": threads,
            "create_time": tracked.create_time,
        }

    def forget_except(self, pids: set[int]) -> None:
        """Drop processes no longer listed (replaced workers)."""
        for pid in list(self._procs):
            if pid not in pids:
                del self._procs[pid]

    def _track(self, pid: int) -> _Tracked | None:
        tracked = self._procs.get(pid)
        if tracked is not None:
            try:
                # is_running() compares the create time psutil saw first with the one
                # the pid has now: a reused pid is a different process.
                if tracked.proc.is_running():
                    return tracked
            except psutil.Error:
                pass
            del self._procs[pid]
        try:
            proc = psutil.Process(pid)
            tracked = _Tracked(proc, proc.create_time())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            return None
        self._procs[pid] = tracked
        return tracked


class Sampler:
    """Turns successive ``stats()`` dicts into figures (see docs/monitoring.md).

    ``sample(stats)`` returns the figures of this moment; rates (``*_per_s``) and
    ``cpu_percent`` cover the interval since the previous ``sample`` call of this sampler
    (``interval_s``) and are ``None`` on the first one. Counters that went backwards (a
    replaced worker starts from zero) give no rate rather than a negative one.
    """

    def __init__(self, procs: ProcessTable | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.procs = procs if procs is not None else ProcessTable(clock=clock)
        self._clock = clock
        self._prev_at: float | None = None
        self._prev_totals: dict[str, float] = {}
        # per process (pid, create time): tasks, bytes, busy seconds, CPU seconds
        self._prev_procs: dict[tuple[int, float], tuple[float, ...]] = {}
        self._mounts = _MountCache()
        self._stuck_disk: tuple[threading.Thread, float] | None = None

    def sample(self, stats: dict[str, Any]) -> dict[str, Any]:
        now = self._clock()
        interval = None if self._prev_at is None else now - self._prev_at
        use_rates = interval is not None and interval >= MIN_RATE_INTERVAL_S

        def rate(key: str, value: float) -> float | None:
            before = self._prev_totals.get(key)
            if not use_rates or before is None or value < before:
                return None
            return (value - before) / interval

        submitted = stats.get("jobs_submitted", {})
        failed = stats.get("jobs_failed", {})
        moved = stats.get("bytes_done", {})
        totals = {
            "store_jobs": submitted.get("store", 0), "load_jobs": submitted.get("load", 0),
            "store_bytes": moved.get("store", 0), "load_bytes": moved.get("load", 0),
            "lookup_keys": stats.get("keys_checked", 0),
        }
        rates = {f"{key}_per_s": rate(key, value) for key, value in totals.items()}

        # A tier attached to a service: its workers are the service's processes, maybe in
        # another PID namespace where their pids name nothing (or something else) here.
        service = stats.get("service")
        remote = (service.get("service") if isinstance(service, dict) else service) or ""
        workers = []
        seen: dict[tuple[int, float], tuple[float, ...]] = {}
        live_pids: set[int] = set()
        for index, entry in enumerate(stats.get("workers", [])):
            figure = self._worker(index, entry, interval if use_rates else None, seen,
                                  read_process=not remote)
            if figure["pid"]:
                live_pids.add(figure["pid"])
            workers.append(figure)
        self.procs.forget_except(live_pids | {os.getpid()})

        root = stats.get("root") or ""
        figures = {
            "time": time.time(),
            "interval_s": interval,
            "mode": stats.get("mode"),
            "closed": stats.get("closed"),
            "root": root,
            "o_direct": stats.get("o_direct"),
            "native": stats.get("native"),
            "backend": stats.get("backend"),
            "unavailable": stats.get("unavailable") or "",
            "block_bytes": stats.get("block_bytes"),
            "queues": dict(stats.get("queued_tasks", {})),
            "jobs_in_flight": stats.get("jobs_in_flight", 0),
            "tasks_in_flight": stats.get("tasks_in_flight", 0),
            "lookup_keys_pending": stats.get("lookup_keys_pending", 0),
            "totals": {
                "jobs_submitted": dict(submitted), "jobs_failed": dict(failed),
                "bytes": dict(moved), "lookup_keys_checked": stats.get("keys_checked", 0),
                "lookup_keys_found": stats.get("keys_found", 0),
                "corrupt_removed": stats.get("corrupt_removed", 0),
                "checksum_failures": stats.get("checksum_failures", 0),
                "bad_entries": stats.get("bad_entries", 0),
                "written_bytes": stats.get("written_bytes", 0),
                "skipped_bytes": stats.get("skipped_bytes", 0),
            },
            "rates": rates,
            "latency": _latency(stats.get("latency", {})),
            "task_latency": _latency(stats.get("task_latency", {})),
            "disk": self._disk(root, stats),
            # a tier's stats() say "pool"; a service's pool.stats() say "counters"
            "pool": dict(stats.get("pool") or stats.get("counters") or {}),
            "workers": workers,
            "process": self._own_process(interval if use_rates else None, seen),
            "notes": [NOTE_WRITE_BYTES],
        }
        # What else the source reports (a service: who is attached, its config; a tier
        # attached to a service: the service's figures) is passed on under its own name.
        for key, value in stats.items():
            if key not in figures and key not in _CONSUMED:
                figures[key] = value
        if remote:
            figures["notes"].append(
                f"the workers are service {remote!r}'s processes: `mptier status --name "
                f"{remote}` shows their CPU, memory and I/O")
        if figures["disk"].get("fs_type") == "tmpfs":
            figures["notes"].append(NOTE_TMPFS)
        self._prev_at = now
        self._prev_totals = totals
        self._prev_procs = seen
        return figures

    def _worker(self, index: int, entry: dict[str, Any], interval: float | None,
                seen: dict, read_process: bool = True) -> dict[str, Any]:
        pid = int(entry.get("pid") or 0)
        thread = entry.get("state") == "thread"
        if "task_age_s" in entry:
            age = entry["task_age_s"]
        else:  # CLOCK_MONOTONIC start of the running task, 0 when none runs
            started_ns = entry.get("task_started_ns") or 0
            age = (time.monotonic_ns() - started_ns) / 1e9 if started_ns else None
        figure: dict[str, Any] = {
            "slot": entry.get("slot", index),
            "pid": pid,
            "role": entry.get("role"),
            "state": entry.get("state"),
            "alive": entry.get("alive"),
            "ready": entry.get("ready"),
            "generation": entry.get("generation"),
            "tasks_done": entry.get("tasks_done", 0),
            "tasks_failed": entry.get("tasks_failed", entry.get("errors", 0)),
            "bytes_done": entry.get("bytes_done", 0),
            "busy_s": entry.get("busy_s", 0.0),
            "task_age_s": age,
            "tasks_per_s": None, "bytes_per_s": None, "mean_task_s": None,
            "cpu_percent": None,
        }
        # Whatever else the pool reports (backend, health) is passed on as it is.
        for key, value in entry.items():
            if key not in figure and key not in ("errors", "task_started_ns") \
                    and (value is None or isinstance(value, (str, int, float, bool))):
                figure[key] = value
        readings = None if thread or not pid or not read_process \
            or not entry.get("alive", True) else self.procs.read(pid)
        figure.update(readings if readings is not None else dict.fromkeys(_PROCESS_KEYS))
        if readings is not None:
            identity = (pid, readings["create_time"])
            now = (figure["tasks_done"], figure["bytes_done"], figure["busy_s"],
                   readings["cpu_user_s"] + readings["cpu_system_s"])
            seen[identity] = now
            before = self._prev_procs.get(identity)
            if interval and before is not None and all(a >= b for a, b in zip(now, before)):
                tasks = now[0] - before[0]
                figure["tasks_per_s"] = tasks / interval
                figure["bytes_per_s"] = (now[1] - before[1]) / interval
                figure["mean_task_s"] = (now[2] - before[2]) / tasks if tasks else None
                figure["cpu_percent"] = 100.0 * (now[3] - before[3]) / interval
        return figure

    def _own_process(self, interval: float | None, seen: dict) -> dict[str, Any] | None:
        """The process serving these figures: the engine (or the service) itself."""
        pid = os.getpid()
        readings = self.procs.read(pid, with_uss=False)
        if readings is None:
            return None
        identity = (-pid, readings["create_time"])  # negative: never a worker's key
        cpu_s = readings["cpu_user_s"] + readings["cpu_system_s"]
        seen[identity] = (cpu_s,)
        before = self._prev_procs.get(identity)
        percent = 100.0 * (cpu_s - before[0]) / interval if interval and before else None
        return {"pid": pid, "cpu_percent": percent, **readings}

    def _disk(self, root: str, stats: dict[str, Any]) -> dict[str, Any]:
        disk: dict[str, Any] = {"path": root, "fs_type": None, "total_bytes": None,
                                "used_bytes": None, "avail_bytes": None,
                                "tier_usage_bytes": stats.get("usage_bytes"),
                                "tier_capacity_bytes": stats.get("capacity_bytes")}
        if not root:
            return disk
        if self._stuck_disk is not None:  # one call stuck in the kernel: start no other
            thread, since = self._stuck_disk
            if thread.is_alive():
                disk["error"] = (f"statvfs({root!r}) has not returned for "
                                 f"{time.monotonic() - since:.0f} s: the file system is "
                                 "not responding")
                return disk
            self._stuck_disk = None
        got: dict[str, Any] = {}

        def read() -> None:
            try:
                got["st"] = os.statvfs(root)
                got["fs_type"] = self._mounts.fs_type(root)
            except OSError as exc:
                got["error"] = f"statvfs({root!r}): {exc.strerror}"

        thread = threading.Thread(target=read, name="mptier-statvfs", daemon=True)
        thread.start()
        thread.join(STATVFS_WAIT_S)
        if thread.is_alive():
            self._stuck_disk = (thread, time.monotonic())
            disk["error"] = (f"statvfs({root!r}) did not return within {STATVFS_WAIT_S:g} s:"
                             " the file system is not responding")
            return disk
        if "error" in got:
            disk["error"] = got["error"]
            return disk
        st = got["st"]
        total = st.f_blocks * st.f_frsize
        disk.update(total_bytes=total, used_bytes=total - st.f_bfree * st.f_frsize,
                    avail_bytes=st.f_bavail * st.f_frsize, fs_type=got["fs_type"])
        return disk


# stats() keys the figures carry under other names (or that Monitor sets itself).
_CONSUMED = frozenset({
    "name", "kind", "pid", "time", "queued_tasks", "jobs_submitted", "jobs_failed",
    "bytes_done", "keys_checked", "keys_found", "corrupt_removed", "checksum_failures",
    "bad_entries", "counters", "written_bytes", "skipped_bytes",
    "capacity_bytes"})

_PROCESS_KEYS = ("cpu_user_s", "cpu_system_s", "rss_bytes", "private_bytes",
                 "uss_bytes", "uss_age_s", "read_bytes", "write_bytes", "read_chars",
                 "write_chars", "open_fds", "threads", "create_time")


def _latency(latency: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {kind: {"p50_s": v.get("p50_s"), "p99_s": v.get("p99_s"),
                   "count": v.get("count", 0)} for kind, v in latency.items()}


class _MountCache:
    """File system type of a path: the mount point that is its longest prefix."""

    def __init__(self) -> None:
        self._mounts: list[tuple[str, str]] = []
        self._read_at = -MOUNT_CACHE_S

    def fs_type(self, path: str) -> str | None:
        now = time.monotonic()
        if now - self._read_at >= MOUNT_CACHE_S:
            self._mounts = fskind.mount_table()
            self._read_at = now
        return fskind.fs_type(os.path.realpath(path), self._mounts) or None

"""What a stretch of a benchmark run kept busy: the machine's CPUs (``/proc/stat``), the
block device under the root (``/proc/diskstats``), and what the engine's thread waited
for (``/proc/thread-self/schedstat``).

* :func:`machine_busy_seconds` -- CPU seconds the whole machine has been busy.
* :func:`stolen_seconds` -- CPU seconds a virtual machine's host ran something else on
  its CPUs while they had work ("steal"): on this project's VM it rises with some I/O
  patterns, and the busy loop loses it (docs/performance.md, section 28).
* :func:`thread_waited_seconds` -- seconds the calling thread has spent runnable on a run
  queue, waiting for a CPU.
* :func:`device_counters` -- bytes read and written, busy time, the time requests spent
  in flight and discards of the device holding a path (None in memory and on network
  or FUSE file systems).
* :class:`Saturation` and :func:`saturation_figures` -- both over a phase, as the
  figures the report prints beside the GB/s: which of the two a design ran out of.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


def _cpu_ticks() -> list[int] | None:
    """``/proc/stat``'s first line: user nice system idle iowait irq softirq steal."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        return ticks if len(ticks) == 8 else None
    except (OSError, ValueError):
        return None


def _busy_and_stolen() -> tuple[float, float]:
    """:func:`machine_busy_seconds` and :func:`stolen_seconds` from one read."""
    ticks = _cpu_ticks()
    if not ticks:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return sum(ticks[:3] + ticks[5:7]) / tick, ticks[7] / tick


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (``/proc/stat``: every
    state but idle, iowait and steal, in ticks of 1/CLK_TCK s); 0.0 where unreadable."""
    return _busy_and_stolen()[0]


def stolen_seconds() -> float:
    """CPU seconds the host has taken from this machine's CPUs since boot (``steal``:
    runnable, not running; 0 outside a virtual machine); 0.0 where unreadable."""
    return _busy_and_stolen()[1]


def thread_waited_seconds() -> float:
    """Seconds the calling thread has spent on a run queue, runnable but not running
    (``/proc/thread-self/schedstat``, its second field, in ns); 0.0 where unreadable."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass(frozen=True)
class DeviceCounters:
    """The counters of the block device under a path, at one moment (/proc/diskstats)."""

    read_bytes: int
    write_bytes: int
    busy_ms: int            # time with at least one request in flight ("io_ticks")
    # Requests completed, and the summed time of every read (write) request from its
    # start to its completion. Over a stretch of wall time the time's growth divided by
    # that time is the number of requests in flight on average (Little's law); times the
    # bytes per request, the bytes in flight. Bytes, not requests, compare designs: the
    # kernel cuts one read into as many requests as the target memory's scattered pages
    # need (on this VM a 2 MiB read into scattered 4 KiB pages was four requests, into
    # physically contiguous memory one). The kernel times each request itself, so this
    # holds where io_ticks does not.
    reads: int
    writes: int
    read_ms: int
    write_ms: int
    discards: int | None    # discard requests completed; None where not counted


# /proc/diskstats counts in sectors of 512 bytes whatever the device's own size.
DISKSTATS_SECTOR = 512


def device_counters(path: str) -> DeviceCounters | None:
    """The counters of the block device holding ``path``; None where no block device
    holds it (tmpfs, FUSE, a network file system) or /proc/diskstats is unreadable."""
    try:
        dev = os.stat(path).st_dev
        with open("/proc/diskstats") as f:
            for line in f:
                fields = line.split()
                if (int(fields[0]), int(fields[1])) != (os.major(dev), os.minor(dev)):
                    continue
                # major minor name, then reads: completed merged sectors ms, writes:
                # completed merged sectors ms, in flight, io_ticks ms, weighted ms,
                # then (Linux 4.18+) discards: completed merged sectors ms
                return DeviceCounters(
                    read_bytes=int(fields[5]) * DISKSTATS_SECTOR,
                    write_bytes=int(fields[9]) * DISKSTATS_SECTOR,
                    busy_ms=int(fields[12]),
                    reads=int(fields[3]),
                    writes=int(fields[7]),
                    read_ms=int(fields[6]),
                    write_ms=int(fields[10]),
                    discards=int(fields[14]) if len(fields) >= 18 else None)
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class Saturation:
    """What a stretch of the run kept busy: the machine's CPUs and the block device
    under the root. Where a design is slower than another, this says which of the two
    ran out (docs/performance.md, section 18): CPUs busy near the machine's count, or
    the device busy the whole time at the rate the raw limit (d) reaches."""

    wall: float
    machine_busy: float
    device: DeviceCounters | None
    stolen: float = 0.0
    waited: float = 0.0  # the thread that took it, as the engine's thread drives the phase

    @classmethod
    def take(cls, root: str) -> Saturation:
        busy, stolen = _busy_and_stolen()
        return cls(time.monotonic(), busy, device_counters(root), stolen,
                   thread_waited_seconds())

    def since(self, earlier: Saturation) -> dict[str, float]:
        """``seconds``, ``cpu_seconds`` (the whole machine's), ``steal_seconds`` (the
        host's), ``waited_seconds`` (the taking thread's on a run queue), and with a
        device under the root ``disk_busy_seconds``, ``disk_read_bytes``,
        ``disk_write_bytes``, ``disk_read_requests``, ``disk_write_requests`` and
        ``disk_read_seconds``, ``disk_write_seconds`` (the requests' summed times)."""
        out = {"seconds": self.wall - earlier.wall,
               "cpu_seconds": max(0.0, self.machine_busy - earlier.machine_busy),
               "steal_seconds": max(0.0, self.stolen - earlier.stolen),
               "waited_seconds": max(0.0, self.waited - earlier.waited)}
        if self.device is not None and earlier.device is not None:
            out["disk_busy_seconds"] = (self.device.busy_ms - earlier.device.busy_ms) / 1e3
            out["disk_read_bytes"] = self.device.read_bytes - earlier.device.read_bytes
            out["disk_write_bytes"] = self.device.write_bytes - earlier.device.write_bytes
            out["disk_read_requests"] = self.device.reads - earlier.device.reads
            out["disk_write_requests"] = self.device.writes - earlier.device.writes
            out["disk_read_seconds"] = (self.device.read_ms - earlier.device.read_ms) / 1e3
            out["disk_write_seconds"] = (self.device.write_ms - earlier.device.write_ms) / 1e3
        return out


def saturation_figures(stretches: list[dict[str, float]]) -> dict[str, float | None]:
    """Summed stretches (:meth:`Saturation.since`) as ``cpus_busy`` (CPUs busy on
    average), ``steal_cpus`` (CPUs the host took on average), ``waited_ms_per_s`` (the
    engine's thread's milliseconds on a run queue per second), ``disk_busy`` (the
    fraction of the time the device had a request in flight), ``disk_read_in_flight``
    and ``disk_write_in_flight`` (bytes being read and written on average: see
    :class:`DeviceCounters`; 0 without requests; the three None without a device).
    Several short stretches (the large job alone, a few tens of milliseconds each) are
    summed first: /proc/stat counts in 10 ms ticks."""
    seconds = sum(s["seconds"] for s in stretches)
    if not stretches or seconds <= 0:
        return {"cpus_busy": None, "steal_cpus": None, "waited_ms_per_s": None,
                "disk_busy": None, "disk_read_in_flight": None, "disk_write_in_flight": None}
    on_disk = all("disk_busy_seconds" in s for s in stretches)

    def total(key: str) -> float:
        return sum(s[key] for s in stretches)

    def in_flight(op: str) -> float | None:
        if not on_disk:
            return None
        requests = total(f"disk_{op}_requests")
        per_request = total(f"disk_{op}_bytes") / requests if requests else 0.0
        return total(f"disk_{op}_seconds") / seconds * per_request

    return {"cpus_busy": total("cpu_seconds") / seconds,
            "steal_cpus": sum(s.get("steal_seconds", 0.0) for s in stretches) / seconds,
            "waited_ms_per_s": sum(s.get("waited_seconds", 0.0) for s in stretches)
            / seconds * 1e3,
            "disk_busy": min(1.0, total("disk_busy_seconds") / seconds) if on_disk else None,
            "disk_read_in_flight": in_flight("read"),
            "disk_write_in_flight": in_flight("write")}

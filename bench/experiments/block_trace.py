"""What the disk saw while a bench ran: every request the root's block device issued and
completed (the kernel's block_rq_issue / block_rq_complete tracepoints, through tracefs),
cut into the bench's store and load phases by its progress lines, and per phase:

- the share of its active time the device had a request in flight ("device busy"; the
  active time leaves out idle stretches longer than --gap-ms, which are the bench's own
  pauses between a phase's halves and before its first job);
- the idle stretches inside the active time (the device waiting on the design);
- how the device completed: the share of completions that came within 0.1 ms of the one
  before (near 1: it finishes what it took as a batch, all at once);
- per issuing thread (a worker process, vLLM's threads show as their process): the
  median time from its last request completing to its next one issued, its "tail".

    sudo python bench/experiments/block_trace.py --root /var/tmp -- \\
        mptier bench --root /var/tmp --block-bytes 2M --designs mptier,vllm \\
        --rounds 2 --total-bytes 2G --no-cold-pass

Needs root (tracefs; mounted at /sys/kernel/tracing for the run if it was not, and
unmounted again). Writes the raw events to --keep DIR when asked. The figures are the
device's own: they do not depend on the bench's clocks. docs/performance.md, section 20.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

TRACEFS = "/sys/kernel/tracing"
EVENTS = ("block_rq_issue", "block_rq_complete")
# Completions this close after the one before count as one batch of the device's.
SAME_BATCH_S = 1e-4
# "Disk busy" counts the share of a phase the device had a request; idle stretches
# longer than this are the bench's pauses (the lookups before a load, the scheduler's
# switch between a phase's halves: 0.3-0.4 s here), not the device waiting on I/O.
DEFAULT_GAP_MS = 50.0
# The bench's progress lines: "[3/24  19.4s] mptier: dropping the page cache".
PROGRESS = re.compile(r"\] (\S+): (.+)$")
PHASES = {"store phase": "W", "load phase": "R"}
EVENT = re.compile(r"^\s*(.+?)-(\d+)\s+\[\d+\]\s+\S+\s+([\d.]+): (block_rq_issue|"
                   r"block_rq_complete): (\d+),(\d+) (\S+) (?:\d+ )?\(\S*\) (\d+) \+ (\d+)")


@dataclass
class Request:
    issuer: str
    issued: float
    sectors: int
    done: float = 0.0


@dataclass
class Phase:
    design: str
    kind: str  # "store" / "load"
    start: float
    end: float
    requests: list[Request] = field(default_factory=list)


def disk_of(path: str) -> tuple[int, int]:
    """(major, minor) of the whole disk holding ``path`` (a partition's parent)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    sysfs = os.path.realpath(f"/sys/dev/block/{major}:{minor}")
    if os.path.exists(os.path.join(sysfs, "partition")):
        with open(os.path.join(os.path.dirname(sysfs), "dev")) as f:
            major, minor = map(int, f.read().split(":"))
    return major, minor


class Tracing:
    """tracefs for one run: mounted if it was not, the block events on, the clock the
    monotonic one (time.monotonic's), everything put back on exit."""

    def __init__(self) -> None:
        self.mounted_here = False
        self.saved: dict[str, str] = {}

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(TRACEFS, name), "w") as f:
            f.write(value)

    def _read(self, name: str) -> str:
        with open(os.path.join(TRACEFS, name)) as f:
            return f.read().strip()

    def __enter__(self) -> Tracing:
        if not os.path.exists(os.path.join(TRACEFS, "trace_pipe")):
            subprocess.run(["mount", "-t", "tracefs", "nodev", TRACEFS], check=True)
            self.mounted_here = True
        clock = self._read("trace_clock")
        self.saved["trace_clock"] = clock[clock.index("[") + 1:clock.index("]")]
        self.saved["tracing_on"] = self._read("tracing_on")
        for event in EVENTS:
            self.saved[f"events/block/{event}/enable"] = \
                self._read(f"events/block/{event}/enable")
        self._write("tracing_on", "0")
        self._write("trace", "")
        self._write("trace_clock", "mono")
        for event in EVENTS:
            self._write(f"events/block/{event}/enable", "1")
        self._write("tracing_on", "1")
        return self

    def __exit__(self, *exc: object) -> None:
        self._write("tracing_on", "0")
        for name, value in self.saved.items():
            self._write(name, value)
        self._write("trace", "")
        if self.mounted_here:
            subprocess.run(["umount", TRACEFS], check=False)


def run_traced(cmd: list[str], events_path: str) -> tuple[int, list[tuple[float, str]]]:
    """Run ``cmd`` with the block events streamed from trace_pipe to ``events_path``;
    returns its exit code and its stderr lines, each with the monotonic time it came."""
    stop = threading.Event()

    def pump() -> None:
        fd = os.open(os.path.join(TRACEFS, "trace_pipe"), os.O_RDONLY | os.O_NONBLOCK)
        with open(events_path, "wb") as out:
            try:
                while True:
                    try:
                        chunk = os.read(fd, 1 << 20)
                    except BlockingIOError:
                        chunk = b""
                    if chunk:
                        out.write(chunk)
                    elif stop.is_set():
                        return
                    else:
                        time.sleep(0.05)
            finally:
                os.close(fd)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    marks = []
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        marks.append((time.monotonic(), line.rstrip("\n")))
        sys.stderr.write(line)
    rc = proc.wait()
    time.sleep(0.2)  # the last events into the pipe
    stop.set()
    reader.join()
    return rc, marks


def phases_of(marks: list[tuple[float, str]]) -> list[Phase]:
    """The bench's store and load phases: from a design's "store phase" / "load phase"
    line to its next progress line."""
    progress = [(t, m.group(1), m.group(2)) for t, line in marks
                if (m := PROGRESS.search(line))]
    ends = [t for t, _, _ in progress[1:]] + [float("inf")]
    return [Phase(design, what.split()[0], t, end)
            for (t, design, what), end in zip(progress, ends) if what in PHASES]


def read_events(path: str, disk: tuple[int, int], phases: list[Phase]) -> None:
    """Sort the device's requests into ``phases`` (writes into store phases, reads into
    load phases), issue matched with completion by sector."""
    open_requests: dict[tuple[str, int], tuple[Phase, Request]] = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = EVENT.match(line)
            if not m or (int(m.group(5)), int(m.group(6))) != disk:
                continue
            t, event, rwbs = float(m.group(3)), m.group(4), m.group(7)
            sector, sectors = int(m.group(8)), int(m.group(9))
            direction = "W" if "W" in rwbs else "R" if "R" in rwbs else ""
            key = (direction, sector)
            if event == "block_rq_issue":
                for phase in phases:
                    if phase.start <= t <= phase.end and PHASES[f"{phase.kind} phase"] \
                            == direction:
                        request = Request(m.group(1).strip(), t, sectors)
                        phase.requests.append(request)
                        open_requests[key] = (phase, request)
                        break
            elif key in open_requests:
                open_requests.pop(key)[1].done = t


def figures(phase: Phase, gap_s: float) -> dict[str, float | int | str]:
    done = [r for r in phase.requests if r.done]
    if len(done) < 2:
        return {"design": phase.design, "phase": phase.kind, "requests": len(done)}
    points = sorted([(r.issued, 1) for r in done] + [(r.done, -1) for r in done])
    depth, prev, busy, area, idle, long_idle = 0, points[0][0], 0.0, 0.0, [], 0.0
    for t, step in points:
        if depth:
            busy += t - prev
            area += depth * (t - prev)
        elif t > prev:
            if t - prev > gap_s:
                long_idle += t - prev
            else:
                idle.append(t - prev)
        depth += step
        prev = t
    active = points[-1][0] - points[0][0] - long_idle
    ends = sorted(r.done for r in done)
    batched = sum(1 for a, b in itertools.pairwise(ends) if b - a < SAME_BATCH_S) \
        / (len(ends) - 1)
    tails = defaultdict(list)
    by_issuer = defaultdict(list)
    for r in done:
        by_issuer[r.issuer].append(r)
    for issuer, requests in by_issuer.items():
        marks = sorted([(r.issued, 1) for r in requests] + [(r.done, -1) for r in requests])
        depth, prev = 0, None
        for t, step in marks:
            if depth == 0 and prev is not None and t - prev <= gap_s:
                tails[issuer].append(t - prev)
            depth += step
            prev = t
    tail_ms = [statistics.median(v) * 1e3 for v in tails.values() if len(v) >= 5]
    nbytes = sum(r.sectors for r in done) * 512
    return {
        "design": phase.design, "phase": phase.kind, "requests": len(done),
        "mean_request_kib": round(nbytes / len(done) / 1024),
        "active_s": round(active, 4),
        "gbps_active": round(nbytes / active / 1e9, 2),
        "device_busy": round(busy / active, 3),
        "idle_stretches": len(idle),
        "idle_ms": round(sum(idle) * 1e3, 1),
        "in_flight": round(area / active, 1),
        "completions_batched": round(batched, 2),
        "issuer_tail_ms": round(statistics.median(tail_ms), 2) if tail_ms else "",
        "issuers": len(by_issuer),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/var/tmp",
                    help="a path on the device to watch (the bench's --root)")
    ap.add_argument("--gap-ms", type=float, default=DEFAULT_GAP_MS,
                    help="idle stretches longer than this are left out of a phase's "
                         f"active time (default {DEFAULT_GAP_MS:g})")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--keep", help="keep the raw events and the progress lines in DIR")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the bench command")
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("give the command to trace after --, e.g. -- mptier bench --root /var/tmp")
    if os.geteuid() != 0:
        ap.error("tracefs needs root")
    disk = disk_of(a.root)
    keep = a.keep or f"/tmp/block_trace.{os.getpid()}"
    os.makedirs(keep, exist_ok=True)
    events_path = os.path.join(keep, "events.txt")
    with Tracing():
        rc, marks = run_traced(cmd, events_path)
    with open(os.path.join(keep, "progress.txt"), "w") as f:
        f.writelines(f"{t:.6f} {line}\n" for t, line in marks)
    phases = phases_of(marks)
    read_events(events_path, disk, phases)
    rows = [figures(p, a.gap_ms / 1e3) for p in phases]
    if not a.keep:
        for name in ("events.txt", "progress.txt"):
            os.remove(os.path.join(keep, name))
        os.rmdir(keep)
    columns = ("design", "phase", "requests", "mean_request_kib", "gbps_active",
               "device_busy", "idle_stretches", "idle_ms", "in_flight",
               "completions_batched", "issuer_tail_ms")
    print(f"device {disk[0]}:{disk[1]} ({a.root}); active time leaves out idle stretches "
          f"over {a.gap_ms:g} ms")
    print("  ".join(columns))
    for row in rows:
        print("  ".join(str(row.get(c, "")) for c in columns))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": cmd, "device": list(disk), "phases": rows}, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""Terminal rendering of status figures with rich: ``mptier status`` and ``mptier monitor``.

:func:`render` builds one tier's panel (header, queues/rates/latency, disk, workers);
:func:`run_monitor` redraws the panels of live endpoints every second in the terminal's
alternate screen until ``q`` or Ctrl-C, and always gives the terminal back as it found
it (termios attributes restored in ``finally``).
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from mptier.errors import MptierError
from mptier.monitor.endpoint import discover, query

# How often `mptier monitor` redraws (the issue asks for every second).
REFRESH_S = 1.0
# Keys that quit the monitor (Ctrl-C works too: it raises KeyboardInterrupt).
QUIT_KEYS = (b"q", b"Q")
WRITE_NOTE = ("rd/wr: bytes read from / sent to a block device (psutil io_counters; 0 "
              "for files on tmpfs). write(): bytes passed to write() on any file system. "
              "uss: refreshed every 10 s at most. t/s: tasks per second. age: of the "
              "running task.")


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop always returns


def short_bytes(n: float | None) -> str:
    """Four characters or so: 0, 512, 9.6K, 27M, 1.2G."""
    if n is None:
        return "-"
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            if not unit:
                return f"{n:.0f}"
            return f"{n:.1f}{unit}" if abs(n) < 10 else f"{n:.0f}{unit}"
        n /= 1024
    return f"{n:.0f}T"  # pragma: no cover - the loop always returns


def _per_s(nbytes: float | None) -> str:
    return "-" if nbytes is None else human_bytes(nbytes) + "/s"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.0f}ms" if seconds < 10 else f"{seconds:.0f}s"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def render(figures: dict[str, Any]) -> RenderableType:
    """One tier (or service): a panel with its summary, disk and workers tables."""
    f = figures
    disk = f.get("disk") or {}
    fs = disk.get("fs_type") or "?"
    title = (f"[b]{f.get('name')}[/b]  {f.get('kind', '')} pid {f.get('pid')}  "
             f"{f.get('mode') or '?'}  O_DIRECT {'on' if f.get('o_direct') else 'off'}  "
             f"native {'on' if f.get('native') else 'off'}")
    if f.get("closed"):
        title += "  [red]closed[/red]"
    rates = f.get("rates") or {}
    totals = f.get("totals") or {}
    latency = f.get("latency") or {}
    queues = f.get("queues") or {}

    summary = Table(box=None, show_header=True, pad_edge=False, expand=False)
    for column in ("", "store", "load", "lookup"):
        summary.add_column(column, justify="right" if column else "left")
    summary.add_row("queued tasks", str(queues.get("store", "-")),
                    str(queues.get("load", "-")), str(queues.get("lookup", "-")))
    summary.add_row("jobs/s", _num(rates.get("store_jobs_per_s")),
                    _num(rates.get("load_jobs_per_s")),
                    _num(rates.get("lookup_keys_per_s"), "{:.1f} keys"))
    summary.add_row("bytes/s", _per_s(rates.get("store_bytes_per_s")),
                    _per_s(rates.get("load_bytes_per_s")), "")
    summary.add_row("job latency p50", _ms(latency.get("store", {}).get("p50_s")),
                    _ms(latency.get("load", {}).get("p50_s")), "")
    summary.add_row("job latency p99", _ms(latency.get("store", {}).get("p99_s")),
                    _ms(latency.get("load", {}).get("p99_s")), "")
    submitted = totals.get("jobs_submitted") or {}
    failed = totals.get("jobs_failed") or {}
    moved = totals.get("bytes") or {}
    checked = totals.get("lookup_keys_checked") or 0
    found = totals.get("lookup_keys_found") or 0
    summary.add_row("jobs (failed)",
                    f"{submitted.get('store', 0)} ({failed.get('store', 0)})",
                    f"{submitted.get('load', 0)} ({failed.get('load', 0)})",
                    f"{found}/{checked} hit")
    summary.add_row("moved", human_bytes(moved.get("store")), human_bytes(moved.get("load")),
                    "")

    lines = [Text.from_markup(
        f"in flight: {f.get('jobs_in_flight', 0)} jobs, {f.get('tasks_in_flight', 0)} "
        f"tasks, {f.get('lookup_keys_pending', 0)} keys to check   "
        f"interval {_num(f.get('interval_s'), '{:.1f} s')}")]
    if disk.get("total_bytes"):
        used, total = disk.get("used_bytes") or 0, disk["total_bytes"]
        text = (f"disk {disk.get('path')} [{fs}]: {human_bytes(used)} of "
                f"{human_bytes(total)} used ({100 * used / total:.0f}%), "
                f"{human_bytes(disk.get('avail_bytes'))} free")
        if disk.get("tier_usage_bytes") is not None:
            text += f"; tier holds {human_bytes(disk['tier_usage_bytes'])}"
            if disk.get("tier_capacity_bytes"):
                text += f" of {human_bytes(disk['tier_capacity_bytes'])}"
        lines.append(Text(text))
    elif disk.get("error"):
        lines.append(Text(f"disk: {disk['error']}", style="red"))
    if f.get("unavailable"):
        lines.append(Text(f"UNAVAILABLE (jobs fail at once): {f['unavailable']}",
                          style="bold red"))
    pool = f.get("pool") or {}
    trouble = ("deaths", "timeouts", "boot_failures", "heartbeat_kills", "memory_kills",
               "stuck")
    if any(pool.get(key) for key in trouble):
        lines.append(Text(
            f"workers died {pool.get('deaths', 0)}, timed out {pool.get('timeouts', 0)}, "
            f"failed to boot {pool.get('boot_failures', 0)}, heartbeat kills "
            f"{pool.get('heartbeat_kills', 0)}, memory kills {pool.get('memory_kills', 0)}, "
            f"stuck now {pool.get('stuck', 0)}; tasks retried "
            f"{pool.get('tasks_retried', 0)}, lost {pool.get('tasks_lost', 0)}",
            style="yellow"))

    workers = Table(show_header=True, header_style="bold", box=None, pad_edge=False,
                    padding=(0, 1), collapse_padding=True)
    for column in ("worker", "pid", "state", "cpu%", "rss", "uss", "rd", "wr", "write()",
                   "fds", "tasks", "fail", "t/s", "age"):
        workers.add_column(column, justify="left" if column in ("worker", "state")
                           else "right", no_wrap=True)
    for w in f.get("workers", []):
        state = str(w.get("state"))
        style = "red" if not w.get("alive", True) else ("green" if state == "busy" else "")
        workers.add_row(
            f"{w.get('role')}/{w.get('slot')}", str(w.get("pid")), state,
            _num(w.get("cpu_percent")), short_bytes(w.get("rss_bytes")),
            short_bytes(w.get("uss_bytes")), short_bytes(w.get("read_bytes")),
            short_bytes(w.get("write_bytes")), short_bytes(w.get("write_chars")),
            _num(w.get("open_fds"), "{:d}"), str(w.get("tasks_done", 0)),
            str(w.get("tasks_failed", 0)), _num(w.get("tasks_per_s")),
            _age(w.get("task_age_s")), style=style)
    note = WRITE_NOTE
    if disk.get("fs_type") == "tmpfs":
        note = "The root is on tmpfs: wr stays 0 there. " + note
    return Panel(Group(*lines, summary, Text(""), workers, Text(note, style="dim")),
                 title=title,
                 title_align="left")


def render_all(replies: list[dict[str, Any]], errors: list[str]) -> RenderableType:
    parts: list[RenderableType] = [render(r["figures"]) for r in replies]
    parts += [Text(e, style="red") for e in errors]
    if not parts:
        parts = [Text("no live mptier status endpoints found")]
    return Group(*parts)


def collect(name: str | None, directory: str | None = None, trust: Any = None
            ) -> tuple[list[dict[str, Any]], list[str]]:
    """Query ``name`` (or every discovered endpoint): replies, and errors as text.
    ``trust`` (:class:`mptier.rundir.Trust`): whose endpoints are believed."""
    targets = [name] if name else [e.path for e in discover(directory, trust=trust)]
    replies, errors = [], []
    for target in targets:
        try:
            replies.append(query(target, directory=directory, trust=trust))
        except MptierError as exc:
            errors.append(str(exc))
    return replies, errors


def run_monitor(name: str | None, *, directory: str | None = None,
                refresh_s: float = REFRESH_S, console: Console | None = None,
                stdin_fd: int | None = None,
                clock: Callable[[], float] = time.monotonic, trust: Any = None) -> int:
    """The live view: redraw every ``refresh_s`` until ``q`` (or Ctrl-C); returns 0.

    Blocks the calling thread. When stdin is a terminal it is put in cbreak mode (keys
    arrive at once, unechoed; Ctrl-C still interrupts) and restored on the way out.
    """
    from rich.live import Live

    console = console or Console()
    fd = sys.stdin.fileno() if stdin_fd is None else stdin_fd
    saved = None
    if os.isatty(fd):
        saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)
    keys = [fd]
    try:
        with Live(console=console, screen=True, auto_refresh=False,
                  redirect_stdout=False, redirect_stderr=False) as live:
            while True:
                live.update(render_all(*collect(name, directory, trust)), refresh=True)
                deadline = clock() + refresh_s
                while (left := deadline - clock()) > 0:
                    ready, _, _ = select.select(keys, [], [], left)
                    if ready:
                        data = os.read(fd, 64)
                        if not data:
                            keys = []  # stdin closed: only Ctrl-C (SIGINT) quits now
                        elif any(k in data for k in QUIT_KEYS):
                            return 0
    except KeyboardInterrupt:
        return 0
    finally:
        if saved is not None:
            with contextlib.suppress(termios.error):
                termios.tcsetattr(fd, termios.TCSADRAIN, saved)

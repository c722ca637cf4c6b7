"""Operator commands against a real tier doing real I/O, run as separate processes:
``mptier status --json``, the Prometheus endpoint, ``mptier monitor`` in a pseudo-terminal.
"""

from __future__ import annotations

import json
import os
import pathlib
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
import psutil
import pytest
from conftest import fill_random, wait_results

from mptier import TransferJob, make_key
from mptier.monitor.prom import METRIC_NAMES

BLOCK = 256 << 10
MPTIER = [sys.executable, "-m", "mptier"]


@pytest.fixture
def disk_root(tmp_path):
    """A root on a block-device file system: psutil's write_bytes stay 0 on tmpfs, and
    tmp_path is on tmpfs on some machines (then /var/tmp is used)."""
    fs = next((p.fstype for p in sorted(psutil.disk_partitions(all=True),
                                        key=lambda p: -len(p.mountpoint))
               if str(tmp_path).startswith(p.mountpoint.rstrip("/") + "/")), "")
    if fs != "tmpfs":
        yield str(tmp_path / "kv")
        return
    folder = tempfile.mkdtemp(prefix="mptier-test-", dir="/var/tmp")
    yield os.path.join(folder, "kv")
    shutil.rmtree(folder, ignore_errors=True)


def _store_and_load(tier, buf, first_job: int, n_jobs: int = 4) -> None:
    """Store ``n_jobs`` jobs of 8 blocks, load them back into other slots, verify."""
    keys = [make_key(os.urandom(32), 0) for _ in range(8 * n_jobs)]
    fill_random(buf.view, range(8 * n_jobs), seed=first_job)
    stores = range(first_job, first_job + n_jobs)
    for n, j in enumerate(stores):
        tier.submit_store(TransferJob(j, keys[8 * n:8 * n + 8], list(range(8 * n, 8 * n + 8))))
    assert all(r.success for r in wait_results(tier, stores).values())
    loads = range(first_job + n_jobs, first_job + 2 * n_jobs)
    half = buf.num_blocks // 2
    for n, j in enumerate(loads):
        tier.submit_load(TransferJob(j, keys[8 * n:8 * n + 8],
                                     list(range(half + 8 * n, half + 8 * n + 8))))
    assert all(r.success for r in wait_results(tier, loads).values())
    assert np.array_equal(buf.view[:8 * n_jobs], buf.view[half:half + 8 * n_jobs])


def _status(*args: str) -> tuple[int, str, str]:
    done = subprocess.run([*MPTIER, "status", *args], capture_output=True, text=True,
                          timeout=60)
    return done.returncode, done.stdout, done.stderr


def test_status_json_carries_the_documented_fields_after_real_io(make_buffer, make_tier,
                                                                 disk_root):
    buf = make_buffer(64, BLOCK)
    tier = make_tier(buf, root_dir=disk_root, n_load_workers=1, n_store_workers=1,
                     task_bytes=BLOCK)
    _store_and_load(tier, buf, first_job=0)
    code, out, err = _status("--json", "--name", tier.status_name, "--interval", "0.3")
    assert code == 0, err
    f = json.loads(out)
    assert (f["name"], f["kind"], f["pid"], f["mode"]) == (tier.status_name, "engine",
                                                          os.getpid(), "processes")
    assert f["root"] == tier.mapper.base_path
    assert f["totals"]["bytes"] == {"store": 32 * BLOCK, "load": 32 * BLOCK}
    assert f["totals"]["jobs_submitted"] == {"store": 4, "load": 4}
    assert f["latency"]["store"]["count"] == 4 and f["latency"]["load"]["p99_s"] > 0
    assert set(f["queues"]) == {"lookup", "load", "store"}
    assert 0.2 < f["interval_s"] < 30  # the second of the two requests, ~0.3 s apart
    assert set(f["rates"]) >= {"store_jobs_per_s", "load_bytes_per_s"}
    assert f["disk"]["total_bytes"] > f["disk"]["avail_bytes"] > 0
    assert f["disk"]["fs_type"] not in (None, "tmpfs")
    assert f["process"]["pid"] == os.getpid() and f["process"]["rss_bytes"] > 0
    workers = f["workers"]
    assert sorted(w["pid"] for w in workers) == sorted(tier.worker_pids())
    assert {w["role"] for w in workers} == {"load", "store"}
    for w in workers:
        assert w["alive"] and w["state"] in ("idle", "busy")
        assert w["cpu_percent"] is not None and w["cpu_percent"] >= 0
        assert w["rss_bytes"] > 0 and w["open_fds"] > 0 and w["uss_bytes"] > 0
        assert w["tasks_failed"] == 0
    assert sum(w["tasks_done"] for w in workers) == 64  # 32 store + 32 load tasks
    store_worker = next(w for w in workers if w["role"] == "store")
    assert store_worker["tasks_done"] > 0
    assert store_worker["write_bytes"] > 0 and store_worker["write_chars"] > 0
    assert any("tmpfs" in note for note in f["notes"])  # the caveat travels with it
    doc = (pathlib.Path(__file__).parent.parent / "docs" / "monitoring.md").read_text()
    undocumented = sorted(k for k in [*f, *workers[0]]
                          if f"`{k}`" not in doc and f"`{k}." not in doc)
    assert not undocumented, f"not in docs/monitoring.md: {undocumented}"


def test_status_lists_every_live_endpoint_and_renders_text(make_buffer, make_tier):
    tier = make_tier(make_buffer(8, 64 << 10), n_load_workers=1, n_store_workers=0)
    other = make_tier(make_buffer(8, 64 << 10), n_load_workers=1, n_store_workers=0,
                      status_socket="unit-other")
    code, out, err = _status("--json", "--interval", "0")
    assert code == 0, err
    names = {f["name"] for f in json.loads(out)}
    assert names >= {tier.status_name, "unit-other"}
    code, out, err = _status("--interval", "0")
    assert code == 0, err
    assert tier.status_name in out and "unit-other" in out and "load/0" in out
    other.shutdown()
    code, out, err = _status("--name", "unit-other", "--interval", "0")
    assert code == 1 and "unit-other" in err and "no status endpoint" in err


def test_status_socket_off_means_no_endpoint(make_buffer, make_tier):
    tier = make_tier(make_buffer(8, 64 << 10), n_load_workers=1, n_store_workers=0,
                     status_socket="")
    assert tier.status_name is None
    code, out, _ = _status("--json", "--interval", "0")
    assert code == 0 and json.loads(out) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    matches = [v for (n, lab), v in samples.items()
               if n == name and set(labels.items()) <= lab]
    assert matches, f"{name}{labels} not scraped"
    return sum(matches)


def test_metrics_endpoint_counters_move_after_io(make_buffer, make_tier, disk_root):
    port = _free_port()
    buf = make_buffer(64, BLOCK)
    tier = make_tier(buf, root_dir=disk_root, n_load_workers=1, n_store_workers=1,
                     task_bytes=BLOCK, metrics_port=port)
    listening = [c.laddr for c in psutil.Process().net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert listening and all(a.ip == "127.0.0.1" for a in listening)  # not 0.0.0.0
    _store_and_load(tier, buf, first_job=0, n_jobs=2)
    before = _scrape(port)
    names = {name for name, _ in before}
    assert names <= METRIC_NAMES, names - METRIC_NAMES
    assert all(n.startswith("mptier_") for n in names)
    tier_label = tier.status_name
    assert _value(before, "mptier_up", tier=tier_label) == 1
    assert _value(before, "mptier_jobs_submitted_total", kind="store") == 2
    assert _value(before, "mptier_worker_up") == 2
    _store_and_load(tier, buf, first_job=100, n_jobs=2)
    after = _scrape(port)
    for name, labels in (("mptier_jobs_submitted_total", {"kind": "store"}),
                         ("mptier_transferred_bytes_total", {"kind": "load"}),
                         ("mptier_worker_tasks_total", {}),
                         ("mptier_worker_io_write_chars_total", {}),
                         ("mptier_worker_io_write_bytes_total", {"role": "store"})):
        assert _value(after, name, **labels) > _value(before, name, **labels), name
    assert _value(after, "mptier_transferred_bytes_total", kind="store") == 32 * BLOCK
    tier.shutdown()
    with pytest.raises(OSError):
        _scrape(port)  # the server went with the tier


def _read_until(fd: int, pattern: bytes, timeout: float, seen: bytearray) -> bool:
    deadline = time.monotonic() + timeout
    while pattern not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child side closed
                return pattern in seen
            if not chunk:
                return pattern in seen
            seen.extend(chunk)
    return True


# The pseudo-terminal tests run in one test process, one after another (--dist
# loadgroup): a terminal's echo and redraws under a parallel suite's load are what made
# them flaky, not what they check.
@pytest.mark.xdist_group("terminal")
@pytest.mark.parametrize("quit_with", [b"q", b"\x03"], ids=["q", "ctrl-c"])
def test_monitor_renders_in_a_terminal_and_quits(make_buffer, make_tier, quit_with):
    buf = make_buffer(64, BLOCK)
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1, task_bytes=BLOCK)
    _store_and_load(tier, buf, first_job=0, n_jobs=1)
    # The shell prints the monitor's exit code and the terminal settings it left behind.
    # Its own Ctrl-C trap (a command, so the monitor gets the default handler) keeps it
    # going when the SIGINT reaches the whole foreground process group.
    script = ('trap ":" INT; "$0" -m mptier monitor --name "$1"; echo "RC=$?"; stty -a; '
              'echo END')
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session leader on the pseudo-terminal, as in a shell
        try:
            # A login shell starts with default dispositions and nothing blocked; an
            # ignored or blocked SIGINT in this test process (pytest's, or a library's
            # thread) would be inherited through exec and keep Ctrl-C from the monitor.
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execvpe("sh", ["sh", "-c", script, sys.executable, tier.status_name],
                       {**os.environ, "TERM": "xterm-256color", "COLUMNS": "100",
                        "LINES": "40"})
        finally:
            os._exit(127)
    seen = bytearray()
    try:
        rendered = _read_until(fd, b"store/1", 60, seen)
        assert rendered, f"monitor did not render: {bytes(seen)[-2000:]!r}"
        assert tier.status_name.encode() in seen and b"\x1b[?1049h" in seen
        time.sleep(0.2)  # the key must arrive after cbreak mode is on (it is by now)
        os.write(fd, quit_with)
        assert _read_until(fd, b"END", 30, seen), bytes(seen)[-2000:]
        tail = bytes(seen).split(b"\x1b[?1049h", 1)[1].decode(errors="replace")
        assert "\x1b[?1049l" in tail  # alternate screen left: the old screen is back
        assert "RC=0" in tail
        settings = tail.split("RC=0", 1)[1]
        assert re.search(r"(?<![-\w])icanon\b", settings), settings
        assert re.search(r"(?<![-\w])echo\b", settings), settings
    finally:
        os.close(fd)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)


def test_render_shows_trouble_and_survives_partial_figures():
    from rich.console import Console

    from mptier.monitor.view import render

    console = Console(width=100, record=True, color_system=None)
    console.print(render({"name": "svc", "kind": "service", "pid": 1,
                          "unavailable": "3 workers in a row failed to start",
                          "pool": {"deaths": 2, "stuck": 1},
                          "workers": [{"slot": 3, "role": "load", "pid": 5,
                                       "state": "stuck", "alive": True}]}))
    text = console.export_text()
    assert "UNAVAILABLE (jobs fail at once): 3 workers in a row failed to start" in text
    assert "died 2" in text and "stuck now 1" in text and "load/3" in text

"""The janitor (mptier/workers/janitor.py): temporary files removed by glob pattern in a
child process, never in the caller; a batch at a time; a bounded wait list that drops
the oldest; close waits a moment and no longer."""

from __future__ import annotations

import os
import time

import psutil

from mptier.workers import janitor as janitor_module
from mptier.workers.janitor import Janitor


def settle(j: Janitor, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while j.busy:
        assert time.monotonic() < deadline, "the janitor never finished"
        j.poll()
        time.sleep(0.02)


def test_files_matching_the_patterns_go_and_nothing_else(tmp_path):
    for name in ("a.bin.t1.0.tmp", "a.bin.t1.1.tmp", "b.bin.t2.0.tmp", "a.bin"):
        (tmp_path / name).write_bytes(b"x")
    j = Janitor()
    j.remove([str(tmp_path / "*.t1.*.tmp")])
    assert j.busy  # started, not done: the caller did not wait for the unlinks
    settle(j)
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "b.bin.t2.0.tmp"]
    j.remove([str(tmp_path / "b.bin.*.tmp"), str(tmp_path / "missing-*")])
    settle(j)
    assert os.listdir(tmp_path) == ["a.bin"]
    j.close()


def test_patterns_asked_while_a_removal_runs_wait_for_the_next_child(tmp_path, monkeypatch):
    """One child at a time: with a pattern batch limit of one pattern, three requests
    take three children, in order, and every file goes."""
    monkeypatch.setattr(janitor_module, "BATCH_BYTES", 1)
    for i in range(3):
        (tmp_path / f"{i}.tmp").write_bytes(b"x")
    before = {child.pid for child in psutil.Process().children()}
    j = Janitor()
    j.remove([str(tmp_path / f"{i}.tmp") for i in range(3)])
    started = [child for child in psutil.Process().children() if child.pid not in before]
    assert len(started) == 1  # one child, the other two wait
    settle(j)
    assert os.listdir(tmp_path) == []
    j.close()


def test_past_max_pending_the_oldest_requests_are_dropped_and_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(janitor_module, "MAX_PENDING", 3)
    j = Janitor()
    (tmp_path / "kept-late.tmp").write_bytes(b"x")
    (tmp_path / "dropped.tmp").write_bytes(b"x")
    j.remove([str(tmp_path / "first-running")])  # a child runs: the rest must wait
    j.remove([str(tmp_path / "dropped.tmp"), "/nonexistent/a", "/nonexistent/b",
              str(tmp_path / "kept-late.tmp")])
    assert j.dropped == 1
    settle(j)
    assert os.listdir(tmp_path) == ["dropped.tmp"]
    j.close()


def test_close_waits_at_most_its_timeout_for_a_stuck_removal(tmp_path, monkeypatch):
    """A removal that does not finish (a child stuck on a hung mount; here one that
    sleeps) is left to finish by itself once close's timeout is over."""
    monkeypatch.setattr(janitor_module, "_SCRIPT", "import time; time.sleep(3)")
    j = Janitor()
    j.remove(["anything"])
    started = time.monotonic()
    j.close(timeout_s=0.3)
    assert time.monotonic() - started < 2.5
    assert j.busy
    (child,) = psutil.Process().children()
    child.wait(30)  # the test's own cleanup: no child left behind

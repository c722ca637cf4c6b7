"""Status endpoints: Unix sockets in the run directory, discovery, stale sockets, names."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest
from conftest import RUN_DIR

from mptier.errors import MptierError
from mptier.monitor import discover, query, run_dir, start_endpoint
from mptier.monitor.endpoint import (
    CLIENT_TIMEOUT_S,
    LOCK_SUFFIX,
    SOCKET_SUFFIX,
    EndpointBusyError,
    StatusEndpoint,
)


def test_run_dir_comes_from_the_environment(tmp_path, monkeypatch):
    assert run_dir() == RUN_DIR  # conftest gives the session its own
    wanted = tmp_path / "nested" / "run"
    monkeypatch.setenv("MPTIER_RUN_DIR", str(wanted))
    assert run_dir() == str(wanted) and wanted.is_dir()


def test_endpoint_answers_status_and_ping_then_removes_its_files():
    calls = []

    def provider():
        calls.append(threading.current_thread().name)
        return {"answer": 42}

    with start_endpoint("unit-a", provider, kind="service") as endpoint:
        assert endpoint.path == os.path.join(RUN_DIR, "unit-a" + SOCKET_SUFFIX)
        reply = query("unit-a")
        assert reply["ok"] and reply["figures"] == {"answer": 42}
        assert (reply["name"], reply["pid"], reply["kind"]) == ("unit-a", os.getpid(),
                                                                "service")
        assert "figures" not in query("unit-a", op="ping")
        assert query(endpoint.path)["figures"] == {"answer": 42}  # a path works too
        assert calls == ["mptier-status-unit-a"] * 2  # on the endpoint's own thread
    assert not os.path.exists(endpoint.path)
    assert not os.path.exists(os.path.join(RUN_DIR, "unit-a" + LOCK_SUFFIX))
    with pytest.raises(MptierError, match="no status endpoint"):
        query("unit-a")


def test_a_second_endpoint_of_a_live_name_is_refused():
    with start_endpoint("unit-b", dict):
        with pytest.raises(EndpointBusyError, match=r"unit-b.*in use by a live process"):
            StatusEndpoint("unit-b", dict)
        assert query("unit-b")["ok"]  # the first one is untouched


def test_auto_names_are_engine_pid_and_distinct_per_tier():
    first = start_endpoint(None, dict)
    second = start_endpoint(None, dict)
    try:
        assert first.name == f"engine-{os.getpid()}"
        assert second.name == f"engine-{os.getpid()}-2"
        assert {e.name for e in discover()} >= {first.name, second.name}
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "x" * 65, "sp ace"])
def test_bad_names_are_refused_naming_the_rule(name):
    with pytest.raises(ValueError, match="letters, digits"):
        StatusEndpoint(name, dict)


def _killed_endpoint(name: str) -> str:
    """An endpoint whose process was SIGKILLed: its socket and lock file stay behind."""
    code = ("import sys; from mptier.monitor import start_endpoint; "
            f"e = start_endpoint({name!r}, dict); print(e.path, flush=True); "
            "sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        path = child.stdout.readline().strip()
        assert query(name)["pid"] == child.pid
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdin.close()
        child.stdout.close()
    assert os.path.exists(path)
    return path


def test_discovery_skips_and_removes_a_stale_socket():
    path = _killed_endpoint("unit-stale")
    with start_endpoint("unit-live", dict):
        names = [e.name for e in discover()]
        assert "unit-live" in names and "unit-stale" not in names
    assert not os.path.exists(path)
    assert not os.path.exists(os.path.join(RUN_DIR, "unit-stale" + LOCK_SUFFIX))
    with pytest.raises(MptierError, match="no status endpoint"):
        query("unit-stale")


def test_discovery_leaves_a_socket_whose_lock_is_held():
    """Not accepting but locked = an endpoint starting or stopping: never removed."""
    path = _killed_endpoint("unit-held")
    lock_path = os.path.join(RUN_DIR, "unit-held" + LOCK_SUFFIX)
    fd = os.open(lock_path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert "unit-held" not in [e.name for e in discover()]
        assert os.path.exists(path)
    finally:
        os.close(fd)
    assert "unit-held" not in [e.name for e in discover()]
    assert not os.path.exists(path)  # lock free now: stale, removed


def test_a_stale_socket_of_the_same_name_is_replaced():
    _killed_endpoint("unit-reborn")
    with start_endpoint("unit-reborn", lambda: {"new": True}):
        assert query("unit-reborn")["figures"] == {"new": True}


def test_bad_requests_and_provider_errors_are_answered_and_serving_goes_on():
    def failing():
        raise RuntimeError("figures unavailable")

    with start_endpoint("unit-c", failing) as endpoint:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(endpoint.path)
            s.sendall(b"GET / HTTP/1.0\r\n\r\n\n")
            reply = json.loads(s.makefile().readline())
        assert not reply["ok"] and "unknown request" in reply["error"]
        with pytest.raises(MptierError, match="RuntimeError: figures unavailable"):
            query("unit-c")
        assert query("unit-c", op="ping")["ok"]


def test_a_silent_client_delays_others_only_up_to_the_client_timeout():
    with start_endpoint("unit-d", lambda: {"x": 1}) as endpoint, \
            socket.socket(socket.AF_UNIX) as silent:
        silent.connect(endpoint.path)  # connects, never sends: served first, times out
        assert query("unit-d", timeout=CLIENT_TIMEOUT_S + 10)["figures"] == {"x": 1}


def test_close_returns_while_a_client_is_connected():
    endpoint = start_endpoint("unit-e", dict)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(endpoint.path)
        endpoint.close()
        assert not os.path.exists(endpoint.path)
    endpoint.close()  # idempotent

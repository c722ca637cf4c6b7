"""The run folder and its sockets against another local user (docs/security.md): a second
uid (4242, no passwd entry) squats folders, listens as an impostor service, plants
symlinks, connects where it may not and holds idle connections -- real processes,
sockets and files. Also: a re-attach gives back everything the last attachment held."""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_for
from reliability_kit import Service, gone, stop_services
from support.hostile import HOSTILE_GID, HOSTILE_UID, Impostor, check_as, public_folder, run_as
from test_service import round_trip

from mptier import FileSystemTier, MptierError, make_key, rundir
from mptier.config import TierConfig
from mptier.monitor import bounded, discover, query, start_endpoint
from mptier.rundir import Trust, UntrustedError
from mptier.service import link
from mptier.service.server import Service as InProcessService

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root")

KB = 1 << 10
BLOCK = 64 * KB


def keys_for(n: int, tag: bytes) -> list[bytes]:
    return [make_key(tag.ljust(28, b".") + i.to_bytes(4, "big")) for i in range(n)]


@pytest.fixture
def pub():
    """A /tmp-like folder (1777) in which the second user makes its own folders."""
    path = public_folder()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def default_dirs(pub, monkeypatch):
    """No MPTIER_RUN_DIR: this process searches ``<pub>/run-mptier`` (standing for
    /run/mptier: root's, 0755) and ``<pub>/mptier-<uid>`` (standing for /tmp/mptier-<uid>,
    which anybody can make first), exactly as it would the real ones."""
    system = os.path.join(pub, "run-mptier")
    fallback = os.path.join(pub, f"mptier-{os.geteuid()}")
    monkeypatch.delenv("MPTIER_RUN_DIR", raising=False)
    monkeypatch.setattr(rundir, "SYSTEM_RUN_DIR", system)
    monkeypatch.setattr(rundir, "fallback_dir", lambda: fallback)
    return system, fallback


@pytest.fixture
def services(tmp_path):
    started: list[Service] = []

    def start(run_dir: str, name: str = "kv", **settings) -> Service:
        service = Service(name, str(tmp_path / "kv"), run_dir, **settings)
        started.append(service)
        return service

    yield start
    stop_services(started)


# -- finding 1: an impostor service in a folder another user made first ------------------

def test_an_engine_never_attaches_to_an_impostor_in_a_squatted_fallback(
        default_dirs, services, make_buffer, caplog, monkeypatch):
    system, fallback = default_dirs
    monkeypatch.setattr(link, "RECONNECT_S", 0.2)
    with Impostor(fallback, "r3victim") as impostor:
        assert os.stat(fallback).st_uid == HOSTILE_UID
        caplog.set_level(logging.WARNING, "mptier")
        with pytest.raises(MptierError, match=rf"no mptier service named 'r3victim'.*"
                           rf"skipped run folder {fallback} is owned by uid {HOSTILE_UID}"):
            FileSystemTier(make_buffer(8, BLOCK), service="r3victim",
                           worker_start_timeout_s=0.5, status_socket="")
        assert f"run folder {fallback} is owned by uid {HOSTILE_UID}" in caplog.text
        assert "mode 0755" in caplog.text

        # The real service in the system folder: the engine attaches there, and after the
        # service restarts it attaches there again -- never to the impostor.
        os.mkdir(system, 0o755)
        service = services(system, "r3victim")
        buf = make_buffer(16, BLOCK)
        tier = FileSystemTier(buf, service="r3victim", status_socket="")
        try:
            round_trip(tier, buf, keys_for(4, b"real"), first_job=1)
            service.stop(signal.SIGKILL)
            wait_for(lambda: tier.stats()["unavailable"], 15, "the loss noticed")
            services(system, "r3victim")
            deadline = time.monotonic() + 30
            while tier.stats()["unavailable"] and time.monotonic() < deadline:
                tier.get_finished_jobs()
                time.sleep(0.05)
            assert tier.stats()["service"]["reattaches"] == 1
            round_trip(tier, buf, keys_for(4, b"again"), first_job=10)
        finally:
            tier.shutdown()
    got = impostor.stop()
    assert got == {"connections": 0, "message_bytes": 0, "fds": 0, "mapped_bytes": 0}


def test_a_listener_of_another_uid_in_a_trusted_folder_is_sent_nothing(pub,
                                                                       make_buffer,
                                                                       monkeypatch):
    """The folder passes (root's, writable by the configured group), the listener's uid
    does not: the engine connects, reads SO_PEERCRED, and sends not a byte."""
    folder = Path(pub) / "shared-run"
    folder.mkdir()
    os.chown(folder, 0, HOSTILE_GID)
    os.chmod(folder, 0o770)
    monkeypatch.setenv("MPTIER_RUN_DIR", str(folder))
    impostor = Impostor(str(folder), "kv")
    with impostor, pytest.raises(MptierError, match=rf"refused to attach.*served by uid "
                                 rf"{HOSTILE_UID} \(pid {impostor.proc.pid}\).*nothing "
                                 "was sent"):
        FileSystemTier(make_buffer(8, BLOCK), service="kv", status_socket="",
                       service_group=str(HOSTILE_GID), worker_start_timeout_s=0.5)
    got = impostor.stop()
    assert got["connections"] == 1  # it did connect: the check is the peer's uid
    assert got["message_bytes"] == got["fds"] == got["mapped_bytes"] == 0
    # Proof the check is what stopped it: told to believe uid 4242, the engine sends.
    with Impostor(str(folder), "kv2") as believed, pytest.raises(MptierError):
        FileSystemTier(make_buffer(8, BLOCK), service="kv2", status_socket="",
                       service_group=str(HOSTILE_GID), service_user=str(HOSTILE_UID),
                       worker_start_timeout_s=0.5)
    got = believed.stop()
    assert got["fds"] > 0 and got["mapped_bytes"] >= 8 * BLOCK


def test_serve_refuses_a_squatted_fallback_naming_the_squatter(default_dirs, tmp_path,
                                                              monkeypatch):
    """As a user who cannot write /run/mptier would: the service does not start
    elsewhere silently, and says whose the folder is and what to do."""
    _, fallback = default_dirs
    monkeypatch.setattr(rundir, "SYSTEM_RUN_DIR", "/proc/mptier-cannot-be-made")
    check_as("os.mkdir(sys.argv[1], 0o755)", fallback)
    with pytest.raises(UntrustedError, match=rf"{fallback} is owned by uid {HOSTILE_UID}.*"
                       r"mode 0755.*MPTIER_RUN_DIR"):
        rundir.run_dir()
    with pytest.raises(UntrustedError, match=rf"owned by uid {HOSTILE_UID}"):
        InProcessService("kv", TierConfig(root_dir=str(tmp_path / "kv")))
    assert os.listdir(fallback) == []  # nothing of ours went into it


def test_serve_refuses_an_entry_at_its_socket_name_that_is_not_its_socket(tmp_path,
                                                                          monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv("MPTIER_RUN_DIR", str(run))
    target = tmp_path / "elsewhere"
    (run / "kv.sock").symlink_to(target)
    service = InProcessService("kv", TierConfig(root_dir=str(tmp_path / "kv")))
    with pytest.raises(UntrustedError, match=r"kv.sock in the run folder is not a socket"):
        service.run()
    assert (run / "kv.sock").is_symlink() and not target.exists()
    (run / "kv.sock").unlink()
    (run / "kv.lock").symlink_to(target)
    with pytest.raises(UntrustedError, match=r"lock file kv.lock is not a regular file"):
        InProcessService("kv", TierConfig(root_dir=str(tmp_path / "kv"))).run()
    assert not target.exists()


@pytest.mark.parametrize("problem", ["other-owner", "world-writable", "group-writable",
                                     "symlink"])
def test_run_folders_that_fail_the_checks_are_refused_naming_owner_and_mode(
        problem, pub, monkeypatch):
    folder = os.path.join(pub, "run")
    if problem == "other-owner":
        check_as("os.mkdir(sys.argv[1], 0o700)", folder)
        want = rf"is owned by uid {HOSTILE_UID}.*mode 0700"
    elif problem == "symlink":
        os.mkdir(folder + "-real", 0o700)
        os.symlink(folder + "-real", folder)
        want = r"is a symlink"
    else:
        os.mkdir(folder)
        os.chmod(folder, 0o777 if problem == "world-writable" else 0o770)
        want = r"is writable by every user.*mode 0777" if problem == "world-writable" \
            else r"is writable by its group 0, which is not the configured service_group"
    monkeypatch.setenv("MPTIER_RUN_DIR", folder)
    with pytest.raises(UntrustedError, match=rf"MPTIER_RUN_DIR: run folder {folder} {want}"):
        rundir.run_dir()
    assert rundir.client_dirs() == []
    with pytest.raises(UntrustedError):
        start_endpoint("unit-x", dict)
    assert not os.path.lexists(os.path.join(folder, "unit-x.status.sock"))


def test_a_group_writable_folder_is_accepted_for_the_configured_group(tmp_path,
                                                                     monkeypatch):
    folder = tmp_path / "grp"
    folder.mkdir()
    os.chown(folder, 0, HOSTILE_GID)
    os.chmod(folder, 0o770)
    monkeypatch.setenv("MPTIER_RUN_DIR", str(folder))
    with pytest.raises(UntrustedError):
        rundir.run_dir()
    assert rundir.run_dir(trust=Trust.of(group=str(HOSTILE_GID))) == str(folder)


# -- finding 4: mptier status as root and another user's symlinks -----------------------

PLANT = """
folder, target = sys.argv[1], sys.argv[2]
os.mkdir(folder, 0o755)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(os.path.join(folder, "evil.status.sock"))   # a socket nobody listens on: "stale"
s.close()
os.symlink(target, os.path.join(folder, "evil.status.lock"))
"""


def test_status_as_root_never_follows_a_symlink_in_a_squatted_folder(default_dirs,
                                                                    tmp_path, caplog):
    _, fallback = default_dirs
    target = tmp_path / "root-owned-file"
    check_as(PLANT, fallback, str(target))
    caplog.set_level(logging.WARNING, "mptier")
    assert discover() == []  # the folder is skipped, with a warning naming it
    assert f"run folder {fallback} is owned by uid {HOSTILE_UID}" in caplog.text
    code = subprocess.run([sys.executable, "-m", "mptier", "status", "--run-dir", fallback,
                           "--interval", "0"], capture_output=True, text=True, timeout=60)
    assert code.returncode != 0
    assert f"is owned by uid {HOSTILE_UID}" in code.stderr
    assert not target.exists()
    assert os.path.islink(os.path.join(fallback, "evil.status.lock"))


def test_a_planted_lock_symlink_in_a_trusted_group_folder_is_not_followed(pub, tmp_path):
    """The group's members may write the folder (configured so); what they plant there
    is still never followed, and another user's entries are never removed."""
    folder = Path(pub) / "grp"
    folder.mkdir()
    os.chown(folder, 0, HOSTILE_GID)
    os.chmod(folder, 0o770)
    target = tmp_path / "root-owned-file"
    check_as(PLANT.replace("os.mkdir(folder, 0o755)", ""), str(folder), str(target))
    trust = Trust.of(group=str(HOSTILE_GID))
    assert discover(str(folder), trust=trust) == []
    assert not target.exists()
    assert (folder / "evil.status.lock").is_symlink()
    assert (folder / "evil.status.sock").exists()


# -- peer credentials on accept -----------------------------------------------------------

CONNECT = """
path, kind = sys.argv[1], sys.argv[2]
family = socket.SOCK_SEQPACKET if kind == "service" else socket.SOCK_STREAM
s = socket.socket(socket.AF_UNIX, family)
s.settimeout(10)
s.connect(path)
try:
    s.send(b'{"op": "status"}\\n')
    data = s.recv(1 << 16)
except OSError as exc:
    data = b""
print(json.dumps({"reply_bytes": len(data)}), flush=True)
"""


def test_service_and_status_sockets_refuse_other_uids_naming_them(pub, tmp_path, make_buffer,
                                                                  monkeypatch):
    run = Path(pub) / "run"
    run.mkdir(mode=0o755)
    monkeypatch.setenv("MPTIER_RUN_DIR", str(run))
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mptier.cli", "serve", "--name", "kv", "--root",
             str(tmp_path / "kv"), "--set", "prefault=false", "--set", "n_load_workers=1",
             "--set", "n_store_workers=1"], stdout=subprocess.PIPE, stderr=log_file,
            text=True)
    try:
        assert "listening on" in proc.stdout.readline()
        sock, status = run / "kv.sock", run / "kv.status.sock"
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert stat.S_IMODE(status.stat().st_mode) == 0o600
        # An operator loosens the modes: the kernel lets uid 4242 connect, the service
        # reads its credentials and closes without reading a byte.
        os.chmod(sock, 0o666)
        os.chmod(status, 0o666)
        for path, kind in ((sock, "service"), (status, "status")):
            out = json.loads(check_as(CONNECT, str(path), kind))
            assert out == {"reply_bytes": 0}, kind
        wait_for(lambda: log_path.read_text().count(f"uid {HOSTILE_UID} (pid ") >= 2, 10,
                 "both refusals logged")
        text = log_path.read_text()
        assert f"mptier service 'kv' refused a connection from uid {HOSTILE_UID}" in text
        assert "may not read status" in text
        # our own uid is served, and the service still takes engines
        assert query("kv")["figures"]["kind"] == "service"
        buf = make_buffer(16, BLOCK)
        with FileSystemTier(buf, service="kv", status_socket="") as tier:
            round_trip(tier, buf, keys_for(2, b"after"), first_job=1)
    finally:
        workers = [c.pid for c in __import__("psutil").Process(proc.pid).children()]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        proc.stdout.close()
        wait_for(lambda: all(gone(p) for p in workers), 10, "the workers to leave")


def test_status_endpoint_refuses_other_uids_and_serves_the_group(pub, caplog):
    folder = Path(pub) / "run"
    folder.mkdir(mode=0o755)
    caplog.set_level(logging.WARNING, "mptier")
    with start_endpoint("unit-peer", lambda: {"x": 1}, directory=str(folder)) as endpoint:
        os.chmod(endpoint.path, 0o666)
        out = json.loads(check_as(CONNECT, endpoint.path, "status"))
        assert out == {"reply_bytes": 0}
        wait_for(lambda: endpoint.loop.refused == 1, 5, "the refusal counted")
        assert f"uid {HOSTILE_UID} (pid " in caplog.text and "may not read status" in \
            caplog.text
    with start_endpoint("unit-grp", lambda: {"x": 2}, directory=str(folder),
                        trust=Trust.of(group=str(HOSTILE_GID))) as endpoint:
        assert os.stat(endpoint.path).st_gid == HOSTILE_GID
        assert stat.S_IMODE(os.stat(endpoint.path).st_mode) == 0o660
        out = json.loads(check_as(CONNECT, endpoint.path, "status"))
        assert out["reply_bytes"] > 0  # a member of service_group may read status


def test_the_status_client_refuses_a_listener_of_another_uid(pub):
    folder = Path(pub) / "grp"
    folder.mkdir()
    os.chown(folder, 0, HOSTILE_GID)
    os.chmod(folder, 0o770)
    listener = run_as("""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(sys.argv[1]); s.listen(4)
        print("up", flush=True)
        sys.stdin.read()
    """, str(folder / "fake.status.sock"), stderr=subprocess.PIPE)
    try:
        assert listener.stdout.readline().strip() == "up"
        trust = Trust.of(group=str(HOSTILE_GID))
        with pytest.raises(UntrustedError, match=rf"served by uid {HOSTILE_UID}"):
            query("fake", directory=str(folder), trust=trust)
        assert discover(str(folder), trust=trust) == []
    finally:
        listener.stdin.close()
        listener.wait(10)
        listener.stdout.close()
        listener.stderr.close()


# -- finding 9: idle connections cannot fill the engine ----------------------------------

HOLD = """
host, port, count, kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # not the engine's lowered limit
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
conns = []
for _ in range(count):
    if kind == "tcp":
        s = socket.create_connection((host, port), timeout=10)
    else:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(host)
    conns.append(s)
print(json.dumps({"held": len(conns)}), flush=True)
sys.stdin.readline()                          # the test has counted
closed, deadline = 0, time.monotonic() + 30
pending = list(conns)
while pending and time.monotonic() < deadline:
    ready, _, _ = select.select(pending, [], [], 1.0)
    for s in ready:
        try:
            data = s.recv(1)
        except OSError:
            data = b""
        if not data:
            closed += 1
            pending.remove(s)
print(json.dumps({"closed_by_server": closed}), flush=True)
"""


# The holder's stdin and stdout pipes, open in this process while it holds.
HOLDER_PIPES = 2
# Descriptors the tier's own threads hold for a moment whenever they like (the pool's
# periodic sweep of /dev/shm opens each object it judges; seen in CI: one more than
# the bound). Far below the 200 connections a thread-per-client design would hold.
PASSING_FDS = 4


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _hold(host: str, port: int, count: int, kind: str, as_root: bool = False):
    if as_root:
        script = "import json, resource, select, socket, sys, time\n" + HOLD
        proc = subprocess.Popen([sys.executable, "-c", script, host, str(port), str(count),
                                 kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
    else:
        proc = run_as(HOLD, host, str(port), str(count), kind)
    held = json.loads(proc.stdout.readline())["held"]
    assert held == count
    return proc


def _release(proc) -> int:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    closed = json.loads(proc.stdout.readline())["closed_by_server"]
    proc.stdin.close()
    proc.wait(30)
    proc.stdout.close()
    return closed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_idle_metrics_connections_of_another_user_take_no_threads_or_descriptors(
        make_buffer, make_tier):
    import urllib.request

    port = _free_port()
    make_tier(make_buffer(16, BLOCK), n_load_workers=1, n_store_workers=1,
              metrics_port=port)
    url = f"http://127.0.0.1:{port}/metrics"
    assert b"mptier_up" in urllib.request.urlopen(url, timeout=10).read()
    threads, fds = _threads(), _fds()
    holder = _hold("127.0.0.1", port, 300, "tcp")
    try:
        time.sleep(0.5)  # let the server accept (and turn away) what it will
        # No thread per held connection (fewer is fine: one of the tier's own may end).
        assert _threads() <= threads
        assert _fds() <= fds + bounded.MAX_CLIENTS + HOLDER_PIPES + PASSING_FDS
    finally:
        closed = _release(holder)
    assert closed == 300  # turned away at once or timed out: none held for good
    # The server closes its side of the last ones as its loop sees them go (once: 58
    # against 57 read at once after the release).
    wait_for(lambda: _fds() <= fds, 10, f"the descriptors back to {fds}")
    text = urllib.request.urlopen(url, timeout=10).read()
    assert b"mptier_up" in text


def test_idle_status_connections_are_capped_and_timed_out(make_buffer, make_tier):
    tier = make_tier(make_buffer(16, BLOCK), n_load_workers=1, n_store_workers=1)
    path = os.path.join(os.environ["MPTIER_RUN_DIR"], tier.status_name + ".status.sock")
    query(tier.status_name)
    threads, fds = _threads(), _fds()
    holder = _hold(path, 0, 200, "unix", as_root=True)
    try:
        time.sleep(0.5)
        # No thread per held connection (fewer is fine: one of the tier's own may end).
        assert _threads() <= threads
        assert _fds() <= fds + bounded.MAX_CLIENTS + HOLDER_PIPES + PASSING_FDS
    finally:
        closed = _release(holder)
    assert closed == 200
    assert query(tier.status_name)["ok"]


def test_with_descriptors_low_a_dead_worker_is_still_replaced(make_buffer, make_tier):
    """The endpoint keeps FD_RESERVE descriptors free: with the soft limit just above
    what the engine uses, 300 idle metrics connections leave room to replace a killed
    worker, and jobs succeed."""
    port = _free_port()
    buf = make_buffer(16, BLOCK)
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1, metrics_port=port)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_fds() + bounded.FD_RESERVE + 8, hard))
    try:
        holder = _hold("127.0.0.1", port, 300, "tcp")
        try:
            time.sleep(0.5)
            assert bounded.descriptors_left() >= bounded.FD_RESERVE - 8
            victim = tier.worker_pids()[0]
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda: victim not in tier.worker_pids() and len(
                [w for w in tier.stats()["workers"] if w["alive"] and w["ready"]]) == 2,
                30, "the killed worker replaced")
            assert tier.stats()["pool"]["boot_failures"] == 0
            round_trip(tier, buf, keys_for(4, b"lowfd"), first_job=1)
        finally:
            _release(holder)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# -- finding 10: a re-attach gives back what the last attachment held -------------------

def _control_entries() -> tuple[list[int], list[int]]:
    """The inodes of the service control blocks (memfds) this process holds: one per
    descriptor, one per mapping."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "mptier-control" in os.readlink(f"/proc/self/fd/{fd}"):
                fds.append(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = [int(line.split()[4]) for line in f if "mptier-control" in line]
    return fds, maps


def _control_blocks(others: frozenset[int] = frozenset()) -> tuple[int, int]:
    """(descriptors, mappings) of service control blocks in this process, but for the
    blocks (inodes) in ``others``."""
    fds, maps = _control_entries()
    return (sum(ino not in others for ino in fds), sum(ino not in others for ino in maps))


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_every_reattach_releases_the_last_attachments_descriptors_and_mappings(
        run_dir, services, make_buffer, monkeypatch):
    monkeypatch.setattr(link, "RECONNECT_S", 0.2)
    # Other tests in this process may have left a control block mapped (a thread-workers
    # tier's slot views keep its mapping, ControlBlock.close), which garbage collection
    # may close at any time: only this tier's blocks count.
    others = frozenset(ino for entries in _control_entries() for ino in entries)
    os.makedirs(run_dir)
    service = services(run_dir)
    buf = make_buffer(16, BLOCK)
    tier = FileSystemTier(buf, service="kv", status_socket="")
    try:
        round_trip(tier, buf, keys_for(2, b"first"), first_job=1)
        fds, maps, threads = _fds(), _maps(), _threads()
        blocks = _control_blocks(others)
        restarts = 6
        for n in range(restarts):
            service.stop(signal.SIGKILL if n % 2 else signal.SIGTERM)
            wait_for(lambda: tier.stats()["unavailable"], 15, "the loss noticed")
            service = services(run_dir)
            deadline = time.monotonic() + 30
            while (tier.stats()["unavailable"] or tier.stats()["service"]["reattaches"]
                   != n + 1) and time.monotonic() < deadline:
                tier.get_finished_jobs()  # the engine takes the loss; the link re-attaches
                time.sleep(0.05)
            assert tier.stats()["service"]["reattaches"] == n + 1
        time.sleep(link.RETIRE_AFTER_S + 1.5)  # replaced blocks are closed after this
        round_trip(tier, buf, keys_for(2, b"last"), first_job=100)
        # The link's thread closes a replaced block at its first turn past the deadline;
        # on a loaded machine that turn can come late (CI: one block still open).
        wait_for(lambda: _control_blocks(others) == blocks, 10, "the replaced blocks closed")
        assert _control_blocks(others) == blocks == (2, 1)  # one block: its fd, mmap's dup, map
        # No thread per held connection (fewer is fine: one of the tier's own may end).
        assert _threads() <= threads
        assert _fds() <= fds + 1, "descriptors kept by re-attaches"
        assert _maps() <= maps + 2, "mappings kept by re-attaches"
    finally:
        tier.shutdown()


def test_a_reattach_the_engine_would_not_notice_by_counters_is_noticed(run_dir, services,
                                                                        make_buffer,
                                                                        monkeypatch):
    """Two fresh services with no traffic have equal message counters: the engine must
    still see the second loss (a new control block is news)."""
    monkeypatch.setattr(link, "RECONNECT_S", 0.2)
    os.makedirs(run_dir)
    service = services(run_dir)
    tier = FileSystemTier(make_buffer(8, BLOCK), service="kv", status_socket="")
    try:
        for n in range(3):
            service.stop(signal.SIGTERM)
            wait_for(lambda: tier.stats()["unavailable"], 15, "the loss noticed")
            service = services(run_dir)
            deadline = time.monotonic() + 30
            while tier.stats()["service"]["reattaches"] != n + 1 and \
                    time.monotonic() < deadline:
                tier.get_finished_jobs()
                time.sleep(0.05)
            assert tier.stats()["service"]["reattaches"] == n + 1
            assert not tier.stats()["unavailable"]
    finally:
        tier.shutdown()


def test_peer_credentials_carry_uid_pid_and_groups():
    a, b = socket.socketpair()
    with a, b:
        peer = rundir.peer_of(a)
    assert (peer.uid, peer.pid) == (os.geteuid(), os.getpid())
    assert Trust.of().admits(peer) and not Trust.of().listener_problem(peer)
    stranger = rundir.Peer(pid=1, uid=HOSTILE_UID, gid=HOSTILE_GID,
                           groups=frozenset({HOSTILE_GID}))
    assert not Trust.of().admits(stranger)
    assert Trust.of(group=str(HOSTILE_GID)).admits(stranger)
    assert Trust.of(group=str(HOSTILE_GID)).listener_problem(stranger)
    assert not Trust.of(user=str(HOSTILE_UID)).listener_problem(stranger)
    with pytest.raises(ValueError, match="not a known group"):
        Trust.of(group="no-such-group-here")

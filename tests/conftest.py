"""Shared fixtures: a temp root, unique shared buffers, tiers that always shut down, and
a leak check after every test (no new mptier objects in /dev/shm or /dev/mqueue, no
status sockets left in the run directory, no child processes left, no mount left under
the test mount folders, no freezer cgroup of ours left). Fixtures for FUSE, JuiceFS,
frozen processes and PID namespaces come from ``tests/support`` (see its ``fixtures``
module).

Under pytest-xdist (``make test`` runs ``-n``), every test process checks only what it
and its children made (shared-memory names, mount folders and cgroups carry the creator's
pid; other workers' objects are never looked at), and the run as a whole is checked once
more at the end by the controller, after every worker has exited (``pytest_sessionfinish``
below): nothing in /dev/shm or /dev/mqueue named after any process a worker saw, no
process left, no mount, cgroup, run directory or mount folder of any worker left."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import psutil
import pytest
from support import freezer, mounts
from support.fixtures import (  # noqa: F401  (fixtures, registered by being imported here)
    dfs_dirs,
    fuse_fs,
    juicefs_pair,
    juicefs_volume,
    make_frozen_cgroup,
    make_fuse_fs,
    make_juicefs_mount,
    make_pid_namespace,
)

from mptier.shm import process_start_ticks

LEAK_DIRS = ("/dev/shm", "/dev/mqueue")

# Status sockets of this test session (every tier makes one, status_socket="auto") go to
# a run directory of its own: tests never see an operator's engines, nor another test
# session's, and a socket left behind is this session's leak. Subprocesses inherit it.
RUN_DIR = tempfile.mkdtemp(prefix="mptier-run-")
os.environ["MPTIER_RUN_DIR"] = RUN_DIR
atexit.register(shutil.rmtree, RUN_DIR, ignore_errors=True)

# The whole run's ledger: a folder the first process (the xdist controller, or the only
# process without xdist) makes and every xdist worker inherits through the environment.
# Each test process writes there the pids it saw (itself, its children at each teardown)
# and its own temporary folders, so the final check knows what this run made, even in a
# process that has exited, without ever counting another run's objects on this machine.
SESSION_ENV = "MPTIER_TEST_SESSION_DIR"
IS_XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
if not os.environ.get(SESSION_ENV) or not IS_XDIST_WORKER:
    os.environ[SESSION_ENV] = tempfile.mkdtemp(prefix="mptier-test-session-")
SESSION_DIR = os.environ[SESSION_ENV]
# Time the controller gives the workers' processes to go after the last worker exited.
SESSION_EXIT_GRACE_S = 10.0


def _record_pids(pids) -> None:
    """Note processes as this run's, by pid and start time (as mptier's shared-memory
    names carry them), so a pid reused later by someone else's process is not ours."""
    _record("pids", [f"{p}.{process_start_ticks(p) or 0}" for p in pids])


def _recorded_pids() -> tuple[set[int], set[str]]:
    """This run's processes: their pids, and their ``pid.start_ticks`` identities."""
    identities = _recorded("pids")
    return {int(i.split(".")[0]) for i in identities}, identities


def _ours(name: str, identities: set[str]) -> bool:
    """Was object ``name`` made by one of this run's processes? Names of the form
    ``mptier.<pid>.<start ticks>.…`` must match pid and start time; others the pid."""
    match = re.match(r"mptier\.(\d+)\.(\d+)\.", os.path.basename(name))
    return match is None or f"{match[1]}.{match[2]}" in identities


def _record(kind: str, values) -> None:
    """Append ``values`` to this process's ``kind`` list in the session ledger."""
    with contextlib.suppress(OSError), open(
            os.path.join(SESSION_DIR, f"{kind}.{os.getpid()}"), "a") as f:
        f.writelines(f"{v}\n" for v in values)


def _recorded(kind: str) -> set[str]:
    found: set[str] = set()
    with contextlib.suppress(OSError):
        for name in os.listdir(SESSION_DIR):
            if name.startswith(kind + "."):
                with open(os.path.join(SESSION_DIR, name)) as f:
                    found.update(line.strip() for line in f if line.strip())
    return found


def _descendants(pid: int) -> set[int]:
    """Pids below ``pid``, from the kernel's per-thread ``children`` lists (a few small
    reads, unlike a scan of every process in /proc)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = {int(k) for k in f.read().split()} - found
                found |= kids
                todo.extend(kids)
    return found


# How often each test process notes its descendants in the ledger: a process a test
# starts and kills between two teardowns (a crashed worker, a SIGKILLed service) is seen
# as long as it lives this long, so what it left in /dev/shm is still counted as ours.
PID_SAMPLE_S = 0.1


def _sample_pids() -> None:
    seen: set[int] = set()
    while True:
        new = _descendants(os.getpid()) - seen
        if new:
            seen |= new
            _record_pids(new)
        time.sleep(PID_SAMPLE_S)


_record_pids([os.getpid()])
_record("dirs", [RUN_DIR])
threading.Thread(target=_sample_pids, name="conftest-pid-sampler", daemon=True).start()


def run_dir_entries() -> set[str]:
    """Status sockets and their lock files in the session's run directory."""
    try:
        return set(os.listdir(RUN_DIR))
    except FileNotFoundError:
        return set()


def _lock_held(entry: str) -> bool:
    """Is the endpoint that ``entry`` belongs to alive (its lock file locked)?"""
    import fcntl

    name = entry.rsplit(".status.", 1)[0]
    try:
        fd = os.open(os.path.join(RUN_DIR, name + ".status.lock"), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def socket_leaks(before: set[str], owners: set[int]) -> set[str]:
    """New run-directory entries of this test's processes (their pid in the name), or of
    any endpoint still alive. A process the test killed leaves stale files on purpose;
    those are removed here, as the next start or discovery would."""
    new = run_dir_entries() - before
    leaked = {e for e in new if _owner_pid(e) in owners or _lock_held(e)}
    if new - leaked:
        from mptier.monitor.endpoint import remove_stale

        remove_stale(RUN_DIR)
    return leaked


def _owner_pid(name: str) -> int | None:
    match = re.search(r"(\d+)", name)
    return int(match.group(1)) if match else None


def mptier_objects(owners: set[int] | None = None) -> set[str]:
    """mptier-named objects in /dev/shm and /dev/mqueue; with ``owners``, only those whose
    name carries one of these pids (so a benchmark running beside the tests is ignored)."""
    found = set()
    for directory in LEAK_DIRS:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        found.update(f"{directory}/{n}" for n in names if "mptier" in n and (
            owners is None or _owner_pid(n) in owners))
    return found


def live_children() -> list[psutil.Process]:
    """Processes below this one that have not exited (zombies aside)."""
    out = []
    for pid in _descendants(os.getpid()):  # not psutil's scan of every process in /proc
        try:
            child = psutil.Process(pid)
            if child.status() != psutil.STATUS_ZOMBIE:
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def mounts_in_test_roots(basetemp) -> set[str]:
    """Mounts under this run's folders: the helpers' mount folder and pytest's base temp
    folder (other runs on the machine have their own, which are never looked at)."""
    return mounts.mounts_under(mounts.mount_root(), basetemp)


@pytest.fixture(scope="session", autouse=True)
def no_session_leaks() -> Iterator[None]:
    """Before the run: detach mounts and remove freezer cgroups that crashed runs left
    (never a live run's). After it, once every session fixture is gone: fail if any
    mount or freezer cgroup of this run is still there."""
    mounts.reap_stale_mounts()
    freezer.reap_stale_cgroups()
    _record("dirs", [mounts.mount_root()])
    yield
    left = mounts.mounts_under(mounts.mount_root())
    cgroups = freezer.cgroup_dirs(os.getpid())
    assert not left, f"mounts left behind at the end of the run: {sorted(left)}"
    assert not cgroups, f"freezer cgroups left behind at the end of the run: {sorted(cgroups)}"
    shutil.rmtree(mounts.mount_root(), ignore_errors=True)


def pytest_sessionstart(session) -> None:
    if not IS_XDIST_WORKER:
        session.config.stash[_OBJECTS_AT_START] = mptier_objects()


_OBJECTS_AT_START = pytest.StashKey[set]()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session) -> None:
    """The whole run, checked by the process that started it once every test process has
    gone (xdist's own ``pytest_sessionfinish`` has torn the workers down by now): any
    leak fails the run, even one a per-test check could not see (a process the test
    killed, a worker that crashed)."""
    if IS_XDIST_WORKER:
        return
    try:
        problems = _whole_run_leaks(session)
    except Exception as exc:  # a broken check must fail the run, not hide its summary
        problems = [f"the end-of-run leak check failed: {exc!r}"]
    shutil.rmtree(SESSION_DIR, ignore_errors=True)
    if problems:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        for line in problems:
            if reporter is not None:
                reporter.write_line(f"LEAK: {line}", red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _whole_run_leaks(session) -> list[str]:
    problems = []
    deadline = time.monotonic() + SESSION_EXIT_GRACE_S
    while live_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    children = live_children()
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    if children:
        problems.append(f"processes left at the end of the run: {[c.pid for c in children]}")
    pids, identities = _recorded_pids()
    before = session.config.stash.get(_OBJECTS_AT_START, set())
    leaked = {o for o in mptier_objects(pids) - before if _ours(o, identities)}
    if leaked:
        problems.append(f"IPC objects left at the end of the run: {sorted(leaked)}")
    left_mounts = {m for d in _recorded("dirs") for m in mounts.mounts_under(d)}
    if left_mounts:
        problems.append(f"mounts left at the end of the run: {sorted(left_mounts)}")
    cgroups = set().union(*(freezer.cgroup_dirs(p) for p in pids))
    if cgroups:
        problems.append(f"freezer cgroups left at the end of the run: {sorted(cgroups)}")
    # The current process's run directory goes at its exit (atexit); every other one, and
    # every worker's mount folder, must be gone already.
    dirs = {d for d in _recorded("dirs") if d != RUN_DIR and os.path.exists(d)}
    if dirs:
        problems.append(f"temporary folders of test processes left: {sorted(dirs)}")
    return problems


@pytest.fixture(autouse=True)
def no_leaks(tmp_path_factory) -> Iterator[None]:
    basetemp = tmp_path_factory.getbasetemp()
    before = mptier_objects()
    sockets_before = run_dir_entries()
    mounts_before = mounts_in_test_roots(basetemp)
    cgroups_before = freezer.cgroup_dirs(os.getpid())
    yield
    # Thaw leaked cgroups and detach leaked mounts first: a frozen child or one stuck in a
    # hung mount could not be killed below, and one leak must not cascade into later tests.
    new_cgroups = freezer.cgroup_dirs(os.getpid()) - cgroups_before
    for path in new_cgroups:
        freezer.remove_cgroup(path)
    new_mounts = mounts_in_test_roots(basetemp) - mounts_before
    for point in new_mounts:
        mounts.unmount(point)
    owners = {os.getpid(), *_descendants(os.getpid())}
    _record_pids(owners)
    deadline = time.monotonic() + 5
    while live_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    children = live_children()
    for child in children:  # do not let one leak cascade into every later test
        child.kill()
    assert not children, f"child processes left behind: {[c.pid for c in children]}"
    leaked = mptier_objects(owners) - before
    assert not leaked, f"IPC objects left behind: {sorted(leaked)}"
    left = socket_leaks(sockets_before, owners)
    assert not left, f"status sockets left behind in {RUN_DIR}: {sorted(left)}"
    assert not new_mounts, f"mounts left behind: {sorted(new_mounts)}"
    assert not new_cgroups, f"freezer cgroups left behind: {sorted(new_cgroups)}"


@pytest.fixture
def run_dir(tmp_path, monkeypatch) -> str:
    """A run directory of the test's own (service and status sockets), for the test and,
    through MPTIER_RUN_DIR, every process it starts."""
    path = str(tmp_path / "run")
    monkeypatch.setenv("MPTIER_RUN_DIR", path)
    return path


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "kv")


@pytest.fixture
def make_buffer() -> Iterator[Callable]:
    """``make_buffer(num_blocks, block_bytes)`` -> a SharedKVBuffer unlinked at teardown."""
    from mptier import SharedKVBuffer

    made = []

    def factory(num_blocks: int = 64, block_bytes: int = 64 << 10):
        buf = SharedKVBuffer.create(num_blocks, block_bytes)
        made.append(buf)
        return buf

    yield factory
    for buf in made:
        buf.close()
        buf.unlink()


@pytest.fixture(params=["native", "python"])
def backend(request) -> str:
    """The I/O backend a test's tiers use; every test that makes a tier runs on both."""
    from mptier import native

    if request.param == "native" and not native.HAS_NATIVE:
        pytest.skip(f"native core not built: {native.NATIVE_IMPORT_ERROR}")
    if request.param == "native" and native.BACKEND != "native":
        pytest.skip("MPTIER_NATIVE=0 switches the native core off in this process")
    return request.param


@pytest.fixture
def make_tier(root, backend) -> Iterator[Callable]:
    """``make_tier(buffer, **overrides)`` -> a FileSystemTier shut down at teardown,
    running on the ``backend`` fixture's I/O backend -- checked in every worker."""
    from mptier import FileSystemTier

    made = []

    def factory(buffer, **overrides):
        overrides.setdefault("root_dir", root)
        overrides.setdefault("prefault", False)
        overrides.setdefault("native", backend == "native")
        tier = FileSystemTier(buffer, **overrides)
        made.append(tier)
        want = "native" if overrides["native"] else "python"
        running = {w["backend"] for w in tier.stats()["workers"]}
        assert running == {want}, f"workers run {running}, the test asked for {want}"
        return tier

    yield factory
    for tier in made:
        tier.shutdown()


def fill_random(view: np.ndarray, blocks, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for b in blocks:
        view[b] = rng.integers(0, 256, size=view.shape[1], dtype=np.uint8)


def wait_results(tier, job_ids, timeout: float = 30.0) -> dict:
    """Poll ``get_finished_jobs`` until every job in ``job_ids`` reported; fail on a
    duplicate report or on timeout. Returns ``{job_id: JobResult}``."""
    want = set(job_ids)
    got: dict = {}
    deadline = time.monotonic() + timeout
    while want - set(got):
        for result in tier.get_finished_jobs():
            assert result.job_id not in got, f"job {result.job_id} reported twice"
            got[result.job_id] = result
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs never finished: {sorted(want - set(got))}; "
                                 f"stats: {tier.stats()}")
        time.sleep(0.005)
    return got


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.02)

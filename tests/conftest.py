"""Shared fixtures: a temp root, unique shared buffers, tiers that always shut down, and
a leak check after every test (no new mptier objects in /dev/shm or /dev/mqueue, no
child processes left)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator

import numpy as np
import psutil
import pytest

LEAK_DIRS = ("/dev/shm", "/dev/mqueue")


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
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    before = mptier_objects()
    yield
    owners = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
    deadline = time.monotonic() + 5
    while live_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    children = live_children()
    for child in children:  # do not let one leak cascade into every later test
        child.kill()
    assert not children, f"child processes left behind: {[c.pid for c in children]}"
    leaked = mptier_objects(owners) - before
    assert not leaked, f"IPC objects left behind: {sorted(leaked)}"


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

"""The pool contract (mptier.workers.Pool): every pool kind implements it, and the
manager talks to its pool through it alone."""

from __future__ import annotations

import ast
import inspect
import pathlib

import numpy as np
import pytest
from conftest import fill_random, wait_for, wait_results

from mptier import FileSystemTier, LookupResult, TierConfig, TransferJob, make_key
from mptier.service import ServiceLink
from mptier.workers import Pool, PoolSettings, WorkerPool, open_pool
from mptier.workers.contract import POOL_MEMBERS
from mptier.workers.threads import ThreadWorkers

KB = 1 << 10
MANAGER = pathlib.Path(__file__).parent.parent / "mptier" / "manager.py"


def _pools(tmp_path, make_buffer):
    settings = PoolSettings.from_config(TierConfig(root_dir=str(tmp_path),
                                                   n_load_workers=1, n_store_workers=1))
    buf = make_buffer(4, 4 * KB)
    return [WorkerPool(settings),
            ThreadWorkers(settings, memoryview(buf.view).cast("B")),
            ServiceLink("contract-test", wait_s=0.1)]


def test_every_pool_kind_implements_the_contract_member_by_member(tmp_path, make_buffer):
    pools = _pools(tmp_path, make_buffer)
    try:
        for pool in pools:
            assert isinstance(pool, Pool), type(pool).__name__
            for name in POOL_MEMBERS:
                want = getattr(Pool, name, None)
                if not callable(want):
                    continue  # a data member: present (isinstance checked it)
                got = getattr(pool, name)
                want_params = list(inspect.signature(want).parameters)[1:]  # no self
                assert list(inspect.signature(got).parameters) == want_params, (
                    f"{type(pool).__name__}.{name}{inspect.signature(got)} differs from "
                    f"Pool.{name}{inspect.signature(want)}")
    finally:
        for pool in pools:
            pool.stop()


def test_a_pool_without_a_contract_member_is_not_a_pool():
    class Partial:
        mode = "processes"
        io = None

        def start(self) -> None:
            pass

    assert not isinstance(Partial(), Pool)


def test_the_manager_names_no_pool_member_outside_the_contract():
    tree = ast.parse(MANAGER.read_text())
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "_pool"}
    assert used, "the manager's pool is no longer self._pool: update this test"
    assert used <= POOL_MEMBERS, f"outside the contract: {sorted(used - POOL_MEMBERS)}"


class StrictPool:
    """A pool that offers its inner pool's contract members and nothing else, and
    remembers which the manager used."""

    def __init__(self, inner: Pool) -> None:
        self._inner = inner
        self.used: set[str] = set()

    def __getattr__(self, name: str):
        if name not in POOL_MEMBERS:
            raise AttributeError(f"the manager asked its pool for {name!r}, which is not a "
                                 "member of mptier.workers.Pool")
        self.used.add(name)
        return getattr(self._inner, name)


@pytest.mark.parametrize("kind", ["processes", "threads"])
def test_a_pool_of_contract_members_only_drives_the_manager(kind, backend, root, make_buffer,
                                                             monkeypatch):
    made: list[StrictPool] = []

    def strict_pool(cfg, buffer):
        memory = memoryview(buffer.view).cast("B") if kind == "threads" else None
        made.append(StrictPool(open_pool(PoolSettings.from_config(cfg), memory)))
        return made[-1]

    monkeypatch.setattr(FileSystemTier, "_open_pool", staticmethod(strict_pool))
    buf = make_buffer(8, 16 * KB)
    fill_random(buf.view, range(4), seed=7)
    keys = [make_key(bytes([i]) * 16, 0) for i in range(4)]
    tier = FileSystemTier(buf, root_dir=root, n_load_workers=1, n_store_workers=1,
                          native=backend == "native", status_socket="", prefault=False)
    assert {w["backend"] for w in tier.stats()["workers"]} == {backend}
    try:
        assert tier.mode == kind
        tier.submit_store(TransferJob(1, keys, [0, 1, 2, 3]))
        assert wait_results(tier, [1])[1].success
        assert tier.lookup(keys[0], "r") is LookupResult.RETRY
        tier.on_schedule_end()
        wait_for(lambda: tier.lookup(keys[0], "r") is not LookupResult.RETRY, timeout=30,
                 what="the lookup's answer")
        assert tier.lookup(keys[0], "r") is LookupResult.HIT
        tier.submit_load(TransferJob(2, keys, [4, 5, 6, 7]))
        assert wait_results(tier, [2])[2].success
        assert np.array_equal(buf.view[4:8], buf.view[0:4])
        assert [r["path"] for r in tier.stats()["roots"]] == [root]
    finally:
        tier.shutdown()
    assert tier.stats()["closed"]
    assert {"serving", "news", "attach", "stats", "root_figures", "stop"} <= made[0].used

"""pytest fixtures over the helpers in :mod:`support` (imported by ``tests/conftest.py``).

Every fixture skips with the reason when its machinery is missing here, and tears down
completely: released, unmounted, thawed, killed, removed. The autouse leak check in
``conftest.py`` then fails a test that left a mount, a freezer cgroup or a process anyway.

* ``fuse_fs`` - a started :class:`~support.fusefs.FuseFS` (backing folder under
  ``tmp_path``); ``make_fuse_fs(**options)`` for more or differently configured ones.
* ``juicefs_volume`` (session) - a formatted JuiceFS volume;
  ``juicefs_pair`` (session) - two mounts of it, ``.a`` and ``.b``, as two nodes with
  JuiceFS's default caches (what users run);
  ``dfs_dirs`` - a fresh folder on that volume, as ``.a`` and ``.b`` paths, removed after
  the test; ``make_juicefs_mount(name, **options)`` - more mounts of the session volume
  (e.g. ``**juicefs.COHERENT``), unmounted after the test.
* ``make_frozen_cgroup(version=None)`` - :class:`~support.freezer.FrozenCgroup` objects,
  closed (thawed, removed) after the test.
* ``make_pid_namespace(**options)`` - :class:`~support.pidns.PidNamespace` objects, ended
  after the test.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest

from . import freezer, fusefs, juicefs, mounts, pidns

#: Set (e.g. by CI on a machine with FUSE) to turn these fixtures' skips into failures, so a
#: missing install step cannot hide behind a green run.
REQUIRE_ENV = "MPTIER_REQUIRE_TEST_DEPS"


def skip_unless(reason: str | None) -> None:
    """Skip the test for ``reason`` (None: carry on); fail instead under
    ``$MPTIER_REQUIRE_TEST_DEPS=1``."""
    if reason:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason} (and {REQUIRE_ENV}=1 forbids skipping)")
        pytest.skip(reason)


# -- FUSE ---------------------------------------------------------------------------------
@pytest.fixture
def make_fuse_fs(tmp_path) -> Iterator[Callable[..., fusefs.FuseFS]]:
    skip_unless(fusefs.fuse_unavailable_reason())
    made: list[fusefs.FuseFS] = []

    def factory(**options) -> fusefs.FuseFS:
        backing = tmp_path / f"fuse-backing-{len(made)}"
        fs = fusefs.FuseFS(backing, mounts.new_mount_dir("fuse-"), **options)
        made.append(fs)
        return fs.start()

    yield factory
    errors = []
    for fs in reversed(made):
        try:
            fs.close()
        except RuntimeError as exc:  # keep closing the others; report at the end
            errors.append(exc)
        shutil.rmtree(fs.mountpoint, ignore_errors=True)
    if errors:
        raise errors[0]


@pytest.fixture
def fuse_fs(make_fuse_fs) -> fusefs.FuseFS:
    return make_fuse_fs()


# -- JuiceFS ------------------------------------------------------------------------------
class Pair(NamedTuple):
    a: Any
    b: Any


@pytest.fixture(scope="session")
def juicefs_volume() -> Iterator[juicefs.JuiceFSVolume]:
    skip_unless(juicefs.juicefs_unavailable_reason())
    workdir = tempfile.mkdtemp(prefix="juicefs-", dir=mounts.mount_root())
    volume = juicefs.JuiceFSVolume(workdir).format()
    try:
        yield volume
    finally:
        volume.close()


@pytest.fixture(scope="session")
def juicefs_pair(juicefs_volume) -> Pair:
    """Two mounts of the session volume (``.a``, ``.b``: JuiceFSMount), default caches."""
    a = juicefs_volume.mounts.get("a") or juicefs_volume.mount("a")
    b = juicefs_volume.mounts.get("b") or juicefs_volume.mount("b")
    return Pair(a, b)


@pytest.fixture
def dfs_dirs(juicefs_pair, request) -> Iterator[Pair]:
    """A fresh folder on the shared volume as seen through mount a and mount b."""
    label = re.sub(r"[^\w.-]", "_", request.node.name)[:40]
    folder = tempfile.mkdtemp(prefix=f"{label}-", dir=juicefs_pair.a.path)
    name = folder.rsplit("/", 1)[1]
    yield Pair(juicefs_pair.a.path / name, juicefs_pair.b.path / name)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def make_juicefs_mount(juicefs_volume) -> Iterator[Callable[..., juicefs.JuiceFSMount]]:
    made: list[juicefs.JuiceFSMount] = []

    def factory(name: str, **options) -> juicefs.JuiceFSMount:
        mount = juicefs_volume.mount(name, **options)
        made.append(mount)
        return mount

    yield factory
    for mount in made:
        mount.umount()
        shutil.rmtree(mount.path, ignore_errors=True)


# -- frozen processes and PID namespaces -------------------------------------------------
@pytest.fixture
def make_frozen_cgroup() -> Iterator[Callable[..., freezer.FrozenCgroup]]:
    made: list[freezer.FrozenCgroup] = []

    def factory(version: int | None = None) -> freezer.FrozenCgroup:
        skip_unless(freezer.freezer_unavailable_reason(require_sigkill_proof=version == 1))
        cg = freezer.FrozenCgroup(version)
        made.append(cg)
        return cg

    yield factory
    for cg in made:
        cg.close()


@pytest.fixture
def make_pid_namespace() -> Iterator[Callable[..., pidns.PidNamespace]]:
    skip_unless(pidns.pidns_unavailable_reason())
    made: list[pidns.PidNamespace] = []

    def factory(**options) -> pidns.PidNamespace:
        ns = pidns.PidNamespace(**options)
        made.append(ns)
        return ns

    yield factory
    for ns in made:
        ns.close()

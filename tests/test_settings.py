"""Settings have one home: every default is TierConfig's, every settings class names its
fields as TierConfig does, and what a service takes from its own config is derived."""

from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import MISSING, dataclass, fields

import pytest
from reliability_kit import tiny_tmpfs

from mptier import native
from mptier.config import ENGINE_FIELDS, LAYOUT_FIELDS, SERVICE_FIELDS, TierConfig, default_of
from mptier.fskind import fs_type
from mptier.storage import FOLDERS_AHEAD_MIN_CAPACITY, FOLDERS_AHEAD_MIN_INODES
from mptier.workers.launcher import BootSpec
from mptier.workers.poolbase import PoolSettings
from mptier.workers.probe import folders_ahead, prepare_io
from mptier.workers.session import IoSettings
from mptier.workers.supervised import SupervisionSettings
from mptier.workers.supervisor import SupervisorSettings

SETTINGS_CLASSES = [PoolSettings, SupervisorSettings, BootSpec, IoSettings]
CONFIG_NAMES = {f.name for f in fields(TierConfig)}


def _default(spec: dataclasses.Field):
    if spec.default_factory is not MISSING:
        return spec.default_factory()
    return spec.default


def disagreements(cls: type) -> list[str]:
    """Fields of ``cls`` named as TierConfig's whose default is not TierConfig's."""
    resolved = getattr(cls, "RESOLVED", frozenset())
    out = []
    for spec in fields(cls):
        required = spec.default is MISSING and spec.default_factory is MISSING
        if spec.name in CONFIG_NAMES and spec.name not in resolved and not required:
            ours, theirs = _default(spec), default_of(spec.name)
            if ours != theirs or type(ours) is not type(theirs):
                out.append(f"{cls.__name__}.{spec.name} = {ours!r}, but TierConfig's "
                           f"default is {theirs!r}")
    return out


@pytest.mark.parametrize("cls", SETTINGS_CLASSES, ids=lambda c: c.__name__)
def test_every_settings_default_is_tierconfigs(cls):
    shared = [f.name for f in fields(cls) if f.name in CONFIG_NAMES]
    assert len(shared) >= 2, f"{cls.__name__} shares no fields with TierConfig any more"
    assert disagreements(cls) == []


def test_a_default_written_twice_is_found():
    @dataclass
    class Drifted:
        worker_nice: int = 0  # TierConfig says 10
        heartbeat_s: float = default_of("heartbeat_s")

    assert disagreements(Drifted) == [
        "Drifted.worker_nice = 0, but TierConfig's default is 10"]


def test_settings_classes_have_no_second_name_for_a_tierconfig_field():
    """A field called after a TierConfig field under another name (nice for worker_nice,
    start_timeout_s for worker_start_timeout_s) could not be derived by name. (IoSettings
    holds what the probes found under names of its own: uring, checksum.)"""
    for cls in (PoolSettings, SupervisorSettings, BootSpec):
        for spec in fields(cls):
            for config_name in CONFIG_NAMES:
                assert spec.name == config_name or not config_name.endswith(
                    "_" + spec.name), f"{cls.__name__}.{spec.name}: call it {config_name}"


def test_the_pool_settings_are_derived_from_every_field_of_the_config(tmp_path):
    """Every PoolSettings field comes from the TierConfig field of its name: set each to
    something other than its default and PoolSettings.from_config carries it."""
    changed = {"n_load_workers": 3, "n_store_workers": 1, "use_o_direct": False,
               "checksum_blocks": False, "io_uring": False, "bounce_loads": True,
               "prefault": False, "worker_nice": 3, "worker_cpus": [0],
               "io_timeout_s": 7.0, "max_task_retries": 5, "worker_start_timeout_s": 9.0,
               "max_stuck_workers": 1, "heartbeat_s": 0.0, "max_worker_rss_bytes": 1 << 30,
               "capacity_bytes": 1 << 20, "eviction_policy": "lru",
               "high_watermark": 0.9, "low_watermark": 0.5, "stale_temp_s": 60.0,
               "lease_locks": False, "root_failures_to_fail": 9, "root_retry_s": 4.0,
               "room_wait_s": 1.5, "bounce_waves": False, "ring_lookups": False,
               "folders_ahead": False, "bounce_stores": False}
    names = {f.name for f in fields(PoolSettings)} - {"root_dir", "root_dirs", "backend"}
    assert names == set(changed), "a PoolSettings field this test does not change"
    assert all(changed[k] != default_of(k) for k in changed)
    settings = PoolSettings.from_config(TierConfig(root_dir=str(tmp_path), **changed))
    assert {k: getattr(settings, k) for k in changed} == changed
    # ... and IoSettings takes the storage ones from PoolSettings by the same names.
    io = prepare_io(settings, TierConfig().layout_kwargs(), 4096)
    for name in ("prefault", "capacity_bytes", "eviction_policy", "high_watermark",
                 "low_watermark", "stale_temp_s", "bounce_waves", "ring_lookups"):
        assert getattr(io, name) == changed[name], name
    # the side-by-side switches reach the native core's flags
    assert io.flags() & native.WHOLE_BOUNCE and io.flags() & native.LOOP_LOOKUP
    default_io = prepare_io(PoolSettings.from_config(TierConfig(root_dir=str(tmp_path))),
                            TierConfig().layout_kwargs(), 4096)
    assert not default_io.flags() & (native.WHOLE_BOUNCE | native.LOOP_LOOKUP)
    # ... and the folders made ahead reach each root's settings (tmp_path: a local disk)
    assert not io.roots[0].folders_ahead and default_io.roots[0].folders_ahead
    # ... and so do bounced stores (O_DIRECT on a local disk: "auto" says yes)
    if fs_type(str(tmp_path)) in ("ext4", "xfs", "btrfs") and default_io.use_o_direct:
        assert default_io.roots[0].bounce_stores
    assert not io.roots[0].bounce_stores
    assert io.room_wait_s == changed["room_wait_s"]
    short = dataclasses.replace(settings, io_timeout_s=4.0)  # at most a quarter of it
    assert prepare_io(short, TierConfig().layout_kwargs(), 4096).room_wait_s == 1.0
    assert io.lease_locks is False and io.use_o_direct is False


@pytest.mark.parametrize("cls", [SupervisorSettings, BootSpec], ids=lambda c: c.__name__)
def test_what_the_pool_hands_on_it_has_by_name(cls):
    """The pool builds these from PoolSettings by field name: each of their fields that
    is a TierConfig field must be a PoolSettings field, or it would silently keep its
    default."""
    pool_names = {f.name for f in fields(PoolSettings)}
    missing = [f.name for f in fields(cls) if f.name in CONFIG_NAMES
               and f.name not in pool_names]
    assert missing == []


def test_the_supervisors_settings_are_declared_once():
    """The TierConfig fields the supervisor runs by are SupervisionSettings' alone: the
    pool's settings and the supervisor's inherit them, and neither declares one again."""
    shared = {f.name for f in fields(SupervisionSettings)}
    assert shared <= CONFIG_NAMES
    for cls in (PoolSettings, SupervisorSettings):
        assert issubclass(cls, SupervisionSettings)
        own = set(inspect.get_annotations(cls))
        assert own & shared == set(), f"{cls.__name__} declares {sorted(own & shared)} again"
    supervisor_config = {f.name for f in fields(SupervisorSettings)} & CONFIG_NAMES
    assert supervisor_config == shared


def test_a_service_takes_every_field_but_the_engines_own():
    assert set(SERVICE_FIELDS) | set(ENGINE_FIELDS) == CONFIG_NAMES
    assert not set(SERVICE_FIELDS) & set(ENGINE_FIELDS)
    assert set(LAYOUT_FIELDS) <= set(ENGINE_FIELDS)
    pool_fields = {f.name for f in fields(PoolSettings)} - {"backend"}
    assert pool_fields | {"native"} <= set(SERVICE_FIELDS), \
        "a pool setting the service would not take from its own config"
    assert {"io_uring", "bounce_loads"} <= set(SERVICE_FIELDS)


def test_folders_ahead_auto_means_a_local_root_without_a_small_budget(tmp_path, make_fuse_fs):
    """``folders_ahead = "auto"`` makes the top folders ahead on a local file system
    (where it was measured) unless the budget is under FOLDERS_AHEAD_MIN_CAPACITY, and
    not on a FUSE mount; true and false are taken as said."""
    local = str(tmp_path)
    assert folders_ahead("auto", local, 0) is True
    assert folders_ahead("auto", local, FOLDERS_AHEAD_MIN_CAPACITY) is True
    assert folders_ahead("auto", local, FOLDERS_AHEAD_MIN_CAPACITY - 1) is False
    assert folders_ahead(True, local, 1 << 20) is True
    assert folders_ahead(False, local, 0) is False
    fuse = make_fuse_fs()
    assert folders_ahead("auto", str(fuse.mountpoint), 0) is False
    assert folders_ahead(True, str(fuse.mountpoint), 0) is True
    # a local file system short of inodes: the folders would take more than a 64th
    with tiny_tmpfs(16 << 20, f"nr_inodes={FOLDERS_AHEAD_MIN_INODES // 2}") as short:
        assert os.statvfs(short).f_favail < FOLDERS_AHEAD_MIN_INODES
        assert folders_ahead("auto", short, 0) is False
        assert folders_ahead(True, short, 0) is True
    with tiny_tmpfs(16 << 20, f"nr_inodes={FOLDERS_AHEAD_MIN_INODES + 16}") as enough:
        assert folders_ahead("auto", enough, 0) is True

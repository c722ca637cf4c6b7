"""TierConfig: defaults, validation that names the key, TOML loading."""

from __future__ import annotations

import pathlib

import pytest

from mptier import ConfigError, FileSystemTier, TierConfig

DEFAULT_TOML = pathlib.Path(__file__).parent.parent / "configs" / "default.toml"


def test_default_toml_documents_every_field_with_its_default():
    loaded = TierConfig.from_toml(DEFAULT_TOML)
    assert loaded == TierConfig(root_dir=loaded.root_dir)
    text = DEFAULT_TOML.read_text()
    for name in TierConfig.field_names():
        assert f"{name} =" in text or f"# {name} =" in text, f"{name} undocumented"


def test_from_toml_with_table_and_overrides(tmp_path):
    path = tmp_path / "tier.toml"
    path.write_text('[tier]\nroot_dir = "/x"\ntask_bytes = "4M"\nuse_o_direct = false\n')
    cfg = TierConfig.from_toml(path, n_load_workers=3)
    assert (cfg.root_dir, cfg.task_bytes, cfg.use_o_direct, cfg.n_load_workers) == \
        ("/x", 4 << 20, False, 3)


@pytest.mark.parametrize("values, named", [
    ({"n_load_workrs": 2}, "n_load_workrs"),
    ({"n_load_workers": -1}, "n_load_workers"),
    ({"n_load_workers": 0, "n_store_workers": 0}, "n_load_workers"),
    ({"task_bytes": "lots"}, "task_bytes"),
    ({"task_bytes": 0}, "task_bytes"),
    ({"io_timeout_s": 0}, "io_timeout_s"),
    ({"room_wait_s": 0}, "room_wait_s"),
    ({"room_wait_s": "2s"}, "room_wait_s"),
    ({"use_o_direct": "maybe"}, "use_o_direct"),
    ({"native": "yes"}, "native"),
    ({"worker_nice": 20}, "worker_nice"),
    ({"worker_cpus": [-1]}, "worker_cpus"),
    ({"model_name": ""}, "model_name"),
    ({"tp_size": 0}, "tp_size"),
])
def test_bad_values_name_the_key(values, named):
    with pytest.raises(ConfigError, match=named) as info:
        TierConfig.from_dict(values)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("roots, expected", [
    (["/dev/shm/kv"], "memory"),
    (["/dev/shm/a", "/dev/shm/b"], "memory"),
    (["{disk}"], "device"),
    (["/dev/shm/kv", "{disk}"], "device"),  # one root on a disk: the disk's size
], ids=["tmpfs", "two-tmpfs", "disk", "mixed"])
def test_task_bytes_auto_follows_the_roots_file_systems(tmp_path, roots, expected):
    """task_bytes = "auto" (the default): 8 MiB tasks where every root is in memory,
    32 MiB where one is on a disk or a server; a number given is kept whatever the
    roots. Read from the mount table: the roots need not exist."""
    from mptier.config import DEVICE_TASK_BYTES, MEMORY_TASK_BYTES
    from mptier.fskind import MEMORY_FS_TYPES, fs_type

    if fs_type("/dev/shm") not in MEMORY_FS_TYPES:
        pytest.skip("/dev/shm is not a memory file system here")
    disk = str(tmp_path / "kv")
    if fs_type(disk) in MEMORY_FS_TYPES:
        disk = "/var/tmp/mptier-no-such-root"  # tmp_path in memory: a path on the disk
        if fs_type(disk) in MEMORY_FS_TYPES:
            pytest.skip("no disk-backed folder to name here")
    dirs = [r.format(disk=disk) for r in roots]
    cfg = TierConfig(root_dirs=dirs) if len(dirs) > 1 else TierConfig(root_dir=dirs[0])
    assert cfg.task_bytes == "auto"
    want = MEMORY_TASK_BYTES if expected == "memory" else DEVICE_TASK_BYTES
    assert cfg.task_bytes_for() == want
    assert (MEMORY_TASK_BYTES, DEVICE_TASK_BYTES) == (8 << 20, 32 << 20)
    given = TierConfig(root_dir=dirs[0], task_bytes="4M")
    assert given.task_bytes_for() == 4 << 20
    assert not pathlib.Path(disk).exists()  # asked of the mount table, never made


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("root_dir = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        TierConfig.from_toml(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        TierConfig.from_toml(tmp_path / "nope.toml")


def test_tier_requires_root_dir_and_rejects_unknown_overrides(make_buffer):
    buf = make_buffer(2, 4096)
    with pytest.raises(ConfigError, match="root_dir is required"):
        FileSystemTier(buf)
    with pytest.raises(ConfigError, match="bogus"):
        FileSystemTier(buf, root_dir="/tmp/x", bogus=1)


def test_unusable_root_raises_oserror_naming_it(make_buffer, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(OSError, match="not-a-dir"):
        FileSystemTier(make_buffer(2, 4096), root_dir=str(blocker))

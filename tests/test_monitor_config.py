"""Shipped configs and `mptier config check`: every file valid, every field documented,
bad keys and values named."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
from dataclasses import asdict

import pytest

from mptier import TierConfig

CONFIGS = sorted((pathlib.Path(__file__).parent.parent / "configs").glob("*.toml"))
DEFAULT = CONFIGS[0].parent / "default.toml"


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mptier", "config", "check", *args],
                          capture_output=True, text=True, timeout=60)


def test_the_three_profiles_ship():
    assert {p.name for p in CONFIGS} >= {"default.toml", "shared-fs.toml", "tmpfs.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_passes_check_and_prints_every_field(path, tmp_path):
    done = _check(str(path))
    assert done.returncode == 0, done.stderr
    printed = done.stdout
    for name in TierConfig.field_names():
        assert re.search(rf"^(# )?{name} = ", printed, re.M), f"{name} not printed"
    # What it prints is the effective config, in a form that loads back to the same.
    echo = tmp_path / "effective.toml"
    echo.write_text(printed)
    assert TierConfig.from_toml(echo) == TierConfig.from_toml(path)
    as_json = _check(str(path), "--json")
    assert json.loads(as_json.stdout) == asdict(TierConfig.from_toml(path))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_field_is_in_every_shipped_config(path):
    text = path.read_text()
    for name in TierConfig.field_names():
        assert re.search(rf"^(# )?{name} = ", text, re.M), f"{path.name}: {name} missing"


def test_every_field_of_default_toml_says_its_default():
    """Each field's comment block (the comment lines above its group of keys) states the
    default, so a new field cannot slip in undocumented."""
    lines = DEFAULT.read_text().splitlines()
    for name in TierConfig.field_names():
        row = next(i for i, line in enumerate(lines)
                   if re.match(rf"^(# )?{name} = ", line))
        block = []
        i = row - 1
        while i >= 0 and lines[i].strip():
            block.append(lines[i])
            i -= 1
        comment = " ".join(block).lower()
        assert "default" in comment, f"default.toml: no default stated above {name}"


def test_a_misspelled_key_is_rejected_naming_it(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(DEFAULT.read_text().replace("n_store_workers =", "n_store_wrokers ="))
    done = _check(str(bad))
    assert done.returncode == 1 and not done.stdout
    assert "'n_store_wrokers'" in done.stderr
    assert "did you mean 'n_store_workers'" in done.stderr


@pytest.mark.parametrize("setting, named, allowed", [
    ("metrics_port=70000", "metrics_port", "0 to 65535"),
    ("status_socket=a/b", "status_socket", '"auto"'),
    ("use_o_direct=sometimes", "use_o_direct", '"auto", true or false'),
    ("task_bytes=lots", "task_bytes", "byte count"),
])
def test_a_bad_value_names_the_key_and_what_is_allowed(setting, named, allowed):
    done = _check(str(DEFAULT), "--set", setting)
    assert done.returncode == 1
    assert named in done.stderr and allowed in done.stderr


def test_a_missing_or_broken_file_is_named(tmp_path):
    done = _check(str(tmp_path / "nope.toml"))
    assert done.returncode == 1 and "nope.toml" in done.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("n_load_workers = \n")
    done = _check(str(broken))
    assert done.returncode == 1 and "not valid TOML" in done.stderr

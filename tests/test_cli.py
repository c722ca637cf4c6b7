"""The ``mptier`` command: the main job end to end, and errors that name the problem."""

from __future__ import annotations

import json

from mptier.cli import main


def test_run_round_trip_verifies_and_reports(tmp_path, capsys):
    code = main(["run", "--total-bytes", "8M", "--block-bytes", "256K", "--workers", "1+1",
                 "--root", str(tmp_path / "kv"), "--set", "prefault=false"])
    out = capsys.readouterr().out
    assert code == 0
    assert "round trip of 32 blocks x 256 KiB" in out
    assert "verified: every byte" in out and "GB/s" in out


def test_bad_settings_are_reported_not_raised(tmp_path, capsys):
    assert main(["run", "--root", str(tmp_path), "--set", "bogus=1"]) == 1
    assert "bogus" in capsys.readouterr().err
    assert main(["run", "--root", str(tmp_path), "--workers", "two"]) == 1
    assert "LOAD+STORE" in capsys.readouterr().err


def test_info_reports_the_native_core(tmp_path, capsys):
    assert main(["info", "--root", str(tmp_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"native_core", "backend", "o_direct", "defaults"} <= set(info)

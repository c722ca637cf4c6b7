"""The ``mptier`` command: the main job end to end, and errors that name the problem."""

from __future__ import annotations

import json

from mptier import native
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
    assert info["crc32c"] == native.crc32c_impl()
    assert info["crc32c"] in info["crc32c_paths"]  # what MPTIER_CRC32C_PATH may name
    assert info["crc32c_paths"] == list(native.get_backend().crc32c_impls)
    assert info["user_xattrs"] == native.probe_xattr(str(tmp_path))
    assert isinstance(info["io_uring"], bool) and isinstance(info["in_memory"], bool)


def test_the_systemd_unit_starts_a_command_the_cli_accepts():
    """configs/mptier@.service stays in step with `mptier serve`'s options."""
    import pathlib
    import shlex

    from mptier.cli import build_parser

    unit = pathlib.Path(__file__).parent.parent / "configs" / "mptier@.service"
    lines = [line for line in unit.read_text().splitlines() if line.startswith("ExecStart=")]
    assert len(lines) == 1
    argv = shlex.split(lines[0].removeprefix("ExecStart=").replace("%i", "kv"))
    assert argv[0].endswith("/mptier")
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.name, args.config) == ("serve", "kv", "/etc/mptier/kv.toml")
    assert args.metrics_port == 9464


def test_the_bench_options_reach_the_benchs_own_parser(capsys):
    """`mptier bench` hands what follows it to mptier.bench.cli: its help lists the
    bench's options, and an option it does not know is named by it."""
    import pytest

    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    assert "--block-bytes" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["bench", "--no-such-option"])
    assert done.value.code == 2
    assert "mptier bench: error: unrecognized arguments: --no-such-option" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["status", "--no-such-option"])  # other commands still refuse extras
    assert done.value.code == 2


def test_commands_other_than_the_bench_start_without_numpy():
    """`mptier serve`, `status` and `gc` run at every service start and monitoring poll:
    building the command line loads neither the bench nor numpy."""
    import subprocess
    import sys

    probe = ("import sys; from mptier.cli import build_parser; build_parser(); "
             "print(sorted(m for m in ('numpy', 'mptier.bench') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "[]"

"""The operator commands: ``mptier status``, ``mptier monitor``, ``mptier config check``.

``mptier/cli.py`` registers their arguments and calls these with the parsed namespace;
each returns the exit code (0 fine, 1 a named error). Errors are raised as
``MptierError``/``ValueError``, which the CLI prints as ``mptier <command>: error: ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, fields
from typing import Any

from mptier.config import TierConfig
from mptier.errors import MptierError


def cmd_status(args: argparse.Namespace) -> int:
    """Print the figures of one endpoint (``--name``) or of every live one.

    With ``--interval S`` (default 1) every endpoint is asked twice, S seconds apart, so
    rates and CPU % cover those S seconds rather than the time since whoever asked last.
    ``--json``: the figures object (one name) or a list of them, as documented in
    docs/monitoring.md.
    """
    from mptier.monitor.endpoint import client_dirs, discover, query

    directory = args.run_dir
    trust = _trust(args)
    if args.name:
        targets = [args.name]
    else:
        targets = [e.path for e in discover(directory, trust=trust)]
        if not targets:
            where = directory or ", ".join(client_dirs(trust)) or \
                "no run directory exists yet"
            if args.json:
                print("[]")
            else:
                print(f"no live mptier status endpoints ({where})")
            return 0
    if args.interval > 0:
        for target in targets:  # prime: the next reply's rates start here
            try:
                query(target, directory=directory, trust=trust)
            except MptierError:
                if args.name:
                    raise
        time.sleep(args.interval)
    replies, errors = [], []
    for target in targets:
        try:
            replies.append(query(target, directory=directory, trust=trust))
        except MptierError as exc:
            if args.name:
                raise
            errors.append(str(exc))  # went away between discovery and now
    for error in errors:
        print(f"mptier status: {error}", file=sys.stderr)
    if args.json:
        figures = [r["figures"] for r in replies]
        out: Any = figures[0] if args.name else figures
        print(json.dumps(out, indent=2, default=str))
        return 0
    from rich.console import Console

    from mptier.monitor.view import render

    console = Console()
    for reply in replies:
        console.print(render(reply["figures"]))
    return 0


def cmd_monitor(args: argparse.Namespace) -> int:
    from mptier.monitor.view import run_monitor

    return run_monitor(args.name, directory=args.run_dir, refresh_s=args.refresh,
                       trust=_trust(args))


def _trust(args: argparse.Namespace) -> Any:
    """Whose endpoints and run folders to believe: ours, root's, and ``--user``'s."""
    from mptier.rundir import Trust

    return Trust.of(user=getattr(args, "user", None) or "")


def cmd_config_check(args: argparse.Namespace) -> int:
    """Validate a config file (plus ``--set`` overrides) and print the effective config,
    every field, as TOML (``--json``: as JSON). A bad key or value raises ``ConfigError``
    naming it and what is allowed."""
    from mptier.config import TierConfig

    config = TierConfig.from_command_line(args.file, args.workers, args.set)
    if args.json:
        print(json.dumps(asdict(config), indent=2))
    else:
        print(f"# {args.file}: valid. Effective configuration (defaults filled in):")
        print(format_toml(config))
    return 0


def format_toml(config: TierConfig) -> str:
    """Every field of ``config`` as flat TOML that :meth:`TierConfig.from_toml` reads back
    to an equal config (a field whose value is ``None`` is shown commented out)."""
    lines = []
    for f in fields(config):
        value = getattr(config, f.name)
        if value is None:
            lines.append(f"# {f.name} = (not set)")
        else:
            lines.append(f"{f.name} = {toml_value(value)}")
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    """A TOML literal of a config value (str, bool, int, float, list, dict)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}"
                                for k, v in value.items()) + " }"
    raise MptierError(f"cannot write {value!r} ({type(value).__name__}) as TOML")

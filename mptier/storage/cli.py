"""``mptier du``, ``mptier scrub`` and ``mptier gc``: parsers, progress and output.

Exit codes: 0 done (scrub: no problem found), 1 scrub found problems (listed; removed
with ``--repair``) or an operation failed, 2 bad usage (the message names the value and
the fix). ``--json`` prints the tool's report dict (see :mod:`mptier.storage.tools`);
a progress line goes to stderr while stderr is a terminal.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from mptier.storage import tools

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


def _duration(text: str) -> float:
    try:
        return tools.parse_duration(text)
    except tools.UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    from mptier.units import parse_byte_count

    value = parse_byte_count(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a byte count such "
                                         "as 8388608, \"8M\" or \"512KiB\"")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a block size must be positive, e.g. 2M")
    return value


def add_commands(sub: Any) -> None:
    """Register ``du``, ``scrub`` and ``gc`` on the ``mptier`` sub-parsers."""
    du = sub.add_parser("du", help="blocks and bytes of a cache root, per folder and rank")
    scrub = sub.add_parser("scrub", help="check every block's size and recorded CRC32C; "
                                         "--repair removes bad ones")
    scrub.add_argument("--repair", action="store_true",
                       help="remove bad blocks, symlinks and FIFOs (each re-checked first)")
    scrub.add_argument("--block-bytes", type=_positive_int,
                       help="block size for folders without mptier.json (default: the "
                            "most common file size in each)")
    gc = sub.add_parser("gc", help="remove blocks unused for longer than --older-than, "
                                   "and stale temporary files")
    gc.add_argument("--older-than", type=_duration, required=True, metavar="AGE",
                    help="remove blocks whose last use is older than AGE: 90s, 15m, 12h, 7d")
    gc.add_argument("--dry-run", action="store_true", help="only count what would go")
    gc.add_argument("--stale-temp-age", type=_duration, metavar="AGE",
                    default=tools.DEFAULT_STALE_TEMP_S,
                    help="where file locks do not work, temporary files older than AGE "
                         "are stale (default 1h)")
    gc.add_argument("--locks", choices=("auto", "on", "off"), default="auto",
                    help="whether flock proves writers alive on this root (auto: probe)")
    for parser, func in ((du, _cmd_du), (scrub, _cmd_scrub), (gc, _cmd_gc)):
        parser.add_argument("root", metavar="ROOT", help="the tier's root_dir")
        parser.add_argument("--json", action="store_true", help="print the report as JSON")
        parser.add_argument("--no-progress", action="store_true", help="no progress line")
        parser.set_defaults(func=func)


@contextmanager
def _progress(args: argparse.Namespace, title: str):
    """A rich progress line on stderr (only on a terminal); yields the callback."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if args.no_progress or not console.is_terminal:
        yield None
        return
    with Progress(SpinnerColumn(), TextColumn(f"{title} [bold]{{task.completed:,}}[/] "
                                              "entries"),
                  TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(title, total=None, detail="")

        def update(entries: int, detail: str) -> None:
            bar.update(task, completed=entries, detail=detail)

        yield update


def _run(args: argparse.Namespace, title: str, work: Callable[[Any], dict],
         show: Callable[[dict], None]) -> tuple[int, dict | None]:
    try:
        with _progress(args, title) as progress:
            report = work(progress)
    except tools.UsageError as exc:
        print(f"mptier {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE, None
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        show(report)
    return EXIT_OK, report


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _walk_line(report: dict) -> str:
    extra = ""
    if report["vanished"]:
        extra += f", {report['vanished']} vanished while walking (others at work)"
    if report["errors"]:
        extra += f", {report['errors']} unreadable folders: {report['error_samples'][:3]}"
    return f"walked {report['entries']:,} entries in {report['seconds']:.1f} s{extra}"


def _show_du(r: dict) -> None:
    print(f"{r['root']}: {r['blocks']:,} blocks, {_size(r['bytes'])}")
    if r["folders"]:
        print(f"  {'FOLDER':<40} {'MODEL':<24} {'BLOCK':>9} {'BLOCKS':>10} {'BYTES':>10}")
    for f in r["folders"]:
        print(f"  {f['folder']:<40} {f['model'] or '?':<24} {_size(f['block_bytes']):>9} "
              f"{f['blocks']:>10,} {_size(f['bytes']):>10}")
        for rank in f["ranks"]:
            print(f"    rank {rank['rank']:<68} {rank['blocks']:>10,} "
                  f"{_size(rank['bytes']):>10}")
    print(f"temporary files: {r['temps']['files']:,} ({_size(r['temps']['bytes'])}), "
          f"leases: {r['leases']}")
    bad = r["bad_entries"]
    if bad["total"]:
        kinds = ", ".join(f"{k} {n}" for k, n in bad["by_kind"].items())
        print(f"bad entries: {bad['total']:,} ({kinds}); `mptier scrub {r['root']}` lists "
              f"them")
    if r["foreign"]["entries"]:
        print(f"foreign entries (not mptier's): {r['foreign']['entries']:,} "
              f"({_size(r['foreign']['bytes'])})")
    print(_walk_line(r))


def _cmd_du(args: argparse.Namespace) -> int:
    return _run(args, "du", lambda p: tools.du(args.root, progress=p), _show_du)[0]


def _show_scrub(r: dict) -> None:
    checks = (f"{r['checksums_checked']:,} checksums verified" if r["crc32c_available"]
              else f"checksums NOT verified ({r['checksums_unverified']:,} recorded): "
                   f"this mptier has no mptier.native.crc32c")
    print(f"{r['root']}: {r['blocks_checked']:,} blocks checked, {checks}, "
          f"{r['checksums_missing']:,} without a checksum record")
    for base, size in r["block_sizes"].items():
        if size["source"] != "mptier.json":
            print(f"  {base}: block size {_size(size['block_bytes'])} ({size['source']})")
    for p in r["problems"]:
        state = "removed" if p["removed"] else (f"left: {p['left_because']}"
                                                if p["left_because"] else "")
        print(f"  {p['kind']:<20} {p['path']}  {p['detail']}{'  ' + state if state else ''}")
    n = len(r["problems"])
    if not n:
        print("no problems found")
    elif r["repair"]:
        print(f"{n} problem(s), {r['removed']} removed")
    else:
        print(f"{n} problem(s); `mptier scrub --repair {r['root']}` removes them")
    print(_walk_line(r))


def _cmd_scrub(args: argparse.Namespace) -> int:
    code, report = _run(args, "scrub", lambda p: tools.scrub(
        args.root, repair=args.repair, block_bytes=args.block_bytes, progress=p), _show_scrub)
    if report is not None and report["problems"]:
        return EXIT_PROBLEMS
    return code


def _show_gc(r: dict) -> None:
    verb = "would remove" if r["dry_run"] else "removed"
    print(f"{r['root']}: {verb} {r['blocks_removed']:,} blocks ({_size(r['bytes_removed'])}) "
          f"unused for more than {r['older_than_s']:g} s; kept {r['blocks_kept']:,}"
          + (f"; {r['refused']} used again meanwhile, kept" if r["refused"] else ""))
    how = "leases (file locks work)" if r["locks_work"] else \
        f"age > {r['stale_temp_s']:g} s (no working file locks)"
    print(f"temporary files: {verb} {r['temps_removed']:,} "
          f"({_size(r['temp_bytes_removed'])}) by {how}, kept {r['temps_kept']:,} of live "
          f"writers; dead leases {verb}: {r['leases_removed']}")
    print(_walk_line(r))


def _cmd_gc(args: argparse.Namespace) -> int:
    locks = {"auto": None, "on": True, "off": False}[args.locks]
    return _run(args, "gc", lambda p: tools.gc(
        args.root, older_than_s=args.older_than, dry_run=args.dry_run,
        stale_temp_s=args.stale_temp_age, locks_work=locks, progress=p), _show_gc)[0]

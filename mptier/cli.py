"""The ``mptier`` command.

    mptier run      a verified store/load round trip through the tier (the default job)
    mptier serve    the worker pool as a service engines attach to (service="NAME")
    mptier bench    mptier vs the in-process thread-pool design vs the raw disk limit
    mptier info     what this installation has: native core, O_DIRECT at a root, defaults
    mptier status   figures of running tiers and services (their status sockets)
    mptier monitor  a live view of the same, refreshed every second (q quits)
    mptier config check FILE   validate a config file and print the effective config
    mptier du       blocks and bytes of a cache root, per folder and rank
    mptier scrub    check every block's size and recorded checksum (--repair removes)
    mptier gc       remove blocks unused for longer than --older-than, stale temp files
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from mptier.config import TierConfig, parse_bytes
from mptier.errors import MptierError


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _config(args: argparse.Namespace) -> TierConfig:
    return TierConfig.from_command_line(args.config, args.workers, args.set)


def _cmd_run(args: argparse.Namespace) -> int:
    from mptier.roundtrip import round_trip

    report = round_trip(total_bytes=args.total_bytes, block_bytes=args.block_bytes,
                        job_blocks=args.job_blocks, inflight=args.inflight, root=args.root,
                        config=_config(args))
    print("\n".join(report.lines()))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import os

    from mptier.service import serve

    if args.run_dir:
        os.environ["MPTIER_RUN_DIR"] = args.run_dir
    if args.root:
        args.set = [*(args.set or []), f"root_dir={json.dumps(args.root)}"]
    if args.metrics_port is not None:
        args.set = [*(args.set or []), f"metrics_port={args.metrics_port}"]
    if args.group:
        args.set = [*(args.set or []), f"service_group={json.dumps(args.group)}"]
    return serve(args.name, _config(args))


def _cmd_info(args: argparse.Namespace) -> int:
    from mptier import native

    backend = native.get_backend()
    info = {"native_core": native.HAS_NATIVE, "backend": native.BACKEND,
            "native_import_error": native.NATIVE_IMPORT_ERROR,
            "crc32c": native.crc32c_impl(), "crc32c_paths": list(backend.crc32c_impls),
            "io_uring": backend.uring_available(),
            "defaults": TierConfig().__dict__}
    if args.root:
        info["root"] = args.root
        info["o_direct"] = native.probe_o_direct(args.root)
        info["user_xattrs"] = native.probe_xattr(args.root)
        info["o_tmpfile"] = native.probe_o_tmpfile(args.root)
        info["in_memory"] = backend.probe_in_memory(args.root)
    print(json.dumps(info, indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mptier", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="verified store/load round trip through the tier")
    run.add_argument("--total-bytes", type=_size, default="2G",
                     help="bytes to store and load back (default 2G)")
    run.add_argument("--block-bytes", type=_size, default="2M", help="block size (2M)")
    run.add_argument("--job-blocks", type=int, default=16, help="blocks per job (16)")
    run.add_argument("--inflight", type=int, default=8, help="jobs in flight (8)")
    run.add_argument("--root", help="folder to use (default: a new temporary folder, "
                                    "removed afterwards)")
    serve = sub.add_parser(
        "serve", help="run the worker pool as a service that engines attach to",
        description="Run the worker pool and its supervisor in the foreground until "
                    "SIGTERM or Ctrl-C. Engines attach with FileSystemTier(buf, "
                    "service=NAME) (vLLM: the tier option \"service\"). Root, worker "
                    "counts and I/O settings come from here; the file layout comes from "
                    "each engine. Listens on <run dir>/NAME.sock (run dir: "
                    "$MPTIER_RUN_DIR, else /run/mptier, else /tmp/mptier-<uid>).")
    serve.add_argument("--name", required=True, help="the service's name (engines use it)")
    serve.add_argument("--root", help="folder the block files go into (root_dir)")
    serve.add_argument("--run-dir", metavar="DIR",
                       help="where the service's sockets go (default: $MPTIER_RUN_DIR, "
                            "else /run/mptier, else /tmp/mptier-<uid>); engines and "
                            "`mptier status` must look there too (MPTIER_RUN_DIR)")
    serve.add_argument("--metrics-port", type=int, metavar="PORT",
                       help="serve Prometheus metrics on this port (metrics_addr, "
                            "default 127.0.0.1)")
    serve.add_argument("--group", metavar="GROUP",
                       help="members of this group may attach and read status, besides "
                            "this user and root (service_group; docs/security.md)")
    serve.set_defaults(func=_cmd_serve)
    for p in (run, serve):
        p.add_argument("--config", help="TOML file with TierConfig fields")
        p.add_argument("--workers", help="LOAD+STORE worker counts, e.g. 4+4")
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a TierConfig field (repeatable)")
    run.set_defaults(func=_cmd_run)

    info = sub.add_parser("info", help="native core, CRC32C path in use (crc32c) and the "
                                        "ones this CPU runs, io_uring, O_DIRECT support, "
                                        "defaults")
    info.add_argument("--root", help="probe O_DIRECT, user xattrs and O_TMPFILE in this "
                                     "folder")
    info.set_defaults(func=_cmd_info)

    _add_monitoring(sub)
    from mptier.storage.cli import add_commands as add_storage_commands
    add_storage_commands(sub)

    # The bench's own parser (mptier.bench.cli) reads its options: importing the bench
    # loads numpy and every design, ~0.25 s of CPU that `mptier serve`, `status` or
    # `gc` would otherwise pay at every start. main() hands it what follows "bench".
    bench = sub.add_parser("bench", add_help=False,
                           help="compare mptier, the thread-pool design and the raw limit "
                                "on this machine (`mptier bench --help`: its options)")
    bench.set_defaults(func=_cmd_bench, bench_args=[])
    return parser


def _add_monitoring(sub: argparse._SubParsersAction) -> None:
    """status, monitor and config check (their code: mptier.monitor.commands)."""
    def lazy(name: str):  # rich and psutil load only for these commands
        def run(args: argparse.Namespace) -> int:
            from mptier.monitor import commands
            return getattr(commands, name)(args)
        return run

    run_dir_help = "folder of the status sockets (default: $MPTIER_RUN_DIR, else " \
                   "/run/mptier and /tmp/mptier-<uid>)"
    user_help = "also believe endpoints served by this user (name or uid) and run " \
                "folders it owns; default: only yours and root's (docs/security.md)"
    status = sub.add_parser("status", help="figures of running tiers and services")
    status.add_argument("--name", help="one endpoint (e.g. engine-1234, a service name, "
                                       "or a socket path); default: every live one")
    status.add_argument("--json", action="store_true", help="print JSON (fields: "
                                                            "docs/monitoring.md)")
    status.add_argument("--interval", type=float, default=1.0,
                        help="seconds the rates and CPU %% cover (asks twice; 0: once, "
                             "rates since the previous asker; default 1)")
    status.add_argument("--run-dir", help=run_dir_help)
    status.add_argument("--user", help=user_help)
    status.set_defaults(func=lazy("cmd_status"))

    monitor = sub.add_parser("monitor", help="live view of tiers and services (q quits)")
    monitor.add_argument("--name", help="one endpoint; default: every live one")
    monitor.add_argument("--refresh", type=float, default=1.0,
                         help="seconds between redraws (default 1)")
    monitor.add_argument("--run-dir", help=run_dir_help)
    monitor.add_argument("--user", help=user_help)
    monitor.set_defaults(func=lazy("cmd_monitor"))

    config = sub.add_parser("config", help="configuration files")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate FILE and print the effective "
                                                "config (every field)")
    check.add_argument("file", help="TOML file with TierConfig fields (see configs/)")
    check.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a field, as `mptier run --set` (repeatable)")
    check.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    check.set_defaults(func=lazy("cmd_config_check"), workers=None)


def _cmd_bench(args: argparse.Namespace) -> int:
    try:
        from mptier.bench.cli import main as bench_main
    except ImportError as exc:  # pragma: no cover - the bench ships with the package
        print(f"mptier bench is unavailable: {exc}", file=sys.stderr)
        return 2
    return bench_main(args.bench_args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = rest  # the bench's parser says what it does not know
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (MptierError, ValueError, OSError) as exc:
        print(f"mptier {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

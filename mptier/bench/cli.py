"""``mptier bench``: mptier vs the in-process thread-pool design vs the raw disk limit.

Entry points: :func:`main` (``python -m mptier.bench``) and :func:`add_arguments` +
:func:`run` for the ``mptier`` command's ``bench`` subcommand.

Long because every bench option, workload and sweep is declared here for both entry
points (mptier bench and python -m mptier.bench); the measuring and the tables live in
measure, harness and report.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import itertools
import json
import os
import platform
import shlex
import sys
import tempfile
import time
import traceback
from typing import Any

from mptier.bench import report as rep
from mptier.bench import twins
from mptier.bench.cleanup import KeptFiles
from mptier.bench.designs import DEFAULT_DESIGNS, DesignSpec, parse_designs
from mptier.bench.harness import Case, Workload
from mptier.bench.measure import (
    crc32c_speed,
    filesystem_of,
    format_size,
    parse_size,
    probe_o_direct,
)
from mptier.bench.raw import RawLimit, fio_path

SCHEMA_VERSION = 2
DEFAULT_SAVE_DIR = os.path.join("bench", "results")
# --sweep NAME: (option it fills, values)
SWEEPS = {"concurrency": ("inflight_jobs", "1,4,16,64"),
          "block-size": ("block_bytes", "64K,128K,256K,512K,1M,2M")}
QUICK_TOTAL = "384M"  # per phase; with --quick the whole default run stays under a minute
# While the kept design folders go at the end of a run (a minute or two for ~25 GB of
# small files on ext4), a line this often says how far it is.
REMOVAL_REPORT_S = 10.0


def _sizes(text: str) -> list[int]:
    try:
        return [parse_size(x) for x in text.replace(",", " ").split()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of whole numbers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive whole numbers: {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the benchmark's options to ``parser`` (a subcommand parser or a fresh one)."""
    add = parser.add_argument
    add("--root", action="append", metavar="DIR",
        help="folder to benchmark (repeatable; each design gets a fresh sub-folder, "
             f"removed afterwards). Default: {tempfile.gettempdir()}")
    add("--block-bytes", type=_sizes, action="append", metavar="SIZE[,SIZE]",
        help="block size(s), e.g. 256K, 2M, 8M (default 2M)")
    add("--job-blocks", type=_ints, action="append", metavar="N[,N]",
        help="blocks per job, e.g. 1, 16, 64 (default 16)")
    add("--inflight-jobs", type=_ints, action="append", metavar="N[,N]",
        help="jobs the scheduler keeps in flight, e.g. 16 or 1,4,16,64 (default 16; also "
             "fio's numjobs)")
    add("--sweep", choices=sorted(SWEEPS), action="append",
        help="shorthand: 'concurrency' = --inflight-jobs " + SWEEPS["concurrency"][1]
             + ", 'block-size' = --block-bytes " + SWEEPS["block-size"][1]
             + "; a table of throughput against the swept value follows the cases")
    add("--total-bytes", type=parse_size, default=None, metavar="SIZE",
        help=f"bytes stored and loaded per phase (default 2G, with --quick {QUICK_TOTAL})")
    add("--designs", action="append", metavar="SPEC[,SPEC]",
        help=f"designs to compare (default {DEFAULT_DESIGNS}); variants such as "
             "mptier:nice=19, mptier:workers=2+2, mptier:task_bytes=8M, "
             "baseline:threads=8+8, raw:tool=loop; vllm (vLLM's own tier with its C "
             "extension vllm.fs_io_C: refused where it does not load, run "
             "scripts/vllm-env.sh) and vllm-py (vLLM's Python fallback on purpose); "
             "SPEC:twin=1 runs SPEC again under its own label, an A/A control whose spread "
             "round by round the report prints")
    add("--rounds", type=int, default=1, metavar="N",
        help="run every design N times, interleaved, and report medians (default 1); "
             "use 3 or more on a machine whose disk or CPUs are shared")
    add("--quick", action="store_true",
        help="small run (under a minute): less data, one large-job repeat, short idle "
             "calibration")
    add("--json", metavar="PATH", help="write the full results as JSON")
    add("--plot", metavar="PATH", help="write a PNG chart (needs matplotlib)")
    add("--markdown", metavar="PATH", help="write the tables as Markdown")
    add("--save", nargs="?", const=DEFAULT_SAVE_DIR, metavar="DIR",
        help=f"write latest.json, table.md, table.txt and chart.png to DIR "
             f"(default {DEFAULT_SAVE_DIR})")
    add("--single-job-blocks", type=int, default=64, metavar="N",
        help="blocks of the large job timed alone (default 64)")
    add("--repeats", type=int, default=None, metavar="N",
        help="runs of the large job alone, median reported (default 3, --quick 1)")
    add("--poll-us", type=int, default=500, metavar="US",
        help="light scheduler: GIL-free sleep between two polls (default 500)")
    add("--busy-work-us", type=int, default=500, metavar="US",
        help="busy scheduler: pure-Python work between two polls (default 500)")
    add("--busy-wait-us", type=int, default=500, metavar="US",
        help="busy scheduler: a GIL-free wait before each work slice, standing for the "
             "model's forward pass; time to get the interpreter back after it counts as "
             "lost work (default 500; 0 = a loop that never lets go of the interpreter)")
    add("--busy-fraction", type=float, default=0.5, metavar="F",
        help="share of each phase's jobs run beside the busy scheduler loop, where "
             "interference is measured (default 0.5; 0 = no busy part)")
    add("--idle-seconds", type=float, default=None, metavar="S",
        help="idle calibration of the scheduler loop per design (default 0.3, quick 0.15)")
    add("--buffer-bytes", type=parse_size, default=parse_size("4G"), metavar="SIZE",
        help="largest primary buffer (source + destination halves; default 4G)")
    add("--engine-cpu", type=int, default=None, metavar="CPU",
        help="pin the harness's main thread (the engine's scheduler) to this CPU while "
             "designs run, e.g. 0 beside mptier:cpus=1")
    add("--no-cold-pass", action="store_true",
        help="skip the cold pass (first store and load over the buffer right after each "
             "design starts)")
    add("--lookups", choices=("await", "beside"), default="await",
        help="load phases: 'await' submits a job only once every key's lookup is "
             "answered, as an engine does, so a slow answer delays the load (default); "
             "'beside' submits it right after asking, the order of runs before "
             "2026-12-06, where a design's lookup time does not show")
    add("--no-warm-memory", action="store_true",
        help="do not hand each phase recently freed memory first (see docs/performance.md"
             ": on a VM whose free memory goes back to the host, the design that runs "
             "after another one's cleanup then wins tmpfs stores)")
    add("--no-drop-caches", action="store_true",
        help="do not drop the page cache between the store and load phases")
    add("--no-verify", action="store_true", help="skip the byte-for-byte check of loads")
    add("--keep-files", action="store_true", help="leave the block files in place")
    add("--remove-each", action="store_true",
        help="on a disk root, remove each design's files right after it (default: at the "
             "end of the run, so no design stores within a minute of another's deletions, "
             "which slow ext4's inode allocation: docs/performance.md, section 14)")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--render", metavar="JSON",
        help="measure nothing: print and write the tables and chart of an earlier run's "
             "JSON (with --save, --markdown, --plot)")
    add("--inject-corruption", type=int, default=0, help=argparse.SUPPRESS)
    from mptier.bench.trace import add_trace_arguments
    add_trace_arguments(parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mptier bench",
        description="Run one workload against mptier (a), the in-process thread-pool "
                    "reference (b), that pool with mptier's native I/O (c) and the raw "
                    "limit of the root (d), on the same files; print a table, and "
                    "optionally write JSON, Markdown and a PNG chart.")
    return add_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return run(args, argv)


# -- running ---------------------------------------------------------------------------

def _flatten(values: list[list[Any]] | None, default: list[Any]) -> list[Any]:
    out: list[Any] = []
    for group in values or [default]:
        for v in group:
            if v not in out:
                out.append(v)
    return out


def _apply_sweeps(args: argparse.Namespace) -> None:
    for name in args.sweep or []:
        field, values = SWEEPS[name]
        parsed = _sizes(values) if field == "block_bytes" else _ints(values)
        setattr(args, field, [*(getattr(args, field) or []), parsed])


def workloads(args: argparse.Namespace) -> list[Workload]:
    _apply_sweeps(args)
    total = args.total_bytes or parse_size(QUICK_TOTAL if args.quick else "2G")
    roots = args.root or [tempfile.gettempdir()]
    out = []
    for root, block, job_blocks, inflight in itertools.product(
            roots, _flatten(args.block_bytes, [parse_size("2M")]),
            _flatten(args.job_blocks, [16]), _flatten(args.inflight_jobs, [16])):
        out.append(Workload(
            root=os.path.abspath(root), block_bytes=block, job_blocks=job_blocks,
            inflight_jobs=inflight, total_bytes=total,
            single_job_blocks=args.single_job_blocks,
            single_repeats=args.repeats or (1 if args.quick else 3),
            idle_seconds=args.idle_seconds or (0.15 if args.quick else 0.3),
            poll_us=args.poll_us, busy_work_us=args.busy_work_us,
            busy_wait_us=args.busy_wait_us,
            busy_fraction=args.busy_fraction, drop_caches=not args.no_drop_caches,
            verify=not args.no_verify, region_cap_bytes=args.buffer_bytes // 2,
            keep_files=args.keep_files, inject_corruption=args.inject_corruption,
            engine_cpu=args.engine_cpu, warm_memory=not args.no_warm_memory,
            cold_pass=not args.no_cold_pass, defer_removal=not args.remove_each,
            await_lookups=args.lookups == "await"))
    return out


def machine_info() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = None
    return {"cpus": len(os.sched_getaffinity(0)), "cpu_model": model, "memory_bytes": mem,
            "kernel": platform.release(), "python": platform.python_version(),
            "fio": fio_path() is not None, "uid": os.getuid()}


class _Progress:
    """A progress bar on stderr (rich when on a terminal, plain lines otherwise).

    Refreshed only between phases -- never from a thread of its own -- so it does not
    compete with the scheduler loop it measures.
    """

    def __init__(self, total_steps: int, enabled: bool) -> None:
        self.enabled = enabled
        self.total = total_steps
        self.step = 0
        self.start = time.monotonic()
        self._rich = None
        if enabled and sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
            except ImportError:
                return
            self._rich = Progress(TextColumn("{task.description}"), BarColumn(),
                                  TextColumn("{task.completed}/{task.total}"),
                                  TimeElapsedColumn(), console=Console(stderr=True),
                                  auto_refresh=False, transient=True)
            self._task = self._rich.add_task("starting", total=total_steps)
            self._rich.start()

    def __call__(self, message: str, advance: bool = True) -> None:
        if not self.enabled:
            return
        self.step = min(self.step + advance, self.total)
        if self._rich is not None:
            self._rich.update(self._task, completed=self.step - 1, description=message)
            self._rich.refresh()
        else:
            elapsed = time.monotonic() - self.start
            print(f"[{self.step}/{self.total} {elapsed:5.1f}s] {message}", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None


def _estimate_seconds(cases: list[Workload], specs: list[DesignSpec], rounds: int) -> float:
    per_design = sum(2 * w.total_bytes / 1.5e9 + 2.0 for w in cases)
    return per_design * len(specs) * rounds


def run_case(w: Workload, specs: list[DesignSpec], progress: _Progress,
             rounds: int = 1, kept: KeptFiles | None = None) -> dict[str, Any]:
    fs_type, mount = filesystem_of(w.root)
    case_doc: dict[str, Any] = {
        "workload": {**dataclasses.asdict(w), "blocks_per_phase": w.n_blocks},
        "root_fs": fs_type, "mount": mount, "o_direct": probe_o_direct(w.root),
    }
    per_spec: dict[DesignSpec, list[dict[str, Any]]] = {spec: [] for spec in specs}
    progress(f"preparing a {format_size(2 * w.region_blocks * w.block_bytes)} buffer and "
             f"{w.n_blocks} keys", advance=False)
    case = Case(w, progress, kept)
    case_doc["buffer"] = {"kind": case.buffer.kind, "region_blocks": case.buffer.region}
    case_doc["removal"] = "kept" if w.keep_files else case.removal
    case_doc["verified"] = (
        "off" if not w.verify else
        f"all {w.n_blocks} blocks" if w.n_blocks <= case.buffer.region else
        f"{case.buffer.region} of {w.n_blocks} blocks: the last load into each slot")
    try:
        for round_no in range(rounds):
            # Every other round runs the designs in reverse, so none always follows the
            # same neighbour (what the machine's memory and caches hold depends on it).
            for position, spec in enumerate(specs if round_no % 2 == 0 else specs[::-1]):
                design = spec.build()
                reason = design.available()
                if reason is not None:
                    if round_no == 0:
                        progress(f"{design.label}: skipped")
                        record = rep.design_record(design.label, design.letter,
                                                   design.kind, {}, [], {})
                        record["skipped"] = reason
                        record["notes"].append(f"skipped: {reason}")
                        per_spec[spec].append(record)
                    continue
                out = case.run_raw(design) if isinstance(design, RawLimit) else \
                    case.run_design(design)
                record = rep.design_record(design.label, design.letter, design.kind,
                                           design.info, design.notes, out)
                record["position"] = position
                per_spec[spec].append(record)
    finally:
        case.close()
    records = [rep.merge_rounds(recs) for recs in per_spec.values()]
    case_doc["rounds"] = rounds
    case_doc["designs"] = records
    for letter, label in rep.add_ratios(records).items():
        case_doc[f"reference_{letter}"] = label
    case_doc["twins"] = twins.twin_spreads(
        records, [(spec.label, spec.twin_of.label) for spec in specs if spec.twin_of])
    case_doc["verdicts"] = twins.verdicts(records, case_doc["twins"])
    drops = [r["page_cache_dropped"] for r in records if r["page_cache_dropped"] is not None]
    case_doc["page_cache_dropped"] = (None if not drops else all(drops))
    background = [r.get("background_cpus_max", r.get("background_cpus")) for r in records
                  if r.get("background_cpus") is not None]
    case_doc["background_cpus_max"] = max(background) if background else None
    case_doc["problems"] = rep.problems(case_doc)
    return case_doc


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the benchmark described by parsed ``args``; return the exit status.

    0: every design ran and every load verified; 1: something failed (printed).
    """
    if getattr(args, "trace", None):
        from mptier.bench.trace import run_trace
        return run_trace(args, _own_argv(argv))
    if getattr(args, "budget", None) is not None or getattr(args, "requests", None):
        print("mptier bench: --budget and --requests go with --trace FILE", file=sys.stderr)
        return 2
    if args.render:
        try:
            with open(args.render, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError) as exc:
            print(f"mptier bench: cannot read {args.render}: {exc}", file=sys.stderr)
            return 2
        _emit(doc, args)
        return 0
    try:
        specs = parse_designs(args.designs or [DEFAULT_DESIGNS])
        designs = [spec.build() for spec in specs]  # reject bad options before any work
    except ValueError as exc:
        print(f"mptier bench: {exc}", file=sys.stderr)
        return 2
    for design in designs:
        if (refusal := getattr(design, "refusal", lambda: None)()) is not None:
            print(f"mptier bench: design {design.label}: {refusal}", file=sys.stderr)
            return 2
    if args.engine_cpu is not None and args.engine_cpu not in os.sched_getaffinity(0):
        print(f"mptier bench: --engine-cpu {args.engine_cpu} is not one of this process's "
              f"CPUs {sorted(os.sched_getaffinity(0))}", file=sys.stderr)
        return 2
    cases = workloads(args)
    for w in cases:
        if not os.path.isdir(w.root):
            print(f"mptier bench: --root {w.root} is not a folder", file=sys.stderr)
            return 2
    rounds = max(1, args.rounds)
    steps = sum(1 if s.name == "raw" else 6 for s in specs) * len(cases) * rounds
    long_run = _estimate_seconds(cases, specs, rounds) > 3
    progress = _Progress(steps, long_run and not args.no_progress)
    doc: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "mptier bench " + shlex.join(_own_argv(argv)),
        "machine": machine_info(),
        "crc32c": crc32c_speed(),
        "figures": [{"key": f.key, "label": f.label.strip(), "unit": f.unit,
                     "better": f.better} for f in rep.FIGURES],
        "cases": [],
    }
    stamp = _code_stamp()
    kept = KeptFiles()  # disk roots' design folders, removed when the run ends
    try:
        for w in cases:
            try:
                doc["cases"].append(run_case(w, specs, progress, rounds, kept))
            except Exception as exc:  # outside any design: name the case and the cause last
                progress.close()
                traceback.print_exc()
                print(f"mptier bench: FAILED: the case {w.root} at "
                      f"{format_size(w.block_bytes)} blocks stopped: "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr)
                return 1
            if _code_stamp() != stamp:
                title = rep.case_title(doc["cases"][-1])
                doc.setdefault("warnings", []).append(
                    f"mptier's source files changed during the case {title}; its figures "
                    "may mix two versions of the code")
                stamp = _code_stamp()
        _emit(doc, args)  # the results first: the removal below can take minutes
    finally:
        progress.close()
        _remove_kept(kept)
    for warning in doc.get("warnings", []):
        print(f"mptier bench: WARNING: {warning}", file=sys.stderr)
    issues = [p for c in doc["cases"] for p in c["problems"]]
    for issue in issues:
        print(f"mptier bench: FAILED: {issue}", file=sys.stderr)
    return 1 if issues else 0


def _remove_kept(kept: KeptFiles) -> None:
    """Remove the design folders kept on disk until the end of the run, saying how far
    it is every REMOVAL_REPORT_S."""
    if not kept.paths:
        return
    print(f"mptier bench: removing {len(kept.paths)} design folder(s) kept on disk until "
          "the end of the run", file=sys.stderr)
    started = last = time.monotonic()

    def each(removed: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if removed == total or now - last >= REMOVAL_REPORT_S:
            last = now
            print(f"mptier bench: removed {removed} of {total} in {now - started:.0f} s",
                  file=sys.stderr)

    kept.remove_all(each)


def _code_stamp() -> float:
    """Newest modification time of mptier's own source files (the benchmark aside).

    Worker processes load the code from disk when they start, so code edited during a
    run mixes two versions: the run reports it.
    """
    import mptier

    newest = 0.0
    for base in getattr(mptier, "__path__", []):
        for folder, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if d not in ("bench", "__pycache__")]
            for name in files:
                if name.endswith((".py", ".so", ".c")):
                    try:
                        newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime)
                    except OSError:
                        continue
    return newest


def _own_argv(argv: list[str] | None) -> list[str]:
    """The benchmark's own arguments (without a leading ``bench`` subcommand word)."""
    if argv is not None:
        return list(argv)
    rest = sys.argv[1:]
    return rest[1:] if rest[:1] == ["bench"] else rest


def _emit(doc: dict[str, Any], args: argparse.Namespace) -> None:
    for case in doc["cases"]:
        rep.print_case(case)
    sweeps = rep.sweep_tables(doc)
    for table in sweeps:
        print(table["text"])
    notes = rep.checksum_notes(doc)
    for line in notes:
        print(line)
    paths = {"json": args.json, "markdown": args.markdown, "plot": args.plot, "text": None}
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        paths = {"json": args.json or os.path.join(args.save, "latest.json"),
                 "markdown": args.markdown or os.path.join(args.save, "table.md"),
                 "plot": args.plot or os.path.join(args.save, "chart.png"),
                 "text": os.path.join(args.save, "table.txt")}
    if paths["json"]:
        _write(paths["json"], json.dumps(doc, indent=2, default=str) + "\n")
    if paths["markdown"]:
        body = "\n\n".join(rep.markdown_table(c) for c in doc["cases"])
        warnings = "".join(f"**Warning:** {w}\n\n" for w in doc.get("warnings", []))
        sweep_md = "".join(f"## {t['title']}\n\n{t['markdown']}\n\n" for t in sweeps)
        notes_md = "".join(f"- {line}\n" for line in notes)
        _write(paths["markdown"], f"Command: `{doc['command']}`\n\n{warnings}## Summary\n\n"
               f"{rep.summary_markdown(doc)}\n\n{notes_md and notes_md + chr(10)}"
               f"{sweep_md}## Every figure\n\n{body}\n")
    if paths["text"]:
        body = "\n\n".join([*(rep.plain_table(c) for c in doc["cases"]),
                             *(t["text"] for t in sweeps), *notes])
        _write(paths["text"], f"{doc['command']}\n\n{body}\n")
    if paths["plot"]:
        try:
            from mptier.bench.plot import write_png
            write_png(doc, paths["plot"])
        except ImportError as exc:
            print(f"mptier bench: no chart written ({exc}); install the 'bench' extra",
                  file=sys.stderr)
    for kind, path in paths.items():
        if path:
            print(f"{kind}: {path}", file=sys.stderr)


def _write(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


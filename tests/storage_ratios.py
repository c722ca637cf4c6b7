"""Issue 12's storage ratios on local disk and on a JuiceFS mount, in one command.

    sudo .venv/bin/python tests/storage_ratios.py --out bench/results/storage \
        [--fs local,juicefs] [--local-total 2G --local-load 512M --local-cap 1G] \
        [--jfs-total 768M --jfs-load 128M --jfs-cap 256M] [--rounds 3] \
        [--bench-args=--quick]

For each file system it runs ``bench/capacity_roots.py`` (variants ``none``,
``cap=SIZE``, ``roots=3``, interleaved rounds, ratios to ``none``) as a child process;
on JuiceFS it then runs ``mptier bench --root <mount>/bench`` once (``--bench-args``;
``--no-bench`` skips it). JuiceFS is a fresh volume (SQLite metadata, a local folder as
object store, ``--trash-days 0``) under ``--jfs-workdir`` mounted once through FUSE by
``tests/support/juicefs.py``; it is unmounted, its daemons ended and its folder removed
in a ``finally``, whatever failed. Needs root (the mount uses ``allow_other``).

Writes into ``--out``: ``<fs>-capacity-roots.json`` / ``.log`` (the child's output),
``juicefs-bench.json`` / ``.md`` / ``.log``, and ``summary.json`` + ``summary.md``
(medians, ratios, room waits, evictions, times and load averages). Blocks for the whole
run; exits 1 when a step failed (the others still run and are reported).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from support.juicefs import JuiceFSVolume

# Lives beside the JuiceFS helper it uses (tests/support): run as a script, its own folder
# is first on the import path, so nothing edits sys.path.
REPO = Path(__file__).resolve().parent.parent

PYTHON = sys.executable
MPTIER = str(Path(PYTHON).parent / "mptier")
# An interrupted child gets this long to shut its tier down before SIGKILL.
CHILD_STOP_S = 30.0


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM (e.g. from ``timeout``) unwinds like Ctrl-C, so every ``finally`` runs
    and the JuiceFS mount is taken down."""
    raise KeyboardInterrupt(f"signal {signum}")


def machine() -> dict[str, Any]:
    """The wall clock and load average now, for the report."""
    return {"time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def run_logged(argv: list[str], log: Path) -> dict[str, Any]:
    """Run ``argv`` to completion with its output in ``log`` (also echoed); returns the
    command, its exit code, and the time and load average before and after."""
    before = machine()
    started = time.monotonic()
    print("$", " ".join(argv), flush=True)
    with open(log, "w") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, stdin=subprocess.DEVNULL)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                f.write(line)
            code = proc.wait()
        except BaseException:
            # Interrupted: the child gets SIGINT, so its own ``finally`` shuts its tier
            # down (its workers hold files on the mount we are about to unmount).
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(CHILD_STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
    return {"argv": argv, "returncode": code, "seconds": round(time.monotonic() - started, 1),
            "before": before, "after": machine()}


def capacity_roots(root: Path, out: Path, fs: str, variants: str, rounds: int, total: str,
                   load: str) -> dict[str, Any]:
    """One interleaved ``capacity_roots.py`` run under ``root`` (removed afterwards)."""
    json_path = out / f"{fs}-capacity-roots.json"
    argv = [PYTHON, str(REPO / "bench" / "capacity_roots.py"), "--root", str(root),
            "--variants", variants, "--rounds", str(rounds), "--total", total,
            "--load", load, "--json", str(json_path)]
    try:
        step = run_logged(argv, out / f"{fs}-capacity-roots.log")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if step["returncode"] == 0 and json_path.exists():
        step["result"] = summarise(json.loads(json_path.read_text()))
    return step


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    """Medians per variant and their ratios to the first variant."""
    rows = data["rows"]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    med = {v: {k: statistics.median(r[k] for r in rows if r["variant"] == v)
               for k in ("store_gbps", "load_gbps", "room_waits", "room_wait_s", "evicted")}
           for v in variants}
    base = med[variants[0]]
    for v in variants:
        med[v]["store_ratio"] = med[v]["store_gbps"] / base["store_gbps"]
        med[v]["load_ratio"] = med[v]["load_gbps"] / base["load_gbps"]
        med[v]["failed_jobs"] = sum(r["store_failed"] + r["load_failed"]
                                    for r in rows if r["variant"] == v)
    return {"variants": variants, "medians": med, "rows": rows}


def juicefs_run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Mount a fresh volume once, run the ratios and the bench on it, unmount."""
    workdir = Path(args.jfs_workdir)
    if workdir.exists():
        raise SystemExit(f"--jfs-workdir {workdir} exists; pick a fresh folder")
    report: dict[str, Any] = {"workdir": str(workdir)}
    vol = JuiceFSVolume(workdir, name="mptier-storage")
    pids: list[int] = []
    try:
        vol.format()
        mount = vol.mount("a")
        pids = list(mount.pids)
        report["mount"] = str(mount.path)
        report["capacity_roots"] = capacity_roots(
            mount.path / "cap", out, "juicefs", f"none,cap={args.jfs_cap},roots=3",
            args.rounds, args.jfs_total, args.jfs_load)
        if not args.no_bench:
            bench_root = mount.path / "bench"
            bench_root.mkdir()
            argv = [MPTIER, "bench", "--root", str(bench_root), "--no-progress",
                    "--json", str(out / "juicefs-bench.json"),
                    "--markdown", str(out / "juicefs-bench.md"), *args.bench_args.split()]
            report["bench"] = run_logged(argv, out / "juicefs-bench.log")
            report["bench"]["left_in_root"] = sorted(os.listdir(bench_root))
    finally:
        vol.close()
    mounted = subprocess.run(["mount"], capture_output=True, text=True).stdout
    report["left_mounted"] = [line for line in mounted.splitlines() if str(workdir) in line]
    report["left_daemons"] = [p for p in pids if os.path.exists(f"/proc/{p}")]
    report["left_workdir"] = workdir.exists()
    return report


def markdown(summary: dict[str, Any]) -> str:
    lines = [f"# Storage ratios ({summary['started']['time']} - {summary['ended']['time']})",
             "", "`" + " ".join(summary["argv"]) + "`", ""]
    for fs in ("local", "juicefs"):
        part = summary.get(fs)
        if not part:
            continue
        step = part["capacity_roots"] if fs == "juicefs" else part
        lines += [f"## {fs}", "", f"`{' '.join(step['argv'][1:])}` -- exit "
                  f"{step['returncode']}, {step['seconds']} s, load average "
                  f"{step['before']['loadavg']} before, {step['after']['loadavg']} after", ""]
        result = step.get("result")
        if result:
            lines += ["| variant | store GB/s | ratio | load GB/s | ratio | room waits | "
                      "room wait s | evicted keys | failed jobs |",
                      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for v in result["variants"]:
                m = result["medians"][v]
                lines.append(f"| {v} | {m['store_gbps']:.2f} | {m['store_ratio']:.2f} | "
                             f"{m['load_gbps']:.2f} | {m['load_ratio']:.2f} | "
                             f"{m['room_waits']:g} | {m['room_wait_s']:.1f} | "
                             f"{m['evicted']:g} | {m['failed_jobs']} |")
            lines += ["", "Medians over rounds (room waits, wait seconds, evicted: medians "
                      "per round); per round:", "",
                      "| round | variant | store GB/s | load GB/s | room waits | evicted |",
                      "| ---: | --- | ---: | ---: | ---: | ---: |"]
            lines += [f"| {r['round']} | {r['variant']} | {r['store_gbps']:.2f} | "
                      f"{r['load_gbps']:.2f} | {r['room_waits']} | {r['evicted']} |"
                      for r in result["rows"]]
        lines.append("")
        if fs == "juicefs":
            bench = part.get("bench")
            if bench:
                lines += [f"`mptier {' '.join(bench['argv'][1:])}` -- exit "
                          f"{bench['returncode']}, {bench['seconds']} s (juicefs-bench.md); "
                          f"left in its root: {bench['left_in_root']}", ""]
            lines += [f"After unmounting: mounts left {part['left_mounted']}, daemons left "
                      f"{part['left_daemons']}, work folder left: {part['left_workdir']}", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the results")
    parser.add_argument("--fs", default="local,juicefs", help="local, juicefs or both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-root", default=f"/var/tmp/mptier-storage-ratios-{os.getpid()}")
    parser.add_argument("--local-total", default="2G")
    parser.add_argument("--local-load", default="512M")
    parser.add_argument("--local-cap", default="1G")
    parser.add_argument("--jfs-workdir", default=f"/var/tmp/mptier-storage-jfs-{os.getpid()}")
    parser.add_argument("--jfs-total", default="768M")
    parser.add_argument("--jfs-load", default="128M")
    parser.add_argument("--jfs-cap", default="256M")
    parser.add_argument("--bench-args", default="--quick",
                        help="arguments for `mptier bench` on the mount, one string "
                             "given with '=' (--bench-args='--quick --rounds 2')")
    parser.add_argument("--no-bench", action="store_true")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    systems = args.fs.split(",")
    unknown = set(systems) - {"local", "juicefs"}
    if unknown:
        raise SystemExit(f"--fs {args.fs}: unknown {sorted(unknown)}; use local, juicefs")
    summary: dict[str, Any] = {"argv": sys.argv, "started": machine()}
    failed = False
    try:
        if "local" in systems:
            if os.path.exists(args.local_root):
                raise SystemExit(f"--local-root {args.local_root} exists; pick a fresh one")
            summary["local"] = capacity_roots(
                Path(args.local_root), out, "local", f"none,cap={args.local_cap},roots=3",
                args.rounds, args.local_total, args.local_load)
            failed |= summary["local"]["returncode"] != 0
        if "juicefs" in systems:
            summary["juicefs"] = part = juicefs_run(args, out)
            failed |= part["capacity_roots"]["returncode"] != 0
            failed |= part.get("bench", {}).get("returncode", 0) != 0
            failed |= bool(part["left_mounted"] or part["left_daemons"] or part["left_workdir"])
    finally:
        summary["ended"] = machine()
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        (out / "summary.md").write_text(markdown(summary))
        print((out / "summary.md").read_text())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

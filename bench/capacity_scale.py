"""Issue 19's two scale targets, measured: room waits on a root of a million blocks, and
the walk work of eight tiers on one root against one.

    python bench/capacity_scale.py --root /var/tmp/mptier-scale [--parts a,b]
        [--blocks 1000000] [--block-bytes 4K] [--rounds 6] [--jobs-per-round 40]
        [--job-blocks 88] [--b-blocks 100000] [--b-tiers 8] [--b-seconds 30]
        [--json out.json]

Part a, "a root of 1 million blocks: a store that needs room waits at most one task's
duration". One tier makes the layout (``config.json``, ``mptier.json``) and stores a few
blocks; the bench then writes ``--blocks`` blocks of ``--block-bytes`` straight into the
same tree (the tier's ``FileMapper`` paths, the bytes a store writes) and checks that a
tier finds and loads its blocks byte for byte. Tier **B** then starts with
``capacity_bytes`` the bytes the root holds already, and walks it once (its first pass
indexes every block; the time is printed). Then, in ``--rounds`` rounds: a tier **R**
without a budget starts on the same root (a contributor: B holds the walker's seat) and
stores ``--jobs-per-round`` jobs of ``--job-blocks`` new blocks, one at a time (one task
each: the duration of one task of that size on this root, no budget); R shuts down; B
stores as many jobs of new blocks, one at a time, each needing room (the root is full).
Per B store: its room wait (the workers' ``room_wait_s``, read before and after it) and
its duration. The target holds when the longest room wait is at most R's median job.

Part b, "8 tiers on one root: total walk work at most 2x one tier's". A second root is
filled with ``--b-blocks`` blocks the same way; then 1 tier, and ``--b-tiers`` tiers (each
its own engine process and worker pool), store new blocks into it for ``--b-seconds``
each. The walk work is the entries every tier's caretakers walked meanwhile
(``stats()["roots"][0]["walked_entries"]``, summed over the tiers), and the ratio is the
many tiers' total over the one's.

Progress lines go to stderr every few seconds. Everything the bench made (the trees,
its buffers, its engine processes) is removed at the end, also on Ctrl-C or an error.
Heavy: wrap it in ``flock /tmp/mptier-bench.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from mptier import FileSystemTier, LookupResult, SharedKVBuffer, TransferJob, make_key
from mptier.config import parse_bytes
from mptier.jobs import TaskKind, task_record_capacity

POLL_S = 0.0005
PROGRESS_S = 5.0
JOB_TIMEOUT_S = 120.0
# How many blocks a tier stores into each tree before it is built (the tier's own files
# are compared with the tree's), and checks by lookup and load afterwards.
PROBE_BLOCKS = 8
# A job of part a is one task: as many blocks as a task record holds (4 KiB blocks are
# far from task_bytes).
ONE_TASK_BLOCKS = task_record_capacity(TaskKind.STORE, len(make_key(bytes(32))))
# A child of part b stores this many jobs at once.
CHILD_IN_FLIGHT = 2


def remove_tree(path: str) -> None:
    """``rm -rf`` (several times faster than shutil.rmtree on a million small files);
    shutil's if that fails."""
    if not os.path.lexists(path):
        return
    started = time.monotonic()
    progress(f"removing {path}")
    with contextlib.suppress(OSError):
        # The block folders' <h3> folders by four rm processes at once, then the rest.
        subprocess.run(f"find {shlex.quote(path)} -mindepth 3 -maxdepth 3 -type d -print0 "
                       "| xargs -0 -r -P 4 -n 64 rm -rf --one-file-system --", shell=True,
                       check=False, stdin=subprocess.DEVNULL)
        subprocess.run(["rm", "-rf", "--one-file-system", "--", path], check=False,
                       stdin=subprocess.DEVNULL)
    shutil.rmtree(path, ignore_errors=True)
    progress(f"removed {path} in {time.monotonic() - started:.0f} s")


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def key_of(tag: bytes, i: int) -> bytes:
    return make_key(hashlib.sha256(tag + i.to_bytes(8, "big")).digest())


def block_bytes_of(key: bytes, size: int) -> bytes:
    """A block's bytes, from its key: a loaded block is checked against them."""
    head = hashlib.sha256(key).digest()
    return (head * (size // len(head) + 1))[:size]


def tier_kwargs(root: str, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    return {"root_dir": root, "prefault": False, "status_socket": "",
            "n_load_workers": args.load_workers, "n_store_workers": args.store_workers,
            **extra}


class Jobs:
    """Runs store and load jobs through one tier, one at a time."""

    def __init__(self, tier: FileSystemTier, buf: SharedKVBuffer) -> None:
        self.tier, self.buf, self.next_id = tier, buf, 0

    def _wait(self, job_id: int) -> Any:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            for result in self.tier.get_finished_jobs():
                if result.job_id == job_id:
                    return result
            time.sleep(POLL_S)
        raise TimeoutError(f"job {job_id} did not finish within {JOB_TIMEOUT_S:g} s")

    def store(self, keys: list[bytes]) -> tuple[Any, float]:
        size = self.buf.block_bytes
        for slot, key in enumerate(keys):
            self.buf.view[slot] = np.frombuffer(block_bytes_of(key, size), np.uint8)
        self.next_id += 1
        started = time.perf_counter()
        self.tier.submit_store(TransferJob(self.next_id, keys, list(range(len(keys)))))
        result = self._wait(self.next_id)
        return result, time.perf_counter() - started

    def check(self, keys: list[bytes]) -> None:
        """Every key is a hit and loads its bytes (raises otherwise)."""
        tier = self.tier
        answers: dict[bytes, LookupResult] = {}
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while len(answers) < len(keys) and time.monotonic() < deadline:
            for key in keys:
                if key not in answers:
                    result = tier.lookup(key, req_id="check")
                    if result is not LookupResult.RETRY:
                        answers[key] = result
            tier.on_schedule_end()
            time.sleep(0.01)
        missing = [k.hex()[:16] for k in keys if answers.get(k) is not LookupResult.HIT]
        if missing:
            raise SystemExit(f"blocks of the tree are not hits for the tier: {missing}")
        self.buf.view[:len(keys)] = 0
        self.next_id += 1
        tier.submit_load(TransferJob(self.next_id, keys, list(range(len(keys)))))
        result = self._wait(self.next_id)
        if not result.success:
            raise SystemExit(f"loading blocks of the tree failed: {result.error}")
        size = self.buf.block_bytes
        for slot, key in enumerate(keys):
            if self.buf.view[slot].tobytes() != block_bytes_of(key, size):
                raise SystemExit(f"block {key.hex()[:16]} loaded wrong bytes")


def waits(tier: FileSystemTier) -> tuple[int, float]:
    workers = tier.stats()["workers"]
    return (sum(w.get("room_waits", 0) for w in workers),
            sum(w.get("room_wait_s", 0.0) for w in workers))


def root_stats(tier: FileSystemTier) -> dict[str, Any]:
    return tier.stats()["roots"][0]


# -- the tree -------------------------------------------------------------------------


def build_tree(root: str, tag: bytes, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """A tier makes the layout and stores PROBE_BLOCKS blocks; ``n`` more are written
    straight at the tier's paths (as its stores leave them: the block's bytes at its
    final name); the tier's own files are compared, and the tree's blocks looked up and
    loaded through a fresh tier. Returns the tree's figures."""
    size = args.block_bytes
    os.makedirs(root)
    with SharedKVBuffer.create(num_blocks=max(args.job_blocks, PROBE_BLOCKS),
                               block_bytes=size) as buf:
        with FileSystemTier(buf, **tier_kwargs(root, args)) as tier:
            probe = [key_of(tag + b"-probe", i) for i in range(PROBE_BLOCKS)]
            result, _ = Jobs(tier, buf).store(probe)
            if not result.success:
                raise SystemExit(f"the probe store failed: {result.error}")
            mapper = tier.mapper
        for key in probe:  # the tier's own files: where and what the builder writes
            path = mapper.path_for(key)
            with open(path, "rb") as f:
                if f.read() != block_bytes_of(key, size):
                    raise SystemExit(f"{path}: the tier wrote other bytes than the builder")
        made: set[str] = {os.path.dirname(mapper.path_for(k)) for k in probe}
        started = last = time.monotonic()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        for i in range(n):
            key = key_of(tag, i)
            path = mapper.path_for(key)
            parent = path[:path.rfind("/")]
            if parent not in made:
                os.makedirs(parent, exist_ok=True)
                made.add(parent)
            fd = os.open(path, flags, 0o644)
            try:
                os.write(fd, block_bytes_of(key, size))
            finally:
                os.close(fd)
            now = time.monotonic()
            if now - last >= PROGRESS_S:
                last = now
                progress(f"building {root}: {i + 1:,} of {n:,} blocks, {len(made):,} "
                         f"leaf folders, {(i + 1) / (now - started):,.0f} blocks/s")
        built_s = time.monotonic() - started
        progress(f"built {n:,} blocks in {len(made):,} leaf folders in {built_s:.1f} s")
        sample = [key_of(tag, i) for i in range(0, n, max(1, n // PROBE_BLOCKS))]
        with FileSystemTier(buf, **tier_kwargs(root, args)) as tier:
            Jobs(tier, buf).check(sample[:PROBE_BLOCKS] + probe)
    return {"blocks": n + PROBE_BLOCKS, "leaf_folders": len(made), "build_s": built_s,
            "bytes": (n + PROBE_BLOCKS) * size}


# -- part a ---------------------------------------------------------------------------


def wait_walker(tier: FileSystemTier, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not root_stats(tier).get("walker"):
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not become the root's walker in {timeout:g} s")
        time.sleep(0.05)


def no_contributors(root: str, timeout: float = 30.0) -> None:
    """Wait until the walker reaped every contributor (R's files are gone and its cursor
    dropped a moment later: ALIVE_CHECK_S)."""
    from mptier.storage.election import ALIVE_CHECK_S, share_dir

    deadline = time.monotonic() + timeout
    while any(n.endswith(".alive") or (n.endswith(".json") and n != "usage.json")
              for n in os.listdir(share_dir(root))):
        if time.monotonic() > deadline:
            raise SystemExit(f"contributors' files still in {share_dir(root)}")
        time.sleep(0.05)
    time.sleep(ALIVE_CHECK_S + 0.2)


def part_a(folder: str, args: argparse.Namespace) -> dict[str, Any]:
    root = f"{folder}/a"
    tree = build_tree(root, b"scale-a", args.blocks, args)
    size = args.block_bytes
    capacity = tree["bytes"]
    out: dict[str, Any] = {"tree": tree, "capacity_bytes": capacity, "b": [], "r": []}
    with SharedKVBuffer.create(num_blocks=args.job_blocks * max(1, args.burst_in_flight),
                               block_bytes=size) as buf_b, \
            SharedKVBuffer.create(num_blocks=args.job_blocks, block_bytes=size) as buf_r:
        started = time.monotonic()
        tier_b = FileSystemTier(buf_b, **tier_kwargs(root, args, capacity_bytes=capacity))
        try:
            wait_walker(tier_b, "tier B")
            last = started
            while not (s := root_stats(tier_b))["usage_complete"]:
                now = time.monotonic()
                if now - last >= PROGRESS_S:
                    last = now
                    progress(f"B's first pass: {s['usage_bytes'] // size:,} blocks of "
                             f"{tree['blocks']:,} counted, {now - started:.0f} s")
                time.sleep(0.1)
            out["first_pass_s"] = time.monotonic() - started
            s = root_stats(tier_b)
            out["after_pass"] = {"usage_bytes": s["usage_bytes"],
                                 "walked_entries": s["walked_entries"]}
            progress(f"B's first pass done in {out['first_pass_s']:.1f} s: "
                     f"{s['usage_bytes']:,} bytes, {s['walked_entries']:,} entries walked")
            run_b = Jobs(tier_b, buf_b)
            n = 0
            for rnd in range(args.rounds):
                with FileSystemTier(buf_r, **tier_kwargs(root, args)) as tier_r:
                    run_r = Jobs(tier_r, buf_r)
                    for _ in range(args.jobs_per_round):
                        keys = [key_of(b"scale-a-r", n * args.job_blocks + i)
                                for i in range(args.job_blocks)]
                        n += 1
                        result, took = run_r.store(keys)
                        if not result.success:
                            raise SystemExit(f"an R store failed: {result.error}")
                        out["r"].append({"round": rnd, "s": took})
                no_contributors(root)
                for _ in range(args.jobs_per_round):
                    keys = [key_of(b"scale-a-b", n * args.job_blocks + i)
                            for i in range(args.job_blocks)]
                    n += 1
                    before = waits(tier_b)
                    result, took = run_b.store(keys)
                    after = waits(tier_b)
                    if not result.success:
                        raise SystemExit(f"a B store failed: {result.error}")
                    out["b"].append({"round": rnd, "s": took, "waits": after[0] - before[0],
                                     "wait_s": after[1] - before[1]})
                r_med = statistics.median(j["s"] for j in out["r"] if j["round"] == rnd)
                b_round = [j for j in out["b"] if j["round"] == rnd]
                progress(f"round {rnd + 1}/{args.rounds}: R median {1e3 * r_med:.1f} ms; "
                         f"B median {1e3 * statistics.median(j['s'] for j in b_round):.1f}"
                         f" ms, longest room wait "
                         f"{1e3 * max(j['wait_s'] for j in b_round):.1f} ms")
            if args.burst_jobs:
                out["burst"] = burst(run_b, n, args)
            s = root_stats(tier_b)
            out["end"] = {k: s[k] for k in ("usage_bytes", "evicted_blocks", "walked_entries",
                                            "walk_passes", "usage_complete")}
        finally:
            tier_b.shutdown()
    remove_tree(root)
    return out


def burst(run: Jobs, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """B stores --burst-jobs jobs with --burst-in-flight at once: stores then outpace
    eviction and wait. Per-store waits are not told apart here (the workers' totals)."""
    tier, size, per = run.tier, args.block_bytes, args.job_blocks
    slots = list(range(args.burst_in_flight))
    for slot in range(args.burst_in_flight * per):
        run.buf.view[slot] = np.frombuffer(block_bytes_of(key_of(b"y", slot), size), np.uint8)
    before = waits(tier)
    started = time.perf_counter()
    in_flight: dict[int, tuple[int, float]] = {}
    took: list[float] = []
    job = failed = 0
    while job < args.burst_jobs or in_flight:
        while slots and job < args.burst_jobs:
            slot = slots.pop()
            keys = [key_of(b"scale-a-burst", (n + job) * per + i) for i in range(per)]
            job += 1
            run.next_id += 1
            in_flight[run.next_id] = (slot, time.perf_counter())
            tier.submit_store(TransferJob(run.next_id, keys,
                                          list(range(slot * per, (slot + 1) * per))))
        for result in tier.get_finished_jobs():
            slot, at = in_flight.pop(result.job_id)
            slots.append(slot)
            took.append(time.perf_counter() - at)
            failed += not result.success
        time.sleep(POLL_S)
    after = waits(tier)
    count, seconds = after[0] - before[0], after[1] - before[1]
    return {"jobs": args.burst_jobs, "in_flight": args.burst_in_flight, "failed": failed,
            "seconds": time.perf_counter() - started, "waits": count, "wait_s": seconds,
            "wait_s_mean": seconds / count if count else 0.0,
            "job_s_median": statistics.median(took), "job_s_max": max(took)}


def summary_a(a: dict[str, Any]) -> dict[str, Any]:
    r = sorted(j["s"] for j in a["r"])
    b = a["b"]
    wait = sorted(j["wait_s"] for j in b)
    task = statistics.median(r)
    return {"task_s_median": task, "task_s_max": r[-1],
            "b_job_s_median": statistics.median(j["s"] for j in b),
            "b_job_s_max": max(j["s"] for j in b),
            "stores": len(b), "stores_that_waited": sum(j["waits"] > 0 for j in b),
            "wait_s_max": wait[-1], "wait_s_median": statistics.median(wait),
            "wait_s_total": sum(wait), "met": wait[-1] <= task}


# -- part b ---------------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    """One engine of part b: a tier on ``--root``; prints "ready" once its caretaker
    is in place, stores new blocks from "go" on stdin for ``--b-seconds``, prints its
    figures as one JSON line and shuts down."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the tier shuts down
    size = args.block_bytes
    blocks = CHILD_IN_FLIGHT * args.job_blocks
    with SharedKVBuffer.create(num_blocks=blocks, block_bytes=size) as buf, \
            FileSystemTier(buf, **tier_kwargs(args.root, args)) as tier:
        deadline = time.monotonic() + 60
        while not root_stats(tier)["caretaker_pid"]:
            if time.monotonic() > deadline:
                raise SystemExit("no caretaker in 60 s")
            time.sleep(0.05)
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        for slot in range(blocks):
            buf.view[slot] = np.frombuffer(block_bytes_of(key_of(b"x", slot), size), np.uint8)
        before = root_stats(tier)
        started = time.monotonic()
        end = started + args.b_seconds
        next_id = n = failed = 0
        in_flight: dict[int, int] = {}
        free = list(range(CHILD_IN_FLIGHT))
        while time.monotonic() < end or in_flight:
            while free and time.monotonic() < end:
                slot = free.pop()
                next_id += 1
                keys = [key_of(args.child_tag.encode(), n + i) for i in range(args.job_blocks)]
                n += args.job_blocks
                tier.submit_store(TransferJob(next_id, keys, list(range(
                    slot * args.job_blocks, (slot + 1) * args.job_blocks))))
                in_flight[next_id] = slot
            for result in tier.get_finished_jobs():
                free.append(in_flight.pop(result.job_id))
                failed += not result.success
            time.sleep(POLL_S)
        took = time.monotonic() - started
        after = root_stats(tier)
        print(json.dumps({"walked": after["walked_entries"] - before["walked_entries"],
                          "walker": after["walker"], "passes": after["walk_passes"]
                          - before["walk_passes"], "blocks": n, "failed": failed,
                          "seconds": took, "pid": os.getpid()}), flush=True)


def run_tiers(root: str, count: int, tag: str, args: argparse.Namespace) -> dict[str, Any]:
    """``count`` engine processes storing into ``root`` at once for --b-seconds."""
    procs: list[subprocess.Popen] = []
    try:
        for i in range(count):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--root", root,
                   "--child-tag", f"{tag}-{i}", "--block-bytes", str(args.block_bytes),
                   "--job-blocks", str(args.job_blocks), "--b-seconds", str(args.b_seconds),
                   "--load-workers", str(args.load_workers),
                   "--store-workers", str(args.store_workers)]
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True, start_new_session=True))
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise SystemExit(f"a part-b engine (pid {p.pid}) did not start")
        time.sleep(2.0)  # the election settles (ELECT_GAP_S) before the clock starts
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        progress(f"{count} tier(s) storing for {args.b_seconds:g} s")
        results = []
        for p in procs:
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"a part-b engine (pid {p.pid}) ended without figures")
            results.append(json.loads(line))
            p.stdin.close()
            p.wait(timeout=60)
        procs.clear()
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return {"tiers": count, "walked": sum(r["walked"] for r in results),
            "walkers": sum(bool(r["walked"]) for r in results),
            "blocks": sum(r["blocks"] for r in results),
            "failed": sum(r["failed"] for r in results), "per_tier": results}


def part_b(folder: str, args: argparse.Namespace) -> dict[str, Any]:
    root = f"{folder}/b"
    tree = build_tree(root, b"scale-b", args.b_blocks, args)
    out: dict[str, Any] = {"tree": tree, "runs": []}
    for rnd in range(args.b_rounds):
        order = (1, args.b_tiers) if rnd % 2 == 0 else (args.b_tiers, 1)
        for count in order:
            run = run_tiers(root, count, f"b{rnd}-{count}", args)
            run["round"] = rnd
            out["runs"].append(run)
            progress(f"{count} tier(s): {run['walked']:,} entries walked by "
                     f"{run['walkers']} tier(s) (passes "
                     f"{[r['passes'] for r in run['per_tier']]}), {run['blocks']:,} blocks "
                     f"stored, {run['failed']} failed")
    remove_tree(root)
    return out


def summary_b(b: dict[str, Any], many: int) -> dict[str, Any]:
    one = [r["walked"] for r in b["runs"] if r["tiers"] == 1]
    lots = [r["walked"] for r in b["runs"] if r["tiers"] == many]
    ratio = statistics.median(lots) / max(1, statistics.median(one))
    return {"walked_one": one, "walked_many": lots, "ratio": ratio, "met": ratio <= 2.0,
            "blocks_one": [r["blocks"] for r in b["runs"] if r["tiers"] == 1],
            "blocks_many": [r["blocks"] for r in b["runs"] if r["tiers"] == many]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="/var/tmp/mptier-scale",
                        help="a folder for the bench's trees (made fresh, removed after)")
    parser.add_argument("--parts", default="a,b", help="a, b or a,b")
    parser.add_argument("--blocks", type=int, default=1_000_000,
                        help="blocks in part a's tree")
    parser.add_argument("--block-bytes", type=parse_bytes, default=4096,
                        help="block size (small: the tree's entries, not bytes, matter)")
    parser.add_argument("--job-blocks", type=int, default=ONE_TASK_BLOCKS,
                        help="blocks per store job (default: as many as one task record "
                        "holds, so a job is one task)")
    parser.add_argument("--rounds", type=int, default=6, help="part a's rounds")
    parser.add_argument("--jobs-per-round", type=int, default=40,
                        help="part a: store jobs of R, then of B, per round")
    parser.add_argument("--burst-jobs", type=int, default=200,
                        help="part a, at the end: B stores this many jobs at once...")
    parser.add_argument("--burst-in-flight", type=int, default=4,
                        help="...this many in flight (0 jobs: no burst)")
    parser.add_argument("--b-blocks", type=int, default=100_000,
                        help="blocks in part b's tree before the tiers store")
    parser.add_argument("--b-tiers", type=int, default=8, help="part b: the many tiers")
    parser.add_argument("--b-seconds", type=float, default=30.0,
                        help="part b: how long each run's tiers store")
    parser.add_argument("--b-rounds", type=int, default=1,
                        help="part b: runs of 1 and of --b-tiers tiers (order alternates)")
    parser.add_argument("--load-workers", type=int, default=2, help="per tier")
    parser.add_argument("--store-workers", type=int, default=2, help="per tier")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-tag", default="c", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    parts = set(args.parts.split(","))
    if not parts <= {"a", "b"}:
        raise SystemExit("--parts: a, b or a,b")
    folder = os.path.abspath(args.root)
    if os.path.exists(folder):
        raise SystemExit(f"{folder} exists: the bench makes it fresh and removes it")
    # Ctrl-C and SIGTERM end the run through the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()
                                        if not k.startswith("child")},
                              "loadavg_start": os.getloadavg(), "started": time.time()}
    try:
        os.makedirs(folder)
        if "a" in parts:
            report["a"] = part_a(folder, args)
            report["a_summary"] = summary_a(report["a"])
            report["loadavg_after_a"] = os.getloadavg()
        if "b" in parts:
            report["b"] = part_b(folder, args)
            report["b_summary"] = summary_b(report["b"], args.b_tiers)
        report["loadavg_end"] = os.getloadavg()
    finally:
        remove_tree(folder)
    print_report(report, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    load = " -> ".join(f"{report[k][0]:.1f}" for k in ("loadavg_start", "loadavg_end"))
    print(f"load average (1 min): {load}")
    if "a" in report:
        a, s = report["a"], report["a_summary"]
        print(f"a: {a['tree']['blocks']:,} blocks of {args.block_bytes} bytes in "
              f"{a['tree']['leaf_folders']:,} leaf folders (built in "
              f"{a['tree']['build_s']:.0f} s); B's first pass {a['first_pass_s']:.1f} s, "
              f"{a['after_pass']['walked_entries']:,} entries")
        print(f"a: one task ({args.job_blocks} blocks) without a budget: median "
              f"{1e3 * s['task_s_median']:.1f} ms, max {1e3 * s['task_s_max']:.1f} ms")
        print(f"a: {s['stores']} stores needing room: {s['stores_that_waited']} waited; "
              f"room wait max {1e3 * s['wait_s_max']:.1f} ms, median "
              f"{1e3 * s['wait_s_median']:.1f} ms; job median "
              f"{1e3 * s['b_job_s_median']:.1f} ms, max {1e3 * s['b_job_s_max']:.1f} ms; "
              f"evicted {a['end']['evicted_blocks']:,} blocks, usage "
              f"{a['end']['usage_bytes'] / a['capacity_bytes']:.4f} of the budget")
        print(f"a: target (longest wait <= one task) {'met' if s['met'] else 'NOT met'}")
        if "burst" in a:
            u = a["burst"]
            print(f"a: burst of {u['jobs']} jobs, {u['in_flight']} in flight: {u['waits']} "
                  f"room waits, {1e3 * u['wait_s']:.0f} ms in all (mean "
                  f"{1e3 * u['wait_s_mean']:.1f} ms); job median "
                  f"{1e3 * u['job_s_median']:.1f} ms, max {1e3 * u['job_s_max']:.1f} ms; "
                  f"{u['failed']} failed")
    if "b" in report:
        s = report["b_summary"]
        print(f"b: entries walked, 1 tier: {s['walked_one']}, {args.b_tiers} tiers: "
              f"{s['walked_many']}; ratio {s['ratio']:.2f} (blocks stored "
              f"{s['blocks_one']} / {s['blocks_many']})")
        print(f"b: target (ratio <= 2) {'met' if s['met'] else 'NOT met'}")


if __name__ == "__main__":
    main()

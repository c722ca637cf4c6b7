"""The tier under faults, scenario by scenario: what was run, lost, served wrong, leaked,
and the slowest engine call meanwhile (issue 9's report; docs/reliability.md).

    sudo .venv/bin/python tests/reliability_run.py                  # every scenario, ~3-5 min
    .venv/bin/python tests/reliability_run.py --only crash_storm,service_restarts
    .venv/bin/python tests/reliability_run.py --list

Scenarios (each with real processes, files, mounts and cgroups; one needing what this
machine lacks -- root, FUSE, a cgroup v1 freezer, a feature not on main yet -- is
skipped with the reason):

* ``crash_storm``      mixed jobs while a random worker (booting ones too) is SIGKILLed
                       every 50-200 ms
* ``sigstop_storm``    a random worker stopped for 0.1-2.5 s, then continued, again and
                       again
* ``stuck_workers``    workers frozen mid-load (cgroup v1: SIGKILL cannot end them) more
                       times than the pool has slots, then thawed
* ``hung_fuse_mount``  the FUSE fault file system: reads that block until released, a
                       slot reused meanwhile, a write that blocks until the connection
                       is aborted
* ``engine_sigkill_mid_store``  an engine killed while storing, five times; a new engine
                       on the same root afterwards
* ``service_restarts`` ``mptier serve`` killed or stopped and restarted four times while
                       the engine keeps submitting
* ``pidns_buffer``     an engine in another PID namespace sharing /dev/shm, while tiers
                       start (and clean up stale objects) outside
* ``hostile_entries``  symlinks, folders, FIFOs and wrong-size files at block paths
* ``hostile_client``   a client of ``mptier serve`` sending malformed datagrams, spoiled
                       attaches (a layout leaving the root, descriptors of the wrong
                       kind, a buffer larger than its file) and task records past its
                       buffer; then a well-behaved engine's traffic
* ``full_completion_pipe``  the engine stops reading its completion pipe past
                       io_timeout_s, then again during a crash storm: nobody blocks,
                       no healthy worker is shot, no report dropped or doubled
* ``impostor``         a second uid squats the engine's fallback run folder and listens
                       as its service, and listens in a group-writable run folder the
                       engine trusts; the engine must refuse both (its attach fails naming
                       the cause), use the real service through two restarts, and leak
                       nothing to the impostor
* ``killed_at_start``  30 engines SIGKILLed within a second of making their buffer; one
                       live tier afterwards frees every buffer, lease, run-folder entry
                       and probe file
* ``root_moved``       a tmpfs mounted over a running tier's root and taken away again:
                       stores follow the path, loads are right

Columns: *jobs run* (reported, or for a killed engine: completed before the kill);
*jobs lost* (submitted, never reported); *wrong bytes* (loads that reported success
with bytes other than the block's, or published files with wrong bytes); *objects
leaked* (after the scenario's teardown: mptier objects in /dev/shm, temporary block
files under its root, live child processes, mounts); *slowest call* (the longest single
engine call -- submit, lookup, on_schedule_end, get_finished_jobs, stats -- during the
scenario: every one is non-blocking by contract). Writes ``bench/results/
reliability.json`` and ``bench/results/reliability.md`` (the table; both untracked).

Long because it is a catalogue: thirteen scenarios of 30-100 lines each, every one a
whole story (start the fault, drive traffic through it, end it, fill the row) that reads
top to bottom and shares nothing with the others but the row, the leak watch and the
table below. What they share beyond that is in ``reliability_kit.py`` (traffic, job
book, services, stop storms) and ``hostile_client.py``, which the pytest suites use too;
splitting the catalogue by kind of fault would scatter one report's rows over files
without making any scenario shorter.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import psutil
from reliability_kit import (
    EngineCalls,
    JobBook,
    Service,
    Traffic,
    busy_worker,
    content,
    run_stop_storm,
    stop_services,
    temp_files,
    wait_until,
    worker_state,
)

from mptier import FileSystemTier, LookupResult, SharedKVBuffer, make_key
from mptier.service import link
from mptier.workers.serving import STALL_ENV

# This runner lives beside the fault machinery it drives (reliability_kit, support/):
# run as a script, its own folder is first on the import path, so bench/ never reaches
# into tests/ and nothing edits sys.path.
TESTS = Path(__file__).resolve().parent

KB = 1 << 10
BLOCK = 64 * KB
RESULTS = TESTS.parent / "bench" / "results"


class Skip(Exception):
    """A scenario that cannot run here (says why)."""


@dataclass
class Row:
    scenario: str
    jobs_run: int | None = None
    jobs_lost: int | None = None
    wrong_bytes: int | None = None
    objects_leaked: int | None = None
    slowest_call_s: float | None = None
    slowest_call: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    status: str = "ran"  # ran / skipped / error
    # pids whose /dev/shm objects count as this scenario's (names carry the creator's
    # pid; other programs on the machine make objects too)
    owners: set[int] = field(default_factory=lambda: {os.getpid()}, repr=False)

    def from_book(self, book: JobBook, calls: EngineCalls) -> None:
        self.jobs_run = (self.jobs_run or 0) + len(book.results)
        self.jobs_lost = (self.jobs_lost or 0) + len(book.lost())
        self.wrong_bytes = (self.wrong_bytes or 0) + len(book.wrong)
        self.slow(calls.slowest, calls.slowest_call)
        if book.twice:
            self.notes.append(f"{len(book.twice)} job(s) reported twice")

    def slow(self, seconds: float, call: str) -> None:
        if self.slowest_call_s is None or seconds > self.slowest_call_s:
            self.slowest_call_s, self.slowest_call = seconds, call


def keys_for(n: int, tag: bytes) -> list[bytes]:
    return [make_key(tag.ljust(28, b".") + i.to_bytes(4, "big")) for i in range(n)]


def full_pool(tier, size: int) -> bool:
    workers = [w for w in tier.stats()["workers"] if w["state"] != "stuck"]
    return len(workers) == size and all(w["alive"] and w["ready"] for w in workers)


# -- leaks ---------------------------------------------------------------------------------

class LeakWatch:
    """What a scenario leaves behind: new mptier objects in /dev/shm, temporary files
    under its root, live child processes, mounts under this run's mount folder."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.shm_before = self._shm()

    @staticmethod
    def _shm(owners: set[int] | None = None) -> set[str]:
        found = set()
        for name in os.listdir("/dev/shm"):
            parts = name.split(".")
            if parts[0] == "mptier" and len(parts) > 2 and parts[1].isdigit() and (
                    owners is None or int(parts[1]) in owners):
                found.add(name)
        return found

    def count(self, row: Row, settle_s: float = 5.0) -> None:
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and _live_children():
            time.sleep(0.05)
        children = _live_children()
        shm = sorted(self._shm(row.owners) - self.shm_before)
        temps = temp_files(self.root) if os.path.isdir(self.root) else []
        mounts_left = _our_mounts()
        row.objects_leaked = len(children) + len(shm) + len(temps) + len(mounts_left)
        for what, items in (("child processes", [c.pid for c in children]),
                            ("/dev/shm objects", shm), ("temporary files", temps),
                            ("mounts", mounts_left)):
            if items:
                row.notes.append(f"leaked {len(items)} {what}: {items[:3]}")
        for child in children:  # do not let one scenario's leak spill into the next
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def _live_children() -> list[psutil.Process]:
    out = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.status() != psutil.STATUS_ZOMBIE:
                out.append(child)
    return out


def _our_mounts() -> list[str]:
    from support import mounts

    return sorted(mounts.mounts_under(mounts.mount_root()))


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        raise Skip(f"{what} needs root")


# -- scenarios -----------------------------------------------------------------------------

def crash_storm(row: Row, root: str, seconds: float = 20.0) -> None:
    rng = random.Random(1)
    buf = SharedKVBuffer.create(64, BLOCK)
    tier = FileSystemTier(buf, root_dir=root, n_load_workers=2, n_store_workers=2,
                          task_bytes=2 * BLOCK, prefault=False)
    try:
        calls = EngineCalls(tier)
        book = JobBook(calls, buf)
        keys = keys_for(256, b"storm")
        free_src, free_dst = list(range(32)), list(range(32, 64))
        slots_of: dict[int, tuple[str, list[int]]] = {}
        kills = 0

        def collect() -> None:
            for result in book.collect():
                kind, slots = slots_of.pop(result.job_id)
                (free_src if kind == "store" else free_dst).extend(slots)

        ends = time.monotonic() + seconds
        next_kill = time.monotonic()
        while time.monotonic() < ends:
            now = time.monotonic()
            if now >= next_kill:
                victims = [w["pid"] for w in calls.stats()["workers"] if w["alive"]]
                if victims:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(rng.choice(victims), signal.SIGKILL)
                        kills += 1
                next_kill = now + rng.uniform(0.05, 0.2)
            choice = rng.random()
            if choice < 0.45 and len(free_src) >= 4:
                chosen = rng.sample(keys, rng.randint(1, 4))
                slots = [free_src.pop() for _ in chosen]
                slots_of[book.store(chosen, slots)] = ("store", slots)
            elif choice < 0.9 and book.stored and len(free_dst) >= 4:
                chosen = rng.sample(sorted(book.stored), min(len(book.stored),
                                                             rng.randint(1, 4)))
                slots = [free_dst.pop() for _ in chosen]
                slots_of[book.load(chosen, slots)] = ("load", slots)
            else:
                for key in rng.sample(keys, 8):
                    calls.lookup(key, rng.randrange(7))
                calls.on_schedule_end()
            collect()
            time.sleep(0.002)
        storm_over = time.monotonic()
        deadline = time.monotonic() + 60
        while book.pending and time.monotonic() < deadline:
            collect()
            time.sleep(0.01)
        wait_until(lambda: full_pool(tier, 4), 30, "the pool whole again")
        row.notes.append(f"{kills} kills over {seconds:g} s; pool whole "
                         f"{time.monotonic() - storm_over:.1f} s after the last")
        after = book.store(keys_for(1, b"after storm"), [free_src[0]])
        ok = book.wait([after], timeout=30).get(after)
        row.notes.append("a store after the storm " + ("succeeded" if ok and ok.success
                                                       else "FAILED"))
        stats = tier.stats()["pool"]
        row.notes.append(f"deaths {stats['deaths']}, retried {stats['tasks_retried']}, "
                         f"lost tasks {stats['tasks_lost']}, boot failures "
                         f"{stats['boot_failures']}")
        row.from_book(book, calls)
    finally:
        tier.shutdown()
        buf.close()
        buf.unlink()


def sigstop_storm(row: Row, root: str, seconds: float = 12.0) -> None:
    rng = random.Random(7)
    buf = SharedKVBuffer.create(48, BLOCK)
    tier = FileSystemTier(buf, root_dir=root, n_load_workers=2, n_store_workers=2,
                          io_timeout_s=1.0, heartbeat_s=0.5, prefault=False)
    try:
        calls = EngineCalls(tier)
        book = JobBook(calls, buf)
        keys = keys_for(24, b"stop storm")
        book.wait([book.store(keys, list(range(24)))])
        stops = run_stop_storm(calls, book, keys, rng, seconds)
        book.drain(30)
        pool = tier.stats()["pool"]
        row.notes.append(f"{stops} stops; {pool['timeouts']} timed out, "
                         f"{pool['heartbeat_kills']} missed heartbeats")
        row.from_book(book, calls)
    finally:
        tier.shutdown()
        buf.close()
        buf.unlink()


def stuck_workers(row: Row, root: str) -> None:
    from support import freezer

    reason = freezer.freezer_unavailable_reason(require_sigkill_proof=True)
    if reason:
        raise Skip(reason)
    io_timeout = 2.0
    os.environ[STALL_ENV] = "load:1.0"  # time to freeze a worker mid-load (replacements too)
    buf = SharedKVBuffer.create(32, BLOCK)
    cgroups: list = []
    tier = None
    try:
        tier = FileSystemTier(buf, root_dir=root, n_load_workers=1, n_store_workers=1,
                              io_timeout_s=io_timeout, max_stuck_workers=1, prefault=False)
        calls = EngineCalls(tier)
        book = JobBook(calls, buf)
        keys = keys_for(8, b"frozen")
        book.wait([book.store(keys, list(range(8)))])
        frozen: list[int] = []
        failed_after: list[float] = []
        fast: list[float] = []
        heal: list[float] = []
        n = 0
        for _outage in range(2):
            while not calls.stats()["unavailable"]:
                job = book.load([keys[n % 8]], [16 + n % 8])
                worker = busy_worker(tier, exclude=frozen)
                cg = freezer.FrozenCgroup(1)
                cgroups.append(cg)
                cg.add(worker["pid"])
                cg.freeze()
                frozen.append(worker["pid"])
                result = book.wait([job], timeout=io_timeout + 10).get(job)
                if result is None or result.success:
                    row.notes.append(f"load {job} on a frozen worker: {result}")
                failed_after.append(book.latency.get(job, float("nan")))
                wait_until(lambda w=worker: worker_state(tier, w["pid"]) == "stuck", 10,
                           "the frozen worker parked", book.collect)
                n += 1
            started = time.perf_counter()
            refused = book.store(keys_for(1, b"refused%d" % n), [30])
            book.collect()
            fast.append(time.perf_counter() - started)
            if refused not in book.results or book.results[refused].success:
                row.notes.append("a job was not failed at once while unavailable")
            if calls.lookup(keys[1], f"outage {n}") is not LookupResult.MISS:
                row.notes.append("a lookup did not miss while unavailable")
            thawed = time.monotonic()
            for cg in cgroups:
                cg.close()
            cgroups.clear()
            wait_until(lambda: not calls.stats()["unavailable"] and full_pool(tier, 2), 20,
                       "serving again after the thaw", book.collect)
            heal.append(time.monotonic() - thawed)
        row.notes.append(f"{len(frozen)} workers frozen (slots: 3); each frozen load failed "
                         f"after {min(failed_after):.1f}-{max(failed_after):.1f} s "
                         f"(io_timeout_s={io_timeout:g}); past max_stuck_workers=1 jobs "
                         f"failed within {max(fast) * 1e3:.2f} ms; serving again "
                         f"{max(heal):.1f} s after the thaw")
        book.drain(30)
        row.from_book(book, calls)
    finally:
        for cg in cgroups:
            cg.close()
        if tier is not None:
            tier.shutdown()
        del os.environ[STALL_ENV]
        buf.close()
        buf.unlink()


def hung_fuse_mount(row: Row, root: str) -> None:
    from support import fusefs, mounts

    reason = fusefs.fuse_unavailable_reason()
    if reason:
        raise Skip(reason)
    io_timeout = 2.0
    fs = fusefs.FuseFS(Path(root) / "fuse-backing", mounts.new_mount_dir("fuse-")).start()
    buf = SharedKVBuffer.create(32, BLOCK)
    tier = None
    try:
        tier = FileSystemTier(buf, root_dir=str(fs.path("kv")), n_load_workers=1,
                              n_store_workers=1, io_timeout_s=io_timeout, prefault=False,
                              use_o_direct=True)
        calls = EngineCalls(tier)
        book = JobBook(calls, buf)
        hung, fresh, *others = keys_for(6, b"hung")
        book.wait([book.store([hung, fresh, *others], list(range(6)))])
        name = f"*{os.path.basename(tier.mapper.path_for(hung))}*"
        rule = fs.block("read", name)
        job = book.load([hung], [8])
        fs.wait_blocked(rule)
        served = 0
        while job not in book.results:  # the other worker goes on serving
            more = book.load([others[served % 4]], [16 + served % 8])
            book.wait([more], timeout=10)
            served += 1
        pid = int(tier.stats()["pool"]["last_deaths"][-1].split(" pid ")[1].split()[0])
        wait_until(lambda: worker_state(tier, pid) == "stuck", 10, "parked", book.collect)
        reuse = book.load([fresh], [8])  # the engine reuses the failed load's slot
        book.wait([reuse], timeout=10)
        rule.release()  # the stuck read completes now
        wait_until(lambda: worker_state(tier, pid) is None, 10, "released", book.collect)
        if not np.array_equal(buf.view[8], content(fresh, BLOCK)):
            row.wrong_bytes = (row.wrong_bytes or 0) + 1
            row.notes.append("a late read landed in a reused slot")
        row.notes.append(f"a hung read failed its load after {book.latency[job]:.1f} s "
                         f"(io_timeout_s={io_timeout:g}); {served} other loads meanwhile; "
                         "its worker was parked, then freed by the release")
        rule = fs.block("write", f"*{os.path.basename(tier.mapper.path_for(others[0]))}*",
                        times=1)
        os.unlink(tier.mapper.path_for(others[0]))
        stored = book.store([others[0]], [2])
        fs.wait_blocked(rule)
        result = book.wait([stored], timeout=io_timeout + 10).get(stored)
        stuck = [w["pid"] for w in tier.stats()["workers"] if w["state"] in ("killed",
                                                                             "stuck")]
        wait_until(lambda: any(w["state"] == "stuck" for w in tier.stats()["workers"]),
                   10, "the writer parked", book.collect)
        mounts.abort_fuse(fs.mountpoint)
        wait_until(lambda: all(worker_state(tier, p) is None for p in stuck), 10,
                   "the writer freed by the abort", book.collect)
        row.notes.append("a hung write: the store was retried on the other worker ("
                         + ("succeeded" if result and result.success else f"{result}")
                         + "), the writer parked until the connection was aborted")
        book.drain(10)
        row.from_book(book, calls)
    finally:
        if tier is not None:
            tier.shutdown()
        fs.close()
        shutil.rmtree(fs.mountpoint, ignore_errors=True)
        buf.close()
        buf.unlink()
    # The aborted mount could not remove the stuck writer's temporary file; the files
    # are still in the backing folder. The lease sweeper (what an operator runs, and what
    # a tier will run at start) finds that writer dead and removes them.
    left = temp_files(fs.backing)
    if left:
        gc = subprocess.run([sys.executable, "-m", "mptier.cli", "gc",
                             str(fs.backing / "kv"), "--older-than", "1000d", "--json",
                             "--no-progress"], capture_output=True, text=True, timeout=60)
        removed = json.loads(gc.stdout)["temps_removed"] if gc.returncode == 0 else gc.stderr
        row.notes.append(f"the aborted mount left {len(left)} temporary file(s) of the stuck "
                         f"writer; `mptier gc` afterwards removed {removed}")


ENGINE_STORING = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, sys.argv[2])
    from reliability_kit import EngineCalls, JobBook
    from mptier import FileSystemTier, SharedKVBuffer, make_key
    buf = SharedKVBuffer.create(32, 65536)
    tier = FileSystemTier(buf, root_dir=sys.argv[1], n_load_workers=1, n_store_workers=2,
                          prefault=False, task_bytes=65536)
    calls = EngineCalls(tier)
    book = JobBook(calls, buf)
    n = 0
    while True:
        if len(book.pending) < 4:
            keys = [make_key(os.urandom(28) + i.to_bytes(4, "big")) for i in range(8)]
            book.store(keys, list(range(8 * (n % 4), 8 * (n % 4) + 8)))
            n += 1
        book.collect()
        ok = sum(r.success for r in book.results.values())
        print(json.dumps({"done": ok, "slowest": calls.slowest,
                          "call": calls.slowest_call}), flush=True)
        time.sleep(0.005)
""")


def engine_sigkill_mid_store(row: Row, root: str, kills: int = 5) -> None:
    from mptier.layout import FileMapper

    rng = random.Random(3)
    row.jobs_run = 0
    for _ in range(kills):
        engine = subprocess.Popen([sys.executable, "-c", ENGINE_STORING, root, str(TESTS)],
                                  stdout=subprocess.PIPE, text=True)
        row.owners.add(engine.pid)
        last: dict = {}
        try:
            deadline = time.monotonic() + 60
            first = None
            while time.monotonic() < deadline:
                line = engine.stdout.readline()
                if not line:
                    break
                last = json.loads(line)
                first = first or time.monotonic()
                if time.monotonic() - first > rng.uniform(0.5, 1.5):
                    break
            engine.kill()
            engine.wait()
        finally:
            engine.kill()
            engine.wait()
            engine.stdout.close()
        row.jobs_run += last.get("done", 0)
        row.slow(last.get("slowest", 0.0), last.get("call", ""))
    from mptier.config import TierConfig

    mapper = FileMapper(root, **TierConfig(root_dir=root).layout_kwargs())
    leftover = temp_files(root)
    row.notes.append(f"{kills} engines killed mid-store; {len(leftover)} temporary files "
                     "left by them")
    # A new engine on the same root, at once (objects are locked before they are
    # named, so no grace is needed): its start removes what nobody holds any more.
    buf = SharedKVBuffer.create(8, BLOCK)
    tier = FileSystemTier(buf, root_dir=root, n_load_workers=1, n_store_workers=1,
                          prefault=False)
    try:
        time.sleep(1.0)
    finally:
        tier.shutdown()
        buf.close()
        buf.unlink()
    still = temp_files(root)
    if still:
        row.notes.append(f"{len(still)} still there after a new engine started (temp-file "
                         "leases and their sweeper are not on main yet)")
    # Every published block is whole and holds its key's bytes: no torn block is served.
    wrong = checked = 0
    for folder, _, names in os.walk(mapper.blocks_dir):
        for name in names:
            if not name.endswith(".bin"):
                continue
            group = int(os.path.basename(folder).split("_g")[1])
            key = make_key(bytes.fromhex(name[:-4]), group)
            with open(os.path.join(folder, name), "rb") as f:
                data = np.frombuffer(f.read(), np.uint8)
            checked += 1
            wrong += not np.array_equal(data, content(key, BLOCK))
    row.wrong_bytes = wrong
    row.notes.append(f"{checked} published blocks checked byte for byte")
    row.jobs_lost = None  # a killed engine's jobs die with it: nobody to report to


def service_restarts(row: Row, root: str, restarts: int = 4) -> None:
    run_dir = tempfile.mkdtemp(prefix="mptier-rel-run-")
    os.environ["MPTIER_RUN_DIR"] = run_dir
    old_reconnect = link.RECONNECT_S
    link.RECONNECT_S = 0.2
    services: list[Service] = []
    buf = SharedKVBuffer.create(32, BLOCK)
    tier = None
    try:
        services.append(Service("rel", root, run_dir))
        tier = FileSystemTier(buf, root_dir="/unused", service="rel")
        calls = EngineCalls(tier)
        book = JobBook(calls, buf)
        keys = keys_for(16, b"restarts")
        book.wait([book.store(keys, list(range(16)))])
        away: list[float] = []
        back: list[float] = []
        work = Traffic(book, calls, keys).step

        for restart in range(restarts):
            work(20)
            sig = signal.SIGKILL if restart % 2 == 0 else signal.SIGTERM
            current = services[-1]
            current.proc.send_signal(sig)
            sent = time.monotonic()
            wait_until(lambda: calls.stats()["unavailable"], 15, "noticed", work)
            away.append(time.monotonic() - sent)
            wait_until(lambda c=current: c.proc.poll() is not None, 30, "exited", work)
            current.stop()
            services.append(Service("rel", root, run_dir))
            started = time.monotonic()
            wait_until(lambda: not calls.stats()["unavailable"], 20, "attached", work)
            back.append(time.monotonic() - started)
        work(20)
        book.drain(30)
        row.notes.append(f"{restarts} restarts (SIGKILL and SIGTERM in turn); the engine "
                         f"noticed within {max(away):.2f} s, attached again within "
                         f"{max(back):.2f} s of each start; "
                         f"{sum(not r.success for r in book.results.values())} jobs failed "
                         "(those in flight or sent while it was away)")
        row.from_book(book, calls)
    finally:
        link.RECONNECT_S = old_reconnect
        if tier is not None:
            tier.shutdown()
        with contextlib.suppress(AssertionError):  # a leak is counted, not raised
            stop_services(services, signal.SIGTERM, 10)
        buf.close()
        buf.unlink()
        del os.environ["MPTIER_RUN_DIR"]
        shutil.rmtree(run_dir, ignore_errors=True)


INSIDE = """
import sys
sys.path.insert(0, {tests!r})
from reliability_kit import EngineCalls, JobBook, content
from mptier import FileSystemTier, SharedKVBuffer, make_key
buf = SharedKVBuffer.create(16, 65536)
tier = FileSystemTier(buf, root_dir={root!r}, n_load_workers=1, n_store_workers=1,
                      prefault=False)
calls = EngineCalls(tier)
book = JobBook(calls, buf)
keys = [make_key(b"inside".ljust(28, b".") + i.to_bytes(4, "big")) for i in range(8)]
book.wait([book.store(keys, list(range(8)))])
"""


def pidns_buffer(row: Row, root: str) -> None:
    from support import pidns

    from mptier.shm import cleanup_stale

    reason = pidns.pidns_unavailable_reason()
    if reason:
        raise Skip(reason)
    with pidns.PidNamespace() as ns:
        row.owners.add(ns.ns_pid)
        ns.run(INSIDE.format(tests=str(TESTS), root=os.path.join(root, "inside")))
        name = ns.eval("buf.name")
        removed = cleanup_stale()  # what a start here does
        outside_buf = SharedKVBuffer.create(8, BLOCK)
        outside = FileSystemTier(outside_buf, root_dir=os.path.join(root, "outside"),
                                 n_load_workers=1, n_store_workers=1, prefault=False)
        outside.shutdown()
        outside_buf.close()
        outside_buf.unlink()
        survived = os.path.exists(f"/dev/shm/{name}") and name not in removed
        ns.run("loaded = book.load(keys, list(range(8, 16)))\nbook.wait([loaded])")
        inside = ns.eval("[len(book.results), len(book.lost()), len(book.wrong), "
                         "len(book.twice), calls.slowest, calls.slowest_call]")
        ns.run("tier.shutdown()\nbuf.close()\nbuf.unlink()")
    row.jobs_run, row.jobs_lost, row.wrong_bytes = inside[0], inside[1], inside[2]
    row.slow(inside[4], inside[5])
    row.notes.append("the inner engine's buffer " + ("survived" if survived else
                                                     "WAS REMOVED BY") +
                     " another namespace's stale cleanup and a tier start there")


def hostile_entries(row: Row, root: str) -> None:
    buf = SharedKVBuffer.create(16, BLOCK)
    tier = FileSystemTier(buf, root_dir=os.path.join(root, "kv"), n_load_workers=1,
                          n_store_workers=1, prefault=False)
    try:
        if "bad_entries" not in tier.stats():
            raise Skip("hostile-entry handling (issue 9 item 4: never follow a symlink or "
                       "leave the root, serve only regular files of exactly the block "
                       "size, count bad entries) is not on main yet")
        calls = EngineCalls(tier)
        book = JobBook(calls, buf)
        outside = Path(root) / "outside"
        outside.mkdir()
        (outside / "foreign.bin").write_bytes(os.urandom(BLOCK))
        keys = keys_for(9, b"hostile")
        book.wait([book.store(keys[:1], [0])])  # a real block inside, for the links
        inside = Path(tier.mapper.path_for(keys[0]))

        def plant(kind: str, path: Path) -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            if kind == "symlink-inside":
                path.symlink_to(inside)
            elif kind == "symlink-outside":
                path.symlink_to(outside / "foreign.bin")
            elif kind == "directory":
                path.mkdir()
            elif kind == "fifo":
                os.mkfifo(path)
            else:
                size = {"shorter": BLOCK // 2, "longer": BLOCK * 2, "empty": 0}[kind]
                path.write_bytes(os.urandom(size))

        kinds = ["symlink-inside", "symlink-outside", "directory", "fifo", "shorter",
                 "longer", "empty"]
        table = []
        for n, kind in enumerate(kinds, start=1):
            key = keys[n]
            path = Path(tier.mapper.path_for(key))
            plant(kind, path)
            answer = calls.lookup(key, kind)
            calls.on_schedule_end()
            answer = wait_until(lambda k=key, r=kind: (
                a := calls.lookup(k, r)) is not LookupResult.RETRY and a, 10, "an answer",
                book.collect)
            loaded = book.load([key], [8])
            load = book.wait([loaded], timeout=10).get(loaded)
            if load is not None and load.success:
                row.wrong_bytes = (row.wrong_bytes or 0) + 1
            stored = book.store([key], [9])
            store = book.wait([stored], timeout=10).get(stored)
            left = ("symlink" if path.is_symlink() else "directory" if path.is_dir()
                    else "fifo" if path.is_fifo() else f"file of {path.stat().st_size} B"
                    if path.exists() else "nothing")
            table.append(f"{kind}: lookup {answer.name}, load "
                         f"{'ok' if load and load.success else 'failed'}, store "
                         f"{'ok' if store and store.success else 'failed'}, left {left}")
        # a layout sub-folder replaced by a symlink to a folder outside the root
        key = keys[8]
        folder = Path(tier.mapper.path_for(key)).parent
        shutil.rmtree(folder, ignore_errors=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        escape = outside / "escape"
        escape.mkdir()
        folder.symlink_to(escape)
        stored = book.store([key], [10])
        book.wait([stored], timeout=10)
        written_outside = list(escape.iterdir())
        if written_outside:
            row.objects_leaked = len(written_outside)
            row.notes.append(f"a store wrote outside the root: {written_outside}")
        table.append(f"symlinked sub-folder: store "
                     f"{'ok' if book.results[stored].success else 'failed'}, "
                     f"{len(written_outside)} file(s) written outside the root")
        row.notes.extend(table)
        row.notes.append(f"bad_entries {tier.stats()['bad_entries']}")
        book.drain(10)
        row.from_book(book, calls)
    finally:
        tier.shutdown()
        buf.close()
        buf.unlink()


def hostile_client(row: Row, root: str) -> None:
    """A client of ``mptier serve`` that speaks the wire protocol by hand
    (tests/hostile_client.py): the malformed first datagrams, the spoiled attaches
    (traversal in the layout, wrong types, descriptors of the wrong kind, a buffer larger
    than its file), garbage on an attached link, task records with block ids past the
    buffer; then a well-behaved engine's traffic, verified byte for byte."""
    import hostile_client as hc

    run_dir = tempfile.mkdtemp(prefix="mptier-rel-run-")
    os.environ["MPTIER_RUN_DIR"] = run_dir
    outside = os.path.join(root, "outside")
    os.makedirs(outside)
    kv = os.path.join(root, "kv")
    services = [Service("hostile", kv, run_dir, heartbeat_s=1)]
    path = os.path.join(run_dir, "hostile.sock")
    sent = exits = wrong = 0
    broken: list[str] = []

    def after(name: str) -> None:
        nonlocal sent, exits
        sent += 1
        if services[-1].proc.poll() is not None:  # it died of it: count, start anew
            exits += 1
            broken.append(name)
            services.append(Service("hostile", kv, run_dir, heartbeat_s=1))

    try:
        for name, (data, make) in hc.FIRST_DATAGRAMS.items():
            with contextlib.suppress(OSError):
                hc.send_datagram(path, data, make())
            after(name)
        spoiled = {**hc.attaches(outside), **hc.wrong_values()}
        for name, attack in spoiled.items():
            with contextlib.suppress(OSError):
                reply = hc.send_attach(path, attack).reply
                wrong += bool(reply and reply.get("ok"))  # accepted: served a lie
            after(name)
        for name, (data, n_fds) in hc.LINK_GARBAGE.items():
            with contextlib.suppress(OSError, AssertionError):
                if hc.garbage_on_link(path, data, n_fds):
                    row.notes.append(f"link garbage {name!r} did not end that session")
            after(f"link: {name}")
        try:
            wrong += hc.task_attacks(path).wrong
        except (OSError, AssertionError) as exc:
            row.notes.append(f"the task-record attack could not run: {exc}")
        sent += len(hc.PAST) * 2 + len(hc.GARBAGE_RECORDS) - 1  # after() counts one
        after("task records past the buffer, garbage records")
        workers = sorted(services[-1].children())
        with contextlib.suppress(OSError, AssertionError):
            if hc.blocking_after_attach(path, wait_s=3.0) != {1: 0}:
                row.notes.append("a store after the engine cleared O_NONBLOCK never finished")
        if sorted(services[-1].children()) != workers:
            row.notes.append("workers were replaced after the engine cleared O_NONBLOCK")
        after("O_NONBLOCK cleared after attach")
        engine = hc.EngineCheck("hostile")
        try:
            engine.attach()
            assert engine.book is not None and engine.calls is not None
            keys = keys_for(4, b"hostile-client")  # Traffic: slots 0-3 and 4-7
            engine.book.wait([engine.book.store(keys, list(range(4)))])
            Traffic(engine.book, engine.calls, keys).step(20)
            engine.book.drain(30)
            row.from_book(engine.book, engine.calls)
        finally:
            engine.close()
        escaped = hc.files_under(outside)
        row.wrong_bytes = (row.wrong_bytes or 0) + wrong
        row.objects_leaked = (row.objects_leaked or 0) + len(escaped)
        row.notes.append(f"{sent} attacks sent ({len(hc.FIRST_DATAGRAMS)} malformed first "
                         f"datagrams, {len(spoiled)} spoiled attaches, "
                         f"{len(hc.LINK_GARBAGE)} garbage messages on an attached link, "
                         f"{len(hc.PAST) * 2} task records past the buffer, "
                         f"{len(hc.GARBAGE_RECORDS)} garbage task records, O_NONBLOCK "
                         "cleared on the pipes after attach); service exits "
                         f"{exits}{f' (after {broken})' if broken else ''}; wrong bytes "
                         f"{wrong}; files outside the root {len(escaped)}")
        if exits:
            row.status = "error"
    finally:
        with contextlib.suppress(AssertionError):  # a leak is counted, not raised
            stop_services(services, signal.SIGTERM, 10)
        del os.environ["MPTIER_RUN_DIR"]
        shutil.rmtree(run_dir, ignore_errors=True)


def full_completion_pipe(row: Row, root: str, jobs: int = 1500) -> None:
    """Thousands of one-block jobs while the engine does not read its completion pipe:
    first for longer than io_timeout_s (workers wait to report: none may be taken for
    hung), then during a crash storm (a worker SIGKILLed every ~50 ms: the supervisor's
    RETRY/LOST reports wait for room too). The pipe is shrunk to a page through the
    tier's fileno(), so a few hundred reports fill it as tens of thousands would fill
    the real 1 MiB."""
    import fcntl

    from mptier.channels import F_SETPIPE_SZ

    rng = random.Random(3)
    io_timeout_s, block = 2.0, 4 * KB
    buf = SharedKVBuffer.create(2 * jobs, block)
    tier = FileSystemTier(buf, root_dir=root, n_load_workers=2, n_store_workers=2,
                          io_timeout_s=io_timeout_s, heartbeat_s=1.0, max_task_retries=100,
                          prefault=False)
    try:
        fcntl.fcntl(tier.fileno(), F_SETPIPE_SZ, os.sysconf("SC_PAGE_SIZE"))
        calls = EngineCalls(tier)
        book = JobBook(calls, buf)
        keys = keys_for(jobs, b"full pipe")

        def shot() -> tuple[int, int]:  # workers the supervisor killed: hung, deaf
            pool = calls.stats()["pool"]
            return pool["timeouts"], pool["heartbeat_kills"]

        ids = [book.store([k], [i]) for i, k in enumerate(keys)]
        time.sleep(2 * io_timeout_s + 1)  # not polling
        paused = shot()
        book.wait(ids, timeout=120)
        kills, most_waiting = 0, 0
        ids = [book.load([k], [jobs + i]) for i, k in enumerate(keys)]
        ids += [book.store([k], [i]) for i, k in enumerate(keys_for(jobs, b"full pipe 2"))]
        wait_until(lambda: any(w["state"] == "reporting" for w in calls.stats()["workers"]),
                   30, "the completion pipe full")  # the storm begins once it is
        ends = time.monotonic() + 4.0
        before_storm = shot()
        while time.monotonic() < ends:  # not polling, killing
            stats = calls.stats()
            most_waiting = max(most_waiting, stats["pool"]["reports_waiting"])
            victims = [w["pid"] for w in stats["workers"] if w["alive"]]
            if victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rng.choice(victims), signal.SIGKILL)
                    kills += 1
            time.sleep(0.05)
        book.wait(ids, timeout=180)
        failed_stores = sum(1 for j, r in book.results.items()
                            if not r.success and j > 2 * jobs)  # the storm's stores
        during = [a - b for a, b in zip(shot(), before_storm)]
        row.notes.append(
            f"healthy workers killed {sum(paused)} (timed out {paused[0]}, missed heartbeats "
            f"{paused[1]}) while the engine did not read for {2 * io_timeout_s + 1:g} s "
            f"(io_timeout_s={io_timeout_s:g}); then {kills} SIGKILLs while it did not read "
            f"again: the supervisor's reports waiting for room {most_waiting} at most, "
            f"workers it killed meanwhile (timed out, missed heartbeats) {during}; stores "
            f"that failed {failed_stores}, jobs reported twice {len(book.twice)}")
        row.from_book(book, calls)
    finally:
        tier.shutdown()
        buf.close()
        buf.unlink()


def impostor(row: Row, root: str, restarts: int = 2) -> None:
    from support.hostile import HOSTILE_GID, Impostor, public_folder

    from mptier import MptierError, rundir

    need_root("a second uid (4242) for the impostor")
    pub = public_folder("mptier-rel-pub-")
    system = os.path.join(pub, "run-mptier")      # stands for /run/mptier (root's, 0755)
    fallback = os.path.join(pub, f"mptier-{os.geteuid()}")  # for /tmp/mptier-<uid>
    saved = (rundir.SYSTEM_RUN_DIR, rundir.fallback_dir, os.environ.pop("MPTIER_RUN_DIR",
                                                                       None))
    rundir.SYSTEM_RUN_DIR, rundir.fallback_dir = system, lambda: fallback
    old_reconnect = link.RECONNECT_S
    link.RECONNECT_S = 0.2
    impostors: list[Impostor] = []
    services: list[Service] = []
    buf = SharedKVBuffer.create(32, BLOCK)
    tier = None
    try:
        # 1. the squatted fallback: searched by nobody, so the attach fails naming it
        impostors.append(Impostor(fallback, "rel-imp"))
        try:
            FileSystemTier(buf, service="rel-imp", status_socket="",
                           worker_start_timeout_s=1.0).shutdown()
            row.notes.append("ATTACHED with only the impostor listening")
        except MptierError as exc:
            cause = "skipped run folder" in str(exc) and "owned by uid 4242" in str(exc)
            row.notes.append("with only the impostor listening, the attach failed " +
                             ("naming the squatted folder and its owner (uid 4242)" if cause
                              else f"WITHOUT naming the cause: {exc}"))
        # 2. the real service beside it, restarted: the engine uses it and only it
        os.mkdir(system, 0o755)
        services.append(Service("rel-imp", root, system))
        tier = FileSystemTier(buf, service="rel-imp", status_socket="")
        calls = EngineCalls(tier)
        book = JobBook(calls, buf)
        keys = keys_for(16, b"impostor")
        book.wait([book.store(keys, list(range(16)))])
        work = Traffic(book, calls, keys).step
        for _ in range(restarts):
            work(20)
            services[-1].proc.send_signal(signal.SIGKILL)
            wait_until(lambda: calls.stats()["unavailable"], 15, "noticed", work)
            services[-1].stop()
            services.append(Service("rel-imp", root, system))
            wait_until(lambda: not calls.stats()["unavailable"], 20, "attached", work)
        work(20)
        book.drain(30)
        row.from_book(book, calls)
        row.notes.append(f"the real service restarted {restarts} times: the engine "
                         f"attached again {tier.stats()['service']['reattaches']} times, "
                         "to it alone")
        tier.shutdown()
        tier = None
        # 3. a run folder the engine trusts (root's, writable by service_group 4242) with
        # the impostor listening in it: the engine connects, reads SO_PEERCRED, sends nothing
        shared = os.path.join(pub, "shared-run")
        os.mkdir(shared)
        os.chown(shared, 0, HOSTILE_GID)
        os.chmod(shared, 0o770)
        impostors.append(Impostor(shared, "rel-imp"))
        os.environ["MPTIER_RUN_DIR"] = shared
        try:
            FileSystemTier(buf, service="rel-imp", status_socket="",
                           service_group=str(HOSTILE_GID), worker_start_timeout_s=1.0
                           ).shutdown()
            row.notes.append("ATTACHED to a listener of uid 4242 in a trusted folder")
        except MptierError as exc:
            named = "served by uid 4242" in str(exc)
            row.notes.append("a listener of uid 4242 in a trusted folder was refused " +
                             ("naming its uid and pid" if named else f"but: {exc}"))
        finally:
            del os.environ["MPTIER_RUN_DIR"]
    finally:
        got = {"connections": 0, "message_bytes": 0, "fds": 0, "mapped_bytes": 0}
        for fake in impostors:
            for key, value in fake.stop().items():
                got[key] += value
        leaked = got["message_bytes"] + got["mapped_bytes"]
        row.notes.append(f"bytes leaked to the impostor: {leaked} ({got['connections']} "
                         f"connection(s) to it, {got['message_bytes']} B of messages, "
                         f"{got['fds']} descriptors, {got['mapped_bytes']} B of buffer "
                         "mapped)")
        if leaked or got["fds"]:
            row.status = "error"
        link.RECONNECT_S = old_reconnect
        if tier is not None:
            tier.shutdown()
        with contextlib.suppress(AssertionError):  # a leak is counted, not raised
            stop_services(services, signal.SIGTERM, 10)
        buf.close()
        buf.unlink()
        rundir.SYSTEM_RUN_DIR, rundir.fallback_dir = saved[0], saved[1]
        if saved[2] is not None:
            os.environ["MPTIER_RUN_DIR"] = saved[2]
        shutil.rmtree(pub, ignore_errors=True)


# The killed engines' blocks, and the live tier's after them: a root's first tier records
# its block size there (mptier.json) and a tier of another size is refused on it.
KILLED_BLOCK = 4096
KILLED_AT_START = f"""
import sys, time
from mptier import FileSystemTier, SharedKVBuffer
buf = SharedKVBuffer.create(8, {KILLED_BLOCK})
print(buf.name, flush=True)
tier = FileSystemTier(buf, root_dir=sys.argv[1], n_load_workers=1, n_store_workers=1,
                      prefault=False)
time.sleep(60)
"""


def killed_at_start(row: Row, root: str, engines: int = 30) -> None:
    """Engines SIGKILLed within a second of making their buffer, 30 in a row; then one
    live tier on the same root and nobody else: its start and its periodic sweeps must
    free every buffer, lease, run-folder entry and probe file the dead ones left."""
    from mptier.storage import names as N
    from mptier.storage.leases import lease_state
    from mptier.workers.supervisor import SHM_SWEEP_S

    rng = random.Random(21)
    run_dir = tempfile.mkdtemp(prefix="mptier-rel-run-")
    saved = os.environ.get("MPTIER_RUN_DIR")
    os.environ["MPTIER_RUN_DIR"] = run_dir
    names, pids = [], []
    try:
        for _ in range(engines):
            engine = subprocess.Popen([sys.executable, "-c", KILLED_AT_START, root],
                                      stdout=subprocess.PIPE, text=True)
            row.owners.add(engine.pid)
            pids.append(engine.pid)
            try:
                names.append(engine.stdout.readline().strip())
                with contextlib.suppress(subprocess.TimeoutExpired):
                    engine.wait(rng.uniform(0.0, 1.0))
            finally:
                engine.kill()
                engine.wait()
                engine.stdout.close()

        def shm_left() -> list[str]:
            return [n for n in names if n and os.path.exists(f"/dev/shm/{n}")]

        def leases_left() -> list[str]:
            with contextlib.suppress(FileNotFoundError):
                return [e for e in os.listdir(os.path.join(root, N.META_DIR, N.LEASES_DIR))
                        if lease_state(root, e.split(".")[0]) != "held"]
            return []

        def run_dir_left() -> list[str]:
            return [e for e in os.listdir(run_dir) if any(f"-{p}." in e for p in pids)]

        def probes_left() -> list[str]:
            # An engine killed while its tier probed the root's block folder (O_DIRECT,
            # xattrs, O_TMPFILE) leaves the probe's named file; the live tier's sweep
            # removes it once past the probe grace (storage.leases.PROBE_TEMP_GRACE_S).
            return [n for _, _, files in os.walk(root) for n in files
                    if N.PROBE_TEMP_RE.match(n)]

        at_kill = (len(shm_left()), len(leases_left()), len(probes_left()))
        started = time.monotonic()
        buf = SharedKVBuffer.create(8, KILLED_BLOCK)
        tier = FileSystemTier(buf, root_dir=root, n_load_workers=1, n_store_workers=1,
                              prefault=False)
        try:
            gone_after = {}
            deadline = started + 3 * SHM_SWEEP_S + 30
            while time.monotonic() < deadline:
                for what, left in (("buffers", shm_left), ("leases", leases_left),
                                   ("run-folder entries", run_dir_left),
                                   ("probe files", probes_left)):
                    if what not in gone_after and not left():
                        gone_after[what] = time.monotonic() - started
                if len(gone_after) == 4:
                    break
                time.sleep(0.2)
            left = len(shm_left()) + len(leases_left()) + len(run_dir_left()) \
                + len(probes_left())
        finally:
            tier.shutdown()
            buf.close()
            buf.unlink()
        row.objects_leaked = left
        row.notes.append(
            f"{engines} engines killed 0-1 s after making their buffer ({at_kill[0]} buffers, "
            f"{at_kill[1]} dead leases and {at_kill[2]} probe files still there when the "
            "last was killed); with one "
            "live tier: " + ", ".join(f"{w} gone {t:.1f} s after its start"
                                      for w, t in gone_after.items())
            + (f"; {left} left after {3 * SHM_SWEEP_S + 30:.0f} s" if left else ""))
        if left:
            row.status = "error"
    finally:
        if saved is None:
            del os.environ["MPTIER_RUN_DIR"]
        else:
            os.environ["MPTIER_RUN_DIR"] = saved
        shutil.rmtree(run_dir, ignore_errors=True)


def root_moved(row: Row, root: str) -> None:
    """A tmpfs mounted over a running tier's root, stores, loads, the mount taken away,
    stores again: every store goes where the root path leads at that moment, every load
    is right, nothing is lost."""
    from support import mounts

    need_root("mounting a tmpfs over a root")
    point = str(mounts.new_mount_dir("rel-follow-"))
    buf = SharedKVBuffer.create(48, BLOCK)
    tier = FileSystemTier(buf, root_dir=point, n_load_workers=1, n_store_workers=1,
                          prefault=False)
    try:
        calls = EngineCalls(tier)
        book = JobBook(calls, buf)
        bare, mounted, again = (keys_for(16, tag) for tag in (b"bare", b"mount", b"back"))

        def blocks() -> int:
            return sum(f.endswith(".bin") for _, _, fs in os.walk(point) for f in fs)

        book.wait([book.store(bare, list(range(16)))])
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "mptier-rel", point],
                       check=True, capture_output=True, timeout=30)
        try:
            book.wait([book.store(mounted, list(range(16, 32)))])
            on_mount = blocks()
            book.wait([book.load(mounted, list(range(32, 48)))])
        finally:
            mounts.unmount(point)
        book.wait([book.store(again, list(range(32, 48)))])
        on_bare = blocks()
        book.wait([book.load(bare, list(range(16))), book.load(again, list(range(16, 32)))])
        row.from_book(book, calls)
        failed = sum(not r.success for r in book.results.values())
        row.notes.append(f"stores after the mount on the mounted tmpfs: {on_mount} of 16; "
                         f"after it went away, on the bare folder: {on_bare} of 32; failed "
                         f"jobs {failed}")
        if on_mount != 16 or on_bare != 32 or failed:
            row.status = "error"
    finally:
        tier.shutdown()
        buf.close()
        buf.unlink()
        with contextlib.suppress(OSError):
            shutil.rmtree(point)


SCENARIOS: dict[str, Callable[[Row, str], None]] = {
    "crash_storm": crash_storm,
    "sigstop_storm": sigstop_storm,
    "stuck_workers": stuck_workers,
    "hung_fuse_mount": hung_fuse_mount,
    "engine_sigkill_mid_store": engine_sigkill_mid_store,
    "service_restarts": service_restarts,
    "pidns_buffer": pidns_buffer,
    "hostile_entries": hostile_entries,
    "hostile_client": hostile_client,
    "full_completion_pipe": full_completion_pipe,
    "impostor": impostor,
    "killed_at_start": killed_at_start,
    "root_moved": root_moved,
}


# -- running and reporting -----------------------------------------------------------------

def run(name: str, workdir: str) -> Row:
    row = Row(name)
    root = os.path.join(workdir, name)
    os.makedirs(root)
    watch = LeakWatch(root)
    started = time.monotonic()
    try:
        SCENARIOS[name](row, root)
    except Skip as exc:
        row.status = "skipped"
        row.notes.append(f"skipped: {exc}")
    except Exception as exc:
        row.status = "error"
        row.notes.append(f"error: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    row.seconds = time.monotonic() - started
    if row.status != "skipped":
        leaked_before = row.objects_leaked or 0
        watch.count(row)
        row.objects_leaked += leaked_before
    return row


def fmt(value, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def table(rows: list[Row]) -> str:
    lines = ["| scenario | jobs run | jobs lost | wrong bytes | objects leaked | "
             "slowest engine call | time |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        if r.status == "skipped":
            lines.append(f"| {r.scenario} | skipped | | | | | |")
            continue
        slowest = "-" if r.slowest_call_s is None else \
            f"{r.slowest_call_s * 1e3:.2f} ms ({r.slowest_call})"
        lines.append(f"| {r.scenario}{' (ERROR)' if r.status == 'error' else ''} | "
                     f"{fmt(r.jobs_run)} | {fmt(r.jobs_lost)} | {fmt(r.wrong_bytes)} | "
                     f"{fmt(r.objects_leaked)} | {slowest} | {r.seconds:.0f} s |")
    lines.append("")
    for r in rows:
        for note in r.notes:
            lines.append(f"- **{r.scenario}**: {note}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--list", action="store_true", help="list the scenarios")
    parser.add_argument("--out", default=str(RESULTS / "reliability.json"))
    args = parser.parse_args()
    if args.list:
        print("\n".join(SCENARIOS))
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    logging.basicConfig(level=logging.CRITICAL)  # the faults are the point: no log storm
    load_before = os.getloadavg()
    began = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="mptier-reliability-")
    rows = []
    try:
        for name in names:
            print(f"== {name}", file=sys.stderr, flush=True)
            rows.append(run(name, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        from support import mounts

        shutil.rmtree(mounts.mount_root(), ignore_errors=True)
    meta = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"kernel": platform.release(), "cpus": os.cpu_count(),
                 "python": platform.python_version()},
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.monotonic() - began, 1),
    }
    text = table(rows)
    print(text)
    print(f"\n{meta['command']} -- {meta['date']}, load average before "
          f"{meta['load_average_before']}, after {meta['load_average_after']}, "
          f"{meta['seconds']} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows_out = [{k: v for k, v in asdict(r).items() if k != "owners"} for r in rows]
    out.write_text(json.dumps({**meta, "rows": rows_out}, indent=2) + "\n")
    out.with_suffix(".md").write_text(text + "\n")
    bad = [r for r in rows if r.status == "error" or r.jobs_lost or r.wrong_bytes
           or r.objects_leaked]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

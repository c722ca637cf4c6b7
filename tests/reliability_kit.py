"""What the reliability tests (``tests/test_reliability_*.py``) and the scenario runner
(``tests/reliability_run.py``) measure a tier with, under faults:

* :class:`EngineCalls` -- the engine's calls on a tier, each one timed: the slowest one
  is the liveness figure ("never hang the engine");
* :class:`JobBook` -- jobs submitted through it and what became of them: each reported
  exactly once (a second report is recorded, never raised), every byte a successful load
  put in its slot checked against :func:`content` (a block's bytes follow from its key,
  whichever store wrote the file);
* :class:`StopStorm` / :func:`run_stop_storm` -- random workers SIGSTOPped and
  continued while the engine works;
  :class:`Traffic` -- the engine's own work meanwhile (stores and loads in turn, lookups);
* :func:`busy_worker`, :func:`worker_state`, :func:`temp_files`, :func:`tiny_tmpfs`.

Nothing here sleeps on the engine's behalf: callers poll, as a scheduler loop would.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# How late a supervisor tick may come on a loaded 2-core machine shared by several test
# runs, on top of the tier's own bounds (io_timeout_s, the 0.5 s tick). A bound, not a
# speed: a hang breaks it by orders of magnitude.
LATE_S = 2.5
# The liveness bound on any single engine call during a fault: every call is
# non-blocking by contract (microseconds when healthy), so a call this slow means it
# waited on I/O or on a lock held across I/O. Generous for a loaded machine.
ENGINE_CALL_BOUND_S = 1.0


def content(key: bytes, nbytes: int) -> np.ndarray:
    """The bytes stored under ``key``: derived from the key alone."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class EngineCalls:
    """The engine-facing calls of ``tier``, each timed (``slowest`` seconds, by
    ``slowest_call``). Use it instead of the tier wherever a scenario measures."""

    def __init__(self, tier: Any) -> None:
        self.tier = tier
        self.count = 0
        self.slowest = 0.0
        self.slowest_call = ""

    def _timed(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            took = time.perf_counter() - started
            self.count += 1
            if took > self.slowest:
                self.slowest, self.slowest_call = took, name

    def submit_store(self, job: Any) -> None:
        self._timed("submit_store", self.tier.submit_store, job)

    def submit_load(self, job: Any) -> None:
        self._timed("submit_load", self.tier.submit_load, job)

    def lookup(self, key: bytes, req_id: Any = None) -> Any:
        return self._timed("lookup", self.tier.lookup, key, req_id)

    def on_schedule_end(self) -> None:
        self._timed("on_schedule_end", self.tier.on_schedule_end)

    def get_finished_jobs(self) -> list:
        return self._timed("get_finished_jobs", self.tier.get_finished_jobs)

    def stats(self) -> dict:
        return self._timed("stats", self.tier.stats)


@dataclass
class Submitted:
    kind: str
    keys: list[bytes]
    slots: list[int]
    at: float


@dataclass
class JobBook:
    """Jobs of one tier (see module docstring). ``buf`` is its SharedKVBuffer."""

    calls: EngineCalls
    buf: Any
    next_id: int = 1
    pending: dict[int, Submitted] = field(default_factory=dict)
    results: dict[int, Any] = field(default_factory=dict)
    latency: dict[int, float] = field(default_factory=dict)
    twice: list[int] = field(default_factory=list)  # jobs reported more than once
    wrong: list[tuple[int, bytes, int]] = field(default_factory=list)  # (job, key, slot)
    stored: set[bytes] = field(default_factory=set)  # keys a store reported done

    @property
    def block_bytes(self) -> int:
        return self.buf.block_bytes

    def store(self, keys: list[bytes], slots: list[int]) -> int:
        """Fill ``slots`` with the keys' contents and submit their store."""
        for key, slot in zip(keys, slots):
            self.buf.view[slot] = content(key, self.block_bytes)
        return self._submit("store", self.calls.submit_store, keys, slots)

    def load(self, keys: list[bytes], slots: list[int]) -> int:
        return self._submit("load", self.calls.submit_load, keys, slots)

    def _submit(self, kind: str, submit: Callable[[Any], None], keys: list[bytes],
                slots: list[int]) -> int:
        from mptier import TransferJob

        job_id = self.next_id
        self.next_id += 1
        self.pending[job_id] = Submitted(kind, list(keys), list(slots), time.monotonic())
        submit(TransferJob(job_id, list(keys), list(slots)))
        return job_id

    def collect(self) -> list[Any]:
        """Take finished jobs; record duplicates, latencies and wrong bytes (a successful
        load's slots are checked now, before anyone reuses them)."""
        out = []
        now = time.monotonic()
        for result in self.calls.get_finished_jobs():
            if result.job_id in self.results:
                self.twice.append(result.job_id)
                continue
            job = self.pending.pop(result.job_id, None)
            self.results[result.job_id] = result
            out.append(result)
            if job is None:
                continue
            self.latency[result.job_id] = now - job.at
            if job.kind == "store":
                if result.success:
                    self.stored.update(job.keys)
                continue
            loaded = job.keys if result.success else (result.successful_keys or ())
            for key, slot in zip(job.keys, job.slots):
                if key in loaded and not np.array_equal(self.buf.view[slot],
                                                        content(key, self.block_bytes)):
                    self.wrong.append((result.job_id, key, slot))
        return out

    def wait(self, job_ids: Iterable[int], timeout: float = 30.0) -> dict[int, Any]:
        """Poll until every job in ``job_ids`` reported (or ``timeout``); returns the
        results that arrived."""
        want = set(job_ids)
        deadline = time.monotonic() + timeout
        while want - set(self.results) and time.monotonic() < deadline:
            self.collect()
            time.sleep(0.005)
        return {j: self.results[j] for j in want if j in self.results}

    def drain(self, timeout: float = 60.0) -> None:
        """Wait for every pending job (bounded); what is still pending is lost."""
        self.wait(list(self.pending), timeout)

    def lost(self) -> list[int]:
        return sorted(self.pending)


# A slot says "busy" for a moment after its task reported, too: a worker busy this long
# is inside a task (a stalled or hung one), not at the end of a quick one.
BUSY_AFTER_S = 0.05


class StopStorm:
    """A random live worker SIGSTOPped every 0.2-0.8 s and continued 0.1-2.5 s later (a
    debugger, a throttled container, a swapping host). Call :meth:`step` from the
    engine's loop and :meth:`continue_all` when done (also from a ``finally``)."""

    def __init__(self, calls: EngineCalls, rng: random.Random) -> None:
        self.calls, self.rng = calls, rng
        self.stopped: dict[int, float] = {}  # pid -> when to continue it
        self.next_stop = time.monotonic()
        self.stops = 0

    def step(self) -> None:
        now = time.monotonic()
        for pid, until in list(self.stopped.items()):
            if now >= until:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                del self.stopped[pid]
        if now >= self.next_stop:
            victims = [w["pid"] for w in self.calls.stats()["workers"]
                       if w["alive"] and w["pid"] not in self.stopped]
            if victims:
                pid = self.rng.choice(victims)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    self.stops += 1
                self.stopped[pid] = now + self.rng.uniform(0.1, 2.5)
            self.next_stop = now + self.rng.uniform(0.2, 0.8)

    def continue_all(self) -> None:
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.stopped.clear()


def run_stop_storm(calls: EngineCalls, book: JobBook, keys: list[bytes],
                   rng: random.Random, seconds: float) -> int:
    """For ``seconds``, a :class:`StopStorm` while the engine keeps up to 8 jobs of one
    of ``keys`` in flight (two loads, into slots ``len(keys)`` on, for each store),
    looks keys up and collects results every 10 ms. Every stopped worker is continued
    before it returns; returns how many stops there were."""
    storm = StopStorm(calls, rng)
    k = len(keys)
    ends = time.monotonic() + seconds
    n = 0
    try:
        while time.monotonic() < ends:
            storm.step()
            if len(book.pending) < 8:
                if n % 3:
                    book.load([keys[n % k]], [k + n % k])
                else:
                    book.store([keys[n % k]], [n % k])
                n += 1
            calls.lookup(keys[rng.randrange(k)], n % 5)
            calls.on_schedule_end()
            book.collect()
            time.sleep(0.01)
    finally:
        storm.continue_all()
    return storm.stops


class Traffic:
    """What the engine does meanwhile: a store or a load of one of ``keys`` in turn
    (stores into slot ``i``, loads into slot ``len(keys) + i``), a lookup, the step's end
    and its results, then 5 ms of other work."""

    def __init__(self, book: JobBook, calls: EngineCalls, keys: list[bytes]) -> None:
        self.book, self.calls, self.keys = book, calls, keys
        self.n = 0

    def step(self, rounds: int = 1) -> None:
        keys, k = self.keys, len(self.keys)
        for _ in range(rounds):
            i = self.n % k
            if self.n % 2:
                self.book.store([keys[i]], [i])
            else:
                self.book.load([keys[i]], [k + i])
            self.n += 1
            self.calls.lookup(keys[(self.n * 7) % k], self.n)
            self.calls.on_schedule_end()
            self.book.collect()
            time.sleep(0.005)


def busy_worker(tier: Any, timeout: float = 10.0, exclude: Iterable[int] = (),
                parked: bool = False) -> dict:
    """The first worker seen busy for more than :data:`BUSY_AFTER_S` (polling
    ``stats()``), or with ``parked`` one the supervisor parked already (a loaded
    machine can take the I/O timeout between the block and the first look);
    ``AssertionError`` if none is within ``timeout``."""
    skip = set(exclude)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for w in tier.stats()["workers"]:
            if w["pid"] in skip:
                continue
            if (w["state"] == "busy" and (w["task_age_s"] or 0) > BUSY_AFTER_S) or (
                    parked and w["state"] == "stuck"):
                return w
        time.sleep(0.005)
    raise AssertionError(f"no busy worker within {timeout} s: {tier.stats()['workers']}")


def worker_state(tier: Any, pid: int) -> str | None:
    """State of worker ``pid`` in ``stats()`` (None once it is not listed)."""
    for w in tier.stats()["workers"]:
        if w["pid"] == pid:
            return w["state"]
    return None


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               between: Callable[[], Any] | None = None) -> Any:
    """Poll ``predicate`` (running ``between`` each round, e.g. collecting results)
    until it is true; its value, or ``AssertionError`` naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        if between is not None:
            between()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def temp_files(root: str | os.PathLike) -> list[str]:
    """Temporary block files (``*.tmp``) anywhere under ``root``."""
    found = []
    for folder, _, names in os.walk(root):
        found += [os.path.join(folder, n) for n in names if n.endswith(".tmp")]
    return found


@contextlib.contextmanager
def tiny_tmpfs(size_bytes: int, options: str = "") -> Iterator[str]:
    """A tmpfs of ``size_bytes`` (root only) mounted under this test run's mount folder,
    so the leak check knows it; unmounted and removed afterwards. ``options`` adds mount
    options (e.g. ``"nr_inodes=64"``)."""
    from support import mounts

    point = mounts.new_mount_dir("tmpfs-")
    extra = f",{options}" if options else ""
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755{extra}",
                    "mptier-test", str(point)], check=True, capture_output=True, timeout=30)
    try:
        yield str(point)
    finally:
        mounts.unmount(point)
        with contextlib.suppress(OSError):
            os.rmdir(point)


class Service:
    """``mptier serve`` as a real subprocess (1 load + 1 store worker unless ``settings``
    say otherwise; extra environment for its workers, e.g. fault injection; its log
    appended to the file ``log``, if given)."""

    def __init__(self, name: str, root: str, run_dir: str, env: dict[str, str] | None = None,
                 log: str | None = None, **settings: Any) -> None:
        import sys

        self.name, self.root, self.run_dir = name, root, run_dir
        settings = {"prefault": "false", "n_load_workers": 1, "n_store_workers": 1,
                    **settings}
        args = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
        err = subprocess.DEVNULL if log is None else os.open(
            log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mptier.cli", "serve", "--name", name, "--root", root,
                 *args], env={**os.environ, "MPTIER_RUN_DIR": run_dir, **(env or {})},
                stdout=subprocess.PIPE, stderr=err, text=True)
        finally:
            if log is not None:
                os.close(err)
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.stop(9)
            raise AssertionError(f"mptier serve did not start: {line!r}")
        self.worker_pids = self._children()  # at start

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _children(self) -> list[int]:
        import psutil

        with contextlib.suppress(psutil.NoSuchProcess):
            return [c.pid for c in psutil.Process(self.proc.pid).children()]
        return []

    def children(self) -> list[int]:
        """Its worker processes now."""
        return self._children() if self.proc.poll() is None else []

    def stop(self, sig: int = 15, timeout: float = 30) -> int:
        """Send ``sig`` (SIGTERM by default) and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts as gone)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def stop_services(services: list[Service], sig: int = signal.SIGKILL,
                  timeout: float = 15.0) -> None:
    """Stop every service in ``services`` with ``sig``, then wait (at most ``timeout``)
    until all their workers have gone: a test's or scenario's teardown. Every service is
    stopped before anything can raise."""
    pids: list[int] = []
    for service in services:
        pids += service.children()
        service.stop(sig)
    wait_until(lambda: all(gone(x) for x in pids), timeout, "the services' workers to go")

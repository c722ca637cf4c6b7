"""What other work on this machine costs the engine's busy loop: the floor under the
bench's scheduler interference, and how much of a tier's share is its workers'.

The bench's busy scheduler (0.5 ms GIL-free wait, then 0.5 ms of pure Python) runs in
this process. Beside it, in windows, run competitors. Plain ones are child processes
at the workers' nice 10 under SCHED_BATCH, one or two of them (``--counts``), each
doing one kind of work and nothing else:

    spin     a pure-Python loop (a CPU, no memory traffic)
    copy     numpy copies between two 256 MiB arrays (memory bandwidth, as a bounce copy)
    l2copy   numpy copies inside 256 KiB (a CPU busy copying, in its own cache)
    kread    preadv of a file in tmpfs into a 2 MiB buffer (the kernel's copy)
    dwrite   O_DIRECT writes of 2 MiB from 4 KiB pages to a file on --root, overwritten
             in place (the device's work, the CPU mostly waiting)
    dread    O_DIRECT reads of 2 MiB into 4 KiB pages from that file, one at a time

Tier competitors are one mptier tier on --root (defaults; --block-bytes), 16 jobs of 16
blocks kept in flight, stores of fresh keys or loads of blocks stored first:

    store-apart / load-apart   the tier driven by another process, which polls it every
                               0.5 ms: only its workers share the machine with the loop
    store-here / load-here     the tier driven from the loop's own thread between its
                               steps, as the bench drives it

``--policies batch,short,idle,loopshort`` makes each case once per scheduling policy of
the competitors and the tiers' worker threads: batch is the workers' own (SCHED_BATCH at
nice 10), short the same with a 100 us EEVDF slice (worker_slice.py), idle SCHED_IDLE;
loopshort leaves them batch and gives the loop's own thread the 100 us slice instead.

Each round: an idle window, the competitor's window (SIGCONT ... SIGSTOP, or the tier
driven), an idle window; the loop's rate in the busy window over the mean of the two
idle ones, as the bench measures it. Every case is one window a round, the order
shuffled each round. Prints per case the medians of the rounds: the loop's rate (and
its range), the CPUs the rest of the machine kept busy (``/proc/stat`` less this
process; steal included), GB/s, the loop thread's milliseconds a second on a run queue
(``/proc/thread-self/schedstat``) and its involuntary switches, the machine's device
interrupts and reschedule and function-call IPIs a second, and its softirq and steal
milliseconds a second.

    python bench/experiments/loop_floor.py --root /var/tmp --rounds 7
    python bench/experiments/loop_floor.py --kinds spin,store-apart,load-apart,store-here,\
        load-here --counts 1 --policies batch,short,idle --rounds 6

docs/performance.md, section 28.
"""

from __future__ import annotations

import argparse
import itertools
import mmap
import os
import random
import shutil
import signal
import statistics
import time
from collections.abc import Callable

import numpy as np
from worker_slice import set_slice  # this folder

from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
from mptier.bench.measure import SchedulerLoad
from mptier.bench.saturation import machine_busy_seconds

CLK_TCK = os.sysconf("SC_CLK_TCK")
PLAIN_KINDS = ("spin", "copy", "l2copy", "kread", "dwrite", "dread")
TIER_KINDS = ("store-apart", "load-apart", "store-here", "load-here")
COPY_BYTES = 256 << 20  # far beyond the 32 MiB L3: every copy goes to memory
L2_BYTES = 256 << 10  # inside the 1 MiB L2
CHUNK_BYTES = 2 << 20  # one read or direct write, a 2 MiB block
FILE_BYTES = 1 << 30
JOB_BLOCKS = 16
IN_FLIGHT = 16  # jobs, as the bench's default
SLOTS = 512
POOL_BYTES = 2 << 30  # blocks stored first, for the loads


def _loop_waits() -> tuple[int, int]:
    """This thread's (ns waited on a run queue, involuntary context switches) so far."""
    with open("/proc/thread-self/schedstat") as f:
        waited = int(f.read().split()[1])
    with open("/proc/thread-self/status") as f:
        for line in f:
            if line.startswith("nonvoluntary_ctxt_switches"):
                return waited, int(line.split()[1])
    return waited, 0


def _interrupts() -> dict[str, int]:
    """Interrupts so far, all CPUs: device IRQs, reschedule and function-call IPIs."""
    counts = {"irq": 0, "RES": 0, "CAL": 0}
    with open("/proc/interrupts") as f:
        cpus = len(f.readline().split())
        for line in f:
            name, _, rest = line.partition(":")
            values = [int(v) for v in rest.split()[:cpus] if v.isdigit()]
            name = name.strip()
            if name.isdigit():
                counts["irq"] += sum(values)
            elif name in counts:
                counts[name] += sum(values)
    return counts


# batch: the workers' own (SCHED_BATCH, nice 10); short: the same with a 100 us EEVDF
# slice (worker_slice.py); idle: SCHED_IDLE, which any normal task's wakeup preempts;
# loopshort: the workers' batch, and the loop's own thread (SCHED_OTHER, nice 0) given
# the 100 us slice, with which a waking task may preempt one of a longer slice at once
# (EEVDF's PREEMPT_SHORT, Linux 6.12+), in its idle windows too.
POLICIES = ("batch", "short", "idle", "loopshort")
SHORT_SLICE_NS = 100_000
WORKER_NICE = 10


def _apply(tid: int, policy: str) -> None:
    if policy == "idle":
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    else:
        set_slice(tid, SHORT_SLICE_NS if policy == "short" else 0, WORKER_NICE)


def _loop_slice(policy: str) -> None:
    """The loop's thread: the 100 us slice under ``loopshort``, the default otherwise."""
    set_slice(0, SHORT_SLICE_NS if policy == "loopshort" else 0, 0, os.SCHED_OTHER)


def _stolen_seconds() -> tuple[float, float]:
    """(softirq, steal) CPU seconds so far, all CPUs (``/proc/stat``): the kernel's work in
    interrupt context, and time the host ran something else on this VM's vCPUs."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return ticks[6] / CLK_TCK, ticks[7] / CLK_TCK


def _as_worker(policy: str) -> None:
    os.nice(WORKER_NICE)
    _apply(0, policy)


def _set_policy(pids: list[int], policy: str) -> None:
    """Every thread of ``pids`` under ``policy``."""
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                _apply(int(tid), policy)
            except OSError:
                pass  # a thread that ended, or the kernel's own (io-wq)


class TierDriver:
    """One tier, stores of fresh keys or loads of a pool stored first, kept
    ``IN_FLIGHT`` jobs deep by :meth:`poll`."""

    def __init__(self, root: str, block: int, pool: bool = True, policy: str = "batch") -> None:
        self.root, self.block = root, block
        self.buf = SharedKVBuffer.create(SLOTS, block)
        self.buf.view[:] = np.random.default_rng(1).integers(0, 256, (SLOTS, block), np.uint8)
        self.tier = FileSystemTier(self.buf, root_dir=root)
        self.policy = policy
        self.ids, self.fresh = itertools.count(1), itertools.count()
        self.pool = [make_key(b"pool", i) for i in range(POOL_BYTES // block if pool else 0)]
        self.inflight = 0
        for s in range(0, len(self.pool), JOB_BLOCKS):
            self.tier.submit_store(TransferJob(next(self.ids), self.pool[s:s + JOB_BLOCKS],
                                               list(range(JOB_BLOCKS))))
            if s % (JOB_BLOCKS * IN_FLIGHT) == 0:
                self.tier.drain_jobs()
                self.tier.get_finished_jobs()
        self.settle()

    def poll(self, kind: str, policy: str | None = None) -> int:
        """Top the jobs in flight up; the bytes of the jobs that finished."""
        for _ in range(IN_FLIGHT - self.inflight):
            if kind.startswith("store"):
                keys = [make_key(b"fresh", next(self.fresh)) for _ in range(JOB_BLOCKS)]
                self.tier.submit_store(TransferJob(next(self.ids), keys, list(range(JOB_BLOCKS))))
            else:
                at = next(self.fresh) * JOB_BLOCKS % len(self.pool)
                self.tier.submit_load(TransferJob(
                    next(self.ids), self.pool[at:at + JOB_BLOCKS],
                    [SLOTS // 2 + i for i in range(JOB_BLOCKS)]))
        if self.inflight == 0:  # a window's first poll: threads started since, or a new policy
            _set_policy(self.tier.worker_pids(), policy or self.policy)
        self.inflight = IN_FLIGHT
        done = len(self.tier.get_finished_jobs())
        self.inflight -= done
        return done * JOB_BLOCKS * self.block

    def settle(self) -> None:
        self.tier.drain_jobs()
        self.tier.get_finished_jobs()
        self.inflight = 0

    def close(self) -> None:
        try:
            self.tier.shutdown()
        finally:
            self.buf.close()
            self.buf.unlink()
            shutil.rmtree(self.root, ignore_errors=True)


def _file_step(kind: str, path: str, index: int) -> Callable[[], int]:
    """One 2 MiB read or write of ``path`` a call, going round the file (kread) or the
    half of it that competitor ``index`` has to itself (dread, dwrite: O_DIRECT, into or
    out of 4 KiB pages). Returns the bytes moved."""
    if kind == "kread":
        fd, buf, start, span = os.open(path, os.O_RDONLY), bytearray(CHUNK_BYTES), 0, FILE_BYTES
    else:
        write = kind == "dwrite"
        fd = os.open(path, (os.O_WRONLY if write else os.O_RDONLY) | os.O_DIRECT)
        buf = mmap.mmap(-1, CHUNK_BYTES)  # 4 KiB pages, page-aligned
        if write:
            buf.write(os.urandom(CHUNK_BYTES))
        span = FILE_BYTES // 2
        start = (index % 2) * span
    move = os.pwritev if kind == "dwrite" else os.preadv
    offset = 0

    def step() -> int:
        nonlocal offset
        got = move(fd, [buf], start + offset)
        offset = (offset + got) % span
        return got
    return step


def _competitor(kind: str, counter: np.ndarray, index: int, path: str, block: int,
                policy: str) -> None:
    """Set ``kind`` up, stop until the first window, then run it until SIGTERM, adding
    the bytes moved to ``counter[index]`` (spin: 100,000 iterations at a time)."""
    driver = None

    def stop(_signum: int, _frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        if kind.endswith("-apart"):
            driver = TierDriver(path, block, pool=kind.startswith("load"), policy=policy)

            def step() -> int:
                time.sleep(0.0005)  # the bench's light scheduler: a poll every 0.5 ms
                return driver.poll(kind)
        elif kind == "spin":
            def step() -> int:
                total = 0
                for i in range(100_000):
                    total += i
                return 1
        elif kind in ("copy", "l2copy"):
            size = COPY_BYTES if kind == "copy" else L2_BYTES
            a = np.ones(size, np.uint8)
            b = np.ones_like(a)

            def step() -> int:
                np.copyto(b, a)
                return size
        elif kind in ("kread", "dread", "dwrite"):
            step = _file_step(kind, path, index)
        else:
            raise SystemExit(f"unknown kind {kind!r}")
        if driver is None:
            _as_worker(policy)  # a tier's workers set their own policy; its driver is the engine's
        os.kill(os.getpid(), signal.SIGSTOP)
        while True:
            counter[index] += step()
    finally:
        if driver is not None:
            driver.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/var/tmp", help="where dwrite and the tiers write")
    ap.add_argument("--memory-root", default="/dev/shm", help="where kread reads (tmpfs)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--window-s", type=float, default=1.0)
    ap.add_argument("--kinds", default=",".join(PLAIN_KINDS + TIER_KINDS))
    ap.add_argument("--counts", default="1,2", help="processes per plain competitor")
    ap.add_argument("--block-bytes", type=int, default=2 << 20, help="the tiers' block")
    ap.add_argument("--policies", default="batch",
                    help="the competitors' and the tiers' workers' scheduling policies, each "
                         f"a case of its own: {', '.join(POLICIES)}")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    unknown = set(kinds) - set(PLAIN_KINDS + TIER_KINDS)
    if unknown:
        ap.error(f"--kinds {','.join(sorted(unknown))}: choose from "
                 f"{', '.join(PLAIN_KINDS + TIER_KINDS)}")
    counts = [int(c) for c in args.counts.split(",")]
    loop = SchedulerLoad(500_000, 500_000)
    tag = f"loop-floor-{os.getpid()}"
    paths = {"kread": os.path.join(args.memory_root, tag), "dwrite": os.path.join(args.root, tag),
             "dread": os.path.join(args.root, tag + "-read")}
    counter = np.frombuffer(mmap.mmap(-1, 4096), np.uint64)  # shared with the children
    policies = args.policies.split(",")
    if set(policies) - set(POLICIES):
        ap.error(f"--policies {args.policies}: choose from {', '.join(POLICIES)}")
    cases = [(k, c, p) for k in kinds for c in (counts if k in PLAIN_KINDS else [1])
             for p in policies]
    procs: dict[tuple[str, int, str], list[int]] = {}
    slots: dict[tuple[str, int, str], range] = {}
    here: TierDriver | None = None
    try:
        for kind, path in paths.items():
            if kind in kinds:
                with open(path, "wb") as f:
                    block = os.urandom(CHUNK_BYTES)
                    for _ in range(FILE_BYTES // CHUNK_BYTES):
                        f.write(block)
                    f.flush()
                    os.fsync(f.fileno())
        slot = 0
        for case in cases:
            kind, count, policy = case
            procs[case] = []
            slots[case] = range(slot, slot + (0 if kind.endswith("-here") else count))
            for index in slots[case]:
                path = paths.get(kind, os.path.join(args.root, f"{tag}-{index}"))
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        _competitor(kind, counter, index, path, args.block_bytes, policy)
                    except SystemExit as e:
                        code = e.code if isinstance(e.code, int) else 1
                    finally:
                        os._exit(code)
                procs[case].append(pid)
                os.waitpid(pid, os.WUNTRACED)  # set up and stopped itself
            slot = slots[case].stop
        if any(k.endswith("-here") for k in kinds):  # after the forks: no child holds it
            here = TierDriver(os.path.join(args.root, tag + "-here"), args.block_bytes)

        def busy_window(case: tuple[str, int, str]) -> tuple[float, float]:
            """(loop rate, bytes moved) over one window."""
            if not case[0].endswith("-here"):
                start = sum(int(counter[s]) for s in slots[case])
                for p in procs[case]:
                    os.kill(p, signal.SIGCONT)
                rate = loop.idle_rate(args.window_s)
                for p in procs[case]:
                    os.kill(p, signal.SIGSTOP)
                return rate, sum(int(counter[s]) for s in slots[case]) - start
            moved = iterations = loop_ns = 0
            deadline = time.monotonic() + args.window_s
            while time.monotonic() < deadline:
                moved += here.poll(case[0], case[2])
                n, dt = loop.step()
                iterations += n
                loop_ns += dt
            here.settle()
            return iterations / (loop_ns / 1e9), moved

        results: dict[tuple[str, int, str], list[tuple[float, ...]]] = {c: [] for c in cases}
        for r in range(args.rounds):
            order = cases[:]
            random.Random(r).shuffle(order)
            for case in order:
                _loop_slice(case[2])
                before = loop.idle_rate(args.window_s)
                busy0, own0, t0 = machine_busy_seconds(), time.process_time(), time.monotonic()
                waits0, irqs0, stolen0 = _loop_waits(), _interrupts(), _stolen_seconds()
                rate, moved = busy_window(case)
                wall = time.monotonic() - t0
                others = (machine_busy_seconds() - busy0 - (time.process_time() - own0)) / wall
                waits, irqs, stolen = _loop_waits(), _interrupts(), _stolen_seconds()
                after = loop.idle_rate(args.window_s)
                results[case].append((
                    rate / ((before + after) / 2), others, moved / wall,
                    (waits[0] - waits0[0]) / 1e6 / wall, (waits[1] - waits0[1]) / wall,
                    *((irqs[k] - irqs0[k]) / wall for k in ("irq", "RES", "CAL")),
                    *((b - a) * 1e3 / wall for a, b in zip(stolen0, stolen))))
                got = results[case][-1]
                print(f"round {r + 1} {case[0]:11s} x{case[1]} {case[2]:5s}: loop {got[0]:.2f}, "
                      f"others {got[1]:.2f} CPUs, {got[2] / 1e9:.2f} GB/s, loop waited "
                      f"{got[3]:.1f} ms/s, preempted {got[4]:.0f}/s, irq {got[5]:.0f}/s "
                      f"RES {got[6]:.0f}/s CAL {got[7]:.0f}/s, softirq {got[8]:.0f} ms/s, "
                      f"steal {got[9]:.0f} ms/s", flush=True)
        print("\nmedians of the rounds; the loop's thread: run-queue wait ms/s, involuntary "
              "switches/s; interrupts/s and softirq, steal ms/s, all CPUs")
        print("case                 loop rate (min-max)  other CPUs  GB/s  waited  preempted"
              "   irq    RES    CAL  softirq  steal")
        for case in cases:
            got = results[case]
            rates = [x[0] for x in got]
            med = [statistics.median(x[i] for x in got) for i in range(len(got[0]))]
            gbps = "-" if case[0] == "spin" else f"{med[2] / 1e9:.2f}"
            print(f"{case[0]:11s} x{case[1]} {case[2]:5s} {med[0]:.2f} "
                  f"({min(rates):.2f}-{max(rates):.2f})     {med[1]:.2f}  {gbps:>5}  "
                  f"{med[3]:6.1f}  {med[4]:9.0f}"
                  f" {med[5]:6.0f} {med[6]:6.0f} {med[7]:6.0f} {med[8]:8.0f} {med[9]:6.0f}")
    finally:
        for pids in procs.values():
            for p in pids:
                os.kill(p, signal.SIGTERM)
                os.kill(p, signal.SIGCONT)
        for pids in procs.values():
            for p in pids:
                os.waitpid(p, 0)
        if here is not None:
            here.close()
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)


if __name__ == "__main__":
    main()

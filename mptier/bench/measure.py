"""Small measuring tools shared by the harness and the designs.

* :class:`SchedulerLoad` -- what the engine's main thread does between polls: a wait
  that releases the interpreter lock and/or a pure-Python counting loop (:func:`spin`).
  The loop's iteration rate while a design runs, divided by its rate when idle, is the
  "scheduler interference" figure (1.0 = the design costs the scheduler nothing).
* :func:`drop_page_cache` -- ``sync`` then ``echo 3 > /proc/sys/vm/drop_caches``, and
  whether it worked (it needs root outside a restricted container).
* :func:`probe_o_direct` -- the reference design's O_DIRECT probe (an aligned one-page
  write in the folder), used by the baseline and the raw limit alike.
* :func:`crc32c_speed` -- the block checksum's speed on one core, over a block in cache.
* byte-count parsing and formatting, percentiles, the file-system type of a path.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import subprocess
import time
from dataclasses import dataclass

from mptier import fskind
from mptier.bench.saturation import machine_busy_seconds

PAGE = mmap.PAGESIZE
# Iterations of the innermost counting loop between two clock reads. Large enough that
# reading the clock costs little of the loop, small enough that a spin slice ends within
# a few microseconds of its deadline.
SPIN_CHUNK = 256
_SPIN_RANGE = range(SPIN_CHUNK)

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNIT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """``"2M"``, ``"256KiB"``, ``"1.5g"``, ``"4096"`` -> bytes (binary units).

    Raises ``ValueError`` naming the text when it is not a byte count.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"not a byte count: {text!r} (e.g. 4096, 256K, 2MiB, 1G)")
    value = float(match.group(1)) * _UNIT[match.group(2).lower()]
    if value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def format_size(n: int) -> str:
    """``2097152`` -> ``"2MiB"``; ``262144`` -> ``"256KiB"``; other counts in bytes."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def spin(duration_ns: int) -> tuple[int, int]:
    """Run the counting loop for about ``duration_ns``; return ``(iterations, elapsed_ns)``.

    Pure Python on purpose: it needs the interpreter lock and a CPU, exactly what a
    scheduler loop needs, so anything in the engine process or on the machine that
    takes either slows it down.
    """
    clock = time.perf_counter_ns
    start = clock()
    end = start + duration_ns
    rounds = 0
    total = 0
    while True:
        for i in _SPIN_RANGE:
            total += i
        rounds += 1
        now = clock()
        if now >= end:
            return rounds * SPIN_CHUNK, now - start


@dataclass(frozen=True)
class SchedulerLoad:
    """What the engine's main thread does between two polls of the tier.

    ``wait_ns`` of a wait that releases the interpreter lock (in a real engine, the wait
    for the model's forward pass), then ``work_ns`` of pure-Python work (:func:`spin`).
    :meth:`step` counts the work from the moment the wait *should* have ended, so time
    spent getting the lock and a CPU back after a wait counts as lost work. The harness
    uses two: the *light* scheduler (wait only: it just polls) and the *busy* one
    (wait and work, or work only: a loop that never lets go of the interpreter).
    """

    work_ns: int
    wait_ns: int

    def step(self) -> tuple[int, int]:
        """One step's ``(iterations, counted_ns)``."""
        if self.wait_ns:
            begin = time.perf_counter_ns()
            time.sleep(self.wait_ns / 1e9)
            due = begin + self.wait_ns
        else:
            due = time.perf_counter_ns()
        if not self.work_ns:
            return 0, 0
        iterations, _ = spin(self.work_ns)
        return iterations, time.perf_counter_ns() - due

    def idle_rate(self, seconds: float) -> float:
        """Iterations per second of :meth:`step` with nothing else running."""
        iterations = elapsed = 0
        deadline = time.perf_counter_ns() + int(seconds * 1e9)
        while time.perf_counter_ns() < deadline:
            n, dt = self.step()
            iterations += n
            elapsed += dt
        return iterations / (elapsed / 1e9) if elapsed else 0.0


@dataclass(frozen=True)
class CpuSnapshot:
    """Machine-wide busy CPU seconds and this process's own CPU seconds, at one moment."""

    wall: float
    machine_busy: float
    own: float

    @classmethod
    def take(cls) -> CpuSnapshot:
        times = os.times()
        return cls(time.monotonic(), machine_busy_seconds(), times.user + times.system)

    def others_since(self, earlier: CpuSnapshot) -> float | None:
        """CPUs kept busy by everything but this process between ``earlier`` and now.

        Measured while this process's own children are idle, this is the background
        load of the machine: anything much above 0 makes the figures noisy.
        """
        wall = self.wall - earlier.wall
        if wall <= 0 or not self.machine_busy:
            return None
        return max(0.0, (self.machine_busy - earlier.machine_busy
                         - (self.own - earlier.own)) / wall)


@dataclass
class CacheDrop:
    """Outcome of one page-cache drop: ``dropped`` is False when the kernel refused it."""

    dropped: bool
    error: str | None = None
    seconds: float = 0.0


def drop_page_cache() -> CacheDrop:
    """``sync`` then drop clean page cache, dentries and inodes. Never raises.

    Blocks until the sync finishes (seconds when gigabytes are dirty); callers keep it
    outside any timed region.
    """
    start = time.perf_counter()
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        return CacheDrop(False, f"{type(exc).__name__}: {exc}", time.perf_counter() - start)
    return CacheDrop(True, None, time.perf_counter() - start)


def probe_o_direct(directory: str) -> bool:
    """Whether an aligned ``O_DIRECT`` write works in ``directory`` (created if needed).

    Same probe as the reference design: one page, written with ``O_DIRECT`` to a
    scratch file that is removed again. Any ``OSError`` means no.
    """
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f".o_direct_probe.{os.getpid()}.{time.monotonic_ns()}")
    page = mmap.mmap(-1, PAGE)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | flag, 0o644)
        try:
            os.write(fd, page)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        page.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


def filesystem_of(path: str) -> tuple[str, str]:
    """``(fs type, mount point)`` of the mount holding ``path`` (``("?", "?")`` if unknown)."""
    kind, mount = fskind.mount_of(os.path.realpath(path))
    return (kind, mount) if kind else ("?", "?")


# CRC32C speed: a 2 MiB block (a common KV block, well inside L2 + L3 here) checksummed
# this many times per sample, the best of CRC_SAMPLES samples (the least disturbed by
# other processes on a shared machine).
CRC_BLOCK_BYTES = 2 << 20
CRC_REPEATS = 20
CRC_SAMPLES = 7


def crc32c_speed() -> dict[str, object]:
    """CRC32C (vLLM's block checksum) on one core over a 2 MiB block already in cache:
    ``{"impl", "gbps", "backend"}`` for the default I/O backend (thread CPU time, so a
    preempted sample does not count against it). ``gbps`` is None if it cannot run."""
    from mptier import native

    data = bytearray(os.urandom(CRC_BLOCK_BYTES))
    native.crc32c(data)  # warm: the block in cache, the implementation chosen
    best = None
    for _ in range(CRC_SAMPLES):
        t0 = time.thread_time_ns()
        for _ in range(CRC_REPEATS):
            native.crc32c(data)
        took = time.thread_time_ns() - t0
        best = took if best is None else min(best, took)
    gbps = CRC_REPEATS * CRC_BLOCK_BYTES / best if best else None
    return {"impl": native.crc32c_impl(), "backend": native.BACKEND, "gbps": gbps}


def percentile(sorted_values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) of already sorted values, by linear interpolation."""
    if not sorted_values:
        return None
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    pos = q * (len(sorted_values) - 1)
    low = int(pos)
    high = min(low + 1, len(sorted_values) - 1)
    frac = pos - low
    return float(sorted_values[low] * (1 - frac) + sorted_values[high] * frac)


def summarize(values: list[float]) -> dict[str, float | None]:
    """``{"p50", "p99", "max", "n"}`` of ``values`` (``None`` figures when empty)."""
    ordered = sorted(values)
    return {
        "p50": percentile(ordered, 0.50),
        "p99": percentile(ordered, 0.99),
        "max": float(ordered[-1]) if ordered else None,
        "n": len(ordered),
    }


def tool_version(argv: list[str]) -> str | None:
    """First line of ``argv``'s output, or None when the tool is missing or fails."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if out.returncode == 0 and text else None


def us_summary(values_ns: list[int]) -> dict[str, float | None]:
    """:func:`summarize` of nanosecond samples, in microseconds."""
    return {k: (v / 1e3 if v is not None and k != "n" else v)
            for k, v in summarize(values_ns).items()}


def ms_summary(values_ns: list[int]) -> dict[str, float | None]:
    """:func:`summarize` of nanosecond samples, in milliseconds."""
    return {k: (v / 1e6 if v is not None and k != "n" else v)
            for k, v in summarize(values_ns).items()}


# -- the machine's free memory -------------------------------------------------------------

# Memory the kernel has handed back to the hypervisor (virtio-balloon free page
# reporting), in KiB since boot; absent on bare metal.
REPORTED_KIB_PATH = "/sys/module/page_reporting/parameters/reported_kib"
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)


def _reported_kib() -> int | None:
    try:
        with open(REPORTED_KIB_PATH) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class MemorySnapshot:
    """Machine-wide page counters at one moment (``/proc/vmstat``), and how much free
    memory the kernel had reported to the hypervisor so far."""

    pages_allocated: int
    page_faults: int
    reported_kib: int | None

    @classmethod
    def take(cls) -> MemorySnapshot:
        allocated = faults = 0
        try:
            with open("/proc/vmstat") as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name.startswith("pgalloc_"):
                        allocated += int(value)
                    elif name == "pgfault":
                        faults = int(value)
        except (OSError, ValueError):
            pass
        return cls(allocated, faults, _reported_kib())

    def since(self, earlier: MemorySnapshot) -> dict[str, int | None]:
        reported = (self.reported_kib - earlier.reported_kib
                    if self.reported_kib is not None and earlier.reported_kib is not None
                    else None)
        return {"pages_allocated": self.pages_allocated - earlier.pages_allocated,
                "page_faults": self.page_faults - earlier.page_faults,
                "reported_kib": reported}


def warm_free_memory(nbytes: int) -> dict[str, float]:
    """Allocate ``nbytes`` of memory, touch every page, and free it again. Blocks until
    done (0.1-0.5 s per GiB); never raises.

    On a virtual machine whose kernel reports idle free memory to the hypervisor, a
    page that was reported costs about 12 µs on first touch (the host must back it
    again) against 3 µs for one freed recently, so a store phase to tmpfs (whose files
    take fresh pages) runs up to 5x slower on "cold" free memory. Whoever ran just
    before decides which pages the next design gets: a design that runs right after
    another freed gigabytes wins. Calling this right before a phase hands every design
    the same recently freed pages. ``us_per_page`` of the touch shows how cold the
    machine's free memory was (about 3 warm, 10 or more cold).
    """
    pages = max(1, nbytes // PAGE)
    start = time.perf_counter()
    try:
        block = mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                          | _MAP_POPULATE)
    except OSError as exc:
        return {"bytes": 0, "seconds": time.perf_counter() - start, "us_per_page": None,
                "error": str(exc)}
    seconds = time.perf_counter() - start
    block.close()
    return {"bytes": pages * PAGE, "seconds": seconds,
            "us_per_page": seconds / pages * 1e6}

"""Design (d): the raw limit of the root -- what the disk (or tmpfs) gives without a tier.

With fio installed: one fio job per in-flight job of the workload (``numjobs`` =
``--inflight-jobs``, capped by the number of blocks), synchronous ``psync`` I/O at
depth 1, one file per block of exactly the block size (``--nrfiles``/``--filesize``),
files created inside the timed run (``create_on_open``, no preallocation), O_DIRECT
where the root supports it. The designs run each in-flight job as one synchronous
stream of block I/O, so this is the same concurrency, the same files and the same block
size, minus everything a tier adds (existence checks, temporary names, renames,
folders, queues). Like the designs' phases, each pass runs in two parts on separate
files: one while the harness's scheduler only polls (the raw throughput), one beside
its busy loop. The store passes write the files, the page cache is dropped, the load
passes read them back.

Without fio (or with ``raw:tool=loop``): the same passes as a plain write/read loop on
as many threads in a child process (``python -m mptier.bench.raw``), from and into
distinct slots of one large buffer, also O_DIRECT where supported. On some virtual
disks O_DIRECT reads into distinct pages run faster than fio's reads into one reused
buffer per job, so the loop can be the higher limit there; run both to see.

Either way the I/O runs in other processes, so (d) also gets an interference figure:
what I/O at this concurrency costs the scheduler loop through CPU contention alone.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from mptier.bench.base import RawOutcome
from mptier.bench.measure import CacheDrop, probe_o_direct, tool_version

O_DIRECT = getattr(os, "O_DIRECT", 0)

Wait = Callable[[subprocess.Popen, bool], tuple[int, int]]


_CPUS = os.sched_getaffinity(0)


def _all_cpus() -> None:
    """In the child before exec: undo the harness's pinning of the engine thread."""
    os.sched_setaffinity(0, _CPUS)


def fio_path() -> str | None:
    return shutil.which("fio")


class RawLimit:
    """(d). Options: ``tool=auto|fio|loop``, ``jobs=N`` (override the concurrency)."""

    letter = "d"
    kind = "raw"
    supports_lookup = False

    def __init__(self, label: str, options: dict[str, str] | None = None) -> None:
        self.label = label
        opts = dict(options or {})
        self.tool = opts.pop("tool", "auto")
        if self.tool not in ("auto", "fio", "loop"):
            raise ValueError(f"{label}: tool must be auto, fio or loop")
        self.jobs_override = int(opts.pop("jobs")) if "jobs" in opts else None
        if opts:
            raise ValueError(f"{label}: unknown option(s) {', '.join(sorted(opts))} "
                             "(known: tool, jobs)")
        self.info: dict = {}
        self.notes: list[str] = []

    @classmethod
    def available(cls) -> str | None:
        return None

    def chosen_tool(self) -> str:
        if self.tool == "auto":
            return "fio" if fio_path() else "loop"
        return self.tool

    def run(self, root: str, block_bytes: int, n_light: int, n_busy: int,
            concurrency: int, wait: Wait, drop: Callable[[], CacheDrop | None],
            job_blocks: int = 1) -> RawOutcome:
        """Store then load one-block files under ``root``: ``n_light`` of them while the
        harness's scheduler only polls, ``n_busy`` beside its busy loop.

        ``wait(proc, busy)`` runs the harness's scheduler loop (light or busy) until
        ``proc`` exits and returns ``(iterations, nanoseconds)``; ``drop`` drops the page
        cache between the store and the load passes.
        """
        tool = self.chosen_tool()
        if tool == "fio" and not fio_path():
            raise RuntimeError(f"{self.label}: fio is not installed")
        direct = probe_o_direct(root) and block_bytes % mmap.PAGESIZE == 0
        out = RawOutcome()
        layout = {name: self._layout(n, concurrency)
                  for name, n in (("light", n_light), ("busy", n_busy)) if n > 0}
        out.info.update(
            tool=tool, o_direct=direct,
            numjobs=max((jobs for jobs, _ in layout.values()), default=0),
            files=sum(jobs * per_job for jobs, per_job in layout.values()),
            ioengine="psync" if tool == "fio" else "os.write/os.readv threads")
        if tool == "fio":
            out.info["fio_version"] = tool_version([fio_path() or "fio", "--version"])
        for phase in ("store", "load"):
            if phase == "load":
                drop()
            for name, (jobs, per_job) in layout.items():
                argv = (self._fio_argv(root, name, phase, block_bytes, per_job, jobs, direct)
                        if tool == "fio" else
                        self._loop_argv(root, name, phase, block_bytes, per_job * jobs, jobs,
                                        direct, job_blocks))
                gbps, iters, ns, note = self._run_one(argv, name, phase, tool, root,
                                                      lambda p, b=name == "busy": wait(p, b))
                if note:
                    out.notes.append(note)
                if name == "light":
                    setattr(out, f"{phase}_gbps", gbps)
                else:
                    setattr(out, f"{phase}_gbps_busy", gbps)
                    setattr(out, f"{phase}_loop_rate", iters / (ns / 1e9) if ns else None)
        return out

    def _layout(self, n_files: int, concurrency: int) -> tuple[int, int]:
        """``(numjobs, files per job)`` for ``n_files`` one-block files."""
        jobs = max(1, min(self.jobs_override or concurrency, n_files))
        return jobs, max(1, n_files // jobs)

    # -- fio ---------------------------------------------------------------------------
    @staticmethod
    def _fio_argv(root: str, name: str, phase: str, block_bytes: int, files_per_job: int,
                  jobs: int, direct: bool) -> list[str]:
        argv = [fio_path() or "fio", f"--name={name}", f"--directory={root}",
                f"--rw={'write' if phase == 'store' else 'read'}", f"--bs={block_bytes}",
                f"--filesize={block_bytes}", f"--nrfiles={files_per_job}",
                f"--numjobs={jobs}", "--ioengine=psync", "--iodepth=1",
                f"--direct={int(direct)}", "--openfiles=1",
                "--file_service_type=sequential", "--group_reporting",
                "--output-format=json", f"--output={root}/fio-{name}-{phase}.json"]
        if phase == "store":
            argv += ["--fallocate=none", "--create_on_open=1"]
        return argv

    # -- plain loop --------------------------------------------------------------------
    @staticmethod
    def _loop_argv(root: str, name: str, phase: str, block_bytes: int, n_files: int,
                   jobs: int, direct: bool, job_blocks: int) -> list[str]:
        return [sys.executable, "-m", "mptier.bench.raw", phase, f"{root}/{name}",
                str(block_bytes), str(n_files), str(jobs), str(int(direct)), str(job_blocks)]

    def _run_one(self, argv: list[str], name: str, phase: str, tool: str, root: str,
                 wait: Callable[[subprocess.Popen], tuple[int, int]]
                 ) -> tuple[float | None, int, int, str | None]:
        env = dict(os.environ)
        package_parent = os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_parent, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, text=True, preexec_fn=_all_cpus)
        iters, ns = wait(proc)
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            tail = (stderr or stdout).strip().splitlines()[-3:]
            return (None, iters, ns,
                    f"{tool} {name} {phase} failed ({proc.returncode}): {' | '.join(tail)}")
        try:
            if tool == "fio":
                with open(f"{root}/fio-{name}-{phase}.json") as f:
                    text = f.read()
                report = json.loads(text[text.index("{"):])
                job = report["jobs"][0]
                side = job["write" if phase == "store" else "read"]
                if job.get("error"):
                    return None, iters, ns, f"fio {phase}: error {job['error']}"
                return side["bw_bytes"] / 1e9, iters, ns, None
            result = json.loads(stdout)
            note = f"loop {phase}: {result['errors'][0]}" if result["errors"] else None
            return result["bytes"] / result["seconds"] / 1e9, iters, ns, note
        except (OSError, ValueError, KeyError, IndexError, ZeroDivisionError) as exc:
            return None, iters, ns, f"{tool} {phase}: unreadable output ({exc})"


# The plain loop's buffer holds at most this many bytes; files beyond it reuse slots.
LOOP_BUFFER_CAP = 1 << 30


def _loop_main(argv: list[str]) -> int:
    """``python -m mptier.bench.raw store|load PREFIX BLOCK_BYTES N_FILES THREADS DIRECT
    JOB_BLOCKS``.

    Files are ``PREFIX.<i>``; file ``i`` is written from / read into slot ``i`` of one
    shared, page-aligned buffer (as the designs move blocks to and from distinct slots
    of the primary buffer). Like the designs' workers, each thread takes the next run
    of JOB_BLOCKS consecutive files and does them in order. Prints ``{"bytes",
    "seconds", "errors"}`` as JSON; the time starts when every thread is ready and ends
    when the last one finished.
    """
    phase, prefix, block, n_files, jobs, direct, job_blocks = argv
    block_bytes, n, n_threads, per_job = int(block), int(n_files), int(jobs), int(job_blocks)
    next_job = iter(range(0, n, per_job))
    take = threading.Lock()
    flag = O_DIRECT if direct == "1" else 0
    slots = max(1, min(n, LOOP_BUFFER_CAP // block_bytes))
    buf = mmap.mmap(-1, slots * block_bytes)
    pattern = os.urandom(min(block_bytes, 1 << 20))
    for pos in range(0, slots * block_bytes, len(pattern)):  # also faults every page in
        buf[pos:pos + len(pattern)] = pattern[:slots * block_bytes - pos]
    view = memoryview(buf)
    barrier = threading.Barrier(n_threads + 1)
    errors: list[str] = []
    done = [0] * n_threads

    def one(i: int) -> None:
        slot = view[(i % slots) * block_bytes:(i % slots + 1) * block_bytes]
        if phase == "store":
            fd = os.open(f"{prefix}.{i}", os.O_CREAT | os.O_WRONLY | os.O_TRUNC | flag, 0o644)
            try:
                os.write(fd, slot)
            finally:
                os.close(fd)
        else:
            fd = os.open(f"{prefix}.{i}", os.O_RDONLY | flag)
            try:
                os.readv(fd, [slot])
            finally:
                os.close(fd)

    def run(index: int) -> None:
        barrier.wait()
        try:
            while True:
                with take:
                    first = next(next_job, None)
                if first is None:
                    return
                for i in range(first, min(first + per_job, n)):
                    one(i)
                    done[index] += block_bytes
        except OSError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    print(json.dumps({"bytes": sum(done), "seconds": seconds, "errors": errors[:3]}))
    return 0


if __name__ == "__main__":
    sys.exit(_loop_main(sys.argv[1:]))

"""An eviction's wait for its process's GIL: the unlink threads of a caretaker (four, as
``EVICTOR_THREADS``) removing told blocks of the tier's layout through Python's calls
(``evict_told``: two ``lstat``, ``unlink``, one or two ``rmdir``, each giving the GIL
back and taking it again) against one native call a block (``backend_evict``), with
the worker's serving thread idle or busy the way a worker is (a native call that
releases the GIL, ~1 ms, then ~0.3 ms of Python holding it). Rounds interleaved, a
fresh tree of ``--blocks`` 4 KiB blocks (a leaf folder each) per way and round.

    .venv/bin/python bench/experiments/evict_gil.py --root /var/tmp --rounds 3
    .venv/bin/python bench/experiments/evict_gil.py --root /var/tmp --rounds 4 --policy
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import queue
import shutil
import statistics
import threading
import time

from mptier import native
from mptier.storage import Entry, Kind
from mptier.storage.maintain import UNSEEN_INO, evict_told
from mptier.workers.evictor import EVICTOR_THREADS, backend_evict

BLOCK = 4096
SERVING_NATIVE_BYTES = 1 << 20  # sha256 of 1 MiB: ~1 ms without the GIL
SERVING_PYTHON_S = 0.0003


def make_tree(top: str, n: int) -> list:
    data = b"x" * BLOCK
    for i in range(n):
        h = hashlib.sha256(i.to_bytes(8, "big")).hexdigest()
        folder = os.path.join(top, "model", h[:3], h[3:5] + "_g0")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, h + ".bin"), "wb") as f:
            f.write(data)
    os.sync()
    entries = []
    for dirpath, _, files in os.walk(top):
        for name in files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            # as a worker tells them: never looked at, made before now
            entries.append((path, st.st_size, st.st_atime_ns))
    return entries


def one_run(root: str, way: str, busy: bool, n: int,
            thread_policy: int | None = None) -> tuple[float, float, float]:
    top = os.path.join(root, f"mptier-evict-gil-{os.getpid()}")
    shutil.rmtree(top, ignore_errors=True)
    made = make_tree(top, n)
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for path, size, atime in made:
        todo.put(Entry(path, Kind.BLOCK, size, atime, atime, UNSEEN_INO, "model", None))
    evict = evict_told if way == "python" else backend_evict(native.get_backend("native"))
    times: list[float] = []
    stop = threading.Event()

    def unlinker() -> None:
        if thread_policy is not None:  # this thread only (Linux: a policy per thread)
            os.sched_setscheduler(0, thread_policy, os.sched_param(0))
        while True:
            try:
                entry = todo.get_nowait()
            except queue.Empty:
                return
            t = time.perf_counter()
            assert evict(entry)
            times.append(time.perf_counter() - t)

    big = os.urandom(SERVING_NATIVE_BYTES)

    def serving() -> None:
        while not stop.is_set():
            hashlib.sha256(big).digest()
            t, x = time.perf_counter(), 0
            while time.perf_counter() - t < SERVING_PYTHON_S:
                x += 1

    server = threading.Thread(target=serving)
    if busy:
        server.start()
    threads = [threading.Thread(target=unlinker) for _ in range(EVICTOR_THREADS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    stop.set()
    if busy:
        server.join()
    shutil.rmtree(top, ignore_errors=True)
    times.sort()
    return n / wall, statistics.median(times) * 1e3, times[int(len(times) * 0.9)] * 1e3


def hog() -> None:
    """A store worker's share of the CPUs: busy, at the workers' nice and policy."""
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/var/tmp")
    ap.add_argument("--blocks", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policy", action="store_true",
                    help="instead: this process at nice 10 under SCHED_BATCH (a worker) beside "
                    "two busy ones, the native call, its unlink threads under SCHED_BATCH (as "
                    "they inherit it) against SCHED_OTHER (wake-up preemption)")
    a = ap.parse_args()
    results: dict = {}
    if a.policy:
        os.nice(10)
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        hogs = [multiprocessing.Process(target=hog, daemon=True) for _ in range(2)]
        for p in hogs:
            p.start()
        try:
            for r in range(a.rounds):
                ways = [("batch", os.SCHED_BATCH), ("other", os.SCHED_OTHER)]
                for name, policy in ways if r % 2 == 0 else ways[::-1]:
                    rate, p50, p90 = one_run(a.root, "native", True, a.blocks, policy)
                    results.setdefault((name, True), []).append((rate, p50, p90))
                    print(f"round {r} unlink threads {name}: {rate:6.0f} evictions/s, "
                          f"median {p50:.3f} ms, p90 {p90:.3f} ms", flush=True)
        finally:
            for p in hogs:
                p.kill()
        ways = []
    else:
        ways = [("python", False), ("native", False), ("python", True), ("native", True)]
    for r in range(a.rounds if ways else 0):
        for way, busy in ways if r % 2 == 0 else ways[::-1]:
            rate, p50, p90 = one_run(a.root, way, busy, a.blocks)
            results.setdefault((way, busy), []).append((rate, p50, p90))
            print(f"round {r} {way:6} serving {'busy' if busy else 'idle'}: {rate:6.0f} "
                  f"evictions/s, median {p50:.3f} ms, p90 {p90:.3f} ms", flush=True)
    print("medians over the rounds:")
    for (way, busy), rows in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rate, p50, p90 = (statistics.median(col) for col in zip(*rows))
        print(f"  {way:6} serving {'busy' if busy else 'idle'}: {rate:6.0f} evictions/s, "
              f"median {p50:.3f} ms, p90 {p90:.3f} ms")


if __name__ == "__main__":
    main()

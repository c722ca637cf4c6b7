"""Cold lookups through the ring against one key at a time (``ring_lookups``), side by side.

A lookup task answers each key from an open of its file, O_PATH beneath the root, and an
fstat. After the page cache is dropped that open reads the key's folders and inode from
the device: a read or two of 4 KiB per key. The system-call loop does them one after
another; with ``URING`` (flag ``LOOP_LOOKUP`` off, the default) every key of the task is
opened in the ring at once and the reads go to the device together.

The script makes ``--keys`` files of ``--block-bytes`` in the tier's two-folder layout
under a fresh folder of ``--root``, then per round, for each way in turn: drop the page
cache, look every key up in tasks of ``--task-keys`` (as a worker takes lookup tasks),
time it. With ``--busy`` a thread reads a file of its own with O_DIRECT throughout, so
the lookups' reads queue behind a device that is working, as they do in a load phase.
Prints each round and the median time per way, and their ratio; removes its files.

    sudo python bench/experiments/ring_lookups.py --root /var/tmp --rounds 5 [--busy]
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import statistics
import threading
import time

from mptier import native
from mptier.bench.measure import drop_page_cache

# The background reader's request: large enough to keep the device's queue busy.
BUSY_READ_BYTES = 4 << 20
BUSY_FILE_BYTES = 512 << 20


def drop_caches() -> None:
    """The keys' folders and inodes out of memory (the bench's own drop), or stop."""
    drop = drop_page_cache()
    if not drop.dropped:
        raise SystemExit(f"cannot drop the page cache (run as root): {drop.error}")


def make_files(root: str, keys: int, block_bytes: int) -> list[bytes]:
    data = os.urandom(block_bytes)
    paths = []
    for i in range(keys):
        h = hashlib.sha256(str(i).encode()).hexdigest()
        rel = f"{h[:2]}/{h[2:4]}/{h}.bin"
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
        paths.append(rel.encode())
    return paths


def busy_reader(path: str, stop: threading.Event) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, BUSY_READ_BYTES)
    try:
        offset = 0
        while not stop.is_set():
            n = os.preadv(fd, [buf], offset)
            offset = 0 if n < BUSY_READ_BYTES else offset + n
    finally:
        os.close(fd)
        buf.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--block-bytes", type=int, default=256 << 10)
    ap.add_argument("--task-keys", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--busy", action="store_true",
                    help="a thread reads another file with O_DIRECT meanwhile")
    args = ap.parse_args()
    backend = native.get_backend("native")
    if not backend.uring_available():
        raise SystemExit(f"io_uring is not usable here: {backend.uring_status()}")
    where = os.path.join(args.root, f"mptier-ring-lookups-{os.getpid()}")
    os.makedirs(where)
    ways = {"ring": native.URING, "loop": native.URING | native.LOOP_LOOKUP}
    times: dict[str, list[float]] = {name: [] for name in ways}
    stop = threading.Event()
    reader = None
    try:
        print(f"making {args.keys} files of {args.block_bytes} bytes in {where} ...")
        paths = make_files(os.path.join(where, "keys"), args.keys, args.block_bytes)
        if args.busy:
            with open(os.path.join(where, "busy"), "wb") as f:
                f.write(os.urandom(1 << 20) * (BUSY_FILE_BYTES >> 20))
        fd = os.open(os.path.join(where, "keys"), os.O_RDONLY | os.O_DIRECTORY)
        try:
            if args.busy:
                reader = threading.Thread(target=busy_reader, daemon=True,
                                          args=(os.path.join(where, "busy"), stop))
                reader.start()
            for r in range(args.rounds):
                for name, flags in ways.items():
                    drop_caches()
                    started = time.perf_counter()
                    for k in range(0, len(paths), args.task_keys):
                        answers = backend.lookup(fd, paths[k:k + args.task_keys],
                                                 args.block_bytes, flags)
                        if set(answers) != {native.LOOKUP_PRESENT}:
                            raise SystemExit(f"{name}: a key was not found: {set(answers)}")
                    times[name].append(time.perf_counter() - started)
                print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.3f} s"
                                                     for n, v in times.items()))
        finally:
            os.close(fd)
    finally:
        stop.set()
        if reader is not None:
            reader.join()
        shutil.rmtree(where, ignore_errors=True)
    ring, loop = (statistics.median(times[n]) for n in ("ring", "loop"))
    ratios = sorted(b / a for a, b in zip(times["ring"], times["loop"]))
    print(f"{args.keys} cold keys in tasks of {args.task_keys}"
          f"{', device busy with a reader' if args.busy else ''}: ring {ring:.3f} s, "
          f"loop {loop:.3f} s (median); loop / ring per round: "
          + " ".join(f"{x:.2f}" for x in ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

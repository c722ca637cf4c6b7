"""What the bounce buffer costs a load (mptier.workers.bounce), measured side by side.

Stores N blocks under ROOT once, then in interleaved rounds (odd ones in reverse order)
loads them into a shared mapping five ways with the native batch call: straight into
the slots; through a bounce buffer of BOUNCE_BYTES (``load_via``: a task per call, each
block copied while later reads are in flight); through a one-block bounce buffer (one
read in flight); and "copy-after", the design before 2026-12-01 (a chunk read by one
call, then copied in Python while nothing is in flight); and "buffered": no O_DIRECT,
straight into the slots through the page cache, evicted before every round. O_DIRECT where the root
takes it, so every round reads the disk. Prints GB/s per round and the medians' ratios to direct.

    python bench/experiments/bounce_cost.py --root /var/tmp --block-bytes 2M --blocks 256
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time

from mptier import native
from mptier.config import parse_bytes
from mptier.workers.bounce import BOUNCE_BYTES, Bounce


def _drop_cache(folder: str, paths: list[bytes]) -> None:
    """Evict the blocks from the page cache (a buffered round fills it)."""
    for p in paths:
        fd = os.open(os.path.join(folder, p.decode()), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _CopyAfter:
    """The design before 2026-12-01: each chunk of BOUNCE_BYTES read by one native call,
    then copied into the slots in Python, nothing in flight while it copies."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.blocks = max(1, BOUNCE_BYTES // size)
        self.map = mmap.mmap(-1, self.blocks * size)
        self.view = memoryview(self.map)
        self.view[:] = bytes(len(self.view))

    def load(self, backend, fd, paths, memory, offsets, flags):
        size, view = self.size, self.view
        for start in range(0, len(paths), self.blocks):
            chunk = paths[start:start + self.blocks]
            rc, done, index = backend.load(fd, chunk, view,
                                           [i * size for i in range(len(chunk))], size, flags)
            done = min(done, len(chunk)) if rc == 0 else min(done, index)
            for i in range(done):
                memory[offsets[start + i]:offsets[start + i] + size] = \
                    view[i * size:(i + 1) * size]
            if rc:
                return rc, start + done, start + index
        return 0, len(paths), 0

    def close(self) -> None:
        self.view.release()
        self.map.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/var/tmp")
    ap.add_argument("--block-bytes", default="2M")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--task-blocks", type=int, default=4, help="blocks per load call")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--uring", action=argparse.BooleanOptionalAction, default=True,
                    help="batch through io_uring (the tier's default off memory file systems)")
    args = ap.parse_args()
    size = parse_bytes(args.block_bytes)
    n = args.blocks
    folder = tempfile.mkdtemp(prefix="mptier-bounce-", dir=args.root)
    backend = native.get_backend("native")
    try:
        flags = native.O_DIRECT if native.probe_o_direct(folder) else 0
        if args.uring and backend.uring_available():
            flags |= native.URING
        shared = mmap.mmap(-1, n * size)
        memory = memoryview(shared)
        memory[:] = os.urandom(size) * n
        fd = native.open_root(folder)
        paths = [f"b{i:05d}".encode() for i in range(n)]
        offsets = [i * size for i in range(n)]
        rc, *_ = backend.store(fd, paths, memory, offsets, size, flags,
                               native.new_tag().encode())
        assert rc == 0, rc
        designs = {"direct": None, "bounce": Bounce(size),
                   "bounce-1-block": Bounce(size, nbytes=size),
                   "copy-after": _CopyAfter(size), "buffered": None}
        results: dict[str, list[float]] = {name: [] for name in designs}
        step = args.task_blocks
        for r in range(args.rounds):
            order = list(designs.items())
            if r % 2:  # odd rounds in reverse: a drift of the disk hits every design alike
                order.reverse()
            for name, bounce in order:
                _drop_cache(folder, paths)  # every design reads the disk
                t0 = time.perf_counter()
                for i in range(0, n, step):
                    p, o = paths[i:i + step], offsets[i:i + step]
                    if name == "buffered":  # through the page cache, into the slots
                        rc, *_ = backend.load(fd, p, memory, o, size,
                                              flags & ~native.O_DIRECT)
                    elif bounce is None:
                        rc, *_ = backend.load(fd, p, memory, o, size, flags)
                    else:
                        rc, *_ = bounce.load(backend, fd, p, memory, o, flags)
                    assert rc == 0, rc
                gbps = n * size / (time.perf_counter() - t0) / 1e9
                results[name].append(gbps)
                print(f"round {r} {name:15s} {gbps:6.2f} GB/s", flush=True)
        base = statistics.median(results["direct"])
        print(f"\n{args.root} O_DIRECT={bool(flags & native.O_DIRECT)} "
              f"io_uring={bool(flags & native.URING)} {args.block_bytes} x{step} per call, "
              f"bounce {BOUNCE_BYTES >> 20} MiB")
        for name, values in results.items():
            med = statistics.median(values)
            print(f"{name:15s} median {med:6.2f} GB/s  ratio to direct {med / base:.2f}")
        for bounce in designs.values():
            if bounce is not None:
                bounce.close()
        os.close(fd)
        memory.release()
        shared.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()

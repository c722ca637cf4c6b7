"""How many pieces of physical memory a bounce slot is made of, with and without huge
pages: a direct read into a slot of more pieces than the disk queue's ``max_segments``
goes to the disk as several requests.

    sudo python bench/experiments/bounce_segments.py [--block 2M] [--maps 8] [--root /var/tmp]

Maps ``--maps`` bounce buffers two ways, one after the other, in this process: 4 KiB pages
(the buffer before huge pages: private anonymous memory, populated) and
:class:`mptier.workers.bounce.Bounce` as the workers map it. For each, reads every page's
frame number from ``/proc/self/pagemap`` (root only: others read zeros) and counts the
runs of consecutive frames per block. Prints, per way, the fewest / median / most runs per
block and the share of blocks over the disk's limit, beside ``/proc/buddyinfo``'s free
blocks of 2 MiB and more (how fragmented free memory is: the 4 KiB way depends on it).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import struct
import sys

from mptier.config import parse_bytes
from mptier.workers.bounce import BOUNCE_BYTES, Bounce

PAGE = os.sysconf("SC_PAGE_SIZE")
PFN_MASK = (1 << 55) - 1
PRESENT = 1 << 63
MADV_POPULATE_WRITE = 23


def max_segments(root: str) -> int | None:
    """The request limit of the disk behind ``root`` (None if not a block device's)."""
    dev = os.stat(root).st_dev
    try:
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue/max_segments") as f:
            return int(f.read())
    except OSError:
        return None


def runs_per_block(address: int, nbytes: int, block: int) -> list[int]:
    """Runs of physically consecutive pages in each block of [address, +nbytes)."""
    pages = nbytes // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(address // PAGE * 8)
        entries = struct.unpack(f"{pages}Q", f.read(pages * 8))
    if not any(e & PFN_MASK for e in entries):
        raise SystemExit("pagemap shows no frame numbers: run as root")
    per_block, out = block // PAGE, []
    for start in range(0, pages, per_block):
        runs, last = 0, None
        for e in entries[start:start + per_block]:
            pfn = e & PFN_MASK if e & PRESENT else None
            runs += pfn is None or last is None or pfn != last + 1
            last = pfn
        out.append(runs)
    return out


def address_of(buffer) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def small_pages(block: int) -> tuple[mmap.mmap, int]:
    """The buffer before huge pages: 4 KiB pages, populated at once."""
    blocks = max(1, BOUNCE_BYTES // block)
    m = mmap.mmap(-1, blocks * block, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(MADV_POPULATE_WRITE)
    return m, blocks * block


def free_huge_blocks() -> int:
    """Free blocks of order 9 (2 MiB) and more, all zones (/proc/buddyinfo)."""
    total = 0
    with open("/proc/buddyinfo") as f:
        for line in f:
            counts = [int(x) for x in line.split()[4:]]
            total += sum(c << (order - 9) for order, c in enumerate(counts) if order >= 9)
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block", default="2M", help="block size (default 2M)")
    p.add_argument("--maps", type=int, default=8, help="buffers mapped each way")
    p.add_argument("--root", default="/var/tmp", help="where the blocks would live")
    args = p.parse_args()
    block = parse_bytes(args.block)
    limit = max_segments(args.root)
    print(f"block {block >> 10} KiB: {block // PAGE} pages; {args.root}: max_segments "
          f"{limit}; free 2 MiB blocks {free_huge_blocks()}")
    for way in ("4 KiB pages", "Bounce.map"):
        runs, keep = [], []
        for _ in range(args.maps):
            if way == "Bounce.map":
                b = Bounce(block)
                b.map()
                view = b._view  # the mapping the workers read into
                runs += runs_per_block(address_of(b._map), len(view), block)
                keep.append(b)
            else:
                m, n = small_pages(block)
                runs += runs_per_block(address_of(m), n, block)
                keep.append(m)
        over = sum(r > limit for r in runs) if limit else 0
        print(f"{way:>12}: runs per block min {min(runs)} median {statistics.median(runs):g} "
              f"max {max(runs)}; over the disk's limit: {over} of {len(runs)} blocks")
        for k in keep:
            k.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

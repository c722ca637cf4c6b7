"""When the bench removes what a design wrote: at once in memory, at the end of the run
on a disk.

On ext4 without a journal, creating an inode within a minute or more of deletions nearby
costs up to six times its CPU: the allocator skips inodes deleted shortly before
(``recently_deleted`` in the kernel's ``fs/ext4/ialloc.c``; docs/performance.md,
sections 11 and 14). A design that stored right after another one's files went measured
the file system's allocator, not itself. So on a disk root every design's folder is
kept (:class:`KeptFiles`) until the run ends, unless the root runs short of room for the
next design's files; in memory a design's files go at once, since the next design needs
the memory. After an early removal the bench waits for the disk to finish discarding
what was freed (:func:`settle`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable

from mptier import fskind
from mptier.bench.saturation import device_counters

# When a design's files go: right after the design, or at the end of the run (every
# case and round).
REMOVE_EACH = "after each design"
REMOVE_AT_END = "at the end of the run"
# Free room a disk root must keep, in units of one design's bytes, before another design
# starts beside the files kept so far (folders, metadata and the file system's reserve).
ROOM_FACTOR = 2
# After an early removal a disk mounted with ``discard`` still has every freed block to
# discard, for seconds to minutes, and the next design's phases would meet those
# requests (a discard took up to 0.2 s of device time on this machine's disk;
# docs/performance.md, section 17). The bench waits until the device has completed no
# discard for SETTLE_QUIET_S, looking every SETTLE_POLL_S, at most SETTLE_LIMIT_S (then
# it says so and goes on).
SETTLE_QUIET_S = 2.0
SETTLE_POLL_S = 0.25
SETTLE_LIMIT_S = 180.0


def removal_rule(root: str, defer: bool = True) -> str:
    """REMOVE_AT_END on a disk root (unless ``defer`` is off), REMOVE_EACH in memory.
    ``root`` exists (the bench refuses a root that does not)."""
    if not defer or fskind.fs_magic(root) in fskind.MEMORY_MAGICS:
        return REMOVE_EACH
    return REMOVE_AT_END


def remove_path(path: str) -> None:
    """Remove a design's folder and everything in it; what is gone already is fine."""
    shutil.rmtree(path, ignore_errors=True)


def device_discards(root: str) -> int | None:
    """Discard requests the block device holding ``root`` has completed; None where no
    block device holds it (tmpfs, FUSE, a network file system) or the kernel does not
    count discards."""
    counters = device_counters(root)
    return None if counters is None else counters.discards


def settle(root: str, progress: Callable[[str], None]) -> None:
    """Write what the file system holds (the removal's journal commits, and with them
    the discards of the freed blocks), then wait until the device under ``root`` has
    completed no discard for SETTLE_QUIET_S, at most SETTLE_LIMIT_S."""
    os.sync()
    first = last = device_discards(root)
    if first is None:
        return
    start = quiet_since = time.monotonic()
    while True:
        time.sleep(SETTLE_POLL_S)
        now, seen = time.monotonic(), device_discards(root)
        if seen is None:
            return
        if seen != last:
            last, quiet_since = seen, now
        if now - quiet_since >= SETTLE_QUIET_S:
            progress(f"the disk under {root} settled {now - start:.1f} s after the removal "
                     f"({last - first} discard requests meanwhile)")
            return
        if now - start >= SETTLE_LIMIT_S:
            progress(f"the disk under {root} still discarding after {SETTLE_LIMIT_S:.0f} s "
                     f"({last - first} discard requests so far): going on; the next "
                     "design's figures may include them")
            return


class KeptFiles:
    """Design folders on disk roots whose removal waits for the end of the run."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def add(self, path: str) -> None:
        self.paths.append(path)

    def remove_all(self, each: Callable[[int, int], None] | None = None) -> None:
        """Remove every kept folder, newest first; ``each(removed, total)`` after each
        (a run's ~25 GB of small files take a minute or two on ext4)."""
        total = len(self.paths)
        while self.paths:
            remove_path(self.paths.pop())
            if each is not None:
                each(total - len(self.paths), total)

    def make_room(self, root: str, design_bytes: int,
                  progress: Callable[[str], None]) -> None:
        """Remove every kept folder now if ``root`` lacks ROOM_FACTOR times the next
        design's ``design_bytes``, and say so through ``progress``."""
        if not self.paths:
            return
        with contextlib.suppress(OSError):
            st = os.statvfs(root)
            if st.f_bavail * st.f_frsize >= ROOM_FACTOR * design_bytes:
                return
        progress(f"removing {len(self.paths)} earlier design folder(s) early: {root} is "
                 "short of room for the next design's files")
        self.remove_all()
        settle(root, progress)

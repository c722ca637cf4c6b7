"""Loads through a private bounce buffer: a read that outlives its worker never lands
in the engine's buffer.

The hazard. A load reads a block file into a slot of the engine's buffer, which the
worker maps. When the file system hangs (a dead NFS server, a stalled FUSE daemon), the
supervisor kills the worker after ``io_timeout_s`` and reports the load failed; the
engine then reuses the slot. But a read that reaches the device or server *directly*
(O_DIRECT, or any read on a FUSE mount that serves ``direct_io``) waits in the kernel
uninterruptibly, SIGKILL or not, with the slot's pages pinned as its target -- and when
the server finally answers, the kernel copies the old block into them: the engine's new
contents of that slot are silently overwritten (measured with the FUSE test file system;
``tests/test_reliability_stuck.py``). A read through the page cache is safe: its wait is
killable and it copies nothing after SIGKILL.

The fix. Where a load may read directly, the worker reads each block into a private,
page-aligned buffer of its own and copies it into the slot only after the read returned.
A worker killed while stuck dies on its way back from the system call, before the
copy: the late bytes land in memory that dies with it.

Where it is used: O_DIRECT loads, and any load from a file system not known to read
through the page cache (:data:`PAGE_CACHE_FS_TYPES`: local disks and memory file
systems). The cost is one memory copy per block, small beside a network or direct read.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence

# File systems whose buffered reads go through the page cache (killable waits, nothing
# copied after SIGKILL). Everything else -- NFS, CIFS, Ceph, Lustre, 9p, every FUSE file
# system (a FUSE daemon may serve direct_io, which bypasses the page cache) -- bounces.
PAGE_CACHE_FS_TYPES = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "jfs", "reiserfs", "bcachefs",
    "tmpfs", "ramfs", "hugetlbfs", "overlay"})


def fs_type(path: str) -> str:
    """Type of the file system mounted at (or above) ``path``, from
    ``/proc/self/mountinfo``; ``""`` if unknown. Never touches ``path`` itself (a hung
    mount must not hang the caller), so a symlink in ``path`` is not followed."""
    target = os.path.abspath(path).rstrip("/") or "/"
    best, best_type = -1, ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.readlines()
    except OSError:
        return ""
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        point = fields[4].replace("\\040", " ").rstrip("/") or "/"
        inside = point == "/" or target == point or target.startswith(point + "/")
        if inside and len(point) >= best:  # later mounts over the same point win
            best, best_type = len(point), right.split()[0]
    return best_type


def needs_bounce(root_dir: str, use_o_direct: bool) -> bool:
    """Whether loads under ``root_dir`` must go through a bounce buffer (see module
    docstring)."""
    return use_o_direct or fs_type(root_dir) not in PAGE_CACHE_FS_TYPES


class Bounce:
    """A worker's private one-block buffer (page-aligned, so O_DIRECT reads into it).

    Not thread-safe: one per worker process.
    """

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self._map: mmap.mmap | None = mmap.mmap(-1, block_bytes)
        self._view = memoryview(self._map)

    def load(self, load: Callable[..., tuple[int, int, int]], root_fd: int,
             paths: Sequence[bytes], memory: memoryview, offsets: Sequence[int],
             flags: int) -> tuple[int, int, int]:
        """Load ``paths[i]`` into ``memory[offsets[i]:+block_bytes]`` one block at a time
        through this buffer, with the native errno layer's ``load(root_fd, paths,
        buffer, offsets, block_bytes, flags)``; returns what it would for the whole
        batch, ``(rc, n_done, fail_index)``. A failing block's slot is left untouched."""
        size = self.block_bytes
        view = self._view
        for i, (path, offset) in enumerate(zip(paths, offsets)):
            rc, _, _ = load(root_fd, [path], view, [0], size, flags)
            if rc:
                return rc, i, i
            memory[offset:offset + size] = view  # only after the read returned
        return 0, len(paths), 0

    def close(self) -> None:
        """Release the buffer. Idempotent."""
        if self._map is not None:
            self._view.release()
            self._map.close()
            self._map = None

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
copy: the late bytes land in memory that dies with it. (With io_uring the killed worker
is gone at once and the kernel finishes the hung request later -- into the private
pages it still pins, never the slot.) The copy is made in C, in the same native call
as the reads (``Backend.load_via``): block by block in batch order, each as soon as its
read returned, while the task's later reads are still in flight. Before a slot is
copied to, the core makes sure the worker's mapping has it (``mpt_map_slot``: two
``/proc/self/pagemap`` entries, and ``MADV_POPULATE_READ`` only when the slot's first or
last page is missing), with io_uring while the reads fly: a slot the engine wrote after
the worker attached (its pre-fault mapped only the pages there were then) would
otherwise take one trapped fault per 4 KiB page in the copy -- 1,024 per 4 MiB against
65 -- where a direct read's pinning maps them in the kernel.

Where it is used (``TierConfig.bounce_loads = "auto"``): O_DIRECT loads from a file
system with a device behind it, and any load from a file system not known to read
through the page cache (:data:`PAGE_CACHE_FS_TYPES`: local disks and memory file
systems); never in memory (tmpfs: an O_DIRECT read there is a copy the worker makes
itself). ``bounce_loads = false`` turns it off for roots the operator trusts never to
stall past ``io_timeout_s``. The cost is one memory copy per block (a CPU's work the
worker must get: on a busy machine the worker's low priority shows here); a task stays
one native call whatever its size. The rule per file system and its measurements:
docs/storage.md, "Loads and the late read".
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any

from mptier.fskind import MEMORY_FS_TYPES, fs_type

# File systems whose buffered reads go through the page cache (killable waits, nothing
# copied after SIGKILL). Everything else -- NFS, CIFS, Ceph, Lustre, 9p, every FUSE file
# system (a FUSE daemon may serve direct_io, which bypasses the page cache) -- bounces.
PAGE_CACHE_FS_TYPES = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "jfs", "reiserfs", "bcachefs",
    "tmpfs", "ramfs", "hugetlbfs", "overlay"})
# File systems in memory (fskind.MEMORY_FS_TYPES): no device and no server, so even an
# O_DIRECT read is a copy the reading process makes itself, done before SIGKILL is acted
# on. Never bounced.

# Where "auto" bounces O_DIRECT stores: local file systems with a device behind them,
# where it was measured (docs/storage.md, "Stores through the bounce buffer"). On a
# network or FUSE file system the write's pages are the server's or the daemon's affair
# and the copy would be pure cost.
BOUNCE_STORES_FS_TYPES = PAGE_CACHE_FS_TYPES - MEMORY_FS_TYPES


def needs_bounce(root_dir: str, use_o_direct: bool, setting: bool | str = "auto") -> bool:
    """Whether process workers' loads under ``root_dir`` go through a bounce buffer
    (``TierConfig.bounce_loads``, see the module docstring): "auto" where a read may
    outlive its worker -- O_DIRECT on a file system with a device behind it, or any file
    system not known to read through the page cache -- never in memory; True wherever
    not in memory; False never."""
    if setting is False:
        return False
    kind = fs_type(root_dir)
    if kind in MEMORY_FS_TYPES:
        return False
    return setting is True or use_o_direct or kind not in PAGE_CACHE_FS_TYPES


def bounce_stores(root_dir: str, use_o_direct: bool, setting: bool | str = "auto",
                  buffer_page_bytes: int = mmap.PAGESIZE) -> bool:
    """Whether process workers' stores under ``root_dir`` copy each block into the
    bounce buffer and write it from there (``TierConfig.bounce_stores``): "auto" for
    O_DIRECT stores on a local disk (BOUNCE_STORES_FS_TYPES), where the write's pages
    decide how the device takes it, unless the engine's buffer is already in huge
    pages (``buffer_page_bytes``, :func:`mptier.mapping.page_bytes`: a block then goes
    to the device in one or a few segments, and the copy would be pure cost); True
    wherever not in memory; False never."""
    if setting is False:
        return False
    kind = fs_type(root_dir)
    if kind in MEMORY_FS_TYPES:
        return False
    return setting is True or (use_o_direct and kind in BOUNCE_STORES_FS_TYPES
                               and buffer_page_bytes < HUGE_PAGE_BYTES)


# A bounce buffer holds this many bytes of blocks (at least one block): the reads in
# flight of one task (io_uring keeps one per bounce slot, at most 32), so a default 8 MiB
# task keeps all its blocks in flight; a worker's private memory stays bounded. Measured
# on this VM's ext4 with O_DIRECT, 2 MiB blocks, 4 per call: one slot (one read in
# flight) ran at 0.32-0.50 of unbounced loads, 16 MiB at 0.70-0.79
# (bench/experiments/bounce_cost.py).
BOUNCE_BYTES = 16 << 20
# The bounce buffer is asked for in transparent huge pages (madvise MADV_HUGEPAGE; x86-64
# PMD size), its length rounded up to whole ones so the kernel aligns it. Why: a direct
# read's request holds at most the disk queue's max_segments runs of physically
# contiguous memory (254 on this VM's virtio disk). A 2 MiB read into 512 scattered
# 4 KiB pages went to the disk as two requests of about 1 MiB (/proc/diskstats: 1,000
# reads of 1,045 KiB for 512 blocks), into one huge page as one; the engine's slots,
# whose pages the kernel had handed out in order, went as one too.
HUGE_PAGE_BYTES = 2 << 20
# madvise(2): allocate and map the bounce buffer's pages writable, at once (Linux 5.14+).
MADV_POPULATE_WRITE = 23


class Bounce:
    """A worker's private buffer of whole blocks (page-aligned, so O_DIRECT reads into
    it). :meth:`map` allocates it; the worker calls it as its session starts, beside the
    pre-fault, so the first load does not pay for it (measured: a new worker's first
    64-block load of 2 MiB blocks took 155-506 ms against 60-100 ms after, four workers
    each mapping 16 MiB inside it). :meth:`load` maps it too if it was not.

    Not thread-safe: one per worker process.
    """

    def __init__(self, block_bytes: int, nbytes: int = BOUNCE_BYTES) -> None:
        self.block_bytes = block_bytes
        self.blocks = max(1, nbytes // block_bytes)
        self._map: mmap.mmap | None = None
        self._whole: memoryview | None = None  # the mapping, huge-page tail included
        self._view: memoryview | None = None  # its blocks

    def map(self) -> None:
        """Allocate and map every page of the buffer now (idempotent)."""
        if self._view is not None:
            return
        # Private: the worker's alone (mmap's default for anonymous memory is shared,
        # which is shmem -- pages the kernel's reclaim may unmap again, to be faulted
        # back in by the next read or copy).
        self._map = mmap.mmap(-1, self.mapped_bytes,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._whole = memoryview(self._map)
        self._view = self._whole[:self.blocks * self.block_bytes]
        # Huge pages where the kernel has them: see HUGE_PAGE_BYTES.
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass
        # Touch every page now. Measured on this VM (ext4, O_DIRECT, io_uring, 2 MiB
        # blocks): reading into a mapping no one had written ran at 1.13 GB/s round
        # after round, into one written first at 1.77 (direct into the slots: 1.64).
        # In the kernel where it can (no 16 MiB of zeros made and copied first).
        try:
            self._map.madvise(MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            self._view[:] = bytes(len(self._view))

    @property
    def mapped_bytes(self) -> int:
        """The mapping's length: the blocks, rounded up to whole huge pages."""
        n = self.blocks * self.block_bytes
        return -(-n // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES

    @property
    def mapped(self) -> bool:
        return self._view is not None

    def load(self, backend: Any, root_fd: int, paths: Sequence[bytes], memory: memoryview,
             offsets: Sequence[int], flags: int) -> tuple[int, int, int]:
        """Load ``paths[i]`` into ``memory[offsets[i]:+block_bytes]`` through this
        buffer, the whole batch in one call of ``backend.load_via`` (the native errno
        layer); returns what ``backend.load`` would, ``(rc, n_done, fail_index)``. Only
        the blocks before a failure reach ``memory``; the failing block's slot is left
        untouched."""
        self.map()
        return backend.load_via(root_fd, paths, memory, offsets, self.block_bytes, flags,
                                self._view)

    def store(self, backend: Any, root_fd: int, paths: Sequence[bytes], memory: memoryview,
              offsets: Sequence[int], flags: int, tag: bytes,
              found: bytearray | None = None) -> tuple[int, int, int, int]:
        """Store ``memory[offsets[i]:+block_bytes]`` to ``paths[i]``, each block copied
        into a slot of this buffer and written from there (``backend.store`` with
        ``bounce``); returns what ``backend.store`` would."""
        self.map()
        return backend.store(root_fd, paths, memory, offsets, self.block_bytes, flags, tag,
                             found, self._view)

    def load_task(self, backend: Any, root_fd: int, record, memory: memoryview,
                  flags: int) -> tuple[int, int, int]:
        """:meth:`load` of the blocks of a task record (``backend.load_task``)."""
        self.map()
        return backend.load_task(root_fd, record, memory, self.block_bytes, flags,
                                 self._view)

    def close(self) -> None:
        """Release the buffer. Idempotent."""
        if self._map is not None:
            for view in (self._view, self._whole):
                if view is not None:
                    view.release()
            self._map.close()
        self._map = self._whole = self._view = None

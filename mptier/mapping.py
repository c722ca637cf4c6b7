"""Mapping the primary buffer into a process: one contiguous address range built from
one or more file segments, plus pre-faulting. No numpy here: workers import this.

Pre-faulting (:meth:`MappedBuffer.prefault`) maps the pages the buffer already has and
never allocates one. Measured on a 2-core VM (bench/experiments/prefault_cost.py,
docs/performance.md): a fresh mapping pays a minor fault per 4 KiB page on first write
(1.8 µs each, 0.47 s per GiB loaded) and one per 16 pages on first read; populating
existing pages read-only costs 0.27 µs per page and leaves no fault for writes either
(a shared shmem mapping gets writable entries), 2.5-3.7x cheaper than
``MADV_POPULATE_WRITE``. Populating a *hole* of a sparse shared-memory file, with either
advice, allocates and zeroes a page: done in every worker at start that commits the whole
buffer and, on a VM whose balloon reports free memory to the host, eats the pool of
host-backed free pages, so every page the file system allocates next costs about 12 µs
instead of 3 (the 5x tmpfs store swing of issue 13). Holes are therefore left alone:
whoever writes a slot first allocates it, as it would without a tier.

A buffer is described by :class:`Segment` s: ``length`` bytes of an open file, starting
at ``file_offset``, that appear at ``buffer_offset`` in the buffer. The segments of a
buffer cover it without gaps. Mapping uses libc ``mmap`` through ctypes so that several
segments can sit back to back (``MAP_FIXED`` into a reserved range) exactly as they do in
the engine.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import time
from dataclasses import dataclass

from mptier import fskind

PAGE_SIZE = mmap.PAGESIZE
MADV_POPULATE_READ = 22  # Linux 5.14+
MADV_POPULATE_WRITE = 23  # Linux 5.14+
_MAP_FIXED = 0x10
_PROT_NONE = 0
_MAP_FAILED = ctypes.c_void_p(-1).value

# The process's own symbols, libc's among them (as fskind and _pure take them):
# ctypes.util.find_library("c") would run ldconfig in a subprocess, ~25 ms at every
# import, in every worker start.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.mincore.restype = ctypes.c_int
# mincore() sets bit 0 of a page's byte when the page is resident; the other bits are
# reserved. This table turns the vector into b"\x01" (resident) / b"\x00" bytes.
_RESIDENT = bytes(i & 1 for i in range(256))
_RUNS = re.compile(rb"\x01+")


@dataclass(frozen=True)
class Segment:
    fd: int
    file_offset: int
    length: int
    buffer_offset: int
    path: str = ""


@dataclass(frozen=True)
class PrefaultResult:
    """What :meth:`MappedBuffer.prefault` did: ``mapped_bytes`` of existing pages now
    mapped, ``hole_bytes`` left alone (no page yet), ``method`` ("populate_read",
    "touch" on old kernels, "none" when residency could not be read), ``seconds``."""

    mapped_bytes: int
    hole_bytes: int
    method: str
    seconds: float


def _check(result: int | None, what: str) -> int:
    if result is None or result == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def check_segments(segments: list[Segment], nbytes: int) -> None:
    """Raise ``ValueError`` unless ``segments`` tile the buffer's ``nbytes`` bytes exactly
    (in order, no gap, no overlap) and each lies inside its open file (``fstat``). A
    mapping past a file's end faults (SIGBUS) on first touch, and a gap would be
    unmapped: then the mapping's length, which bounds every block the native layer
    moves, would promise memory that is not there. What an engine claims about its
    buffer is checked against what its descriptors are."""
    if not segments:
        raise ValueError("a buffer needs at least one segment")
    at = 0
    for i, seg in enumerate(segments):
        if seg.buffer_offset != at:
            raise ValueError(f"segment {i} starts at buffer offset {seg.buffer_offset}, "
                             f"expected {at}: segments must cover the buffer in order, "
                             "without gaps or overlaps")
        if seg.length <= 0 or seg.file_offset < 0:
            raise ValueError(f"segment {i} has length {seg.length} at file offset "
                             f"{seg.file_offset}: expected a positive length at an offset "
                             ">= 0")
        size = os.fstat(seg.fd).st_size
        if seg.file_offset + seg.length > size:
            raise ValueError(f"segment {i} ({seg.path or f'fd {seg.fd}'}) claims bytes "
                             f"[{seg.file_offset}, {seg.file_offset + seg.length}) of a file "
                             f"of {size} bytes: a buffer must lie inside its files")
        at += seg.length
    if at != nbytes:
        raise ValueError(f"the segments cover {at} bytes but the buffer is said to have "
                         f"{nbytes}")


class MappedBuffer:
    """The primary buffer mapped from its segments; ``memory`` is a writable byte view of
    exactly ``nbytes``, every byte of it backed by a file (:func:`check_segments`)."""

    def __init__(self, segments: list[Segment], nbytes: int) -> None:
        check_segments(segments, nbytes)
        # Segments may start inside a page (a view that begins mid-page): map from the
        # page boundary and remember how far into the mapping byte 0 of the buffer lies.
        first = segments[0]
        lead = first.file_offset % PAGE_SIZE
        self._total = _round_up(lead + nbytes, PAGE_SIZE)
        base = _check(_libc.mmap(None, self._total, _PROT_NONE,
                                 mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0),
                      "reserving address space for the primary buffer")
        self._base = base
        try:
            for seg in segments:
                seg_lead = seg.file_offset % PAGE_SIZE
                at = base + lead + seg.buffer_offset - seg_lead
                if at % PAGE_SIZE:
                    raise ValueError(f"segment at buffer offset {seg.buffer_offset} is not "
                                     "page-aligned relative to the first segment")
                _check(_libc.mmap(at, seg_lead + seg.length,
                                  mmap.PROT_READ | mmap.PROT_WRITE,
                                  mmap.MAP_SHARED | _MAP_FIXED, seg.fd,
                                  seg.file_offset - seg_lead),
                       f"mapping {seg.path or f'fd {seg.fd}'}")
        except BaseException:
            _libc.munmap(base, self._total)
            raise
        self.address = base + lead
        self.nbytes = nbytes
        self.memory = memoryview((ctypes.c_char * nbytes).from_address(self.address)).cast("B")

    def prefault(self) -> PrefaultResult:
        """Map every page the buffer already has into this process now, so the first
        tasks do not pay a minor fault per 4 KiB page. Blocks for the time it takes
        (about 0.3 µs per page); never raises.

        Only resident pages are touched (``mincore``), with ``MADV_POPULATE_READ``, so
        it never allocates memory nor dirties a page: holes of a sparse buffer stay
        holes. On kernels without the advice (before 5.14) it reads one byte per
        resident page instead.
        """
        start = time.perf_counter()
        n_pages = self._total // PAGE_SIZE
        vector = (ctypes.c_ubyte * n_pages)()
        if _libc.mincore(self._base, self._total, vector) != 0:
            # Cannot tell pages from holes: map nothing rather than allocate them.
            return PrefaultResult(0, self._total, "none", time.perf_counter() - start)
        resident = bytes(vector).translate(_RESIDENT)
        method = "populate_read"
        mapped = 0
        for run in _RUNS.finditer(resident):
            addr = self._base + run.start() * PAGE_SIZE
            length = (run.end() - run.start()) * PAGE_SIZE
            mapped += length
            if method == "populate_read" and \
                    _libc.madvise(addr, length, MADV_POPULATE_READ) == 0:
                continue
            if method == "populate_read" and ctypes.get_errno() != errno.EINVAL:
                continue  # e.g. the file shrank meanwhile: leave the rest to faults
            method = "touch"
            for pos in range(addr, addr + length, PAGE_SIZE):
                ctypes.string_at(pos, 1)  # reading a resident page maps it
        return PrefaultResult(mapped, self._total - mapped, method,
                              time.perf_counter() - start)

    def close(self) -> None:
        if self._base:
            self.memory.release()
            _libc.munmap(self._base, self._total)
            self._base = 0


def page_bytes(segments: list[Segment]) -> int:
    """The smallest page size among the files behind ``segments``
    (:func:`mptier.fskind.page_bytes_of`); the base page for a file that cannot be asked."""
    sizes = []
    for segment in segments:
        try:
            sizes.append(fskind.page_bytes_of(segment.fd))
        except OSError:
            sizes.append(PAGE_SIZE)
    return min(sizes, default=PAGE_SIZE)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple

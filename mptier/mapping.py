"""Mapping the primary buffer into a process: one contiguous address range built from
one or more file segments, plus pre-faulting. No numpy here: workers import this.

A buffer is described by :class:`Segment` s: ``length`` bytes of an open file, starting
at ``file_offset``, that appear at ``buffer_offset`` in the buffer. The segments of a
buffer cover it without gaps. Mapping uses libc ``mmap`` through ctypes so that several
segments can sit back to back (``MAP_FIXED`` into a reserved range) exactly as they do in
the engine.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from dataclasses import dataclass

PAGE_SIZE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # Linux 5.14+
_MAP_FIXED = 0x10
_PROT_NONE = 0
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


@dataclass(frozen=True)
class Segment:
    fd: int
    file_offset: int
    length: int
    buffer_offset: int
    path: str = ""


def _check(result: int | None, what: str) -> int:
    if result is None or result == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


class MappedBuffer:
    """The primary buffer mapped from its segments; ``memory`` is a writable byte view."""

    def __init__(self, segments: list[Segment], nbytes: int) -> None:
        if not segments:
            raise ValueError("a buffer needs at least one segment")
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

    def prefault(self) -> None:
        """Fault every page in for writing now rather than on first touch."""
        if _libc.madvise(self._base, self._total, MADV_POPULATE_WRITE) == 0:
            return
        # Older kernels: touch one byte per page, keeping its value.
        mem = self.memory
        for pos in range(0, self.nbytes, PAGE_SIZE):
            mem[pos] = mem[pos]

    def close(self) -> None:
        if self._base:
            self.memory.release()
            _libc.munmap(self._base, self._total)
            self._base = 0


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple

"""Adapter from validated Python arguments to the compiled core (``_mptier_cffi``).

Exposes the same four functions with the same signatures and return values as
``_pure``. Importing this module raises ``ImportError`` when the extension was not
built. cffi releases the GIL around each call, so a whole batch runs without it; the C
loop sees only the paths blob, the buffer address and the offsets array.
"""

from __future__ import annotations

from collections.abc import Sequence

import mptier.native._mptier_cffi as _cffi
from mptier.native import _pure

ffi, lib = _cffi.ffi, _cffi.lib

if (lib.MPT_O_DIRECT, lib.MPT_DIRECT_ALIGN) != (_pure.O_DIRECT_FLAG, _pure.DIRECT_ALIGN):
    raise ImportError("mptier native core and mptier/native/_pure.py disagree on constants; "
                      "rebuild the package")


def _batch(fn, paths: Sequence[bytes], buffer, offsets: Sequence[int], block_bytes: int,
           flags: int) -> tuple[int, int, int]:
    n = len(paths)
    if n == 0:
        return 0, 0, 0
    blob = b"\0".join(paths) + b"\0"  # one allocation for the whole batch
    offs = ffi.new("uint64_t[]", offsets)
    out = ffi.new("size_t[2]")
    with ffi.from_buffer("char[]", buffer, require_writable=True) as base:
        rc = fn(blob, n, base, offs, block_bytes, flags, out, out + 1)
    return rc, out[0], out[1]


def batch_store(paths: Sequence[bytes], buffer, offsets: Sequence[int], block_bytes: int,
                flags: int) -> tuple[int, int, int]:
    return _batch(lib.mpt_batch_store, paths, buffer, offsets, block_bytes, flags)


def batch_load(paths: Sequence[bytes], buffer, offsets: Sequence[int], block_bytes: int,
               flags: int) -> tuple[int, int, int]:
    return _batch(lib.mpt_batch_load, paths, buffer, offsets, block_bytes, flags)


def batch_exists(paths: Sequence[bytes]) -> list[bool]:
    n = len(paths)
    if n == 0:
        return []
    out = ffi.new("uint8_t[]", n)
    lib.mpt_batch_exists(b"\0".join(paths) + b"\0", n, out)
    return [bool(x) for x in ffi.unpack(out, n)]


def probe_o_direct(directory: bytes) -> int:
    return lib.mpt_probe_o_direct(directory)

"""CRC32C in Python with numpy: the pure twin of ``crc32c.c``. Correct first, then usable.

A Python loop over bytes manages a few MB/s, too slow for a test suite that may run
whole on this backend. numpy cannot carry one CRC faster, but it can carry thousands at
once, so the data is cut into L equal lanes whose CRCs advance together, a 16-bit
table step (two table look-ups per 4 bytes) at a time::

    data = lane_0 | lane_1 | ... | lane_{L-1} | tail         every lane m bytes
    raw(data, r) = XOR_i Z_{(L-1-i) m}(raw(lane_i, r if i == 0 else 0)), then the tail

``raw`` is the CRC register without the final xor, ``Z_n`` "feed n zero bytes": a
linear map on 32 bits (a 32x32 matrix over GF(2)), applied to many values at once
through four 256-entry tables. The lanes are joined pairwise, level by level (Z_m, then
Z_2m, ...), zero lanes padding their number to a power of two (a zero register fed
zeros stays zero). Small inputs skip numpy and run the 16-bit table step in plain Python.
"""

from __future__ import annotations

import sys

import numpy as np

POLY = 0x82F63B78  # Castagnoli, bit-reflected
# Below this many bytes the plain-Python loop is cheaper than numpy's per-call overhead.
NUMPY_MIN_BYTES = 2048
# Lane length by input size: longer lanes mean fewer, larger numpy steps. The numbers
# come from timing 8 KiB to 4 MiB inputs: per-step overhead versus per-element work.
_LANE_BYTES = ((1 << 20, 256), (64 << 10, 128), (0, 64))


def _byte_table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = (t >> 1) ^ (np.uint32(POLY) * (t & 1))
    return t


_T8 = _byte_table()


def _after_zero_bytes(table: np.ndarray, steps: int) -> np.ndarray:
    """``table`` advanced by ``steps`` zero bytes (the CRC register step)."""
    for _ in range(steps):
        table = _T8[table & 0xFF] ^ (table >> 8)
    return table


# raw(x, 4 bytes w) for x = 0: the register after 4 bytes is a function of (x ^ w), which
# splits by linearity into its low and high 16 bits.
_LO16 = _after_zero_bytes(np.arange(1 << 16, dtype=np.uint32), 4)
_HI16 = _after_zero_bytes(np.arange(1 << 16, dtype=np.uint32) << 16, 4)
_LO16_LIST = _LO16.tolist()
_HI16_LIST = _HI16.tolist()
_T8_LIST = _T8.tolist()
_LITTLE = sys.byteorder == "little"  # _raw_small reads native 4-byte words


# -- GF(2) operators: a tuple of 32 ints, the image of each bit ------------------------

def _apply(mat: tuple[int, ...], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _compose(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """a after b."""
    return tuple(_apply(a, col) for col in b)


def _one_zero_byte() -> tuple[int, ...]:
    bit = (POLY, *(1 << (i - 1) for i in range(1, 32)))
    op = bit
    for _ in range(3):
        op = _compose(op, op)
    return op


_shift_tables: dict[int, np.ndarray] = {}
_zero_ops: dict[int, tuple[int, ...]] = {1: _one_zero_byte()}


def _zero_op(nbytes: int) -> tuple[int, ...]:
    """Z_nbytes; nbytes is a power of two (lane lengths and their doublings)."""
    op = _zero_ops.get(nbytes)
    if op is None:
        half = _zero_op(nbytes // 2)
        op = _zero_ops[nbytes] = _compose(half, half)
    return op


def _shift_table(nbytes: int) -> np.ndarray:
    """Z_nbytes as four 256-entry tables, one per byte of the register: (4, 256)."""
    tab = _shift_tables.get(nbytes)
    if tab is None:
        op = np.array(_zero_op(nbytes), dtype=np.uint32)
        b = np.arange(256, dtype=np.uint32)
        tab = np.zeros((4, 256), dtype=np.uint32)
        for k in range(4):
            for j in range(8):
                tab[k] ^= op[8 * k + j] * ((b >> j) & 1)
        _shift_tables[nbytes] = tab
    return tab


# -- the register loops --------------------------------------------------------------------

def _raw_small(reg: int, data: memoryview) -> int:
    """The register after ``data`` (any length), in plain Python."""
    n4 = len(data) & ~3 if _LITTLE else 0
    lo, hi = _LO16_LIST, _HI16_LIST
    if n4:
        for w in data[:n4].cast("I"):  # native order: little-endian on every Linux target
            x = reg ^ w
            reg = lo[x & 0xFFFF] ^ hi[x >> 16]
    t8 = _T8_LIST
    for byte in data[n4:]:
        reg = t8[(reg ^ byte) & 0xFF] ^ (reg >> 8)
    return reg


def _raw_lanes(reg: int, data: np.ndarray, lane: int) -> int:
    """The register after ``data`` (a multiple of ``lane`` bytes, ``lane`` a power of 2)."""
    n_lanes = len(data) // lane
    words = data.view("<u4").reshape(n_lanes, lane // 4)
    crc = np.zeros(n_lanes, dtype=np.uint32)
    crc[0] = reg
    for j in range(lane // 4):
        x = crc ^ words[:, j]
        crc = _LO16[x & 0xFFFF] ^ _HI16[x >> 16]
    width = 1 << (n_lanes - 1).bit_length()
    if width != n_lanes:  # zero lanes in front change nothing
        crc = np.concatenate([np.zeros(width - n_lanes, dtype=np.uint32), crc])
    span = lane
    while len(crc) > 1:
        tab = _shift_table(span)
        a, b = crc[0::2], crc[1::2]
        crc = (tab[0][a & 0xFF] ^ tab[1][(a >> 8) & 0xFF] ^ tab[2][(a >> 16) & 0xFF]
               ^ tab[3][a >> 24] ^ b)
        span *= 2
    return int(crc[0])


def crc32c(data, value: int = 0) -> int:
    """CRC32C of ``data`` (any C-contiguous buffer), continuing from ``value``."""
    with memoryview(data) as mv, mv.cast("B") as flat:
        reg = (value ^ 0xFFFFFFFF) & 0xFFFFFFFF
        n = len(flat)
        if n >= NUMPY_MIN_BYTES:
            lane = next(size for least, size in _LANE_BYTES if n >= least)
            body = n - n % lane
            reg = _raw_lanes(reg, np.frombuffer(flat, dtype=np.uint8, count=body), lane)
            reg = _raw_small(reg, flat[body:])
        else:
            reg = _raw_small(reg, flat)
    return reg ^ 0xFFFFFFFF

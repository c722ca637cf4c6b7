"""CRC32C: the check value, and every implementation ("path": the C core's carry-less
multiply folding on AVX-512, AVX2 or 128-bit registers, SSE4.2 or ARMv8, its tables, the
numpy twin) agreeing with a bit-by-bit reference and with each other on random data of
many lengths, alignments and continuations, including the lengths where the paths change
gear. The folding constants and the multiply-based shift are derived here again in pure
Python, and the folding scheme run on them, to check the derivation in crc32c.c. The
CPU detection is held to /proc/cpuinfo, and MPTIER_CRC32C_PATH is tried in children."""

from __future__ import annotations

import os
import platform
import random
import threading
import time

import numpy as np
import pytest
from native_support import (  # noqa: F401  (fixtures)
    backend_fixture,
    crc32c_reference,
    no_fault_fixture,
    run_python,
)

from mptier import native

CHECK_INPUT, CHECK_VALUE = b"123456789", 0xE3069283  # the catalogue's check value

# Lengths around the C core's gear changes (8-byte words, 3 x 256 and 3 x 8192 streams;
# folding from 512 bytes, 256 a round, then 16-byte steps) and the numpy twin's (2048
# bytes to numpy, lane sizes at 64 KiB and 1 MiB).
# Also the folding paths' 16 KiB chunks beside crc32 streams, with tails of every kind.
EDGE_LENGTHS = [0, 1, 7, 8, 9, 15, 16, 255, 256, 511, 512, 513, 527, 528, 767, 768, 769,
                775, 1023, 1024, 1039, 2047, 2048, 2049, 16383, 16384, 16385, 16399,
                16640, 16671, 24575, 24576, 24577, 25343, 32768, 65535, 65536, 65537]


def all_impls():
    """(backend, impl) pairs this machine can run."""
    out = []
    for name in ("native", "python"):
        try:
            be = native.get_backend(name)
        except ImportError:
            continue
        out += [(be, impl) for impl in be.crc32c_impls]
    return out


def test_check_value(backend):
    for impl in backend.crc32c_impls:
        assert backend.crc32c(CHECK_INPUT, impl=impl) == CHECK_VALUE
    assert backend.crc32c(b"") == 0
    assert crc32c_reference(CHECK_INPUT) == CHECK_VALUE
    assert native.crc32c(CHECK_INPUT) == CHECK_VALUE


# Every path of the C core by name, fastest first (crc32c.c's table).
NATIVE_PATHS = ["avx512-vpclmulqdq", "avx2-vpclmulqdq", "pclmulqdq", "sse4.2", "armv8-crc",
                "table"]


def test_implementations_reported():
    assert native.crc32c_impl() == native.get_backend().crc32c_impl()
    assert native.get_backend("python").crc32c_impls == ("numpy",)
    if native.HAS_NATIVE:
        be = native.get_backend("native")
        assert be.crc32c_impls[-1] == "table"
        assert list(be.crc32c_impls) == [p for p in NATIVE_PATHS if p in be.crc32c_impls]
        assert be.crc32c_impl() == (os.environ.get(native.CRC32C_PATH_ENV)
                                    or be.crc32c_impls[0])
        for path in NATIVE_PATHS:
            assert (be.crc32c_lacks(path) == "") == (path in be.crc32c_impls), path
        with pytest.raises(ValueError, match="abacus"):
            be.crc32c_lacks("abacus")


@pytest.mark.parametrize("length", EDGE_LENGTHS)
def test_every_implementation_matches_the_reference(length):
    data = random.Random(length).randbytes(length + 7)
    for offset in (0, 1, 3, 7):  # alignment of the first byte
        chunk = data[offset : offset + length]
        want = crc32c_reference(chunk)
        got = {f"{be.name}/{impl}": be.crc32c(chunk, impl=impl) for be, impl in all_impls()}
        assert set(got.values()) == {want}, (offset, got, want)


def test_random_lengths_alignments_and_continuation():
    rng = random.Random(2024)
    data = np.frombuffer(rng.randbytes(3 << 20), np.uint8)
    impls = all_impls()
    reference_cases = 0
    for case in range(60):
        length = rng.choice([rng.randrange(1 << 10), rng.randrange(1 << 17),
                             rng.randrange(3 << 20)])
        offset = rng.randrange(64)
        chunk = data[offset : offset + length]
        seed = rng.randrange(1 << 32) if case % 4 == 0 else 0
        got = {f"{be.name}/{impl}": be.crc32c(chunk, seed, impl=impl) for be, impl in impls}
        assert len(set(got.values())) == 1, (length, offset, got)
        if length < 20000:  # the bitwise reference is slow: short ones only
            assert next(iter(got.values())) == crc32c_reference(chunk.tobytes(), seed)
            reference_cases += 1
        cut = rng.randrange(length + 1)
        for be, impl in impls:  # crc(a + b) == crc(b, crc(a))
            first = be.crc32c(chunk[:cut], seed, impl=impl)
            assert be.crc32c(chunk[cut:], first, impl=impl) == got[f"{be.name}/{impl}"]
    assert reference_cases >= 10


def test_any_buffer(backend):
    raw = bytes(range(256)) * 40
    want = crc32c_reference(raw)
    for data in (raw, bytearray(raw), memoryview(raw), np.frombuffer(raw, np.uint8),
                 np.frombuffer(raw, np.float16).reshape(40, -1)):
        assert backend.crc32c(data) == want
    with pytest.raises(ValueError, match="not C-contiguous"):
        backend.crc32c(np.frombuffer(raw, np.uint8)[::2])
    with pytest.raises(TypeError, match="buffer protocol"):
        backend.crc32c("text")
    with pytest.raises(ValueError, match="not available"):
        backend.crc32c(raw, impl="abacus")


def test_native_crc_releases_the_gil():
    try:
        be = native.get_backend("native")
    except ImportError as e:
        pytest.skip(str(e))
    data = np.random.default_rng(1).integers(0, 256, 256 << 20, dtype=np.uint8)
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        start = time.perf_counter()
        be.crc32c(data, impl="table")  # the slow one: long enough to see the ticker run
        duration = time.perf_counter() - start
    finally:
        stop.set()
        thread.join()
    during = [t for t in ticks if start < t < start + duration]
    assert duration > 0.02, "the CRC was too quick to tell"
    assert len(during) >= 3, (duration, len(during))


# -- each path of the C core against its tables and the numpy twin -----------------------

def native_or_skip() -> native.Backend:
    try:
        return native.get_backend("native")
    except ImportError as e:
        pytest.skip(str(e))


@pytest.fixture(params=NATIVE_PATHS)
def path(request) -> str:
    """A path of the C core; skipped, saying why, where this CPU cannot run it."""
    lacks = native_or_skip().crc32c_lacks(request.param)
    if lacks:
        pytest.skip(f"{request.param}: this CPU lacks {lacks}")
    return request.param


def test_path_matches_tables_and_twin_at_every_length_to_5000(path):
    be, twin = native.get_backend("native"), native.get_backend("python")
    rng = random.Random(5000)
    data = rng.randbytes(5000 + 64)
    for length in range(5001):
        offset = length * 7 % 64  # every alignment of the first byte, in turn
        chunk = memoryview(data)[offset : offset + length]
        value = rng.randrange(1 << 32) if length % 3 else 0
        want = be.crc32c(chunk, value, impl="table")
        assert be.crc32c(chunk, value, impl=path) == want, (length, offset)
        if length % 61 == 0:  # the twin is slow below 2 KiB: a sample
            assert twin.crc32c(chunk, value) == want, (length, offset)


LARGE_LENGTHS = [16 * 16384, 2 << 20, (2 << 20) + 5, (3 << 20) - 1, 3 * 16384 + 4097,
                 100_003, 256 * 1024 + 16 + 3]


def test_path_large_inputs_offsets_and_continuation(path):
    be, twin = native.get_backend("native"), native.get_backend("python")
    rng = random.Random(7)
    data = np.frombuffer(rng.randbytes((3 << 20) + 64), np.uint8)
    for length in LARGE_LENGTHS:
        offset = rng.randrange(64)
        chunk = data[offset : offset + length]
        want = be.crc32c(chunk, impl="table")
        assert be.crc32c(chunk, impl=path) == want, (length, offset)
        assert twin.crc32c(chunk) == want, (length, offset)
        cuts = sorted(rng.randrange(length + 1) for _ in range(5))  # crc(a+b) = crc(b, crc(a))
        value, start = 0, 0
        for cut in [*cuts, length]:
            value = be.crc32c(chunk[start:cut], value, impl=path)
            start = cut
        assert value == want, (length, cuts)


# Around mpt_crc32c_copy's 128 KiB pieces, and a 2 MiB block with a tail.
COPY_LENGTHS = [0, 1, 4095, (128 << 10) - 1, 128 << 10, (128 << 10) + 1, 256 << 10,
                (2 << 20) + 77]


def test_copy_with_crc_copies_and_checksums_on_every_path(path):
    """``mpt_crc32c_copy`` (a bounced store's copy into its bounce slot) leaves the
    destination equal to the source and returns the CRC the tables give, continuing
    from a value, on each path this CPU runs."""
    from mptier.native import _native

    be = native.get_backend("native")
    rng = random.Random(11)
    data = rng.randbytes((2 << 20) + 77 + 64)
    code, _ = _native.crc32c_select(path)
    assert code == 0
    try:
        for length in COPY_LENGTHS:
            offset = rng.randrange(64)
            src = data[offset:offset + length]
            dst = _native.ffi.new("char[]", length + 1)
            value = rng.randrange(1 << 32) if length % 2 else 0
            got = _native.lib.mpt_crc32c_copy(value, dst, src, length)
            assert got == be.crc32c(src, value, impl="table"), (length, offset)
            assert _native.ffi.buffer(dst, length)[:] == src and dst[length] == b"\0"
    finally:
        _native.lib.mpt_crc32c_select(_native.ffi.NULL)  # the fastest again


def _cpuinfo_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def test_cpu_detection_agrees_with_proc_cpuinfo():
    """Linux lists AVX flags only when it saves their registers: the same answer as
    the core's cpuid + xgetbv check. Here (a Zen 3 EPYC) avx2-vpclmulqdq and pclmulqdq
    must be among the paths."""
    be = native_or_skip()
    if platform.machine() != "x86_64":
        pytest.skip(f"x86-64 feature flags; this is {platform.machine()}")
    flags = _cpuinfo_flags()
    need = {"avx512-vpclmulqdq": {"avx512f", "vpclmulqdq", "pclmulqdq", "sse4_2"},
            "avx2-vpclmulqdq": {"avx2", "vpclmulqdq", "pclmulqdq", "sse4_2"},
            "pclmulqdq": {"pclmulqdq", "sse4_2"}, "sse4.2": {"sse4_2"}}
    for name, wanted in need.items():
        assert (name in be.crc32c_impls) == (wanted <= flags), (name, be.crc32c_lacks(name))
        for flag in wanted - flags:
            assert flag in be.crc32c_lacks(name)
    assert "armv8-crc" not in be.crc32c_impls
    assert "aarch64" in be.crc32c_lacks("armv8-crc")


# -- MPTIER_CRC32C_PATH, in children (it is read once, at import) -------------------------

def test_environment_forces_each_path(tmp_path):
    be = native_or_skip()
    data = random.Random(3).randbytes(300_001)
    (tmp_path / "data").write_bytes(data)
    code = """
        import sys
        from mptier import native
        be = native.get_backend("native")
        data = open(sys.argv[1], "rb").read()
        print(be.crc32c_impl(), be.crc32c(data), be.crc32c(data[:1000]))
    """
    want = [str(be.crc32c(data, impl="table")), str(crc32c_reference(data[:1000]))]
    for name in be.crc32c_impls:
        proc = run_python(code, str(tmp_path / "data"), env={native.CRC32C_PATH_ENV: name})
        assert proc.stdout.split() == [name, *want], name


def test_environment_refuses_unknown_and_unavailable_paths():
    be = native_or_skip()
    proc = run_python("import mptier.native", env={native.CRC32C_PATH_ENV: "abacus"},
                      check=False)
    assert proc.returncode != 0
    assert "ConfigError: MPTIER_CRC32C_PATH='abacus' names no CRC32C path" in proc.stderr
    assert ", ".join(be.crc32c_impls) in proc.stderr
    unavailable = [p for p in NATIVE_PATHS if be.crc32c_lacks(p)]
    for name in unavailable:  # here: avx512-vpclmulqdq, armv8-crc
        proc = run_python("import mptier.native", env={native.CRC32C_PATH_ENV: name},
                          check=False)
        assert proc.returncode != 0
        assert f"this CPU lacks {be.crc32c_lacks(name)}" in proc.stderr, proc.stderr


# -- crc32c.c's folding derivation, again in pure Python ----------------------------------
#
# Integers as GF(2) polynomials (bit i = x^i) for the arithmetic; CRC registers and loaded
# lanes are bit-reflected (crc32c.c's comment on the folding paths says how).

P_FULL = 0x11EDC6F41  # x^32 + the Castagnoli polynomial, normal bit order
M64 = (1 << 64) - 1


def clmul(a: int, b: int) -> int:
    """Carry-less product (what PCLMULQDQ computes on two 64-bit operands)."""
    out = 0
    while b:
        if b & 1:
            out ^= a
        a <<= 1
        b >>= 1
    return out


def poly_mod(a: int) -> int:
    while a.bit_length() > 32:
        a ^= P_FULL << (a.bit_length() - 33)
    return a


def reflect(v: int, bits: int) -> int:
    return int(f"{v:0{bits}b}"[::-1], 2)


def xpow_register(n: int) -> int:
    """x^n mod P as a CRC register value (bit j = x^(31 - j)), by polynomial division."""
    return reflect(poly_mod(1 << n), 32)


def xpow_shift_reduce(n: int) -> int:
    """The same as crc32c.c's mpt_xpow_mod computes it: from x^31, n - 31 steps of
    "times x" on the reflected register."""
    reg = 1
    for _ in range(31, n):
        reg = (reg >> 1) ^ (0x82F63B78 if reg & 1 else 0)
    return reg


def raw(data: bytes, reg: int) -> int:
    """The CRC register after ``data`` from register ``reg`` (no final xor)."""
    return crc32c_reference(data, reg ^ 0xFFFFFFFF) ^ 0xFFFFFFFF


def fold(lane: int, distance: int, data_lane: int) -> int:
    """crc32c.c's mpt_fold128: lane moved ``distance`` bytes on, XOR the lane there."""
    k_lo = xpow_register(8 * distance + 63) << 32
    k_hi = xpow_register(8 * distance - 1) << 32
    return clmul(lane & M64, k_lo) ^ clmul(lane >> 64, k_hi) ^ data_lane


def crc_by_folding(data: bytes, value: int, registers: int) -> int:
    """CRC32C as the folding paths compute it: ``registers`` lanes a round, all folded
    onto the last, its CRC from zero by "crc32 instructions", then the tail."""
    lanes_bytes = len(data) // (16 * registers) * 16 * registers
    lanes = [int.from_bytes(data[i : i + 16], "little") for i in range(0, lanes_bytes, 16)]
    lanes[0] ^= value ^ 0xFFFFFFFF  # the initial register into the first four bytes
    regs = lanes[:registers]
    for r in range(registers, len(lanes), registers):
        regs = [fold(regs[i], 16 * registers, lanes[r + i]) for i in range(registers)]
    last = regs[-1]
    for i in range(registers - 1):
        last = fold(regs[i], 16 * (registers - 1 - i), last)
    reg = raw(last.to_bytes(16, "little"), 0)
    return raw(data[lanes_bytes:], reg) ^ 0xFFFFFFFF


def shift_by_multiply(c: int, nbytes: int) -> int:
    """crc32c.c's mpt_shift_clmul: Z_nbytes(c) by one product and one crc32."""
    k = xpow_register(8 * nbytes - 33) << 32
    return raw((clmul(c << 32, k) >> 64).to_bytes(8, "little"), 0)


def test_fold_constants_by_division_equal_the_cores_shift_and_reduce():
    for n in (31, 32, 63, 64, 95, 127, 8 * 256 + 63, 8 * 16384 - 33, 8 * 12288 - 33):
        assert xpow_shift_reduce(n) == xpow_register(n), n


@pytest.mark.parametrize("registers", [1, 4, 8], ids=lambda r: f"{r}-lanes")
def test_folding_scheme_gives_the_crc(registers):
    rng = random.Random(registers)
    for length in (16 * registers, 16 * registers * 3 + 5, 1000):
        data = rng.randbytes(length)
        value = rng.randrange(1 << 32)
        assert crc_by_folding(data, value, registers) == crc32c_reference(data, value)


def test_shift_by_multiply_is_feeding_zeros():
    rng = random.Random(11)
    for nbytes in (5, 16, 2048, 3072, 12288, 16384):
        c = rng.randrange(1 << 32)
        assert shift_by_multiply(c, nbytes) == raw(bytes(nbytes), c), nbytes

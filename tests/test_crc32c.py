"""CRC32C: the check value, and every implementation (SSE4.2 or ARMv8, the C tables, the
numpy twin) agreeing with a bit-by-bit reference on random data of many lengths and
alignments, including the lengths where the three-stream code changes gear."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
from native_support import (  # noqa: F401  (fixtures)
    backend_fixture,
    crc32c_reference,
    no_fault_fixture,
)

from mptier import native

CHECK_INPUT, CHECK_VALUE = b"123456789", 0xE3069283  # the catalogue's check value

# Lengths around the C core's gear changes (8-byte words, 3 x 256 and 3 x 8192 streams;
# folding from 512 bytes, 256 a round, then 16-byte steps) and the numpy twin's (2048
# bytes to numpy, lane sizes at 64 KiB and 1 MiB).
EDGE_LENGTHS = [0, 1, 7, 8, 9, 15, 16, 255, 256, 511, 512, 513, 527, 528, 767, 768, 769,
                775, 1023, 1024, 1039, 2047, 2048, 2049, 24575, 24576, 24577, 25343, 65535,
                65536, 65537]


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


def test_implementations_reported():
    assert native.crc32c_impl() == native.get_backend().crc32c_impl()
    assert native.get_backend("python").crc32c_impls == ("numpy",)
    if native.HAS_NATIVE:
        be = native.get_backend("native")
        assert be.crc32c_impls[-1] == "table"
        assert be.crc32c_impl() in ("avx512-vpclmulqdq", "sse4.2", "armv8-crc", "table")
        assert be.crc32c_impl() == be.crc32c_impls[0]


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

"""mptier.workers.bounce, stores: each block copied into the worker's private buffer and
written from there (``Backend.store(..., bounce)``, ``mpt_batch_store_via``) lands the
same bytes as a store from the engine's slots, on every path, and the pool's workers do
it where ``bounce_stores`` says so."""

from __future__ import annotations

import errno
import mmap
import os
import pathlib
import shutil
import tempfile

import numpy as np
import pytest

from mptier import TransferJob, make_key, native
from mptier.fskind import fs_type
from mptier.workers.bounce import HUGE_PAGE_BYTES, Bounce, bounce_stores

BLOCK = 64 << 10
N = 11  # not a multiple of the bounce slots: slots are reused as blocks finish
TAG = b"0123456789abcdef"
CHECKED = native.O_DIRECT | native.CHECKSUM


@pytest.fixture(params=["native", "python"])
def io_backend(request):
    got = native.get_backend(request.param)
    assert got.name == request.param
    return got


@pytest.fixture
def root_fd(tmp_path):
    fd = native.open_root(str(tmp_path))
    yield fd
    os.close(fd)


def source(n: int = N, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n * BLOCK, dtype=np.uint8)


def paths_of(n: int = N, tag: str = "b") -> list[bytes]:
    return [f"{tag}{i % 3}/{tag}{i:03d}".encode() for i in range(n)]


@pytest.mark.parametrize("flags", [0, native.URING, CHECKED, CHECKED | native.URING],
                         ids=["loop", "uring", "loop-direct-crc", "uring-direct-crc"])
@pytest.mark.parametrize("bounce_blocks", [1, 4, N, 64])
def test_bounced_stores_write_every_block_exactly(io_backend, root_fd, tmp_path, flags,
                                                  bounce_blocks):
    """More blocks than bounce slots or fewer, scattered slots: every file holds its
    block, and with checksums its record is the block's CRC32C (loads check it)."""
    data = source()
    slots = [(i * 5 + 3) % N for i in range(N)]
    paths = paths_of()
    bounce = Bounce(BLOCK, nbytes=bounce_blocks * BLOCK)
    try:
        got = bounce.store(io_backend, root_fd, paths, memoryview(data),
                           [s * BLOCK for s in slots], flags, TAG)
    finally:
        bounce.close()
    assert got == (0, N, N, 0)
    for i, slot in enumerate(slots):
        assert (tmp_path / paths[i].decode()).read_bytes() == \
            data[slot * BLOCK:(slot + 1) * BLOCK].tobytes(), i
    back = np.zeros(N * BLOCK, dtype=np.uint8)
    assert io_backend.load(root_fd, paths, memoryview(back), [i * BLOCK for i in range(N)],
                        BLOCK, flags)[:2] == (0, N)
    assert all(np.array_equal(back[i * BLOCK:(i + 1) * BLOCK],
                              data[s * BLOCK:(s + 1) * BLOCK]) for i, s in enumerate(slots))


@pytest.mark.parametrize("flags", [native.O_DIRECT, native.O_DIRECT | native.URING],
                         ids=["loop", "uring"])
def test_the_write_goes_out_of_the_bounce_buffer(io_backend, root_fd, flags):
    """The switch reaches the I/O: after a store through a one-slot bounce buffer the
    slot holds the last block written."""
    data = source()
    via = np.zeros(BLOCK, dtype=np.uint8)
    assert io_backend.store(root_fd, paths_of(), memoryview(data),
                         [i * BLOCK for i in range(N)], BLOCK, flags, TAG, None,
                         memoryview(via)) == (0, N, N, 0)
    assert via.tobytes() == data[(N - 1) * BLOCK:].tobytes()


@pytest.mark.parametrize("uring", [False, True], ids=["loop", "uring"])
def test_a_bounced_store_says_what_it_found_and_stops_at_a_failure(io_backend, root_fd,
                                                                   tmp_path, uring):
    """``found`` and a failure's prefix as a store from the slots reports them: a block
    already there is only touched (found), and after a failing block nothing is
    published."""
    data = source()
    paths = paths_of()
    flags = native.O_DIRECT | (native.URING if uring else 0)
    offsets = [i * BLOCK for i in range(N)]
    bounce = Bounce(BLOCK, nbytes=4 * BLOCK)
    try:
        assert bounce.store(io_backend, root_fd, paths[:2], memoryview(data), offsets[:2],
                            flags, TAG)[0] == 0
        found = bytearray(N)
        native.set_fault(f"store:5:{errno.EACCES}")
        try:
            got = bounce.store(io_backend, root_fd, paths, memoryview(data), offsets, flags,
                               TAG, found)
        finally:
            native.set_fault(None)
    finally:
        bounce.close()
    assert got[:3] == (-errno.EACCES, 5, 5)
    assert list(found[:5]) == [1, 1, 0, 0, 0]
    assert all((tmp_path / p.decode()).exists() for p in paths[:5])
    assert not any((tmp_path / p.decode()).exists() for p in paths[5:])


def test_a_bounce_smaller_than_a_block_is_refused_before_any_write(io_backend, root_fd,
                                                                   tmp_path):
    data = source()
    got = io_backend.store(root_fd, paths_of(), memoryview(data), [i * BLOCK for i in range(N)],
                        BLOCK, native.URING, TAG, None, memoryview(bytearray(BLOCK - 1)))
    assert got[0] == -errno.EINVAL and got[1] == 0
    assert not any(tmp_path.iterdir())


def test_the_setting_and_the_file_system_decide(tmp_path, make_fuse_fs):
    """``bounce_stores = "auto"``: O_DIRECT stores on a local disk; never in memory; on
    FUSE only when asked for (True)."""
    disk = str(tmp_path)
    if fs_type(disk) not in ("ext4", "xfs", "btrfs"):
        pytest.skip(f"{disk} is on {fs_type(disk)}, not a local disk file system")
    assert bounce_stores(disk, True, "auto") is True
    assert bounce_stores(disk, False, "auto") is False  # buffered: the page cache copies
    assert bounce_stores(disk, False, True) is True
    assert bounce_stores(disk, True, False) is False
    # An engine buffer already in huge pages needs no copy under "auto"; True still copies.
    assert bounce_stores(disk, True, "auto", HUGE_PAGE_BYTES) is False
    assert bounce_stores(disk, True, "auto", 1 << 30) is False
    assert bounce_stores(disk, True, "auto", 64 << 10) is True
    assert bounce_stores(disk, True, True, HUGE_PAGE_BYTES) is True
    if fs_type("/dev/shm") == "tmpfs":
        assert bounce_stores("/dev/shm", True, True) is False
    fuse = make_fuse_fs()
    assert bounce_stores(str(fuse.mountpoint), True, "auto") is False
    assert bounce_stores(str(fuse.mountpoint), True, True) is True


def _bounce_buffers(pid: int, nbytes: int) -> list[bytes]:
    """The first block of every private anonymous mapping of exactly ``nbytes`` in
    ``pid`` (the worker's bounce buffer), read through ``/proc/PID/mem``."""
    spans = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            head = line.split()
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            if hi - lo == nbytes and head[1].endswith("p") and len(head) == 5:
                spans.append(lo)
    with open(f"/proc/{pid}/mem", "rb") as mem:
        out = []
        for lo in spans:
            mem.seek(lo)
            out.append(mem.read(BLOCK))
        return out


@pytest.mark.parametrize("setting", [True, False], ids=["bounced", "from-the-slot"])
def test_pool_workers_store_through_their_bounce_buffer_as_set(make_buffer, make_tier,
                                                                tmp_path, setting):
    """Through a real pool (process workers; the ``backend`` fixture's I/O): with
    ``bounce_stores`` on, the worker that stored the block holds it in its bounce buffer;
    off (loads still bounced, so the buffer is mapped), no worker's buffer holds it. The
    block loads back either way, and ``stats()`` says what each root got."""
    buf = make_buffer(4, BLOCK)
    tier = make_tier(buf, root_dir=str(tmp_path / "kv"), bounce_loads=True,
                     bounce_stores=setting, n_load_workers=1, n_store_workers=1)
    assert tier.stats()["roots"][0]["bounce_stores"] is setting
    block = np.random.default_rng(11).integers(0, 256, BLOCK, dtype=np.uint8)
    buf.view[0] = block
    key = make_key(b"bounced-store", 0)
    tier.submit_store(TransferJob(1, [key], [0]))
    tier.drain_jobs()
    assert all(r.success for r in tier.get_finished_jobs())
    pids = [w["pid"] for w in tier.stats()["workers"]]
    nbytes = Bounce(BLOCK).mapped_bytes
    holders = sum(block.tobytes() in _bounce_buffers(pid, nbytes) for pid in pids)
    assert holders == (1 if setting else 0)
    buf.view[1] = 0
    tier.submit_load(TransferJob(2, [key], [1]))
    tier.drain_jobs()
    assert all(r.success for r in tier.get_finished_jobs())
    assert np.array_equal(buf.view[1], block)


def test_no_bounce_in_memory_whatever_the_setting(make_buffer, make_tier):
    """On tmpfs "auto" and True alike write from the slots: there is no device."""
    if fs_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    shm = pathlib.Path(tempfile.mkdtemp(prefix="mptier-test-bstores-", dir="/dev/shm"))
    try:
        for setting in ("auto", True):
            tier = make_tier(make_buffer(4, BLOCK), root_dir=str(shm / "kv"),
                             bounce_stores=setting, n_load_workers=1, n_store_workers=1)
            assert tier.stats()["roots"][0]["bounce_stores"] is False
            tier.shutdown()
    finally:
        shutil.rmtree(shm)


@pytest.mark.parametrize("pages", ["huge", "base"])
def test_auto_writes_from_an_engine_buffer_in_huge_pages(make_tier, tmp_path, pages):
    """A real pool on a disk root with O_DIRECT: "auto" copies stores out of an engine
    buffer of base pages (a tmpfs with ``huge=never``), not out of one whose tmpfs asks
    for huge pages (``huge=always``); the block round-trips either way."""
    from reliability_kit import tiny_tmpfs

    from mptier import SharedKVBuffer

    disk = str(tmp_path)
    if fs_type(disk) not in ("ext4", "xfs", "btrfs"):
        pytest.skip(f"{disk} is on {fs_type(disk)}, not a local disk file system")
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    nbytes = 4 * BLOCK
    with tiny_tmpfs(8 << 20, "huge=always" if pages == "huge" else "huge=never") as point:
        fd = os.open(os.path.join(point, "engine.mmap"), os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes)
        os.close(fd)
        view = np.frombuffer(mapping, dtype=np.uint8).reshape(4, BLOCK)
        buf = SharedKVBuffer.from_memoryview(memoryview(view))
        tier = None
        try:
            tier = make_tier(buf, root_dir=str(tmp_path / "kv"), use_o_direct=True,
                             n_load_workers=1, n_store_workers=1)
            assert tier.stats()["roots"][0]["bounce_stores"] is (pages == "base")
            block = np.random.default_rng(5).integers(0, 256, BLOCK, dtype=np.uint8)
            buf.view[0] = block
            key = make_key(b"huge-buffer", 0)
            tier.submit_store(TransferJob(1, [key], [0]))
            tier.drain_jobs()
            buf.view[1] = 0
            tier.submit_load(TransferJob(2, [key], [1]))
            tier.drain_jobs()
            assert all(r.success for r in tier.get_finished_jobs())
            assert np.array_equal(buf.view[1], block)
        finally:
            if tier is not None:  # before the tmpfs goes: its workers map the file
                tier.shutdown()
            buf.close()
            del view
            mapping.close()

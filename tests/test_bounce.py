"""mptier.workers.bounce: loads through a worker's private buffer land the same bytes
as direct loads, in chunks, and nothing after a failure reaches the engine's slots."""

from __future__ import annotations

import errno
import os
import pathlib
import shutil
import tempfile

import numpy as np
import pytest

from mptier import native
from mptier.workers.bounce import Bounce, fs_type, needs_bounce

BLOCK = 64 << 10
N = 11  # not a multiple of the chunk: the last chunk is short


@pytest.fixture(params=["native", "python"])
def stored(request, tmp_path):
    """N random blocks stored under tmp_path by the backend under test."""
    backend = native.get_backend(request.param)
    assert backend.name == request.param
    source = np.random.default_rng(7).integers(0, 256, N * BLOCK, dtype=np.uint8)
    paths = [f"b{i:03d}".encode() for i in range(N)]
    fd = native.open_root(str(tmp_path))
    try:
        offsets = [i * BLOCK for i in range(N)]
        rc, n_done, _, _ = backend.store(fd, paths, memoryview(source), offsets, BLOCK, 0,
                                         native.new_tag().encode())
        assert (rc, n_done) == (0, N)
        yield backend, fd, paths, source
    finally:
        os.close(fd)


@pytest.mark.parametrize("chunk_blocks", [1, 4, N, 64])
def test_chunked_loads_land_every_block_in_its_slot(stored, chunk_blocks):
    backend, fd, paths, source = stored
    bounce = Bounce(BLOCK, nbytes=chunk_blocks * BLOCK)
    target = np.zeros((N + 3) * BLOCK, dtype=np.uint8)
    slots = [(i * 5 + 3) % (N + 3) for i in range(N)]  # scattered, not in order
    calls = []

    def counting_load(*args):
        calls.append(len(args[1]))
        return backend.load(*args)

    try:
        rc, n_done, _ = bounce.load(counting_load, fd, paths, memoryview(target),
                                    [s * BLOCK for s in slots], 0)
    finally:
        bounce.close()
    assert (rc, n_done) == (0, N)
    assert calls == [min(chunk_blocks, N - i) for i in range(0, N, chunk_blocks)]
    for i, slot in enumerate(slots):
        assert np.array_equal(target[slot * BLOCK:(slot + 1) * BLOCK],
                              source[i * BLOCK:(i + 1) * BLOCK]), i


def test_a_failure_reports_the_prefix_and_leaves_later_slots_untouched(stored, tmp_path):
    backend, fd, paths, source = stored
    os.unlink(tmp_path / paths[6].decode())  # fails in the second chunk of four
    bounce = Bounce(BLOCK, nbytes=4 * BLOCK)
    target = np.full(N * BLOCK, 0xAB, dtype=np.uint8)
    try:
        rc, n_done, index = bounce.load(backend.load, fd, paths, memoryview(target),
                                        [i * BLOCK for i in range(N)], 0)
    finally:
        bounce.close()
    assert rc == -errno.ENOENT and n_done == 6 and index == 6
    assert np.array_equal(target[:6 * BLOCK], source[:6 * BLOCK])
    # the failing block and the rest of its chunk (read into the bounce buffer, maybe)
    # never reach the engine's slots
    assert (target[6 * BLOCK:] == 0xAB).all()


@pytest.mark.parametrize("outside", [N * BLOCK, N * BLOCK - 1, -BLOCK, 1 << 70])
def test_a_slot_outside_the_buffer_fails_like_the_native_layer(stored, outside):
    backend, fd, paths, source = stored
    whole = np.full((N + 1) * BLOCK, 0xAB, dtype=np.uint8)  # the last block: a guard
    target = memoryview(whole)[:N * BLOCK]
    slots = [i * BLOCK for i in range(5)] + [outside] + [6 * BLOCK]
    bounce = Bounce(BLOCK, nbytes=4 * BLOCK)
    try:
        got = bounce.load(backend.load, fd, paths[:7], target, slots, 0)
    finally:
        bounce.close()
    assert got == backend.load(fd, paths[:7], target, slots, BLOCK, 0) == (-errno.EINVAL, 5, 5)
    assert np.array_equal(whole[:5 * BLOCK], source[:5 * BLOCK])
    assert (whole[6 * BLOCK:] == 0xAB).all()


def test_close_is_idempotent_and_maps_nothing_before_use():
    bounce = Bounce(BLOCK)
    assert bounce._map is None
    bounce.close()
    bounce.close()


def test_fs_type_reads_the_mount_table():
    assert fs_type("/proc") == "proc"
    assert fs_type("/proc/self") == "proc"  # the longest mount point above the path


@pytest.mark.parametrize("setting,o_direct,root,expected", [
    ("auto", True, "/dev/shm", False),    # memory: a read there is the worker's own copy
    (True, True, "/dev/shm", False),
    ("auto", False, "/proc", True),       # not known to read through the page cache
    (False, True, "/proc", False),
])
def test_the_setting_and_the_file_system_decide(setting, o_direct, root, expected):
    if root == "/dev/shm" and fs_type(root) != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    assert needs_bounce(root, o_direct, setting) is expected


def test_o_direct_on_a_disk_bounces_unless_turned_off(tmp_path):
    kind = fs_type(str(tmp_path))
    if kind not in ("ext4", "xfs", "btrfs"):
        pytest.skip(f"{tmp_path} is on {kind}, not a local disk file system")
    assert needs_bounce(str(tmp_path), True, "auto")
    assert not needs_bounce(str(tmp_path), False, "auto")  # buffered: killable wait
    assert needs_bounce(str(tmp_path), False, True)
    assert not needs_bounce(str(tmp_path), True, False)


def test_each_root_reports_what_it_got(make_buffer, make_tier, tmp_path):
    """stats()["roots"][i]["bounce_loads"]: the decision the workers act on."""
    disk = tmp_path / "kv"
    shm = pathlib.Path(tempfile.mkdtemp(prefix="mptier-test-bounce-", dir="/dev/shm"))
    try:
        for root, setting in ((disk, "auto"), (disk, False), (shm, "auto")):
            tier = make_tier(make_buffer(4, BLOCK), root_dir=str(root), bounce_loads=setting,
                             n_load_workers=1, n_store_workers=1)
            (got,) = tier.stats()["roots"]
            assert got["bounce_loads"] is needs_bounce(str(root), got["o_direct"], setting)
            tier.shutdown()
    finally:
        shutil.rmtree(shm)

"""mptier.workers.bounce: loads through a worker's private buffer land the same bytes
as direct loads, in chunks, and nothing after a failure reaches the engine's slots."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import pathlib
import resource
import shutil
import signal
import tempfile
import threading
import time
import traceback

import numpy as np
import pytest
from native_support import descriptors

from mptier import native
from mptier.fskind import fs_type
from mptier.workers.bounce import Bounce, needs_bounce

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


@pytest.mark.parametrize("uring", [False, True], ids=["loop", "uring"])
@pytest.mark.parametrize("bounce_blocks", [1, 4, N, 64])
def test_bounced_loads_land_every_block_in_its_slot_in_one_call(stored, bounce_blocks,
                                                                 uring):
    """Whatever the bounce buffer holds (fewer blocks than the batch: its slots are
    reused as blocks finish), one call lands every block in its own slot."""
    backend, fd, paths, source = stored
    bounce = Bounce(BLOCK, nbytes=bounce_blocks * BLOCK)
    target = np.zeros((N + 3) * BLOCK, dtype=np.uint8)
    slots = [(i * 5 + 3) % (N + 3) for i in range(N)]  # scattered, not in order
    flags = native.URING if uring else 0
    try:
        rc, n_done, _ = bounce.load(backend, fd, paths, memoryview(target),
                                    [s * BLOCK for s in slots], flags)
    finally:
        bounce.close()
    assert (rc, n_done) == (0, N)
    for i, slot in enumerate(slots):
        assert np.array_equal(target[slot * BLOCK:(slot + 1) * BLOCK],
                              source[i * BLOCK:(i + 1) * BLOCK]), i


@pytest.mark.parametrize("uring", [False, True], ids=["loop", "uring"])
@pytest.mark.parametrize("block,shift", [
    (64 << 10, 0),            # streamed whole: 16-byte aligned, a multiple of 64
    ((64 << 10) + 48, 0),     # streamed, then a 48-byte tail copied plainly
    ((64 << 10) + 48, 1),     # slots off 16-byte alignment: copied plainly
    ((64 << 10) - 16, 0),     # under the streaming threshold: copied plainly
], ids=["aligned", "tail", "unaligned", "short"])
def test_the_copy_into_the_slot_is_exact_on_every_path(tmp_path, block, shift, uring):
    """The native core copies a checked block into its slot with streaming stores where
    the slot is 16-byte aligned and the block long (mpt_copy_to_slot), plainly
    otherwise; every path lands the block exactly, and the bytes around it stay."""
    backend = native.get_backend("native")
    n = 5
    source = np.random.default_rng(block + shift).integers(0, 256, n * block, dtype=np.uint8)
    paths = [f"c{i}".encode() for i in range(n)]
    fd = native.open_root(str(tmp_path))
    target = np.full((n + 1) * block + 64, 0xA5, dtype=np.uint8)
    offsets = [shift + ((i * 3) % n) * block for i in range(n)]
    bounce = Bounce(block, nbytes=2 * block)
    try:
        rc, n_done, _, _ = backend.store(fd, paths, memoryview(source),
                                         [i * block for i in range(n)], block, 0,
                                         native.new_tag().encode())
        assert (rc, n_done) == (0, n)
        rc, n_done, _ = bounce.load(backend, fd, paths, memoryview(target), offsets,
                                    native.URING if uring else 0)
    finally:
        bounce.close()
        os.close(fd)
    assert (rc, n_done) == (0, n)
    assert (target.ctypes.data + offsets[1]) % 16 == (0 if shift == 0 else shift)
    for i, at in enumerate(offsets):
        assert np.array_equal(target[at:at + block], source[i * block:(i + 1) * block]), i
    assert (target[:shift] == 0xA5).all() and (target[shift + n * block:] == 0xA5).all()


def test_loads_into_the_same_slot_end_with_the_last_block(stored):
    """Slots that repeat in a batch get the blocks in batch order, as the loop does
    (io_uring reads into distinct bounce slots; the copies are ordered)."""
    backend, fd, paths, source = stored
    bounce = Bounce(BLOCK, nbytes=4 * BLOCK)
    target = np.zeros(2 * BLOCK, dtype=np.uint8)
    try:
        rc, n_done, _ = bounce.load(backend, fd, paths, memoryview(target),
                                    [(i % 2) * BLOCK for i in range(N)], native.URING)
    finally:
        bounce.close()
    assert (rc, n_done) == (0, N)
    assert np.array_equal(target[:BLOCK], source[(N - 1) * BLOCK:N * BLOCK])  # N odd
    assert np.array_equal(target[BLOCK:], source[(N - 2) * BLOCK:(N - 1) * BLOCK])


@pytest.mark.parametrize("uring", [False, True], ids=["loop", "uring"])
@pytest.mark.parametrize("check", [False, True], ids=["plain", "checksum"])
def test_a_failure_reports_the_prefix_and_leaves_later_slots_untouched(stored, tmp_path,
                                                                       uring, check):
    backend, fd, paths, source = stored
    if check:  # a wrong record: the block is read whole, then refused
        os.setxattr(tmp_path / paths[6].decode(), native.XATTR_NAME, b"\0\0\0\0")
    else:
        os.unlink(tmp_path / paths[6].decode())
    bounce = Bounce(BLOCK, nbytes=4 * BLOCK)
    target = np.full(N * BLOCK, 0xAB, dtype=np.uint8)
    flags = (native.URING if uring else 0) | (native.CHECKSUM if check else 0)
    try:
        rc, n_done, index = bounce.load(backend, fd, paths, memoryview(target),
                                        [i * BLOCK for i in range(N)], flags)
    finally:
        bounce.close()
    assert rc == (-errno.EBADMSG if check else -errno.ENOENT), rc
    assert n_done == 6 and index == 6
    assert np.array_equal(target[:6 * BLOCK], source[:6 * BLOCK])
    # the failing block and the blocks read with it (into the bounce buffer, maybe)
    # never reach the engine's slots
    assert (target[6 * BLOCK:] == 0xAB).all()


@pytest.mark.parametrize("uring", [False, True], ids=["loop", "uring"])
@pytest.mark.parametrize("outside", [N * BLOCK, N * BLOCK - 1, -BLOCK, 1 << 70])
def test_a_slot_outside_the_buffer_fails_like_the_native_layer(stored, outside, uring):
    backend, fd, paths, source = stored
    whole = np.full((N + 1) * BLOCK, 0xAB, dtype=np.uint8)  # the last block: a guard
    target = memoryview(whole)[:N * BLOCK]
    slots = [i * BLOCK for i in range(5)] + [outside] + [6 * BLOCK]
    bounce = Bounce(BLOCK, nbytes=4 * BLOCK)
    flags = native.URING if uring else 0
    try:
        got = bounce.load(backend, fd, paths[:7], target, slots, flags)
    finally:
        bounce.close()
    assert got == backend.load(fd, paths[:7], target, slots, BLOCK, flags) \
        == (-errno.EINVAL, 5, 5)
    assert np.array_equal(whole[:5 * BLOCK], source[:5 * BLOCK])
    assert (whole[6 * BLOCK:] == 0xAB).all()


def test_close_is_idempotent_and_maps_nothing_before_use():
    bounce = Bounce(BLOCK)
    assert not bounce.mapped
    bounce.map()
    bounce.map()
    assert bounce.mapped
    bounce.close()
    bounce.close()
    assert not bounce.mapped


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


@pytest.mark.parametrize("backend_name", ["native", "python"])
@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
def test_checksummed_blocks_through_a_small_bounce_buffer(backend_name, o_direct, tmp_path):
    """Blocks of an odd size (not a power of two), more of them than the bounce buffer
    holds, checksummed, a corrupt one last: every block before it lands whole, the
    corrupt one is refused and removed, and its slot is left alone."""
    backend = native.get_backend(backend_name)
    block = (1 << 20) + (8 << 10)
    n = 5
    source = np.random.default_rng(3).integers(0, 256, n * block, dtype=np.uint8)
    paths = [f"big{i}".encode() for i in range(n)]
    flags = native.CHECKSUM | native.URING | (native.O_DIRECT if o_direct else 0)
    fd = native.open_root(str(tmp_path))
    bounce = Bounce(block, nbytes=2 * block)
    try:
        rc, n_done, _, _ = backend.store(fd, paths, memoryview(source),
                                         [i * block for i in range(n)], block,
                                         native.CHECKSUM, native.new_tag().encode())
        assert (rc, n_done) == (0, n)
        with open(tmp_path / "big4", "r+b") as f:  # one byte off: the CRC says no
            f.seek(block // 2)
            f.write(bytes([source[4 * block + block // 2] ^ 1]))
        target = np.full(n * block, 0xCD, dtype=np.uint8)
        rc, n_done, index = bounce.load(backend, fd, paths, memoryview(target),
                                        [i * block for i in range(n)], flags)
    finally:
        bounce.close()
        os.close(fd)
    assert (rc, n_done, index) == (-errno.EBADMSG, 4, 4)
    assert np.array_equal(target[:4 * block], source[:4 * block])
    assert (target[4 * block:] == 0xCD).all()
    assert not (tmp_path / "big4").exists()  # a corrupt block is removed


@pytest.mark.parametrize("uring", [False, True], ids=["loop", "uring"])
def test_a_slot_this_process_never_mapped_is_mapped_before_the_copy(tmp_path, uring):
    """The engine's buffer as a worker sees a slot the engine wrote after the worker
    attached: pages that exist in the shared file but have no entry in this process's
    mapping. The bounced copy must not take a fault per 4 KiB page (that is the worker's
    CPU, charged at its low priority): the native core maps the slot first, in the
    kernel. Measured as this process's minor faults over the call; without the mapping
    step the copy alone takes one per page."""
    block, n = 256 << 10, 16
    pages = n * block // mmap.PAGESIZE
    backend = native.get_backend("native")
    source = np.random.default_rng(11).integers(0, 256, n * block, dtype=np.uint8)
    paths = [f"m{i:02d}".encode() for i in range(n)]
    fd = native.open_root(str(tmp_path))
    bounce = Bounce(block, nbytes=4 * block)
    shm = os.memfd_create("mptier-test-unmapped")
    try:
        rc, n_done, _, _ = backend.store(fd, paths, memoryview(source),
                                         [i * block for i in range(n)], block, 0,
                                         native.new_tag().encode())
        assert (rc, n_done) == (0, n)
        warm = np.zeros(n * block, dtype=np.uint8)  # maps and touches the bounce buffer
        flags = native.URING if uring else 0
        offsets = [i * block for i in range(n)]
        assert bounce.load(backend, fd, paths, memoryview(warm), offsets, flags)[:2] == (0, n)
        os.pwrite(shm, b"\xcd" * (n * block), 0)  # every page exists, none is mapped here
        with mmap.mmap(shm, n * block) as slots:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            rc, n_done, _ = bounce.load(backend, fd, paths, memoryview(slots), offsets, flags)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            landed = bytes(slots) == source.tobytes()
    finally:
        bounce.close()
        os.close(shm)
        os.close(fd)
    assert (rc, n_done) == (0, n)
    assert landed
    assert faults < pages // 4, f"{faults} minor faults for a copy into {pages} pages"


@pytest.mark.parametrize("uring", [False, True], ids=["loop", "uring"])
def test_a_forked_child_keeps_what_it_opened_under_an_inherited_number(stored, uring):
    """The native core keeps descriptors of its own (a thread's io_uring, /proc/self/
    pagemap for the bounced copy). A forked child that closes what it inherited and
    opens its own files, as a daemon does, gets those numbers back: its first bounced
    load must leave them alone (the core used to close the inherited numbers at that
    first use, by then the child's pipes)."""
    backend, fd, paths, source = stored
    if backend.name != "native":
        pytest.skip("the pure twin keeps no descriptor of its own")
    bounce = Bounce(BLOCK, nbytes=4 * BLOCK)
    flags = native.URING if uring else 0
    slots = np.zeros(N * BLOCK, dtype=np.uint8)
    offsets = [i * BLOCK for i in range(N)]
    try:
        assert bounce.load(backend, fd, paths, memoryview(slots), offsets, flags)[:2] == (0, N)
        held = descriptors().items()
        pagemap = [fd for fd, t in held if t == f"/proc/{os.getpid()}/pagemap"]
        rings = [fd for fd, t in held if t == "anon_inode:[io_uring]"]
        assert len(pagemap) == 1 and (rings or not uring), (pagemap, rings)
        kept = pagemap + rings  # what the core holds after a bounced load
        pid = os.fork()
        if pid == 0:
            code = 1  # an exception
            try:
                for number in kept:  # the daemon's clean-up...
                    with contextlib.suppress(OSError):
                        os.close(number)
                pipes = []
                for number in kept:  # ...then its own files, one on each number
                    r, w = os.pipe()
                    high = fcntl.fcntl(w, fcntl.F_DUPFD_CLOEXEC, 256)  # out of the way
                    os.close(w)
                    if r != number:
                        os.dup2(r, number)
                        os.close(r)
                    pipes.append((number, high, os.fstat(number).st_ino))
                slots[:] = 0
                rc = bounce.load(backend, fd, paths, memoryview(slots), offsets, flags)
                loaded = rc[:2] == (0, N) and np.array_equal(slots, source)
                intact = True
                for number, w, ino in pipes:
                    os.write(w, b"ok")
                    try:
                        intact &= os.fstat(number).st_ino == ino and os.read(number, 2) == b"ok"
                    except OSError:
                        intact = False
                code = 0 if loaded and intact else 2 if intact else 3
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, \
            "1: an exception, 2: a block not loaded, 3: a pipe of the child was closed"
    finally:
        bounce.close()


def test_a_child_forked_during_bounced_loads_can_load(stored):
    """Another thread keeps making bounced loads (each looks up its slots under the
    core's pagemap lock) while this one forks: every child's own bounced load finishes.
    A child forked while the lock was held by that other thread -- which the child does
    not have -- would wait for it forever, so the lock is held across fork."""
    backend, fd, paths, source = stored
    if backend.name != "native":
        pytest.skip("the pure twin has no lock")
    bounce = Bounce(BLOCK, nbytes=4 * BLOCK)
    busy = np.zeros(N * BLOCK, dtype=np.uint8)
    offsets = [i * BLOCK for i in range(N)]
    stop, failures = threading.Event(), []

    def loads() -> None:
        mine = Bounce(BLOCK, nbytes=4 * BLOCK)
        try:
            while not stop.is_set():
                mine.load(backend, fd, paths, memoryview(busy), offsets, 0)
        finally:
            mine.close()

    thread = threading.Thread(target=loads, daemon=True)
    thread.start()
    try:
        for _ in range(FORKS):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    slots = np.zeros(N * BLOCK, dtype=np.uint8)
                    rc = bounce.load(backend, fd, paths, memoryview(slots), offsets, 0)
                    code = 0 if rc[:2] == (0, N) and np.array_equal(slots, source) else 2
                finally:
                    os._exit(code)
            deadline = time.monotonic() + HUNG_S
            while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            if done[0] == 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                failures.append("a child's bounced load still waited after "
                                f"{HUNG_S} s")
                break
            if os.waitstatus_to_exitcode(done[1]) != 0:
                failures.append(f"a child exited {os.waitstatus_to_exitcode(done[1])}")
    finally:
        stop.set()
        thread.join(10)
        bounce.close()
    assert failures == []


# Forks of test_a_child_forked_during_bounced_loads_can_load, and how long a child's one
# bounced load of N blocks may take before it counts as waiting forever.
FORKS = 150
HUNG_S = 10.0


def _thp_offered() -> bool:
    """Whether this kernel gives transparent huge pages to a mapping that asks."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _resident_bounce_buffers(pid: int, nbytes: int) -> int:
    """Private anonymous mappings of exactly ``nbytes`` in ``pid`` whose every page is
    resident and, where the kernel offers huge pages, that ask for them (the ``hg`` flag:
    madvise MADV_HUGEPAGE) (``/proc/PID/smaps``)."""
    found, size, resident = 0, None, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                private_anonymous = head[1].endswith("p") and len(head) == 5
                size = hi - lo if private_anonymous else None
            elif head[0] == "Anonymous:" and size == nbytes:
                resident = int(head[1]) * 1024 == nbytes
            elif head[0] == "VmFlags:" and size == nbytes:
                found += resident and ("hg" in head[1:] or not _thp_offered())
    return found


@pytest.mark.parametrize("setting", [True, False], ids=["bounced", "direct"])
def test_workers_map_their_bounce_buffer_as_they_start(make_buffer, make_tier, tmp_path,
                                                       setting):
    """The bounce buffer is private memory allocated at the session's start, with the
    pre-fault, not in the first load's time (where a new worker's first job paid
    100-400 ms), in huge pages where the kernel has them (in 4 KiB pages a 2 MiB direct
    read went to the disk as two requests)."""
    from mptier.workers.bounce import Bounce

    tier = make_tier(make_buffer(4, BLOCK), root_dir=str(tmp_path / "kv"),
                     bounce_loads=setting, bounce_stores=setting,
                     n_load_workers=1, n_store_workers=1)
    pids = [w["pid"] for w in tier.stats()["workers"]]
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while True:  # the workers map the buffer once their session started
        ready = [_resident_bounce_buffers(p, Bounce(BLOCK).mapped_bytes) for p in pids]
        if not setting or all(ready) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    # No load ran yet.
    assert tier.stats()["bytes_done"]["load"] == 0
    assert ready == ([1, 1] if setting else [0, 0]), ready


def _parked(rule, want: int, settle_s: float = 0.5, limit_s: float = 20.0) -> int:
    """Wait until ``want`` callers wait in ``rule`` (or ``limit_s`` passed), then
    ``settle_s`` more: the number waiting then (more would have arrived by now)."""
    deadline = time.monotonic() + limit_s
    while rule.waiting < want and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(settle_s)
    return rule.waiting


@pytest.mark.parametrize("waves", [True, False], ids=["waves", "whole"])
def test_a_bounced_uring_load_reads_in_waves_of_half_its_slots(make_fuse_fs, waves):
    """Through io_uring a bounced load keeps at most half its bounce slots' reads in
    flight, and sends the next wave as soon as the last has returned (then copies it):
    seen from a FUSE file system that parks the reads of the first four blocks and of the
    next four under two rules. WHOLE_BOUNCE (``bounce_waves = false``) sends every slot's
    read at once. Either way every block lands in its slot."""
    backend = native.get_backend("native")
    if backend.uring_status() != "io_uring":
        pytest.skip(f"no io_uring here: {backend.uring_status()}")
    fs = make_fuse_fs(direct_io=True)  # every read reaches the file system
    n = 8
    source = np.random.default_rng(5).integers(0, 256, n * BLOCK, dtype=np.uint8)
    for i in range(n):
        (fs.backing / f"w{i}").write_bytes(source[i * BLOCK:(i + 1) * BLOCK].tobytes())
    paths = [f"w{i}".encode() for i in range(n)]
    first, second = fs.block("read", "/w[0-3]"), fs.block("read", "/w[4-7]")
    fd = native.open_root(str(fs.mountpoint))
    bounce = Bounce(BLOCK, nbytes=n * BLOCK)  # room for the whole batch: waves or not
    target = np.zeros(n * BLOCK, dtype=np.uint8)
    flags = native.URING | (0 if waves else native.WHOLE_BOUNCE)
    result: list = []
    loader = threading.Thread(target=lambda: result.append(bounce.load(
        backend, fd, paths, memoryview(target), [i * BLOCK for i in range(n)], flags)))
    loader.start()
    try:
        in_first = _parked(first, 4)
        in_second = second.waiting
        first.release()
        after_first = _parked(second, 4)
    finally:
        first.release()
        second.release()
        loader.join(30)
        bounce.close()
        os.close(fd)
    assert not loader.is_alive(), "the load never returned"
    assert in_first == 4
    if waves:
        assert in_second == 0, f"{in_second} reads of the second wave were sent with the first"
        assert after_first == 4, "the second wave was not sent when the first returned"
    else:
        assert in_second == 4, f"{in_second} of the second half in flight, not all 4"
    assert result[0][:2] == (0, n)
    assert np.array_equal(target, source)

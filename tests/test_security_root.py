"""A root is shared, so what is in it is input: hostile files at the names mptier reads,
folders and inodes the byte budget must see, a root that turns read-only. Real files,
FIFOs, devices, tmpfs mounts and worker processes throughout."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import time

import pytest
from conftest import wait_for
from native_support import aligned, child_env, io_fixture  # noqa: F401  (fixture)
from reliability_kit import tiny_tmpfs
from support import mounts
from test_capacity import Driver, blocks_on_disk, keys_for, root_stats

from mptier import LookupResult, rootfile
from mptier.errors import RootFileError
from mptier.layout import FileMapper
from mptier.rootfile import REPLACED_TRIES, ROOT_FILE_LIMIT_BYTES, read_root_file
from mptier.storage import tools

KB = 1 << 10
BLOCK = 64 * KB
MODEL = "hostile/model"


def _symlink_to_zero(path: str) -> None:
    os.symlink("/dev/zero", path)


def _fifo(path: str) -> None:
    os.mkfifo(path)


def _huge(path: str) -> None:
    with open(path, "wb") as f:  # sparse: large to read, nothing on disk
        f.truncate(ROOT_FILE_LIMIT_BYTES * 64)


def _folder(path: str) -> None:
    os.mkdir(path)


def _char_device(path: str) -> None:
    os.mknod(path, stat.S_IFCHR | 0o644, os.makedev(1, 5))  # /dev/zero's numbers


# (what is planted, what the error must say it found)
HOSTILE = [(_symlink_to_zero, "a symlink"), (_fifo, "a FIFO"),
           (_huge, f"larger than {ROOT_FILE_LIMIT_BYTES} bytes"), (_folder, "a folder"),
           (_char_device, "a character device")]
HOSTILE_IDS = ["symlink-to-dev-zero", "fifo", "huge", "folder", "char-device"]


@pytest.mark.parametrize(("plant", "found"), HOSTILE, ids=HOSTILE_IDS)
def test_read_root_file_refuses_what_is_not_a_small_regular_file(tmp_path, plant, found):
    path = str(tmp_path / "mptier.json")
    plant(path)
    with pytest.raises(RootFileError) as info:
        read_root_file(path)
    assert path in str(info.value) and found in str(info.value)
    assert "remove" in str(info.value), "the error says what to do"
    assert info.value.errno in (errno.ELOOP, errno.EFBIG, getattr(errno, "EMEDIUMTYPE", 0))


def test_read_root_file_reads_a_regular_file_and_misses_a_missing_one(tmp_path):
    path = tmp_path / "config.json"
    assert read_root_file(str(path)) is None
    path.write_bytes(b"x" * ROOT_FILE_LIMIT_BYTES)  # exactly the limit is fine
    assert read_root_file(str(path)) == b"x" * ROOT_FILE_LIMIT_BYTES


@pytest.mark.parametrize("err", [errno.EBADF, errno.ESTALE], ids=["EBADF", "ESTALE"])
def test_read_root_file_reads_a_record_replaced_through_another_node_again(make_fuse_fs,
                                                                           err):
    """JuiceFS fails the read of a record another mount renamed over with EBADF (seen
    when two tiers on two mounts start at once), NFS with ESTALE: the name leads to the
    new record, so it is opened again, a bounded number of times."""
    fs = make_fuse_fs(direct_io=True)  # every read reaches the file system
    path = fs.path("mptier.json")
    path.write_bytes(b'{"block_bytes": 4096}')
    reads = fs.calls("read")
    fs.fail("read", err, "/mptier.json", times=REPLACED_TRIES - 1)
    assert read_root_file(str(path)) == b'{"block_bytes": 4096}'
    # two reads failed, then the record and its end of file were read
    assert fs.calls("read") - reads == REPLACED_TRIES + 1
    reads = fs.calls("read")
    fs.fail("read", err, "/mptier.json", times=REPLACED_TRIES)
    with pytest.raises(OSError) as info:
        read_root_file(str(path))
    assert info.value.errno == err and fs.calls("read") - reads == REPLACED_TRIES
    reads = fs.calls("read")
    fs.fail("read", errno.EIO, "/mptier.json", times=1)  # a fault: never read again
    with pytest.raises(OSError) as info:
        read_root_file(str(path))
    assert info.value.errno == errno.EIO and fs.calls("read") - reads == 1


def test_read_root_file_reads_again_when_the_opened_record_is_gone(tmp_path,
                                                                   monkeypatch):
    """JuiceFS fails the fstat of a record another mount renamed over right after this
    one opened it with ENOENT (seen in CI): read again by name. A missing record is
    still None, and a record that keeps vanishing fails after REPLACED_TRIES."""
    path = tmp_path / "mptier.json"
    path.write_bytes(b'{"block_bytes": 4096}')
    real_fstat, failures, budget = os.fstat, [], REPLACED_TRIES - 1

    def fstat(fd: int):
        if len(failures) < budget:
            failures.append(fd)
            raise FileNotFoundError(errno.ENOENT, "No such file or directory")
        return real_fstat(fd)
    monkeypatch.setattr(rootfile.os, "fstat", fstat)
    assert read_root_file(str(path)) == b'{"block_bytes": 4096}'
    assert len(failures) == REPLACED_TRIES - 1
    failures.clear()
    budget = REPLACED_TRIES
    with pytest.raises(FileNotFoundError):
        read_root_file(str(path))
    assert len(failures) == REPLACED_TRIES
    assert read_root_file(str(tmp_path / "none.json")) is None


# The record a start reads, and how it was replaced (the I/O backend plays no part).
STARTS = [("mptier.json", *case) for case in HOSTILE] + \
    [("config.json", *HOSTILE[0]), ("config.json", *HOSTILE[1])]
START_IDS = [f"mptier.json-{i}" for i in HOSTILE_IDS] + \
    ["config.json-symlink-to-dev-zero", "config.json-fifo"]


def _plant_record(root: str, name: str, plant) -> str:
    mapper = FileMapper(root, MODEL)
    os.makedirs(mapper.base_path)
    os.makedirs(mapper.blocks_dir)
    path = f"{mapper.base_path}/{name}"
    plant(path)
    return path


@pytest.mark.parametrize("backend", ["native"], indirect=True)
@pytest.mark.parametrize(("name", "plant", "found"), STARTS, ids=START_IDS)
def test_a_tier_refuses_to_start_on_a_hostile_record_naming_it(make_buffer, make_tier, root,
                                                                name, plant, found):
    """The start fails at once with the path and what was found -- no 2.6 GiB read from
    /dev/zero, no wait on a FIFO until io_timeout_s blames the file system."""
    path = _plant_record(root, name, plant)
    with pytest.raises(RootFileError) as info:
        make_tier(make_buffer(4, BLOCK), model_name=MODEL, io_timeout_s=600.0)
    text = str(info.value)
    assert path in text and found in text
    assert "not responding" not in text and "io_timeout_s" not in text


@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_removing_the_hostile_record_as_told_lets_the_tier_start(make_buffer, make_tier,
                                                                 root):
    path = _plant_record(root, "mptier.json", _fifo)
    buf = make_buffer(4, BLOCK)
    with pytest.raises(RootFileError, match="remove"):
        make_tier(buf, model_name=MODEL)
    os.unlink(path)
    tier = make_tier(buf, model_name=MODEL)
    assert tier.stats()["roots"][0]["in_rotation"]
    assert read_root_file(path) == b'{"block_bytes": %d}' % BLOCK


def test_a_record_is_never_written_through_a_planted_temporary_name(root, tmp_path):
    """The record's temporary file is created new (O_EXCL, O_NOFOLLOW): a symlink
    planted at the name an older tier used is not followed."""
    mapper = FileMapper(root, MODEL)
    os.makedirs(mapper.base_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    for pid in range(os.getpid() - 5, os.getpid() + 5):
        os.symlink(victim, f"{mapper.record_path}.tmp.{pid}")
    mapper.prepare(BLOCK)
    assert victim.read_bytes() == b"keep me"
    assert mapper.recorded_block_bytes() == BLOCK


@pytest.mark.parametrize(("plant", "found"), HOSTILE, ids=HOSTILE_IDS)
def test_du_reports_a_hostile_record_as_unknown_without_reading_it(root, plant, found):
    mapper = FileMapper(root, MODEL)
    mapper.prepare(BLOCK)
    os.unlink(mapper.record_path)
    plant(mapper.record_path)
    report = tools.du(root)  # returns at once: nothing read from /dev/zero or a FIFO
    [folder] = report["folders"]
    assert folder["model"] == MODEL and folder["block_bytes"] is None


# -- a read-only root ---------------------------------------------------------------------

def _remount(point: str, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", point], check=True,
                   capture_output=True, timeout=30)


def _lookup(tier, key: bytes) -> LookupResult:
    """Ask until the answer is not RETRY (lookups run in batches off the thread)."""
    answer = [LookupResult.RETRY]

    def settled() -> bool:
        answer[0] = tier.lookup(key, "req")
        tier.on_schedule_end()
        return answer[0] is not LookupResult.RETRY

    wait_for(settled, 20, f"a lookup answer for {key.hex()}")
    tier.on_request_finished("req")
    return answer[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting tmpfs needs root")
def test_a_read_only_root_serves_loads_and_fails_stores_fast(make_buffer, make_tier):
    """EROFS stores never take a readable root out of rotation: its blocks still load
    and look up as hits, stores fail at once with EROFS (counted, no I/O), and once it
    is writable again stores resume after root_retry_s."""
    # A file system with a file open for writing cannot be remounted read-only, and
    # every writer holds its lease open (<root>/.mptier/leases): the leases live on a
    # file system of their own, bound in, as a root's blocks are the part that goes
    # read-only when a disk fails under ext4's errors=remount-ro.
    with tiny_tmpfs(16 << 20) as point, tiny_tmpfs(1 << 20) as meta:
        os.makedirs(f"{point}/kv/.mptier")
        subprocess.run(["mount", "--bind", meta, f"{point}/kv/.mptier"], check=True,
                       capture_output=True, timeout=30)
        try:
            buf = make_buffer(8, BLOCK)
            tier = make_tier(buf, root_dir=f"{point}/kv", task_bytes=BLOCK,
                             root_retry_s=4.0, root_failures_to_fail=2)
            try:
                # The caretaker's folders made ahead first: a mkdir in flight makes the
                # remount fail (EBUSY), as a store writing would.
                assert tier.stats()["roots"][0]["folders_ahead"]
                blocks = tier.mapper.blocks_dir
                wait_for(lambda: len(os.listdir(blocks)) == 16 ** 3, 30, "the folders")
                _read_only_then_writable(tier, buf, point)
            finally:
                tier.shutdown()  # before the unmount: workers hold the root open
        finally:
            mounts.unmount(f"{point}/kv/.mptier")


def _read_only_then_writable(tier, buf, point: str) -> None:
    run = Driver(tier, buf)
    kept, new = keys_for(b"kept", 4), keys_for(b"new", 4)
    assert run.store(kept).success
    _remount(point, "ro")
    try:
        results = [run.store([key]) for key in new[:3]]  # past root_failures_to_fail
        assert all(not r.success and r.errno == errno.EROFS for r in results), results
        assert "read-only" in results[-1].error and "without I/O" in results[-1].error
        stats = tier.stats()["roots"][0]
        assert stats["in_rotation"] and stats["read_only"]
        assert stats["errno"] == errno.EROFS and stats["read_only_stores"] >= 1
        assert stats["times_out"] == 0
        for key in kept:  # every block still there, read back and checked
            assert run.load([key]).success
            assert _lookup(tier, key) is LookupResult.HIT
        assert run.load(kept).success
        assert _lookup(tier, new[0]) is LookupResult.MISS
        assert tier.stats()["roots"][0]["read_only"], "a load does not end read-only"
    finally:
        _remount(point, "rw")
    wait_for(lambda: run.store(new).success, 30, "stores resuming on the root")
    # The store's success reaches the root's health through its worker's report, which
    # the health owner may take a moment after the job's completion (seen in CI at load:
    # still read_only right after the store); within a retry period it is seen.
    wait_for(lambda: not tier.stats()["roots"][0]["read_only"], 15, "read_only cleared")
    stats = tier.stats()["roots"][0]
    assert stats["in_rotation"] and not stats["read_only"] and stats["errno"] == 0
    assert run.load(new).success


# -- folders ------------------------------------------------------------------------------

EVICTOR = """
import os, sys
from mptier.storage.walk import remove_empty_parents
root, count = sys.argv[1], 0
leaf = os.path.join(root, "abc", "de_g0")
print("ready", flush=True)
while not os.path.exists(os.path.join(root, "stop")):
    try:
        names = os.listdir(leaf)
    except FileNotFoundError:
        continue
    for name in names:  # as eviction does: the block, then its folders if now empty
        if name.endswith(".bin"):
            os.unlink(os.path.join(leaf, name))
            count += remove_empty_parents(os.path.join(leaf, name))
print(count, flush=True)
"""


def test_stores_survive_empty_folders_removed_under_them(io, tmp_path):
    """Eviction removes a block's folders once they are empty, while writers store into
    them: a writer that finds its folder, or the folder's parent, gone between making
    and using it makes it again (the retry in mpt_store_one / _store_one) -- no store
    fails."""
    rounds = 300
    buf = aligned(BLOCK, seed=3)
    paths = [f"abc/de_g0/abcde{i:059x}.bin" for i in range(rounds)]
    evictor = subprocess.Popen([sys.executable, "-c", EVICTOR, str(tmp_path)],
                               env=child_env(), text=True, stdout=subprocess.PIPE)
    failures = []
    try:
        assert evictor.stdout.readline().strip() == "ready"
        for path in paths:
            try:
                io.batch_store(tmp_path, [path], buf, [0], BLOCK)
            except OSError as exc:
                failures.append((path, exc))
            # The next store starts as the evictor takes this block and its folders.
            wait_for(lambda path=path: not (tmp_path / path).exists(), 10, "an eviction")
    finally:
        (tmp_path / "stop").touch()
        removed = int(evictor.stdout.readline())
        evictor.wait(timeout=30)
        evictor.stdout.close()
    assert failures == []
    assert removed > 0, "no folder was ever removed: the race was not run"


def _folders(top: str) -> tuple[int, int, int]:
    """(block sub-folders, empty ones, bytes on disk of everything under ``top``:
    st_blocks * 512 of files and folders alike)."""
    def on_disk(path: str) -> int:  # 0 for what eviction removed since it was listed
        try:
            return os.lstat(path).st_blocks * 512
        except FileNotFoundError:
            return 0

    folders = empty = disk = 0
    for path, dirs, files in os.walk(top):
        disk += on_disk(path)
        disk += sum(on_disk(os.path.join(path, f)) for f in files)
        if path != top:
            folders += 1
            empty += not dirs and not files
    return folders, empty, disk


def test_evicted_blocks_take_their_folders_with_them(make_buffer, make_tier, root):
    """With a 1 MiB budget, storing 6 MiB of blocks (each in a folder pair of its own,
    4 KiB each on ext4) leaves no empty folder behind: what the cache takes on disk,
    folders included, stays near the budget."""
    cap = 16 * BLOCK
    buf = make_buffer(4, BLOCK)
    tier = make_tier(buf, model_name=MODEL, capacity_bytes=cap, task_bytes=BLOCK)
    run = Driver(tier, buf)
    keys = keys_for(b"folders", 96)
    for key in keys:
        assert run.store([key]).success
    blocks_dir = tier.mappers[0].blocks_dir
    # An older tier's leftovers: empty folders the walk finds and removes.
    an_hour_ago = time.time() - 3600
    for name in ("fff/ff_g0", "ffe/00_g3", "ffd"):
        os.makedirs(f"{blocks_dir}/{name}")
        for folder in (name, os.path.dirname(name)):
            if folder:
                os.utime(f"{blocks_dir}/{folder}", (an_hour_ago, an_hour_ago))
    fresh = f"{blocks_dir}/ffc/00_g0"  # just made: a writer may be about to use it
    os.makedirs(fresh)
    # The folders go within a step and the step's figures are published after it: wait
    # for both (read at once, the count could still be the step's before).
    wait_for(lambda: _folders(blocks_dir)[1] == 1 and not root_stats(tier)["evicting"]
             and root_stats(tier)["folders_removed"] >= 4,
             30, "no empty folder left but the fresh one, and the removals counted")
    assert os.path.isdir(fresh), "a folder made now is kept (FOLDER_GRACE_NS)"
    os.rmdir(fresh)
    os.rmdir(os.path.dirname(fresh))
    folders, _, disk = _folders(blocks_dir)
    n_blocks, _, _ = blocks_on_disk(blocks_dir)
    assert 0 < n_blocks * BLOCK <= cap
    assert folders <= 2 * n_blocks
    assert disk <= cap + 2 * n_blocks * 4096 + 4096  # blocks and the folders they need
    stats = root_stats(tier)
    assert stats["folders_removed"] >= 4 and stats["evicted_blocks"] >= 96 - 16
    assert run.load(keys[-4:]).success


# -- inodes -------------------------------------------------------------------------------

def _store_until(run, key: bytes, timeout: float) -> tuple[bool, int]:
    """Store ``key`` until it succeeds or ``timeout`` passes: (stored, failures)."""
    failures = 0
    deadline = time.monotonic() + timeout
    while True:
        result = run.store([key])
        if result.success:
            return True, failures
        assert result.errno == errno.ENOSPC, result
        failures += 1
        if time.monotonic() > deadline:
            return False, failures
        time.sleep(0.05)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting tmpfs needs root")
def test_a_root_out_of_inodes_evicts_while_bytes_are_free(make_buffer, make_tier):
    """A tmpfs of 64 MiB but 100 inodes holds ~30 blocks (a file and two folders each)
    with the byte budget (16 MiB) far away: the caretaker sees the inodes pass the high
    watermark (and stores refused for space) and evicts, so stores go on."""
    inodes = 100
    with tiny_tmpfs(64 << 20, f"nr_inodes={inodes}") as point:
        buf = make_buffer(4, BLOCK)
        tier = make_tier(buf, root_dir=f"{point}/kv", model_name=MODEL,
                         capacity_bytes=256 * BLOCK, task_bytes=BLOCK)
        try:
            run = Driver(tier, buf)
            keys = keys_for(b"inodes", 70)
            stored = [_store_until(run, key, 20.0) for key in keys]
            assert all(ok for ok, _ in stored), stored
            stats = root_stats(tier)
            assert stats["evicted_blocks"] > 0
            assert stats["usage_bytes"] < 0.5 * stats["capacity_bytes"]  # bytes were free
            wait_for(lambda: root_stats(tier)["inodes_total"] == inodes, 10, "inodes")
            assert 0 <= root_stats(tier)["inodes_free"] < inodes
            if any(failures for _, failures in stored):
                assert stats["no_space_stores"] > 0
            # The newest blocks are kept (LRU is approximate in a first pass: not all).
            assert run.load([keys[-1]]).success
        finally:
            tier.shutdown()  # before the unmount: workers hold the root open

"""SharedKVBuffer: created, attached, and adopted from the engine's own memory."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time

import numpy as np
import pytest
from conftest import fill_random, wait_results

from mptier import ConfigError, SharedKVBuffer, TransferJob, make_key
from mptier.mapping import MappedBuffer, Segment
from mptier.shm import cleanup_stale, hold, unique_name

KB = 1 << 10


# Tests that sweep every stale mptier object (cleanup_stale(min_age_s=0)) run in one test
# process, one at a time: a sweep in another process removes the object this test made
# stale and then looks for (seen in CI: test_service's sweep took it first).
STALE_SWEEP = pytest.mark.xdist_group("stale-shm-sweep")

def keys_for(n: int) -> list[bytes]:
    return [make_key(os.urandom(32), 1) for _ in range(n)]


def round_trip(tier, buf: SharedKVBuffer, n: int) -> None:
    """Store slots 0..n-1 and load them into n..2n-1; every byte must match."""
    fill_random(buf.view, range(n), seed=n)
    keys = keys_for(n)
    tier.submit_store(TransferJob(1, keys, list(range(n))))
    assert wait_results(tier, [1])[1].success
    tier.submit_load(TransferJob(2, keys, list(range(n, 2 * n))))
    assert wait_results(tier, [2])[2].success
    assert np.array_equal(buf.view[:n], buf.view[n:2 * n])


@contextlib.contextmanager
def vllm_like_file(tmp_name: str, nbytes: int):
    """A /dev/shm file mapped shared, as vLLM's scheduler-side primary buffer is."""
    path = f"/dev/shm/{tmp_name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes)
        os.close(fd)
        fd = -1
        yield path, mapping
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def test_create_attach_and_unlink():
    with SharedKVBuffer.create(4, 8 * KB) as buf:
        assert buf.view.shape == (4, 8 * KB) and buf.view.dtype == np.uint8
        assert os.path.exists(f"/dev/shm/{buf.name}")
        assert str(os.getpid()) in buf.name
        buf.view[2, :5] = [1, 2, 3, 4, 5]
        other = SharedKVBuffer.attach(buf.name, block_bytes=8 * KB)
        assert list(other.view[2, :5]) == [1, 2, 3, 4, 5]
        other.close()
        other.unlink()  # not the owner: must not remove it
        assert os.path.exists(f"/dev/shm/{buf.name}")
        name = buf.name
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.parametrize("num_blocks, block_bytes", [(0, 4096), (4, 0), (4, -1), (2.5, 4)])
def test_create_rejects_bad_sizes(num_blocks, block_bytes):
    with pytest.raises(ConfigError):
        SharedKVBuffer.create(num_blocks, block_bytes)


@STALE_SWEEP
def test_stale_objects_are_those_nobody_holds():
    held, orphan, young = (unique_name("buf") for _ in range(3))
    paths = {n: f"/dev/shm/{n}" for n in (held, orphan, young)}
    fds = {}
    try:
        for name, path in paths.items():
            fds[name] = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        hold(fds[held])
        for name in (orphan, young):
            os.close(fds.pop(name))
        old = os.stat(paths[held]).st_ctime
        removed = cleanup_stale(min_age_s=0)
        assert orphan in removed and held not in removed and young in removed
        # a fresh object (its creator may not have locked it yet) is left alone
        fd = os.open(paths[young], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.close(fd)
        assert young not in cleanup_stale(min_age_s=3600)
        assert os.path.exists(paths[held]) and os.stat(paths[held]).st_ctime == old
        os.close(fds.pop(held))  # its holder goes away: now it is stale
        assert held in cleanup_stale(min_age_s=0)
    finally:
        for fd in fds.values():
            os.close(fd)
        for path in paths.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


# How long the attacher's lock may outlive its exit (see the test below).
RELEASE_WAIT_S = 10.0


def _flock_holders(path: str) -> list[str]:
    """Who holds a lock on ``path`` (``/proc/locks``: pid and command line)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return []
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    out = []
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if "->" in fields:
                fields.remove("->")
            if len(fields) > 5 and fields[5] == want:
                pid = fields[4]
                try:
                    with open(f"/proc/{pid}/cmdline") as c:
                        cmd = c.read().replace("\0", " ")[:200]
                except OSError:
                    cmd = "?"
                out.append(f"{fields[1]} {fields[3]} pid {pid}: {cmd}")
    return out


ATTACHER = """
import sys, time
from mptier import SharedKVBuffer
buf = SharedKVBuffer.attach(sys.argv[1], block_bytes=4096)
print(bytes(buf.view[0, :4]).hex(), flush=True)
sys.stdin.readline()
"""


@STALE_SWEEP
def test_an_attached_buffer_survives_its_creator_and_cleanup():
    import subprocess
    import sys

    buf = SharedKVBuffer.create(2, 4096)
    name = buf.name
    buf.view[0, :4] = [1, 2, 3, 4]
    attacher = subprocess.Popen([sys.executable, "-c", ATTACHER, name],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert attacher.stdout.readline().strip() == "01020304"
        buf.close()  # the creator lets go without unlinking (as a crashed engine would)
        assert name not in cleanup_stale(min_age_s=0), "another process still uses it"
        assert os.path.exists(f"/dev/shm/{name}")
        attacher.stdin.write("\n")
        attacher.stdin.flush()
        attacher.wait(30)
        # The attacher's lock goes with its last descriptor; a process that shared them
        # may outlive it by a moment (seen in CI: nothing to sweep at the first call).
        # Any sweep may take it once it is free: this one, or a live pool's periodic
        # sweep in another test process (seen in CI: gone before this sweep came).
        path, holders = f"/dev/shm/{name}", []
        deadline = time.monotonic() + RELEASE_WAIT_S
        while os.path.exists(path) and time.monotonic() < deadline:
            holders = _flock_holders(path)
            cleanup_stale(min_age_s=0)
            time.sleep(0.05)
        assert not os.path.exists(path), f"still locked by {holders}"
    finally:
        attacher.kill()
        attacher.wait()
        attacher.stdin.close()
        attacher.stdout.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")


NAMESPACED = """
import sys
from mptier import SharedKVBuffer
buf = SharedKVBuffer.create(2, 4096)
import os
print(buf.name, os.getpid(), flush=True)
sys.stdin.readline()
buf.close()
buf.unlink()
"""


@STALE_SWEEP
@pytest.mark.skipif(os.geteuid() != 0, reason="unshare --pid needs root")
def test_buffer_of_a_process_in_another_pid_namespace_survives_cleanup():
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    inner = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", NAMESPACED],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    name = ""
    try:
        name, inner_pid = inner.stdout.readline().split()
        assert inner_pid == "1"  # it sees itself as init of its own namespace
        assert name in os.listdir("/dev/shm")
        assert name not in cleanup_stale(min_age_s=0)
        assert os.path.exists(f"/dev/shm/{name}")
        inner.stdin.write("\n")
        inner.stdin.flush()
        assert inner.wait(30) == 0
        assert not os.path.exists(f"/dev/shm/{name}")  # its owner removed it itself
    finally:
        inner.kill()
        inner.wait()
        inner.stdin.close()
        inner.stdout.close()
        if name:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("unlink_first", [False, True], ids=["file", "unlinked-file"])
def test_from_memoryview_of_shared_file(make_tier, unlink_first):
    nbytes = 16 * 16 * KB
    with vllm_like_file(f"vllm_offload_test{os.getpid()}.mmap", nbytes) as (path, mapping):
        view2d = np.frombuffer(mapping, dtype=np.uint8).reshape(16, 16 * KB)
        if unlink_first:  # vLLM unlinks once its own workers mapped the file
            os.unlink(path)
        buf = SharedKVBuffer.from_memoryview(memoryview(view2d))
        assert buf.shareable and buf.block_bytes == 16 * KB and buf.num_blocks == 16
        tier = make_tier(buf)
        assert tier.stats()["mode"] == "processes"
        round_trip(tier, buf, 8)
        tier.shutdown()
        buf.close()
        del view2d


def test_from_memoryview_of_two_segments(make_tier):
    """vLLM splits large buffers into `.mmap`, `.mmap.1`...: one contiguous mapping."""
    seg_bytes = 8 * 16 * KB
    base = f"/dev/shm/vllm_offload_seg{os.getpid()}.mmap"
    paths = [base, base + ".1"]
    fds = []
    try:
        for p in paths:
            fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, seg_bytes)
            fds.append(fd)
        mapped = MappedBuffer([Segment(fd, 0, seg_bytes, i * seg_bytes, p)
                               for i, (fd, p) in enumerate(zip(fds, paths))], 2 * seg_bytes)
        buf = SharedKVBuffer.from_memoryview(mapped.memory, block_bytes=16 * KB)
        assert buf.shareable and len(buf.open_segments()) == 2
        tier = make_tier(buf)
        round_trip(tier, buf, 8)  # blocks 0-7 in the first file, 8-15 in the second
        with open(paths[1], "rb") as f:  # the loads landed in the second file
            assert f.read(16 * KB) == buf.view[8].tobytes()
        tier.shutdown()
        buf.close()
    finally:
        for fd in fds:
            os.close(fd)
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


def test_anonymous_memory_falls_back_to_threads(make_tier, caplog):
    import mptier.manager

    mptier.manager._warned_threads = False
    memory = np.zeros((16, 16 * KB), dtype=np.uint8)
    buf = SharedKVBuffer.from_memoryview(memory)
    assert not buf.shareable and "anonymous" in buf.unshareable_reason
    with caplog.at_level(logging.WARNING, logger="mptier.manager"):
        tier = make_tier(buf, n_load_workers=1, n_store_workers=1)
        second = make_tier(buf, n_load_workers=1, n_store_workers=1)
    warnings = [r for r in caplog.records if "cannot be shared" in r.getMessage()]
    assert len(warnings) == 1, "warn once"
    second.shutdown()
    assert tier.stats()["mode"] == "threads"
    assert all(w["pid"] == os.getpid() for w in tier.stats()["workers"])
    round_trip(tier, buf, 8)
    assert np.array_equal(memory[:8], memory[8:16])  # the engine's own array got the data


def test_private_file_mapping_is_not_shareable(tmp_path):
    path = tmp_path / "private.bin"
    path.write_bytes(bytes(4 * 4096))
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 4 * 4096, flags=mmap.MAP_PRIVATE)
    buf = SharedKVBuffer.from_memoryview(mapping, block_bytes=4096)
    assert not buf.shareable and "private" in buf.unshareable_reason
    buf.close()


def test_from_memoryview_needs_block_bytes_for_flat_memory():
    with pytest.raises(ConfigError, match="block_bytes is required"):
        SharedKVBuffer.from_memoryview(bytearray(8192))
    with pytest.raises(ConfigError, match="not a multiple"):
        SharedKVBuffer.from_memoryview(bytearray(8192), block_bytes=3000)


def _held_by_someone(path: str) -> bool:
    """Would an exclusive lock on ``path`` be refused (someone holds the object)?"""
    import fcntl

    fd = os.open(path, os.O_RDONLY)  # a new open file description: its own lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.mark.parametrize("how", ["tmpfile", "rename"])
def test_a_new_buffer_is_locked_before_it_has_its_name(monkeypatch, how):
    """The name appears (the link) only once the object is held, so a sweep at any moment
    -- with no grace period -- never removes a live buffer. ``rename``: the path taken
    where the folder refuses O_TMPFILE (the errno injected)."""
    import errno

    from mptier import shm

    real_open, real_link = os.open, os.link
    seen: list[tuple[str, bool]] = []

    def refusing_open(path, flags, *args, **kwargs):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "O_TMPFILE refused (injected)")
        return real_open(path, flags, *args, **kwargs)

    def watching_link(src, dst, *args, src_dir_fd=None, **kwargs):
        named = src if src_dir_fd is None else f"/proc/self/fd/{src}"
        seen.append((dst, _held_by_someone(named)))
        if src_dir_fd is not None:
            kwargs["src_dir_fd"] = src_dir_fd
        return real_link(src, dst, *args, **kwargs)

    if how == "rename":
        monkeypatch.setattr(shm.os, "open", refusing_open)
    monkeypatch.setattr(shm.os, "link", watching_link)
    buf = SharedKVBuffer.create(2, 4 * KB)
    try:
        path = f"/dev/shm/{buf.name}"
        assert seen == [(path, True)], "the object must be held when its name appears"
        assert buf.name not in cleanup_stale(), "a live buffer is never stale"
        assert os.path.exists(path) and _held_by_someone(path)
        assert not [n for n in os.listdir("/dev/shm") if n.endswith(shm.CREATING_SUFFIX)]
        buf.view[1, :3] = [7, 8, 9]
        other = SharedKVBuffer.attach(buf.name, block_bytes=4 * KB)
        assert list(other.view[1, :3]) == [7, 8, 9]
        other.close()
    finally:
        buf.close()
        buf.unlink()


def test_a_taken_name_is_refused_and_nothing_is_left():
    from mptier import MptierError

    with SharedKVBuffer.create(1, 4 * KB) as buf:
        before = set(os.listdir("/dev/shm"))
        with pytest.raises(MptierError, match="already exists"):
            SharedKVBuffer.create(1, 4 * KB, name=buf.name)
        assert set(os.listdir("/dev/shm")) == before


KILLED_AT_START = """
import sys
from mptier import FileSystemTier, SharedKVBuffer
buf = SharedKVBuffer.create(8, 4096)
print(buf.name, flush=True)
tier = FileSystemTier(buf, root_dir=sys.argv[1], n_load_workers=1, n_store_workers=1,
                      prefault=False)
print("started", flush=True)
import time
time.sleep(60)
"""


ENGINES_KILLED = 12  # tests/reliability_run.py's killed_at_start runs 30


def test_engines_killed_within_a_second_of_start_leave_no_buffer(root):
    """Engines SIGKILLed at a random moment of the second after they made their buffer
    (some before their tier is up, some just after): each next engine's start frees the
    buffers that nobody holds any more (no grace period to wait out), and a live tier's
    periodic sweep frees the rest once their workers (which exit on their own) let go --
    nobody calls ``cleanup_stale`` here."""
    import random
    import signal
    import subprocess
    import sys

    from conftest import RUN_DIR

    from mptier.storage import names as N
    from mptier.storage.leases import lease_state
    from mptier.workers.supervisor import SHM_SWEEP_S

    rng = random.Random(21)
    names: list[str] = []
    pids: list[int] = []
    for _ in range(ENGINES_KILLED):
        engine = subprocess.Popen([sys.executable, "-c", KILLED_AT_START, root],
                                  stdout=subprocess.PIPE, text=True)
        pids.append(engine.pid)
        try:
            names.append(engine.stdout.readline().strip())
            time_left = rng.uniform(0.0, 1.0)
            try:
                engine.wait(time_left)
            except subprocess.TimeoutExpired:
                engine.send_signal(signal.SIGKILL)
        finally:
            engine.kill()
            engine.wait()
            engine.stdout.close()
    names = [n for n in names if n]
    assert len(names) == ENGINES_KILLED
    from conftest import wait_for

    from mptier import FileSystemTier

    # A tier that lives on: its start and its periodic sweeps are the only cleanup.
    with SharedKVBuffer.create(4, 4 * KB) as buf, \
            FileSystemTier(buf, root_dir=root, n_load_workers=1, n_store_workers=1,
                           prefault=False):
        wait_for(lambda: not any(os.path.exists(f"/dev/shm/{n}") for n in names),
                 timeout=3 * SHM_SWEEP_S, what="the killed engines' buffers removed")

        def dead_leases() -> list[str]:
            with contextlib.suppress(FileNotFoundError):
                return [e for e in os.listdir(os.path.join(root, N.META_DIR, N.LEASES_DIR))
                        if lease_state(root, e.split(".")[0]) != "held"]
            return []

        # the live tier's caretaker sweeps dead writers' leases on its walk passes
        wait_for(lambda: not dead_leases(), timeout=60, what="dead leases removed")
        # the live tier's status endpoint removed the killed engines' sockets at start
        left = [e for e in os.listdir(RUN_DIR) if any(f"-{pid}." in e for pid in pids)]
        assert not left, f"the killed engines left {left} in the run directory"

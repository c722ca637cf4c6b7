"""Leases and the temporary-file sweeper, with real processes: a live writer's files are
never touched, a SIGKILLed writer's are removed, and without working locks age decides."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from storage_tree import key_for, make_cache, start_lease_holder, write_block

from mptier.errors import MptierError
from mptier.storage import (
    Kind,
    Lease,
    TempSweeper,
    Walker,
    lease_state,
    probe_locks,
    sweep_temps,
    temp_tag,
)
from mptier.storage.leases import LEASE_CREATE_GRACE_S, PROBE_TEMP_GRACE_S
from mptier.storage.names import LEASE_RE, TAG_RE

HOUR_NS = 3600 * 10**9


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, fs in os.walk(root) for f in fs)


def _age(path, seconds):
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds * 1e9)))


def test_lease_file_holds_its_writer_and_is_locked(tmp_path):
    root = str(tmp_path)
    lease = Lease.create(root)
    assert TAG_RE.match(lease.tag) and LEASE_RE.match(os.path.basename(lease.path))
    with open(lease.path) as f:
        record = json.load(f)
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert isinstance(record["created"], float) and lease.locked
    assert lease_state(root, lease.tag) == "held"   # another open file conflicts
    name = lease.temp_name("/x/abcdef.bin")
    assert temp_tag(name) == lease.tag and name.endswith(".1.tmp")
    assert lease.temp_name("/x/abcdef.bin").endswith(".2.tmp")
    lease.release()
    lease.release()   # idempotent
    assert lease_state(root, lease.tag) == "missing" and not os.path.exists(lease.path)
    assert os.listdir(f"{root}/.mptier/leases") == []


def test_probe_locks_finds_working_locks_and_leaves_nothing(tmp_path):
    assert probe_locks(str(tmp_path)) is True
    assert os.listdir(tmp_path / ".mptier") == []


def _flock_failing(err: int, on_call: int):
    """A flock that fails its ``on_call``-th call with ``err`` (the way a file system's
    lock calls fail: this machine's file systems all take locks)."""
    real, calls = fcntl.flock, []

    def flock(fd, op):
        calls.append(op)
        if len(calls) == on_call:
            raise OSError(err, os.strerror(err))
        return real(fd, op)
    return flock


@pytest.mark.parametrize("on_call", [1, 2], ids=["first-lock", "second-lock"])
def test_probe_locks_says_no_only_when_the_file_system_refuses_locks(tmp_path, monkeypatch,
                                                                      on_call):
    """ENOLCK (NFS without its lock manager) is an answer: no locks. EIO (JuiceFS's
    metadata engine busy) is a failure of the moment: it raises, so the caller asks
    again later instead of walking the root alone for good."""
    monkeypatch.setattr(fcntl, "flock", _flock_failing(errno.ENOLCK, on_call))
    assert probe_locks(str(tmp_path)) is False
    monkeypatch.setattr(fcntl, "flock", _flock_failing(errno.EIO, on_call))
    with pytest.raises(OSError) as info:
        probe_locks(str(tmp_path))
    assert info.value.errno == errno.EIO
    assert os.listdir(tmp_path / ".mptier") == []  # no probe file left either way


def test_lease_refuses_a_symlinked_meta_folder(tmp_path):
    os.makedirs(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / ".mptier")
    with pytest.raises(MptierError, match=r"\.mptier.*symlink.*remove it"):
        Lease.create(str(tmp_path))
    assert os.listdir(tmp_path / "elsewhere") == []


def test_live_writer_is_protected_and_a_killed_one_is_swept(tmp_path):
    root = str(tmp_path)
    mapper = make_cache(root)
    block = write_block(mapper, key_for(1))
    final = mapper.path_for(key_for(2))
    os.makedirs(os.path.dirname(final), exist_ok=True)
    proc, tag = start_lease_holder(root, final, n_temps=3)
    try:
        mine = Lease.create(root)       # this process is a live writer too
        my_temp = mine.temp_name(final)
        with open(my_temp, "wb") as f:
            f.write(b"y")
        for path in (f"{final}.{tag}.1.tmp", my_temp):
            _age(path, 10 * 3600)       # old files: only the lease decides
        before = _files(root)
        report = sweep_temps(root)
        assert report.locks_work
        assert report.counts.temps_removed == 0 and report.counts.temps_kept == 4
        assert report.counts.leases_removed == 0
        assert _files(root) == before
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert lease_state(root, tag) == "free"
        report = sweep_temps(root)
        assert report.counts.temps_removed == 3 and report.counts.leases_removed == 1
        assert report.counts.temps_kept == 1
        left = _files(root)
        assert not any(tag in p for p in left)
        assert os.path.exists(my_temp) and os.path.exists(mine.path) and os.path.exists(block)
        mine.release()
        report = sweep_temps(root)        # a released lease's leftovers go at once
        assert report.counts.temps_removed == 1 and not os.path.exists(my_temp)
    finally:
        proc.kill()
        proc.wait()


def test_without_working_locks_age_decides(tmp_path):
    root = str(tmp_path)
    mapper = make_cache(root)
    final = mapper.path_for(key_for(3))
    os.makedirs(os.path.dirname(final), exist_ok=True)
    live = Lease.create(root)            # held, but locks "do not work": ignored
    old, young = live.temp_name(final), live.temp_name(final)
    legacy_old, legacy_young = f"{final}.77.88.1.tmp", f"{final}.77.88.2.tmp"
    for path in (old, young, legacy_old, legacy_young):
        with open(path, "wb") as f:
            f.write(b"z" * 10)
    _age(old, 2 * 3600)
    _age(legacy_old, 2 * 3600)
    try:
        report = sweep_temps(root, locks_work=False, stale_temp_s=3600)
        assert not report.locks_work
        assert report.counts.temps_removed == 2 and report.counts.temps_kept == 2
        assert not os.path.exists(old) and not os.path.exists(legacy_old)
        assert os.path.exists(young) and os.path.exists(legacy_young)
        assert os.path.exists(live.path)        # a young lease file stays
    finally:
        live.release()


def test_with_locks_legacy_temps_are_judged_by_age(tmp_path):
    root = str(tmp_path)
    mapper = make_cache(root)
    final = mapper.path_for(key_for(4))
    os.makedirs(os.path.dirname(final), exist_ok=True)
    old, young = f"{final}.1.2.3.tmp", f"{final}.1.2.4.tmp"
    for path in (old, young):
        with open(path, "wb") as f:
            f.write(b"q")
    _age(old, 7200)
    report = sweep_temps(root, locks_work=True, stale_temp_s=3600)
    assert report.counts.temps_removed == 1
    assert not os.path.exists(old) and os.path.exists(young)


def test_a_half_created_lease_is_removed_only_when_old_and_free(tmp_path):
    root = str(tmp_path)
    Lease.create(root).release()        # makes the folders
    young = f"{root}/.mptier/leases/{'a' * 16}.lease.new"
    old = f"{root}/.mptier/leases/{'b' * 16}.lease.new"
    for path in (young, old):
        open(path, "w").close()
    _age(old, 3600)
    report = sweep_temps(root, locks_work=True)
    assert report.counts.leases_removed == 1
    assert os.path.exists(young) and not os.path.exists(old)


def test_dry_run_removes_nothing_and_sweeper_works_slice_by_slice(tmp_path):
    root = str(tmp_path)
    mapper = make_cache(root)
    finals = [mapper.path_for(key_for(i)) for i in range(20)]
    dead_tag = "deadbeef00000000"
    for final in finals:
        os.makedirs(os.path.dirname(final), exist_ok=True)
        with open(f"{final}.{dead_tag}.1.tmp", "wb") as f:
            f.write(b"t" * 7)
    dry = sweep_temps(root, dry_run=True)
    assert dry.counts.temps_removed == 20 and dry.counts.temp_bytes_removed == 140
    assert sum(p.endswith(".tmp") for p in _files(root)) == 20
    sweeper = TempSweeper(root, locks_work=True)
    walker = Walker(root)
    removed = 0
    while not walker.done:
        removed += sum(sweeper.offer(e) for e in walker.step(3))
    assert removed == 20 and not any(p.endswith(".tmp") for p in _files(root))
    assert all(e.kind is not Kind.TEMP for e in Walker(root).walk_all())


def test_probe_files_of_a_dead_prober_are_removed_when_old(tmp_path):
    root = str(tmp_path)
    os.makedirs(f"{root}/.mptier")
    old, young = f"{root}/.mptier/lockprobe.{'c' * 16}", f"{root}/.mptier/clock.{'d' * 16}"
    for path in (old, young):
        open(path, "w").close()
    _age(old, 3600)
    report = sweep_temps(root, locks_work=True)
    assert report.counts.probes_removed == 1
    assert not os.path.exists(old) and os.path.exists(young)


# A native probe's file as the probe has it while its name lives: created, then locked.
PROBER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("probing", flush=True)
time.sleep(600)
"""


def _start_prober(path):
    proc = subprocess.Popen([sys.executable, "-c", PROBER, path], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "probing", f"prober exit {proc.poll()}"
    return proc


@pytest.mark.parametrize("where", ["root", "block folder"])
def test_a_native_probes_file_is_removed_once_its_prober_died(tmp_path, where):
    """A tier's start probes its block folder (`mptier info --root`: the root) through a
    named file, .mpt_probe.<pid>.<n>.tmp, whose flock the probe holds while the name
    lives. A prober SIGKILLed mid-probe (an engine killed while its tier started; the
    killed_at_start scenario once leaked one) leaves the file with its lock free: the
    sweep removes it once past PROBE_TEMP_GRACE_S. A live probe's file (locked) and a
    young one stay; an older version's O_DIRECT probe name is swept too. Without
    working locks, age alone (LEASE_CREATE_GRACE_S) decides."""
    root = str(tmp_path)
    mapper = make_cache(root)
    os.makedirs(mapper.blocks_dir, exist_ok=True)
    folder = root if where == "root" else mapper.blocks_dir
    live, dead, young = (f"{folder}/.mpt_probe.{n}.1.tmp" for n in (11, 12, 13))
    legacy = f"{folder}/.mpt_odirect_probe.14.15.2.tmp"
    holder, killed = _start_prober(live), _start_prober(dead)
    try:
        killed.kill()
        killed.wait()
        for path in (young, legacy):
            open(path, "w").close()
        for path in (live, dead, legacy):
            _age(path, PROBE_TEMP_GRACE_S + 60)
        assert {e.path for e in Walker(root).walk_all() if e.kind is Kind.TEMP} \
            == {live, dead, young, legacy}
        report = sweep_temps(root, locks_work=True)
        assert report.counts.probes_removed == 2
        assert [os.path.exists(p) for p in (live, dead, young, legacy)] \
            == [True, False, True, False]
    finally:
        holder.kill()
        holder.wait()
        killed.stdout.close()
        holder.stdout.close()
    assert sweep_temps(root, locks_work=True).counts.probes_removed == 1  # its prober died
    assert not os.path.exists(live) and os.path.exists(young)
    _age(young, LEASE_CREATE_GRACE_S - 10)
    assert sweep_temps(root, locks_work=False).counts.probes_removed == 0
    _age(young, 20)
    assert sweep_temps(root, locks_work=False).counts.probes_removed == 1
    assert not os.path.exists(young)


def test_a_writer_that_followed_its_root_away_and_back_takes_its_tag_anew(tmp_path):
    """A writer let go of its lease without removing it (the root path led to another
    folder then: a mount over it) and comes back: its own tag's free lease is taken anew;
    a tag somebody holds is still refused."""
    import fcntl

    root = str(tmp_path)
    lease = Lease.create(root)
    fd = os.open(lease.path, os.O_RDONLY)  # the lease file, kept while its lock goes
    os.close(lease._fd)  # what release() does where the path leads elsewhere
    lease._fd = None
    assert lease_state(root, lease.tag) == "free"
    again = Lease.create(root, tag=lease.tag)
    assert lease_state(root, again.tag) == "held"
    assert os.fstat(fd).st_nlink == 0, "the stale file was replaced, not reused"
    os.close(fd)
    with pytest.raises(FileExistsError):
        Lease.create(root, tag=again.tag)  # held: somebody else's
    # release() removes only its own file: one put at its path meanwhile stays
    os.rename(again.path, again.path + ".moved")
    with open(again.path, "w") as f:
        f.write("another writer's")
    again.release()
    assert os.path.exists(again.path)
    held = os.open(again.path + ".moved", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # its lock went with release()
    os.close(held)

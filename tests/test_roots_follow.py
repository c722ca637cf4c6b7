"""A tier follows its roots by path: a file system mounted over a running tier's root
(the service that started before the mount) or taken away again is adopted at the next
task, and so is a new folder put where the old one was renamed away; a root path that
no longer leads to a folder leaves rotation, and nothing lands in the renamed folder.
Real mounts and folders; docs/storage.md states the rule."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from conftest import wait_for
from support import mounts
from test_capacity import Driver, blocks_on_disk, keys_for

from mptier import LookupResult
from mptier.storage.election import ELECT_GAP_S

BLOCK = 64 << 10

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def answer(tier, key: bytes, req: str) -> LookupResult:
    tier.lookup(key, req)
    tier.on_schedule_end()
    found = []
    wait_for(lambda: found.append(tier.lookup(key, req)) or found[-1] is not
             LookupResult.RETRY, 10, "a lookup answered")
    return found[-1]


def test_a_file_system_mounted_over_a_running_root_is_followed(make_buffer, make_tier):
    root = str(mounts.new_mount_dir("follow-"))
    buf = make_buffer(8, BLOCK)
    tier = make_tier(buf, root_dir=root, task_bytes=BLOCK)
    run = Driver(tier, buf)
    before, during, after = (keys_for(tag, 2) for tag in (b"bare", b"mounted", b"again"))
    assert run.store(before).success  # on the bare mount point (the system disk)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "mptier-follow", root],
                   check=True, capture_output=True, timeout=30)
    try:
        assert run.store(during).success
        on_tmpfs = blocks_on_disk(root)[0]
        assert on_tmpfs == 2, "the stores after the mount went to the mounted file system"
        assert all(os.path.exists(tier.path_for(k)) for k in during)
        assert answer(tier, before[0], "r1") is LookupResult.MISS  # not on this one
        assert run.load(during).success
        # the caretaker follows too: usage is that of the mounted file system
        wait_for(lambda: tier.stats()["roots"][0]["usage_bytes"] == 2 * BLOCK, 30,
                 "usage of the mounted file system")
    finally:
        mounts.unmount(root)
    assert run.store(after).success  # the mount went away: back on the bare folder
    assert blocks_on_disk(root)[0] == 4
    assert run.load(before + after).success
    assert answer(tier, during[0], "r2") is LookupResult.MISS
    wait_for(lambda: tier.stats()["roots"][0]["usage_bytes"] == 4 * BLOCK, 30,
             "usage of the bare folder again")


def test_a_mount_seen_first_by_the_walker_seat_check_is_followed(make_buffer, make_tier):
    """The caretaker's walker seat lies in the root's .mptier/walk: after a mount over
    the root the seat check finds its lock file gone and the election fails there for
    good. The workers stand still over the mount (longer than the seat check's gap), so
    that check comes due in the caretaker's first step after it; the move is seen all
    the same, and the usage is the mounted file system's."""
    root = str(mounts.new_mount_dir("seat-"))
    buf = make_buffer(8, BLOCK)
    tier = make_tier(buf, root_dir=root, task_bytes=BLOCK)
    run = Driver(tier, buf)
    before, during = (keys_for(tag, 2) for tag in (b"bare", b"mounted"))
    assert run.store(before).success
    wait_for(lambda: tier.stats()["roots"][0]["usage_bytes"] == 2 * BLOCK, 30,
             "usage of the bare folder")
    pids = tier.worker_pids()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "mptier-seat", root],
                       check=True, capture_output=True, timeout=30)
        time.sleep(3 * ELECT_GAP_S)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    try:
        # no task yet: only the caretaker's own steps can find the move
        wait_for(lambda: tier.stats()["roots"][0]["usage_bytes"] == 0, 30,
                 "usage of the (empty) mounted file system")
        assert run.store(during).success
        wait_for(lambda: tier.stats()["roots"][0]["usage_bytes"] == 2 * BLOCK, 30,
                 "usage of the mounted file system")
        assert os.path.exists(os.path.join(root, ".mptier", "walk", "seat.lock"))
    finally:
        mounts.unmount(root)


def test_a_root_renamed_away_is_followed_by_path(make_buffer, make_tier, tmp_path):
    root = str(tmp_path / "kv")
    moved = str(tmp_path / "kv-renamed")
    buf = make_buffer(8, BLOCK)
    tier = make_tier(buf, root_dir=root, task_bytes=BLOCK, root_failures_to_fail=2,
                     root_retry_s=1.0)
    run = Driver(tier, buf)
    first, second, third = (keys_for(tag, 2) for tag in (b"first", b"second", b"third"))
    assert run.store(first).success
    os.rename(root, moved)
    with open(root, "wb") as f:  # a file where the root was
        f.write(b"not a folder")
    for key in second:
        result = run.store([key])
        assert not result.success and root in (result.error or ""), result
    assert blocks_on_disk(moved)[0] == 2, "nothing was written into the renamed folder"
    wait_for(lambda: not tier.stats()["roots"][0]["in_rotation"], 10, "the root out")
    os.unlink(root)
    os.mkdir(root)  # a new, empty folder at the path: adopted after root_retry_s
    time.sleep(1.2)
    wait_for(lambda: run.store(third).success, 15, "a store into the new folder")
    assert blocks_on_disk(root)[0] == 2 and blocks_on_disk(moved)[0] == 2
    assert tier.stats()["roots"][0]["in_rotation"]
    assert run.load(third).success

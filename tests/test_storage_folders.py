"""The top folders of a block folder made ahead (mptier/storage/folders.py), and the
walk's maintainer keeping them empty (``RootMaintainer(keep_top_folders=True)``): real
folders on the test's file system."""

from __future__ import annotations

import errno
import os
import time

import pytest
from conftest import wait_for
from storage_tree import key_for, make_cache, write_block

from mptier import TransferJob
from mptier.storage import RootMaintainer, TopFolders
from mptier.storage import folders as folders_module
from mptier.storage.folders import TOP_FOLDER_NAMES

BLOCK = 4096
AN_HOUR_AGO = time.time() - 3600


def test_the_names_are_every_top_folder_the_layout_puts_a_block_in(tmp_path):
    mapper = make_cache(str(tmp_path))
    assert len(set(TOP_FOLDER_NAMES)) == len(TOP_FOLDER_NAMES) == 16 ** 3
    tops = {mapper.relative_path_for(key_for(i, group=i % 3)).split("/")[0]
            for i in range(2000)}
    assert tops <= set(TOP_FOLDER_NAMES)
    assert len(tops) > 1000  # the keys spread: a real sample of the names, not one


def test_it_makes_every_missing_top_folder_a_slice_at_a_time(tmp_path):
    blocks = tmp_path / "blocks"
    blocks.mkdir()
    (blocks / "000").mkdir()
    (blocks / "abc").mkdir()
    (blocks / "fff").write_bytes(b"not a folder")  # in the way: left as it is
    maker = TopFolders(str(blocks))
    steps = 0
    while not maker.done:
        assert maker.step(budget_s=0) == 1  # one a step with no time to spare
        steps += 1
        assert steps <= 4093
    assert steps == 4093  # every name but the three taken (a file is not replaced)
    assert maker.made == 4093 and maker.step() == 0
    names = set(os.listdir(blocks))
    assert names == set(TOP_FOLDER_NAMES)
    assert all((blocks / n).is_dir() for n in names - {"fff"})
    assert (blocks / "fff").read_bytes() == b"not a folder"


def test_a_folder_made_meanwhile_by_a_store_is_passed_over(tmp_path):
    blocks = tmp_path / "blocks"
    blocks.mkdir()
    maker = TopFolders(str(blocks))
    assert maker.step(budget_s=0) == 1  # "000", and the rest listed as missing
    (blocks / "001").mkdir()  # a store (or another tier) is first
    assert maker.step(budget_s=0) == 0
    assert maker.step(budget_s=0) == 1 and (blocks / "002").is_dir()
    while not maker.done:
        maker.step()
    assert maker.made == 4095


def test_it_waits_for_the_block_folder_and_follows_it_when_made_again(tmp_path):
    blocks = tmp_path / "blocks"
    maker = TopFolders(str(blocks))
    assert maker.step() == 0 and not maker.done  # not made yet: the first store makes it
    blocks.mkdir()
    assert maker.step(budget_s=0) == 1
    os.rmdir(blocks / "000")
    os.rmdir(blocks)  # removed under it (an operator wiped the cache)
    assert maker.step(budget_s=0) == 0 and not maker.done
    blocks.mkdir()
    while not maker.done:
        maker.step()
    assert sorted(os.listdir(blocks)) == list(TOP_FOLDER_NAMES)


def test_a_folder_it_cannot_make_raises_naming_the_error(tmp_path, monkeypatch):
    """A read-only or full file system: the caller hears of it (and leaves the folders
    to the stores)."""
    blocks = tmp_path / "blocks"
    blocks.mkdir()

    def refused(path, mode=0o777):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    monkeypatch.setattr(folders_module.os, "mkdir", refused)
    with pytest.raises(OSError) as caught:
        TopFolders(str(blocks)).step()
    assert caught.value.errno == errno.EROFS


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "removed"])
def test_the_walk_keeps_empty_top_folders_only_when_asked(tmp_path, keep):
    """An empty <h3> folder the walk finds stays with keep_top_folders; an empty
    <h2>_g<group> folder goes either way, and its <h3> folder with it only without."""
    root = str(tmp_path / "root")
    mapper = make_cache(root, block_bytes=BLOCK)
    write_block(mapper, key_for(1), BLOCK)
    blocks = mapper.blocks_dir
    for name in ("fff", "ffe/00_g0"):
        os.makedirs(f"{blocks}/{name}")
    for name in ("fff", "ffe/00_g0", "ffe"):
        os.utime(f"{blocks}/{name}", (AN_HOUR_AGO, AN_HOUR_AGO))
    m = RootMaintainer(root, block_bytes=BLOCK, keep_top_folders=keep)
    while not m.step(1000).pass_completed:
        pass
    assert not os.path.exists(f"{blocks}/ffe/00_g0")
    assert os.path.isdir(f"{blocks}/fff") == keep
    assert os.path.isdir(f"{blocks}/ffe") == keep
    assert m.folders_removed == (1 if keep else 3)
    assert os.path.exists(mapper.path_for(key_for(1)))


@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "on-demand"])
def test_a_tiers_caretaker_makes_the_top_folders_of_its_block_folder(
        make_buffer, make_tier, ahead):
    """Through a real pool: with folders_ahead the root's caretaker makes all 4,096
    top folders soon after the start, without a store; with it off only the stores'
    own folders appear. Blocks stored into the made folders load back."""
    buf = make_buffer(4, BLOCK)
    tier = make_tier(buf, folders_ahead=ahead)
    assert tier.stats()["roots"][0]["folders_ahead"] is ahead
    blocks = tier.mapper.blocks_dir
    if ahead:
        wait_for(lambda: len(os.listdir(blocks)) == 16 ** 3, 30, "the top folders made")
    keys = [key_for(i) for i in range(4)]
    buf.view[:] = 7
    tier.submit_store(TransferJob(1, keys, [0, 1, 2, 3]))
    tier.drain_jobs()
    assert all(r.success for r in tier.get_finished_jobs())
    tops = {tier.mapper.relative_path_for(k).split("/")[0] for k in keys}
    assert set(os.listdir(blocks)) == (set(TOP_FOLDER_NAMES) if ahead else tops)
    buf.view[:] = 0
    tier.submit_load(TransferJob(2, keys, [0, 1, 2, 3]))
    tier.drain_jobs()
    assert all(r.success for r in tier.get_finished_jobs())
    assert (buf.view == 7).all()

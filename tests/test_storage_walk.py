"""The layout-aware walker: classification of every kind of entry, incremental steps
equal to a full walk, nothing followed, and a tree changing underneath."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from storage_tree import key_for, make_cache, write_block

from mptier.storage import Kind, Lease, UsageTracker, Walker
from mptier.storage.names import temp_name
from mptier.storage.walk import relative_to

BB = 4096
TAG = "0123456789abcdef"


def _block_path(mapper, i=0):
    path = mapper.path_for(key_for(i))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


def _write(path, size):
    with open(path, "wb") as f:
        f.write(b"\1" * size)


def _case_block(m, outside):
    return write_block(m, key_for(0))


def _case_temp(m, outside):
    path = temp_name(_block_path(m), TAG, 7)
    _write(path, 10)
    return path


def _case_legacy_temp(m, outside):
    path = f"{_block_path(m)}.123.456.7.tmp"
    _write(path, 10)
    return path


def _case_lease(m, outside):
    lease = Lease.create(m.root_dir)
    _case_lease.held = lease
    return lease.path


def _case_symlink_block(m, outside):
    target = f"{outside}/full-size"
    _write(target, BB)
    path = _block_path(m)
    os.symlink(target, path)
    return path


def _case_symlink_folder(m, outside):
    # The leaf folder is a symlink to a folder outside holding a "block".
    leaf = os.path.dirname(_block_path(m))
    os.rmdir(leaf)
    os.makedirs(f"{outside}/leaf")
    _write(f"{outside}/leaf/{os.path.basename(m.path_for(key_for(0)))}", BB)
    os.symlink(f"{outside}/leaf", leaf)
    return leaf


def _case_dir_at_block(m, outside):
    path = _block_path(m)
    os.mkdir(path)
    _write(f"{path}/inside.bin", BB)  # never reported: a bad directory is not entered
    return path


def _case_fifo_at_block(m, outside):
    path = _block_path(m)
    os.mkfifo(path)
    return path


def _sized(size):
    def case(m, outside):
        path = _block_path(m)
        _write(path, size)
        return path
    return case


def _case_foreign_in_leaf(m, outside):
    path = f"{os.path.dirname(_block_path(m))}/notes.txt"
    _write(path, 5)
    return path


def _case_foreign_at_root(m, outside):
    path = f"{m.root_dir}/README"
    _write(path, 5)
    return path


def _case_wrong_folder(m, outside):
    # A well-formed block name in a folder its hash does not belong to.
    good = _block_path(m)
    other = f"{m.blocks_dir}/fff/ff_g0"
    os.makedirs(other)
    path = f"{other}/{os.path.basename(good)}"
    _write(path, BB)
    return path


def _case_file_at_folder(m, outside):
    path = f"{m.blocks_dir}/abc"
    _write(path, 3)
    return path


def _case_config(m, outside):
    return m.config_path


CASES = [
    ("block", _case_block, Kind.BLOCK),
    ("temp", _case_temp, Kind.TEMP),
    ("legacy temp", _case_legacy_temp, Kind.TEMP),
    ("lease", _case_lease, Kind.LEASE),
    ("symlink at block path", _case_symlink_block, Kind.BAD_SYMLINK),
    ("symlinked leaf folder", _case_symlink_folder, Kind.BAD_SYMLINK),
    ("directory at block path", _case_dir_at_block, Kind.BAD_DIR),
    ("FIFO at block path", _case_fifo_at_block, Kind.BAD_SPECIAL),
    ("short file", _sized(BB - 1), Kind.BAD_SIZE),
    ("long file", _sized(BB + 1), Kind.BAD_SIZE),
    ("empty file", _sized(0), Kind.BAD_SIZE),
    ("foreign file in a leaf", _case_foreign_in_leaf, Kind.FOREIGN),
    ("foreign file at the root", _case_foreign_at_root, Kind.FOREIGN),
    ("block name in the wrong folder", _case_wrong_folder, Kind.FOREIGN),
    ("file where a layout folder belongs", _case_file_at_folder, Kind.BAD_NOT_DIR),
    ("config.json", _case_config, Kind.CONFIG),
]


@pytest.mark.parametrize("make, kind", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_classification_table(tmp_path, make, kind):
    root, outside = str(tmp_path / "root"), str(tmp_path / "outside")
    os.makedirs(outside)
    mapper = make_cache(root, block_bytes=BB)
    path = make(mapper, outside)
    try:
        entries = {e.path: e for e in Walker(root).walk_all()}
        st = os.lstat(path)
    finally:
        held = getattr(_case_lease, "held", None)
        if held is not None:
            held.release()
            _case_lease.held = None
    assert path in entries, f"{path} not reported; got {sorted(entries)}"
    entry = entries[path]
    assert entry.kind is kind
    assert (entry.size, entry.ino, entry.atime_ns, entry.mtime_ns) == \
        (st.st_size, st.st_ino, st.st_atime_ns, st.st_mtime_ns)
    assert entry.folder in (os.path.basename(mapper.blocks_dir), "",
                            os.path.basename(mapper.base_path), ".mptier")
    # Nothing outside the root is ever reported, and nothing inside a bad entry.
    assert all(p.startswith(root + "/") for p in entries)
    assert not any(p.startswith(path + "/") for p in entries)
    if kind is Kind.TEMP:
        assert entry.tag == (TAG if ".0123456789abcdef." in path else None)
    # Exactly the entries made: config.json, mptier.json, and the case's own (with the
    # empty block sub-folder a case may leave beside it).
    others = {p: e.kind for p, e in entries.items() if p != path}
    assert set(others.values()) <= {Kind.CONFIG, Kind.EMPTY_FOLDER}, others


def test_block_size_unknown_counts_any_nonempty_file(tmp_path):
    root = str(tmp_path)
    mapper = make_cache(root, record_size=False)
    write_block(mapper, key_for(1), size=100)
    write_block(mapper, key_for(2), size=0)
    kinds = sorted(e.kind.value for e in Walker(root).walk_all() if e.path.endswith(".bin"))
    assert kinds == ["bad_size", "block"]
    # A default size for folders without mptier.json makes the 100-byte file short.
    walker = Walker(root, default_block_bytes=BB)
    assert sorted(e.kind.value for e in walker.walk_all() if e.path.endswith(".bin")) \
        == ["bad_size", "bad_size"]


def _tree(root, n=300):
    mapper = make_cache(root, block_bytes=BB)
    other = make_cache(root, model="other", block_bytes=BB, rank=1)
    for i in range(n):
        write_block(mapper if i % 3 else other, key_for(i, group=i % 2))
    _write(temp_name(mapper.path_for(key_for(1, group=1)), TAG, 1), 10)
    os.makedirs(f"{root}/foreign/deep")
    _write(f"{root}/foreign/deep/x.bin", BB)
    return mapper


@pytest.mark.parametrize("budget", [1, 3, 17, 1000])
def test_incremental_steps_equal_a_full_walk(tmp_path, budget):
    root = str(tmp_path)
    _tree(root)
    full = list(Walker(root).walk_all())
    walker = Walker(root)
    stepped = []
    calls = 0
    while not walker.done:
        before = walker.entries
        stepped.extend(walker.step(budget))
        assert walker.entries - before <= budget
        calls += 1
    assert stepped == full
    assert sum(e.kind is Kind.BLOCK for e in full) == 300
    assert walker.step(budget) == []
    if budget == 1:
        assert calls >= len(full)


def test_walk_position_tells_what_it_will_still_reach(tmp_path):
    root = str(tmp_path)
    mapper = _tree(root, n=50)
    blocks = sorted(e.path for e in Walker(root).walk_all() if e.kind is Kind.BLOCK)
    walker = Walker(root)
    assert walker.will_visit(blocks[0])          # not started: everything is ahead
    got = []
    while len(got) < 20:
        got.extend(e.path for e in walker.step(1) if e.kind is Kind.BLOCK)
    for path in blocks:   # an existing file is ahead exactly when the walk has not had it
        assert walker.will_visit(path) == (path not in got), path
    # New names: in a folder behind the walk, in the folder it is in (behind or ahead of
    # its place: listings are taken whole, so both are missed), and in a new folder.
    top, leaf = got[-1].split("/")[-3:-1]
    assert not walker.will_visit(f"{mapper.blocks_dir}/{top}/{leaf}/{'f' * 64}.bin")
    assert not walker.will_visit(f"{mapper.blocks_dir}/{top}/{leaf}/{'0' * 64}.bin")
    assert not walker.will_visit(f"{mapper.blocks_dir}/fff/ff_g9/{'f' * 64}.bin")
    assert not walker.will_visit(f"{mapper.blocks_dir}/000/00_g9/{'0' * 64}.bin")
    # A new name in a folder not listed yet is reached: the walk lists it later.
    last = blocks[-1]
    assert os.path.dirname(last) != os.path.dirname(got[-1])
    sibling = f"{os.path.dirname(last)}/{os.path.basename(last)[:5]}{'0' * 59}.bin"
    assert walker.will_visit(sibling)
    while not walker.done:
        walker.step(100)
    assert not walker.will_visit(blocks[-1])
    with pytest.raises(ValueError, match="not under the walked root"):
        walker.will_visit("/elsewhere/x.bin")


def _outcome(fn, *args):
    try:
        return fn(*args)
    except ValueError as exc:  # relpath's for an empty path: relative_to raises it too
        return repr(exc)


@pytest.mark.parametrize("root", ["/var/tmp/kv", "/", "/a", "relative/root"])
def test_relative_to_is_relpath_for_every_form_of_path(root):
    """relative_to cuts a path the tier made by string (the caretaker's accounting of
    every stored block) and must answer what os.path.relpath does for any path: doubled
    or trailing slashes, "." and ".." components, hidden names, the root itself,
    absolute paths elsewhere."""
    tails = ["m_r0/abc/de_g0/x.bin", "m//x", "m/./x", "m/../x", "../x", "m/", "", "m",
             ".mptier/walk", "m/.hidden/x", "/abs", "//abs", "m/x.", "x/..", "."]
    checked = 0
    for tail in tails:
        for path in (f"{root}/{tail}", f"{root}{tail}", tail, f"/{tail}"):
            if os.path.isabs(path) != os.path.isabs(root):
                continue  # relpath mixes in the working folder there; the tier never does
            assert _outcome(relative_to, os.path.normpath(root), path) == \
                _outcome(os.path.relpath, path, root), path
            checked += 1
    assert checked > 20


def test_walk_survives_the_tree_vanishing_between_steps(tmp_path):
    root = str(tmp_path)
    mapper = _tree(root)
    walker = Walker(root)
    first = []
    while len(first) < 40:
        first.extend(walker.step(1))
    shutil.rmtree(mapper.blocks_dir)   # listed folders and entries ahead are gone
    rest = list(walker.walk_all())
    assert walker.done and walker.vanished >= 1 and walker.errors == 0
    assert all(not e.path.startswith(mapper.blocks_dir + "/") or e in first
               for e in first + rest)


DELETER = textwrap.dedent("""
    import os, random, sys
    root = sys.argv[1]
    paths = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    random.seed(1)
    random.shuffle(paths)
    print("ready", flush=True)
    sys.stdin.readline()
    for p in paths:
        try:
            os.unlink(p)
            os.rmdir(os.path.dirname(p))               # its folders too, when empty
            os.rmdir(os.path.dirname(os.path.dirname(p)))
        except OSError:
            pass
""")


def test_walk_survives_concurrent_deletion_by_another_process(tmp_path):
    root = str(tmp_path / "root")
    for _attempt in range(5):  # a race: repeat until the deleter overlapped the walk
        _tree(root, n=600)
        proc = subprocess.Popen([sys.executable, "-c", DELETER, root], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        walker = Walker(root)
        entries = walker.step(1)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        while not walker.done:
            entries.extend(walker.step(5))
            time.sleep(0.0002)   # let the deleter run between slices
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
        assert all(e.kind in (Kind.BLOCK, Kind.TEMP, Kind.CONFIG, Kind.FOREIGN,
                              Kind.EMPTY_FOLDER)  # a folder the deleter emptied
                   for e in entries)
        if walker.vanished:
            break
        shutil.rmtree(root)
    assert walker.vanished > 0 and walker.errors == 0


def test_missing_root_is_an_error_until_it_appears(tmp_path):
    root = tmp_path / "later"
    walker = Walker(str(root))
    for _ in range(2):
        with pytest.raises(FileNotFoundError):
            walker.step(10)
        assert not walker.done
    tracker = UsageTracker(str(root))
    with pytest.raises(FileNotFoundError):
        tracker.step(10)
    assert not tracker.complete and tracker.passes == 0   # never an empty "full" pass
    make_cache(str(root))
    while not walker.done:
        walker.step(10)
    assert walker.entries > 0
    with pytest.raises(ValueError, match="budget"):
        Walker(str(tmp_path)).step(0)

"""Tests of mptier.workers.evictor: a caretaker's unlink threads and the one call a block
they evict with (``backend_evict``: ``Backend.evict_block``, C or its twin). Each case
runs on both backends against ``evict_told``, the Python it stands in for, on real
files and folders of the layout.
"""

from __future__ import annotations

import errno
import os
import time

import pytest
from native_support import backend_fixture  # noqa: F401  (fixture)
from storage_tree import change_block, key_for, make_cache, write_block

from mptier.native import _native, _pure
from mptier.storage import Kind, Walker
from mptier.storage.maintain import UNSEEN_INO, evict_told
from mptier.workers.evictor import Evictor, backend_evict

BB = 4096
T0 = 1_700_000_000 * 10**9


def _tree(root, n: int = 1):
    """n blocks of the layout under ``root`` (atime T0) and their walked entries, in the
    order of the keys."""
    mapper = make_cache(str(root), block_bytes=BB)
    paths = [write_block(mapper, key_for(i), atime_ns=T0) for i in range(n)]
    walked = {e.path: e for e in Walker(str(root)).walk_all() if e.kind is Kind.BLOCK}
    return mapper, paths, [walked[p] for p in paths]


def _told(entry, told_ns: int = T0):
    """``entry`` as a worker tells it: never looked at, made at ``told_ns``."""
    return entry._replace(ino=UNSEEN_INO, atime_ns=told_ns)


CHANGES = ["unchanged", "used since", "atime older (clock skew)", "replaced by a new file",
           "another size", "a folder now", "a symlink now", "gone"]


@pytest.mark.parametrize("told", [False, True], ids=["walked", "told"])
@pytest.mark.parametrize("change", CHANGES)
def test_the_one_call_decides_as_evict_told_does(tmp_path, backend, change, told):
    """Two copies of one tree, one evicted by evict_told and one by the backend's call:
    the same answer and the same files and folders left, whatever changed since."""
    answers, left = [], []
    for way in ("python", "backend"):
        root = tmp_path / way
        _, (path,), (entry,) = _tree(root)
        change_block(path, change, root, T0)
        if told:
            entry = _told(entry)
        evict = evict_told if way == "python" else backend_evict(backend)
        answers.append(evict(entry))
        left.append(sorted(os.path.relpath(os.path.join(d, n), root)
                           for d, dirs, files in os.walk(root) for n in dirs + files))
    assert answers[0] == answers[1]
    assert left[0] == left[1]
    # what each case must be, not only alike: kept unless unchanged; a told block has
    # no inode to compare, only its atime (its store set it at most when it was told)
    removed = change == "unchanged" or (
        told and change in ("atime older (clock skew)", "replaced by a new file"))
    assert answers[1] is removed


def test_an_evicted_block_takes_the_folders_it_emptied_and_no_more(tmp_path, backend):
    """The leaf folder and the <h3> folder above it go when the block was their last;
    a leaf folder with another file stays, and so does the block folder."""
    mapper, paths, entries = _tree(tmp_path, 2)
    assert len({os.path.dirname(os.path.dirname(p)) for p in paths}) == 2
    evict = backend_evict(backend)
    leaf = os.path.dirname(paths[0])
    with open(os.path.join(leaf, "beside.bin"), "wb") as f:
        f.write(b"x")
    assert evict(entries[0]) is True
    assert not os.path.exists(paths[0]) and os.path.isdir(leaf)
    assert evict(entries[1]) is True
    assert not os.path.exists(os.path.dirname(paths[1]))
    assert not os.path.exists(os.path.dirname(os.path.dirname(paths[1])))
    assert os.path.isdir(mapper.blocks_dir)
    assert evict(entries[1]) is False  # gone: kept, nothing raised


def test_a_failing_look_raises_for_a_walked_block_and_keeps_a_told_one(tmp_path, backend):
    """ENOTDIR (a file where a folder of the path should be): a walked block's lstat
    error is the root failing (OSError, as evict_told raises); a told block is only a
    guess at a file, so it is kept (False)."""
    _, (path,), (entry,) = _tree(tmp_path)
    leaf = os.path.dirname(path)
    os.unlink(path)
    os.rmdir(leaf)
    with open(leaf, "wb") as f:
        f.write(b"a file where the leaf folder was")
    evict = backend_evict(backend)
    with pytest.raises(NotADirectoryError):
        evict_told(entry)
    with pytest.raises(OSError) as caught:
        evict(entry)
    assert caught.value.errno == errno.ENOTDIR
    assert caught.value.filename == entry.path
    assert evict(_told(entry)) is False and evict_told(_told(entry)) is False


def test_each_backend_reaches_its_own_evict_block(backend, monkeypatch, tmp_path):
    """The backend switch reaches the call: the native backend's is the C function
    (cffi), the python backend's the twin -- each seen called through backend_evict."""
    impl = _native if backend.name == "native" else _pure
    assert backend._impl is impl
    if backend.name == "native":
        assert type(_native.evict_block).__module__ != _pure.__name__
        assert not hasattr(_native.evict_block, "__code__"), "a C function, not Python"
    calls = []
    real = impl.evict_block
    monkeypatch.setattr(impl, "evict_block", lambda *a: calls.append(a) or real(*a))
    _, (path,), (entry,) = _tree(tmp_path)
    assert backend_evict(backend)(entry) is True
    assert calls == [(os.fsencode(path), BB, entry.ino, T0, 0)]


def test_the_threads_remove_what_they_are_handed_and_count_the_bytes(tmp_path, backend):
    """An Evictor with the backend's call: every handed block removed by its threads,
    each reported done, and the bytes told to ``freed`` as they go."""
    _, paths, entries = _tree(tmp_path, 24)
    told = []
    evictor = Evictor(str(tmp_path), 4, told.append, backend_evict(backend))
    try:
        for entry in entries[:12]:
            evictor.put(entry)
        for entry in entries[12:]:
            evictor.put(_told(entry, T0 + 5))
        deadline = time.monotonic() + 10
        while len(evictor.done) < 24 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        evictor.stop(2.0)
    assert sorted(e.path for e, removed in evictor.done if removed) == sorted(paths)
    assert not any(os.path.exists(p) for p in paths)
    assert evictor.freed_total == 24 * BB and max(told) == 24 * BB
    assert evictor.failures == 0


def test_the_threads_leave_their_workers_batch_policy_for_prompt_wakeups(tmp_path):
    """A worker runs under SCHED_BATCH (its threads inherit it); its unlink threads go
    back to SCHED_OTHER, so one woken by its returning unlink may preempt a busy
    worker instead of waiting out its slice (evict_gil.py --policy), at the nice they
    inherited."""
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    try:
        evictor = Evictor(str(tmp_path), 2)
        try:
            deadline = time.monotonic() + 5
            ids = [t.native_id for t in evictor._threads]
            while time.monotonic() < deadline and any(
                    os.sched_getscheduler(tid) != os.SCHED_OTHER for tid in ids):
                time.sleep(0.01)
            assert [os.sched_getscheduler(tid) for tid in ids] == [os.SCHED_OTHER] * 2
            assert os.sched_getscheduler(0) == os.SCHED_BATCH  # the worker's thread kept it
        finally:
            evictor.stop(2.0)
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))

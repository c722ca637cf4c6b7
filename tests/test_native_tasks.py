"""Tests of mptier.native.tasks, a backend's calls on task records: the take of a record
from a worker's queues, a record's keys as the layout's paths, the load of a whole task
from its record. Each runs on both backends, against the Python it stands in for
(``jobs.decode_task``, ``FileMapper.relative_path_for``, the serving loop's former
readv + FIONREAD take, ``Backend.load`` of lists) and, for loads, on real files.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random

import numpy as np
import pytest
from native_support import (  # noqa: F401  (fixtures)
    BLOCK,
    aligned,
    backend_fixture,
    no_fault_fixture,
)

from mptier import jobs, make_key, native
from mptier.jobs import (
    TASK_HEADER_BYTES,
    TASK_RECORD_BYTES,
    TaskKind,
    check_task,
    decode_task,
    encode_task,
)
from mptier.keys import MAX_KEY_BYTES
from mptier.layout import FileMapper
from mptier.workers.bounce import Bounce

MAPPER = FileMapper("/unused", "model")


def test_the_pure_twin_repeats_the_wire_formats_constants():
    """_pure_task repeats mptier.jobs' constants (jobs imports the native package): a
    wire change must reach both, or the pure backend refuses every record."""
    from mptier.native import _pure_task

    assert (
        jobs.WIRE_VERSION, jobs.TASK_RECORD_BYTES, jobs.TASK_HEADER_BYTES,
        int(TaskKind.LOOKUP)) == (_pure_task.WIRE_VERSION, _pure_task.TASK_RECORD_BYTES,
            _pure_task.TASK_HEADER_BYTES, _pure_task.KIND_LOOKUP)
    assert tuple(sorted(int(k) for k in TaskKind)) == _pure_task._KINDS


def relative(key: bytes) -> bytes:
    return MAPPER.relative_path_for(key).encode()


def odd_keys(rng: random.Random) -> list[bytes]:
    """Keys of every length a record may carry, the engine's checks aside: empty, up to
    the group index's 4 bytes (no hash), short hashes (folder names cut short), vLLM's
    36 bytes, the longest accepted, group indices up to 2**32 - 1."""
    keys = [b"", b"\x01", b"ab\xff", b"\x00\x00\x00\x07", make_key(b"\x9a", 3),
            make_key(b"\x12\x34", 65536), make_key(bytes(2), 0xFFFFFFFF)]
    keys += [make_key(rng.randbytes(32), rng.randrange(1 << 32)) for _ in range(8)]
    keys.append(make_key(rng.randbytes(MAX_KEY_BYTES - 4), 1))
    return keys


@pytest.mark.parametrize("kind", [TaskKind.LOAD, TaskKind.STORE, TaskKind.LOOKUP])
def test_task_items_are_the_layouts_paths_and_the_slots_offsets(backend, kind):
    rng = random.Random(int(kind))
    keys = odd_keys(rng)
    ids = [rng.randrange(1 << 20) for _ in keys]
    ids[1] = (1 << 64) - 1  # past any buffer: the offset overflows
    record = encode_task(kind, 9, keys, ids if kind != TaskKind.LOOKUP else ())
    paths, offsets = backend.task_items(memoryview(bytearray(record)), BLOCK)
    task = decode_task(record)
    assert paths == [relative(key) for key in task.keys]
    if kind == TaskKind.LOOKUP:
        assert offsets == []
    else:  # an overflow is an offset outside any buffer, as _native._offsets makes it
        assert offsets == [min(b * BLOCK, (1 << 64) - 1) for b in task.block_ids]


def test_task_items_of_a_full_record(backend):
    """The most items and the most path bytes a record can hold fit the native buffers."""
    for kind, key_len in ((TaskKind.LOAD, 0), (TaskKind.LOAD, 1), (TaskKind.LOAD, 200),
                          (TaskKind.LOOKUP, 0), (TaskKind.LOOKUP, 5)):
        per = (TASK_RECORD_BYTES - TASK_HEADER_BYTES) // (
            key_len + (2 if kind == TaskKind.LOOKUP else 10))
        keys = [bytes([i % 256]) * key_len for i in range(per)]
        record = encode_task(kind, 1, keys, range(per) if kind != TaskKind.LOOKUP else ())
        paths, _ = backend.task_items(record, BLOCK)
        assert paths == [relative(key) for key in keys], (kind, key_len)


def malformed_records() -> list[bytes]:
    good = bytearray(encode_task(TaskKind.LOAD, 3, [make_key(bytes(32))] * 4, range(4)))
    wrong_magic = bytearray(good)
    wrong_magic[0:3] = b"XYZ"
    wrong_version = bytearray(good)
    wrong_version[3] = 99
    wrong_kind = bytearray(good)
    wrong_kind[4] = 7
    too_many = bytearray(good)
    too_many[8:12] = (410).to_bytes(4, "little")  # 410 x 10 bytes: past the record
    keys_past = bytearray(good)
    at = TASK_HEADER_BYTES + 8 * 4
    keys_past[at:at + 2] = (4000).to_bytes(2, "little")  # the keys end past the record
    return [bytes(r) for r in (wrong_magic, wrong_version, wrong_kind, too_many, keys_past)]


@pytest.mark.parametrize("record", malformed_records())
def test_a_malformed_record_is_refused_by_every_decoder(backend, record):
    with pytest.raises(ValueError) as decoded:
        decode_task(record)
    with pytest.raises(ValueError) as checked:
        check_task(record)
    assert str(checked.value) == str(decoded.value)
    with pytest.raises(ValueError):
        backend.task_items(record, BLOCK)
    buf = aligned(4 * BLOCK)
    assert backend.load_task(-1, record, buf, BLOCK, 0) == (-errno.EINVAL, 0, 0)


def test_check_task_answers_as_decode_task():
    rng = random.Random(5)
    for kind in TaskKind:
        keys = odd_keys(rng)
        ids = range(len(keys)) if kind != TaskKind.LOOKUP else ()
        record = encode_task(kind, 77, keys, ids)
        task = decode_task(record)
        assert check_task(record) == (task.kind, 77, len(keys)) == (kind, 77, len(keys))


# -- load_task on real files -------------------------------------------------------------

N = 12


@pytest.fixture
def stored(tmp_path):
    """N blocks stored under tmp_path at the layout's paths of N keys; the source."""
    keys = [make_key(os.urandom(32), i % 3) for i in range(N)]
    source = aligned(N * BLOCK, seed=11)
    native.get_backend("python").batch_store(
        tmp_path, [relative(k) for k in keys], source, [i * BLOCK for i in range(N)], BLOCK)
    return tmp_path, keys, source


def load_record(keys, slots) -> memoryview:
    return memoryview(bytearray(encode_task(TaskKind.LOAD, 1, keys, slots)))


@pytest.mark.parametrize("bounced", [False, True])
def test_load_task_loads_as_load_of_the_lists_does(backend, stored, bounced):
    root, keys, source = stored
    flags = native.CHECKSUM | native.TOUCH
    slots = list(range(2 * N - 1, N - 1, -1))
    fd = native.open_root(root)
    bounce = Bounce(BLOCK, nbytes=4 * BLOCK) if bounced else None
    try:
        buf = aligned(2 * N * BLOCK)
        via = None
        if bounce is not None:
            bounce.map()
            via = bounce._view
        assert backend.load_task(fd, load_record(keys, slots), buf, BLOCK, flags,
                                 via) == (0, N, N)
        for i, slot in enumerate(slots):
            assert np.array_equal(buf[slot * BLOCK:(slot + 1) * BLOCK],
                                  source[i * BLOCK:(i + 1) * BLOCK])
        # A missing block stops the batch where the lists' load stops.
        missing = [*keys[:5], make_key(os.urandom(32)), *keys[5:]]
        record = load_record(missing, range(N + 1))
        paths, offs = backend.task_items(record, BLOCK)
        want = backend.load(fd, paths, aligned((N + 1) * BLOCK), offs, BLOCK, flags)
        assert want == (-errno.ENOENT, 5, 5)
        assert backend.load_task(fd, record, aligned((N + 1) * BLOCK), BLOCK, flags,
                                 via) == want
        # A slot past the buffer fails that block with EINVAL, nothing after it.
        assert backend.load_task(fd, load_record(keys[:3], [0, 1, 10 ** 9]),
                                 aligned(4 * BLOCK), BLOCK, flags, via) == (-errno.EINVAL,
                                                                            2, 2)
    finally:
        os.close(fd)
        if bounce is not None:
            bounce.close()


def test_an_injected_load_fault_applies_to_load_task(backend, stored):
    root, keys, _ = stored
    fd = native.open_root(root)
    try:
        native.set_fault("load:3:5")
        assert backend.load_task(fd, load_record(keys, range(N)), aligned(N * BLOCK),
                                 BLOCK, 0) == (-5, 3, 3)
        native.set_fault("load:30:5")  # past the batch: no effect
        assert backend.load_task(fd, load_record(keys, range(N)), aligned(N * BLOCK),
                                 BLOCK, 0) == (0, N, N)
    finally:
        os.close(fd)


# -- record_taker ----------------------------------------------------------------------------


@pytest.fixture
def queues():
    pipes = [os.pipe() for _ in range(3)]
    for r, _ in pipes:
        os.set_blocking(r, False)
    yield pipes
    for r, w in pipes:
        os.close(r)
        os.close(w)


def put(pipe, task_id: int) -> None:
    os.write(pipe[1], encode_task(TaskKind.LOAD, task_id, [make_key(bytes(32))], [0]))


def test_the_take_reads_the_first_queue_holding_a_record(backend, queues):
    record = memoryview(bytearray(TASK_RECORD_BYTES))
    take = backend.record_taker(tuple(r for r, _ in queues), record)
    assert take() == (-1, False)
    put(queues[2], 1)
    put(queues[1], 2)
    assert take() == (1, True)  # queue 2 still holds one: ring the doorbell
    assert check_task(record)[1] == 2
    assert take() == (2, False)
    assert check_task(record)[1] == 1
    assert take() == (-1, False)
    put(queues[0], 3)
    put(queues[0], 4)
    assert take() == (0, True)
    assert take() == (0, False)
    assert check_task(record)[1] == 4


def test_a_short_record_is_never_run(backend, queues):
    """A write of less than a record (never made by an engine of ours) is read, its
    header zeroed, and the take goes on to the next queue."""
    record = memoryview(bytearray(TASK_RECORD_BYTES))
    take = backend.record_taker(tuple(r for r, _ in queues), record)
    os.write(queues[0][1], encode_task(TaskKind.LOAD, 5, [b"k" * 8], [0])[:100])
    put(queues[2], 6)
    assert take() == (2, False)
    assert check_task(record)[1] == 6
    os.write(queues[1][1], encode_task(TaskKind.LOAD, 7, [b"k" * 8], [0])[:100])
    assert take() == (-1, False)
    assert bytes(record[:TASK_HEADER_BYTES]) == bytes(TASK_HEADER_BYTES)


def test_a_failing_read_raises(backend, queues):
    record = memoryview(bytearray(TASK_RECORD_BYTES))
    take = backend.record_taker((queues[0][1],), record)  # a write end: EBADF on read
    with pytest.raises(OSError) as raised:
        take()
    assert raised.value.errno == errno.EBADF
    assert fcntl.fcntl(queues[0][1], fcntl.F_GETFD) >= 0  # nothing closed


# -- same_folder ------------------------------------------------------------------------------


def test_same_folder_answers_as_root_identity(backend, tmp_path):
    from mptier.storage.roots import root_identity

    folder = tmp_path / "root"
    folder.mkdir()
    path = os.fsencode(folder)
    identity = root_identity(str(folder))
    assert backend.same_folder(path, identity) == 1
    assert backend.same_folder(path, (identity[0], identity[1] + 1)) == 0
    folder.rename(tmp_path / "away")
    folder.mkdir()  # another folder where the root was: followed by path
    assert backend.same_folder(path, identity) == 0
    assert backend.same_folder(path, root_identity(str(folder))) == 1
    folder.rmdir()
    assert backend.same_folder(path, identity) == -errno.ENOENT
    folder.write_bytes(b"")  # a file where the folder was, its own identity or not
    st = os.stat(folder)
    assert backend.same_folder(path, (st.st_dev, st.st_ino)) == 0

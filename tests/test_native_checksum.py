"""vLLM's checksum record in batch store and load, on every backend and resolution path.

The record: xattr ``user.vllm.kv_crc32c`` = CRC32C of the block, 4 bytes big-endian, set
on the temporary file before it is published. On load: no record loads; a record that
is not 4 bytes or does not match fails the block with EBADMSG and removes the file.
Expected CRCs come from a bit-by-bit reference, not from the code under test.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
from native_support import (  # noqa: F401  (fixtures)
    BLOCK,
    aligned,
    assert_not_loaded_after,
    block_paths,
    crc32c_reference,
    io_fixture,
    make_io,
    no_fault_fixture,
    offsets,
    run_python,
    run_with_shim,
    shim_fixture,
    temp_files,
    write_file,
)

from mptier import native
from mptier.errors import BatchIOError

NAME = "user.vllm.kv_crc32c"
# Past the C core's 256 KiB checksum chunk and not a multiple of it: the chunked CRC of
# buffered I/O runs over several chunks and a short last one.
MULTI_CHUNK = 2 * 256 * 1024 + 3 * 4096


def record(data) -> bytes:
    """The expected record. Past 64 KiB the bitwise reference is too slow; there the
    numpy twin serves (test_crc32c.py holds it to the reference), never the C core."""
    data = bytes(data)
    crc = (crc32c_reference(data) if len(data) <= 65536
           else native.get_backend("python").crc32c(data))
    return crc.to_bytes(4, "big")


def blocks_of(buf, n, block_bytes=BLOCK):
    return [bytes(buf[i * block_bytes : (i + 1) * block_bytes]) for i in range(n)]


@pytest.mark.parametrize("tmpfile", [False, True], ids=["named", "tmpfile"])
@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "direct"])
def test_record_name_and_bytes_after_store(io, tmp_path, tmpfile, o_direct):
    buf = aligned(3 * BLOCK, seed=1)
    paths = block_paths(3)
    io.batch_store(tmp_path, paths, buf, offsets(range(3)), BLOCK, checksum=True,
                   tmpfile=tmpfile, o_direct=o_direct)
    for path, block in zip(paths, blocks_of(buf, 3)):
        assert os.listxattr(tmp_path / path) == [NAME]
        assert os.getxattr(tmp_path / path, NAME) == record(block)
    plain = block_paths(1, "plain")
    io.batch_store(tmp_path, plain, buf, [0], BLOCK, tmpfile=tmpfile, o_direct=o_direct)
    assert os.listxattr(tmp_path / plain[0]) == []  # checksums off: no record written


def test_record_of_a_multi_chunk_block(io, tmp_path):
    buf = aligned(2 * MULTI_CHUNK, seed=2)
    paths = block_paths(1)
    io.batch_store(tmp_path, paths, buf, [0], MULTI_CHUNK, checksum=True, o_direct=False)
    want = crc32c_reference(bytes(buf[:MULTI_CHUNK])).to_bytes(4, "big")
    assert os.getxattr(tmp_path / paths[0], NAME) == want
    io.batch_load(tmp_path, paths, buf, [MULTI_CHUNK], MULTI_CHUNK, checksum=True,
                  o_direct=False)
    assert bytes(buf[MULTI_CHUNK:]) == bytes(buf[:MULTI_CHUNK])


@pytest.mark.parametrize("tmpfile", [False, True], ids=["named", "tmpfile"])
def test_record_is_on_the_file_when_it_is_published(io, tmp_path, shim, tmpfile):
    """The shim reads the attribute inside renameat / linkat, before the real call."""
    root = tmp_path / "root"
    root.mkdir()
    paths = block_paths(4)
    code = """
        import json, sys
        from native_support import IO, aligned
        io, root, paths = IO(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
        buf = aligned(4 * 8192, seed=5)
        io.batch_store(root, paths, buf, [i * 8192 for i in range(4)], 8192,
                       checksum=True, tmpfile=sys.argv[4] == "1")
        with open(sys.argv[5], "wb") as out:
            out.write(bytes(buf[: 4 * 8192]))
    """
    # The blocks come back in a file: 64 KiB of them as text on the child's standard
    # output once arrived cut at the pipe's 65,536 bytes (one fresh-clone run; not
    # reproduced), which is no part of what this test checks.
    stored = tmp_path / "blocks.bin"
    _, _, lines = run_with_shim(shim, "publish", tmp_path / "shim.log", code, io.variant,
                                str(root), json.dumps(paths), str(int(tmpfile)), str(stored))
    data = stored.read_bytes()
    assert len(data) == 4 * 8192
    blocks = [data[i * 8192 : (i + 1) * 8192] for i in range(4)]
    want_records = [record(b).hex() for b in blocks]
    if tmpfile:
        assert lines == [f"link {r}" for r in want_records]
    else:
        assert [line.split()[0] for line in lines] == ["rename"] * 4
        assert [line.split()[2] for line in lines] == want_records
        for line, path in zip(lines, paths):
            assert line.split()[1].startswith(f"{root}/{path}.")
    for path, rec in zip(paths, want_records):
        assert os.getxattr(root / path, NAME).hex() == rec


def _corrupt(path, how: str) -> None:
    if how == "flipped byte":
        with open(path, "r+b") as f:
            f.seek(BLOCK - 1)
            last = f.read(1)
            f.seek(BLOCK - 1)
            f.write(bytes([last[0] ^ 0x01]))
    elif how == "flipped byte, multi-chunk":
        with open(path, "r+b") as f:
            f.seek(MULTI_CHUNK - 5)
            f.write(b"\xff\xfe\xfd")
    elif how == "3-byte record":
        os.setxattr(path, NAME, os.getxattr(path, NAME)[:3])
    elif how == "5-byte record":
        os.setxattr(path, NAME, os.getxattr(path, NAME) + b"\0")
    elif how == "64-byte record":
        os.setxattr(path, NAME, os.getxattr(path, NAME) * 16)
    elif how == "empty record":
        os.setxattr(path, NAME, b"")
    elif how == "wrong value":
        value = os.getxattr(path, NAME)
        os.setxattr(path, NAME, bytes([value[0] ^ 0x80]) + value[1:])
    elif how == "little-endian record":
        os.setxattr(path, NAME, os.getxattr(path, NAME)[::-1])


@pytest.mark.parametrize("how", ["flipped byte", "3-byte record", "5-byte record",
                                 "64-byte record", "empty record", "wrong value",
                                 "little-endian record", "flipped byte, multi-chunk"])
@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "direct"])
def test_corrupt_block_fails_with_ebadmsg_and_heals(io, tmp_path, how, o_direct):
    size = MULTI_CHUNK if "multi-chunk" in how else BLOCK
    n = 4
    buf = aligned(2 * n * size, seed=3)
    paths = block_paths(n)
    io.batch_store(tmp_path, paths, buf, offsets(range(n), size), size, checksum=True)
    _corrupt(tmp_path / paths[2], how)
    buf[n * size :] = 0x5A
    with pytest.raises(BatchIOError) as info:
        io.batch_load(tmp_path, paths, buf, offsets(range(n, 2 * n), size), size,
                      checksum=True, o_direct=o_direct)
    e = info.value
    assert (e.errno, e.index, e.n_done, e.filename) == (
        errno.EBADMSG, 2, 2, str(tmp_path / paths[2]))
    assert "checksum mismatch" in e.strerror and "removed" in e.strerror
    assert bytes(buf[n * size : (n + 2) * size]) == bytes(buf[: 2 * size])  # kept
    stored = [bytes(buf[k * size:(k + 1) * size]) for k in range(n)]
    assert_not_loaded_after(io, buf, 3, range(n, 2 * n), 0x5A, stored, size)
    assert not (tmp_path / paths[2]).exists()
    assert all((tmp_path / p).exists() for p in (paths[0], paths[1], paths[3]))
    assert io.batch_lookup(tmp_path, paths, size)[2] == native.LOOKUP_ABSENT
    # the next store of the key rewrites it, whole and with its record
    io.batch_store(tmp_path, paths, buf, offsets(range(n), size), size, checksum=True)
    assert os.getxattr(tmp_path / paths[2], NAME) == record(buf[2 * size : 3 * size])
    io.batch_load(tmp_path, paths, buf, offsets(range(n, 2 * n), size), size,
                  checksum=True, o_direct=o_direct)
    assert bytes(buf[n * size :]) == bytes(buf[: n * size])
    assert temp_files(tmp_path) == []


def test_block_without_record_loads_with_checksums_on(io, tmp_path):
    buf = aligned(4 * BLOCK, seed=4)
    paths = block_paths(2)
    io.batch_store(tmp_path, paths[:1], buf, [0], BLOCK)  # checksums off
    write_file(tmp_path / paths[1], bytes(buf[BLOCK : 2 * BLOCK]))  # as vLLM 0.33 writes
    io.batch_load(tmp_path, paths, buf, offsets([2, 3]), BLOCK, checksum=True)
    assert bytes(buf[2 * BLOCK :]) == bytes(buf[: 2 * BLOCK])
    assert [os.listxattr(tmp_path / p) for p in paths] == [[], []]


def test_checksums_off_checks_nothing(io, tmp_path):
    buf = aligned(2 * BLOCK, seed=6)
    paths = block_paths(1)
    io.batch_store(tmp_path, paths, buf, [0], BLOCK, checksum=True)
    os.setxattr(tmp_path / paths[0], NAME, b"\0\0\0\0")
    io.batch_load(tmp_path, paths, buf, [BLOCK], BLOCK)  # vLLM's checksum_blocks=false
    assert bytes(buf[BLOCK:]) == bytes(buf[:BLOCK])
    assert (tmp_path / paths[0]).exists()


def test_root_without_user_xattrs(io, tmp_path):
    """ramfs has no extended attributes at all: mounted in a private mount namespace, so
    nothing outlives the child."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a ramfs privately")
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    code = """
        import errno, json, sys
        from native_support import IO, aligned
        from mptier.errors import BatchIOError
        io, root = IO(sys.argv[1]), sys.argv[2]
        buf = aligned(4 * 8192, seed=7)
        out = {"probe": io.probe_xattr(root)}
        try:
            io.batch_store(root, ["a/x.bin"], buf, [0], 8192, checksum=True)
            out["checked store"] = "ok"
        except BatchIOError as e:
            out["checked store"] = e.errno
        import os
        out["left"] = sorted(os.listdir(root)) + sorted(os.listdir(root + "/a"))
        io.batch_store(root, ["a/y.bin"], buf, [8192], 8192)
        io.batch_load(root, ["a/y.bin"], buf, [16384], 8192, checksum=True)
        out["load"] = buf[8192:16384].tobytes() == buf[16384:24576].tobytes()
        print(json.dumps(out))
    """
    proc = run_python(code, io.variant, str(mnt), prefix=[
        "unshare", "--mount", "--propagation", "private", "sh", "-c",
        'mount -t ramfs none "$0" && exec "$@"', str(mnt)], check=False)
    if proc.returncode != 0 and "mount" in proc.stderr and "Traceback" not in proc.stderr:
        pytest.skip(f"cannot mount a ramfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"probe": False, "checked store": errno.EOPNOTSUPP,
                                       "left": ["a"], "load": True}
    assert os.listdir(mnt) == []  # the mount was the child's alone


@pytest.fixture
def shm_root():
    """A folder on /dev/shm (tmpfs): there the C core checksums O_DIRECT I/O chunk by
    chunk, as a memory copy, instead of in one pass."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    import tempfile
    path = tempfile.mkdtemp(prefix="native-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path)


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "direct"])
def test_checksums_on_a_memory_file_system(io, shm_root, o_direct):
    n = 3
    buf = aligned(2 * n * MULTI_CHUNK, seed=11)
    paths = block_paths(n)
    io.batch_store(shm_root, paths, buf, offsets(range(n), MULTI_CHUNK), MULTI_CHUNK,
                   checksum=True, o_direct=o_direct)
    for i, p in enumerate(paths):
        assert os.getxattr(os.path.join(shm_root, p), NAME) == record(
            buf[i * MULTI_CHUNK : (i + 1) * MULTI_CHUNK])
    with open(os.path.join(shm_root, paths[1]), "r+b") as f:
        f.seek(MULTI_CHUNK - 1)
        f.write(b"\x00" if buf[2 * MULTI_CHUNK - 1] else b"\x01")
    with pytest.raises(BatchIOError) as info:
        io.batch_load(shm_root, paths, buf, offsets(range(n, 2 * n), MULTI_CHUNK),
                      MULTI_CHUNK, checksum=True, o_direct=o_direct)
    assert (info.value.errno, info.value.index) == (errno.EBADMSG, 1)
    assert bytes(buf[n * MULTI_CHUNK : (n + 1) * MULTI_CHUNK]) == bytes(buf[:MULTI_CHUNK])
    assert not os.path.exists(os.path.join(shm_root, paths[1]))


# More chunks than the C core keeps in flight at once (8 x 512 KiB) and a short last one:
# its O_DIRECT read checksums early chunks while later ones are still arriving.
DEEP_BLOCK = 9 * 512 * 1024 + 4096


def test_checksummed_direct_io_deeper_than_the_queue(io, tmp_path):
    if not io.probe_o_direct(tmp_path):
        pytest.skip(f"O_DIRECT does not work in {tmp_path}")
    buf = aligned(4 * DEEP_BLOCK, seed=13)
    paths = block_paths(2)
    io.batch_store(tmp_path, paths, buf, offsets(range(2), DEEP_BLOCK), DEEP_BLOCK,
                   checksum=True)
    for i, p in enumerate(paths):
        assert os.getxattr(tmp_path / p, NAME) == record(
            buf[i * DEEP_BLOCK : (i + 1) * DEEP_BLOCK])
    io.batch_load(tmp_path, paths, buf, offsets(range(2, 4), DEEP_BLOCK), DEEP_BLOCK,
                  checksum=True)
    assert bytes(buf[2 * DEEP_BLOCK :]) == bytes(buf[: 2 * DEEP_BLOCK])
    for where in (100, DEEP_BLOCK - 1):  # a flip in the first and in the last chunk
        with open(tmp_path / paths[0], "r+b") as f:
            f.seek(where)
            old = f.read(1)
            f.seek(where)
            f.write(bytes([old[0] ^ 0x10]))
        buf[2 * DEEP_BLOCK :] = 0
        with pytest.raises(BatchIOError) as info:
            io.batch_load(tmp_path, paths, buf, offsets(range(2, 4), DEEP_BLOCK), DEEP_BLOCK,
                          checksum=True)
        assert (info.value.errno, info.value.index) == (errno.EBADMSG, 0)
        assert not (tmp_path / paths[0]).exists()
        io.batch_store(tmp_path, paths, buf, offsets(range(2), DEEP_BLOCK), DEEP_BLOCK,
                       checksum=True)


def test_checksummed_direct_io_without_linux_aio(io, tmp_path, shim):
    """With io_setup refused, O_DIRECT checksums run one after the other, same results."""
    if io.uring:
        pytest.skip("the io_uring path does not use Linux AIO: its CRCs overlap the ring's "
                    "transfers of other blocks")
    if not io.probe_o_direct(tmp_path):
        pytest.skip(f"O_DIRECT does not work in {tmp_path}")
    root = tmp_path / "root"
    root.mkdir()
    paths = block_paths(2)
    code = """
        import json, os, sys
        from native_support import IO, aligned
        io, root, paths = IO(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
        size = int(sys.argv[4])
        buf = aligned(4 * size, seed=14)
        io.batch_store(root, paths, buf, [0, size], size, checksum=True)
        io.batch_load(root, paths, buf, [2 * size, 3 * size], size, checksum=True)
        print(json.dumps([buf[: 2 * size].tobytes() == buf[2 * size :].tobytes(),
                          [os.getxattr(os.path.join(root, p), "user.vllm.kv_crc32c").hex()
                           for p in paths]]))
    """
    proc, hits, _ = run_with_shim(shim, "noaio", tmp_path / "shim.log", code, io.variant,
                                  str(root), json.dumps(paths), str(DEEP_BLOCK))
    same, records = json.loads(proc.stdout)
    buf = aligned(4 * DEEP_BLOCK, seed=14)
    assert same and records == [record(buf[i * DEEP_BLOCK : (i + 1) * DEEP_BLOCK]).hex()
                                for i in range(2)]
    assert hits == (1 if io.name == "native" else 0)  # the C core asked for AIO once


def _crc_paths() -> list[str]:
    return list(native.get_backend("native").crc32c_impls) if native.HAS_NATIVE else []


@pytest.mark.parametrize("variant", ["native", "native-uring"])
@pytest.mark.parametrize("path", _crc_paths())
def test_records_under_each_forced_crc_path(tmp_path, path, variant):
    """MPTIER_CRC32C_PATH (read at import, as a worker would) makes the C core's stores
    and loads checksum with that path: the records are the reference's, and a flipped
    byte in the last 16 KiB folding chunk or in the tail is still caught."""
    make_io(variant)  # skips where io_uring is not usable
    root = tmp_path / "root"
    root.mkdir()
    code = """
        import json, os, sys
        from native_support import IO, aligned
        from mptier import native
        from mptier.errors import BatchIOError
        io, root, size = IO(sys.argv[1]), sys.argv[2], int(sys.argv[3])
        buf = aligned(4 * size, seed=21)
        paths = ["a/x.bin", "a/y.bin"]
        out = {"impl": native.get_backend("native").crc32c_impl(), "caught": []}
        for o_direct in (False, True):
            io.batch_store(root, paths, buf, [0, size], size, checksum=True, o_direct=o_direct)
            out["records"] = [os.getxattr(os.path.join(root, p), "user.vllm.kv_crc32c").hex()
                              for p in paths]
            io.batch_load(root, paths, buf, [2 * size, 3 * size], size, checksum=True,
                          o_direct=o_direct)
            out["same"] = buf[: 2 * size].tobytes() == buf[2 * size :].tobytes()
            for where in (size - 16384 - 1, size - 3):
                with open(os.path.join(root, paths[1]), "r+b") as f:
                    f.seek(where)
                    old = f.read(1)
                    f.seek(where)
                    f.write(bytes([old[0] ^ 0x04]))
                try:
                    io.batch_load(root, paths, buf, [2 * size, 3 * size], size,
                                  checksum=True, o_direct=o_direct)
                except BatchIOError as e:
                    out["caught"].append([e.errno, e.index])
                io.batch_store(root, paths, buf, [0, size], size, checksum=True)
            for p in paths:
                os.unlink(os.path.join(root, p))
        print(json.dumps(out))
    """
    proc = run_python(code, variant, str(root), str(MULTI_CHUNK),
                      env={native.CRC32C_PATH_ENV: path})
    out = json.loads(proc.stdout)
    buf = aligned(4 * MULTI_CHUNK, seed=21)
    assert out["impl"] == path
    assert out["records"] == [record(buf[i * MULTI_CHUNK : (i + 1) * MULTI_CHUNK]).hex()
                              for i in range(2)]
    assert out["same"]
    assert out["caught"] == [[errno.EBADMSG, 1]] * 4

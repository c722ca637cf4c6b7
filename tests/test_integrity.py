"""Never serve wrong bytes, through the whole tier: vLLM's CRC32C record per block, and
entries at block paths that are not block files (symlinks, directories, FIFOs, wrong
sizes). Real worker processes, real files, both I/O backends."""

from __future__ import annotations

import errno
import logging
import os
import stat

import numpy as np
import pytest
from conftest import fill_random, wait_for, wait_results

from mptier import ConfigError, LookupResult, TransferJob, make_key, native

KB = 1 << 10
BLOCK = 16 * KB
XATTR = "user.vllm.kv_crc32c"


def keys_for(n: int, tag: int = 0) -> list[bytes]:
    return [make_key(bytes([tag, i]) * 16) for i in range(n)]


def store(tier, job_id: int, keys: list[bytes], slots: list[int]):
    tier.submit_store(TransferJob(job_id, keys, slots))
    return wait_results(tier, [job_id])[job_id]


def load(tier, job_id: int, keys: list[bytes], slots: list[int]):
    tier.submit_load(TransferJob(job_id, keys, slots))
    return wait_results(tier, [job_id])[job_id]


def looked_up(tier, key: bytes, req: str) -> LookupResult:
    tier.lookup(key, req)
    tier.on_schedule_end()
    wait_for(lambda: tier.lookup(key, req) is not LookupResult.RETRY, what="a lookup")
    return tier.lookup(key, req)


# -- checksums ----------------------------------------------------------------------------

def test_store_records_vllms_checksum_and_load_verifies_it(make_buffer, make_tier):
    buf = make_buffer(8, BLOCK)
    fill_random(buf.view, range(3))
    tier = make_tier(buf, checksum_blocks=True, enable_events=True)
    keys = keys_for(3)
    assert store(tier, 1, keys, [0, 1, 2]).success
    for i, key in enumerate(keys):
        record = os.getxattr(tier.mapper.path_for(key), XATTR)
        assert record == native.crc32c(buf.view[i]).to_bytes(4, "big")
    tier.take_events()
    path = tier.mapper.path_for(keys[1])
    with open(path, "r+b") as f:  # same size, one byte different: only the CRC can tell
        f.seek(BLOCK // 2)
        byte = f.read(1)
        f.seek(BLOCK // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = load(tier, 2, keys, [4, 5, 6])
    assert not result.success and result.errno == errno.EBADMSG
    assert result.checksum_failed
    assert result.successful_keys == (keys[0],)  # a batch stops at its first failure
    assert np.array_equal(buf.view[4], buf.view[0])
    assert not os.path.exists(path), "a block failing its checksum is removed"
    stats = tier.stats()
    assert stats["checksum_failures"] == 1 and stats["corrupt_removed"] == 1
    assert [(e.kind, e.keys, e.extra) for e in tier.take_events()] == [
        ("removed", (keys[1],), {"reason": "checksum"})]
    assert looked_up(tier, keys[1], "r") is LookupResult.MISS
    assert store(tier, 3, keys[1:2], [1]).success  # the next store rewrites it
    result = load(tier, 4, keys[1:2], [5])
    assert result.success and not result.checksum_failed
    assert np.array_equal(buf.view[5], buf.view[1])


@pytest.mark.parametrize("record", [b"\x01\x02\x03", b"", b"\0\0\0\0\0"],
                         ids=["3-bytes", "empty", "5-bytes"])
def test_a_malformed_record_fails_the_block(make_buffer, make_tier, record):
    buf = make_buffer(4, BLOCK)
    fill_random(buf.view, [0])
    tier = make_tier(buf, checksum_blocks=True)
    (key,) = keys_for(1)
    assert store(tier, 1, [key], [0]).success
    os.setxattr(tier.mapper.path_for(key), XATTR, record)
    result = load(tier, 2, [key], [1])
    assert result.errno == errno.EBADMSG and result.checksum_failed
    assert not os.path.exists(tier.mapper.path_for(key))


def test_blocks_without_a_record_load_with_checksums_on(make_buffer, make_tier, root):
    buf = make_buffer(4, BLOCK)
    fill_random(buf.view, [0])
    (key,) = keys_for(1)
    plain = make_tier(buf, checksum_blocks=False)
    assert store(plain, 1, [key], [0]).success
    with pytest.raises(OSError):  # checksums off: vLLM's meaning, no record written
        os.getxattr(plain.mapper.path_for(key), XATTR)
    plain.shutdown()
    checked = make_tier(buf, checksum_blocks=True)
    result = load(checked, 2, [key], [1])
    assert result.success and np.array_equal(buf.view[1], buf.view[0])


def test_checksums_required_on_a_root_without_xattrs_refuse_to_start(
        make_buffer, make_tier, monkeypatch, root):
    monkeypatch.setattr(native.Backend, "probe_xattr", lambda self, directory: False)
    buf = make_buffer(4, BLOCK)
    with pytest.raises(ConfigError, match=r"checksum_blocks=true.*extended attributes"):
        make_tier(buf, checksum_blocks=True)


def test_auto_checksums_on_a_root_without_xattrs_warn_once_and_run(
        make_buffer, make_tier, monkeypatch, caplog):
    monkeypatch.setattr(native.Backend, "probe_xattr", lambda self, directory: False)
    buf = make_buffer(4, BLOCK)
    fill_random(buf.view, [0])
    with caplog.at_level(logging.WARNING, logger="mptier.workers"):
        tier = make_tier(buf)  # checksum_blocks="auto"
    warnings = [r for r in caplog.records if "extended attributes" in r.getMessage()]
    assert len(warnings) == 1
    (key,) = keys_for(1)
    assert store(tier, 1, [key], [0]).success
    with pytest.raises(OSError):
        os.getxattr(tier.mapper.path_for(key), XATTR)
    assert load(tier, 2, [key], [1]).success


# -- hostile entries ----------------------------------------------------------------------

def _plant(tier, key: bytes, kind: str, outside: str) -> str:
    """Put a hostile entry of ``kind`` where ``key``'s block belongs; returns what to
    check on disk afterwards."""
    path = tier.mapper.path_for(key)
    folder = os.path.dirname(path)
    if kind == "symlinked-folder":
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        os.makedirs(outside, exist_ok=True)
        os.symlink(outside, folder)
        return folder
    os.makedirs(folder, exist_ok=True)
    if kind == "symlink-outside":
        with open(outside, "wb") as f:
            f.write(b"x" * BLOCK)  # a whole block's worth of foreign bytes
        os.symlink(outside, path)
    elif kind == "symlink-inside":
        inside = os.path.join(folder, "elsewhere.bin")
        with open(inside, "wb") as f:
            f.write(b"y" * BLOCK)
        os.symlink(inside, path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind in ("shorter", "longer", "empty"):
        size = {"shorter": BLOCK // 2, "longer": BLOCK + 1, "empty": 0}[kind]
        with open(path, "wb") as f:
            f.write(b"z" * size)
    return path


# kind: (lookup, load errno, store ok, what remains at the path afterwards). A lookup
# and a load remove a symlink (never what it points to); a load removes a corrupt file;
# what may be someone else's (a directory, a FIFO, a longer file) is left and reported.
HOSTILE = {
    "symlink-outside": (LookupResult.MISS, errno.ELOOP, True, "block"),
    "symlink-inside": (LookupResult.MISS, errno.ELOOP, True, "block"),
    "symlinked-folder": (LookupResult.MISS, errno.ELOOP, True, "folder"),
    "directory": (LookupResult.MISS, errno.EMEDIUMTYPE, False, "directory"),
    "fifo": (LookupResult.MISS, errno.EMEDIUMTYPE, False, "fifo"),
    "shorter": (LookupResult.MISS, errno.ENODATA, True, "block"),
    "empty": (LookupResult.MISS, errno.ENODATA, True, "block"),
    "longer": (LookupResult.MISS, errno.EFBIG, False, "longer"),
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_entry_is_never_served_nor_followed(make_buffer, make_tier, tmp_path, kind):
    want_lookup, want_load_errno, want_store_ok, remains = HOSTILE[kind]
    buf = make_buffer(4, BLOCK)
    fill_random(buf.view, [0])
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1)
    (key,) = keys_for(1, tag=7)
    outside = str(tmp_path / "outside" / "target")
    os.makedirs(os.path.dirname(outside), exist_ok=True)
    checked = _plant(tier, key, kind, outside)
    outside_before = sorted(os.listdir(os.path.dirname(outside)))
    result = load(tier, 1, [key], [1])
    assert not result.success and result.errno == want_load_errno, result
    assert not np.array_equal(buf.view[1], buf.view[0])
    if kind.startswith("symlink") or kind in ("shorter", "empty"):
        assert not os.path.lexists(checked)  # the load removed the link / corrupt file
        checked = _plant(tier, key, kind, outside)  # and again, for the lookup
    assert looked_up(tier, key, "r1") is want_lookup
    if kind.startswith("symlink"):
        assert not os.path.lexists(checked)  # a lookup removes a link too
    result = store(tier, 2, [key], [0])
    assert result.success is want_store_ok, result
    if not want_store_ok:
        assert tier.mapper.path_for(key) in (result.error or ""), result.error
    path = tier.mapper.path_for(key)
    if remains == "block":
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and st.st_size == BLOCK
    elif remains == "folder":
        assert stat.S_ISDIR(os.lstat(checked).st_mode)  # a real folder replaced the link
        assert stat.S_ISREG(os.lstat(path).st_mode)
    elif remains == "directory":
        assert stat.S_ISDIR(os.lstat(path).st_mode)
    elif remains == "fifo":
        assert stat.S_ISFIFO(os.lstat(path).st_mode)
    elif remains == "longer":
        assert os.lstat(path).st_size == BLOCK + 1
    # nothing outside the root was touched or created
    assert sorted(os.listdir(os.path.dirname(outside))) == outside_before
    if os.path.exists(outside) and kind == "symlink-outside":
        with open(outside, "rb") as f:
            assert f.read() == b"x" * BLOCK
    if want_store_ok:
        again = load(tier, 3, [key], [2])
        assert again.success and np.array_equal(buf.view[2], buf.view[0])
    assert tier.stats()["bad_entries"] >= (0 if kind in ("shorter", "empty") else 1)


def test_a_folder_of_another_block_size_is_refused_at_start(make_buffer, make_tier):
    make_tier(make_buffer(4, BLOCK)).shutdown()
    with pytest.raises(ConfigError, match=rf"holds blocks of {BLOCK} bytes.*"
                                          rf"this tier's blocks are {2 * BLOCK} bytes"):
        make_tier(make_buffer(4, 2 * BLOCK))

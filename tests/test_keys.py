"""Offload keys (mptier/keys.py): vLLM's ``block_hash + 4-byte big-endian group``, the
split back, and the checks that name what is wrong with a bad key."""

from __future__ import annotations

import pytest

from mptier.keys import (
    GROUP_IDX_BYTES,
    MAX_KEY_BYTES,
    NAME_MAX,
    check_key,
    key_block_hash,
    key_group_idx,
    make_key,
    split_key,
)
from mptier.layout import FileMapper


@pytest.mark.parametrize("group", [0, 1, 255, 256, (1 << 32) - 1])
def test_a_key_is_the_hash_then_the_group_big_endian_and_splits_back(group):
    block_hash = bytes(range(32))
    key = make_key(block_hash, group)
    assert key == block_hash + group.to_bytes(4, "big")
    assert split_key(key) == (block_hash, group)
    assert key_block_hash(key) == block_hash and key_group_idx(key) == group


def test_make_key_takes_any_bytes_like_hash_and_refuses_others():
    assert make_key(bytearray(b"ab"), 3) == make_key(memoryview(b"ab"), 3) == b"ab\0\0\0\3"
    with pytest.raises(TypeError, match="block_hash must be bytes, got str"):
        make_key("ab")
    for group in (-1, 1 << 32):
        with pytest.raises(ValueError, match=f"group_idx must be in .*got {group}"):
            make_key(b"ab", group)


def test_check_key_returns_bytes_and_names_each_fault():
    assert check_key(bytearray(b"hash\0\0\0\1")) == b"hash\0\0\0\1"
    with pytest.raises(ValueError, match=r"must be bytes .*got str"):
        check_key("hash")
    with pytest.raises(ValueError, match=f"longer than {GROUP_IDX_BYTES} bytes.*got 4"):
        check_key(b"\0\0\0\1")
    with pytest.raises(ValueError, match=f"at most {MAX_KEY_BYTES} bytes.*got"):
        check_key(b"h" * (MAX_KEY_BYTES + 1))


def test_the_longest_key_accepted_still_gets_a_file_name_and_a_temp_name_that_fit(tmp_path):
    """MAX_KEY_BYTES is derived from NAME_MAX: a block file and its longest temporary
    name for the longest key are created on a real file system."""
    key = check_key(b"\xab" * (MAX_KEY_BYTES - GROUP_IDX_BYTES) + b"\0\0\0\7")
    name = FileMapper(str(tmp_path), "model").relative_path_for(key).rsplit("/", 1)[1]
    longest_temp = f"{name}.{'t' * 16}.{'9' * 20}.tmp"
    assert len(longest_temp) <= NAME_MAX
    for n in (name, longest_temp):
        (tmp_path / n).write_bytes(b"x")
        assert (tmp_path / n).exists()

"""Offload keys: ``block_hash + group_idx.to_bytes(4, "big")`` (vLLM's ``OffloadKey``)."""

from __future__ import annotations

GROUP_IDX_BYTES = 4
# The longest file name the file system takes (Linux NAME_MAX).
NAME_MAX = 255
# A block file is "<hex of the block hash>.bin"; while it is written it may be named
# "<that>.<16-char lease tag>.<counter, up to 20 digits>.tmp".
BLOCK_SUFFIX = ".bin"
TEMP_SUFFIX_MAX_BYTES = len(".") + 16 + len(".") + 20 + len(".tmp")
# Longest key accepted: the longest whose block file and temporary name still fit in
# NAME_MAX (each hash byte is two hex digits). vLLM's keys are 36 bytes.
MAX_KEY_BYTES = (NAME_MAX - len(BLOCK_SUFFIX) - TEMP_SUFFIX_MAX_BYTES) // 2 + GROUP_IDX_BYTES


def make_key(block_hash: bytes, group_idx: int = 0) -> bytes:
    """Build the key of block ``block_hash`` in KV-cache group ``group_idx``."""
    if not isinstance(block_hash, (bytes, bytearray, memoryview)):
        raise TypeError(f"block_hash must be bytes, got {type(block_hash).__name__}")
    if not 0 <= group_idx < 1 << 32:
        raise ValueError(f"group_idx must be in [0, 2**32), got {group_idx}")
    return bytes(block_hash) + group_idx.to_bytes(GROUP_IDX_BYTES, "big")


def key_block_hash(key: bytes) -> bytes:
    """The block hash part of ``key`` (everything but the last 4 bytes)."""
    return bytes(key[:-GROUP_IDX_BYTES])


def key_group_idx(key: bytes) -> int:
    """The KV-cache group index stored in the last 4 bytes of ``key``."""
    return int.from_bytes(key[-GROUP_IDX_BYTES:], "big")


def split_key(key: bytes) -> tuple[bytes, int]:
    """``(block_hash, group_idx)`` of ``key``; the inverse of :func:`make_key`."""
    return key_block_hash(key), key_group_idx(key)


def check_key(key: object) -> bytes:
    """Return ``key`` as bytes, or raise ``ValueError`` saying what is wrong with it."""
    if isinstance(key, bytes):
        raw = key
    elif isinstance(key, (bytearray, memoryview)):
        raw = bytes(key)
    else:
        raise ValueError(
            f"a key must be bytes (block_hash + 4-byte group index, see mptier.make_key), "
            f"got {type(key).__name__}: {key!r:.60}")
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(
            f"a key must be at most {MAX_KEY_BYTES} bytes (its block file name, two hex "
            f"digits per hash byte plus a temporary suffix, must fit the file system's "
            f"{NAME_MAX}-byte name limit), got {len(raw)}")
    if len(raw) <= GROUP_IDX_BYTES:
        raise ValueError(
            f"a key must be longer than {GROUP_IDX_BYTES} bytes (block_hash + 4-byte group "
            f"index), got {len(raw)} bytes: {raw!r:.60}")
    return raw

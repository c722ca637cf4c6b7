"""The names a root may hold, and what each one means (see ``mptier/layout.py``)::

    <root>/<model>_<12 hex>/config.json             layout fields (vLLM writes it)
    <root>/<model>_<12 hex>/mptier.json             {"block_bytes": N} (mptier writes it)
    <root>/<model>_<12 hex>_r<rank>/<h[0:3]>/<h[3:5]>_g<group>/<h>.bin     one block
        ... /<h>.bin.<tag>.<counter>.tmp            a store in progress by lease <tag>
        ... /<h>.bin.<pid>.<tid>.<counter>.tmp      the same, older writers (no lease)
    <root>/.mptier/leases/<tag>.lease               a writer's lease (flock held while alive)
    <root>/.mptier/leases/<tag>.lease.new           a lease being created (locked, renamed)
    <root>[/<model>_<12 hex>_r<rank>]/.mpt_probe.<pid>.<n>.tmp
                                                    a file-system probe's file (flock held
                                                    while it lives: mptier.native probes)

Pure string work, no I/O. ``tag`` is exactly :data:`TAG_LEN` characters of ``[0-9a-z]``.
"""

from __future__ import annotations

import json
import os
import re

from mptier.keys import GROUP_IDX_BYTES
from mptier.native import TAG_LEN
from mptier.rootfile import read_root_file

MPTIER_JSON = "mptier.json"
CONFIG_JSON = "config.json"
META_DIR = ".mptier"
LEASES_DIR = "leases"
LEASE_SUFFIX = ".lease"
LEASE_NEW_SUFFIX = ".lease.new"
TAG_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
# Longest decimal counter in a temporary name: 2**64 has 20 digits.
MAX_COUNTER_DIGITS = 20

BASE_RE = re.compile(r"^(?P<model>.+)_(?P<digest>[0-9a-f]{12})$")
BLOCKS_DIR_RE = re.compile(r"^(?P<base>.+_[0-9a-f]{12})_r(?P<rank>\d+)$")
TOP_RE = re.compile(r"^[0-9a-f]{3}$")
LEAF_RE = re.compile(r"^(?P<prefix>[0-9a-f]{2})_g(?P<group>\d+)$")
# A block hash is at least five hex digits: the two folder levels take the first five.
BLOCK_RE = re.compile(r"^(?P<h>[0-9a-f]{5,})\.bin$")
_TAG = f"[0-9a-z]{{{TAG_LEN}}}"
TEMP_RE = re.compile(
    rf"^(?P<h>[0-9a-f]{{5,}})\.bin\.(?P<tag>{_TAG})\.(?P<counter>\d{{1,{MAX_COUNTER_DIGITS}}})\.tmp$")
LEGACY_TEMP_RE = re.compile(r"^(?P<h>[0-9a-f]{5,})\.bin\.\d+\.\d+\.\d+\.tmp$")
# The probes of mptier.native (O_DIRECT, user xattrs, O_TMPFILE) leave this in the
# folder they probe -- a tier's block folder, or the root (`mptier info`) -- if their
# process dies mid-probe; ".mpt_odirect_probe.<pid>.<tid>.<n>.tmp" is the name older
# versions' O_DIRECT probe used.
PROBE_TEMP_RE = re.compile(r"^\.mpt_(probe\.\d+|odirect_probe\.\d+\.\d+)\.\d+\.tmp$")
TAG_RE = re.compile(f"^{_TAG}$")
LEASE_RE = re.compile(rf"^(?P<tag>{_TAG})\.lease(?P<new>\.new)?$")


def temp_name(final: str, tag: str, counter: int) -> str:
    """``<final>.<tag>.<counter>.tmp``: the temporary name a leased writer uses.

    Raises ``ValueError`` for a malformed tag or a counter outside ``[0, 10**20)``.
    """
    if not TAG_RE.match(tag):
        raise ValueError(f"lease tag {tag!r}: expected {TAG_LEN} characters of [0-9a-z]")
    if not 0 <= counter < 10 ** MAX_COUNTER_DIGITS:
        raise ValueError(f"temporary-file counter {counter}: must be in "
                         f"[0, 10**{MAX_COUNTER_DIGITS})")
    return f"{final}.{tag}.{counter}.tmp"


def temp_tag(name: str) -> str | None:
    """The lease tag in a temporary file's name, or ``None`` (not a leased temp name)."""
    match = TEMP_RE.match(os.path.basename(name))
    return match.group("tag") if match else None


def lease_path(root: str, tag: str) -> str:
    return f"{root}/{META_DIR}/{LEASES_DIR}/{tag}{LEASE_SUFFIX}"


def key_of_block_path(path: str) -> bytes:
    """The offload key (``block_hash + group.to_bytes(4, "big")``) a block path stores.

    The inverse of :meth:`mptier.layout.FileMapper.path_for`, for "removed" events.
    Raises ``ValueError`` when ``path`` is not a block path of the layout.
    """
    parts = path.rstrip("/").split("/")
    if len(parts) < 3:
        raise ValueError(f"{path!r} is not a block path (<h3>/<h2>_g<group>/<h>.bin)")
    top, leaf, name = parts[-3:]
    block = BLOCK_RE.match(name)
    leaf_match = LEAF_RE.match(leaf)
    if not (block and leaf_match and TOP_RE.match(top) and len(block.group("h")) % 2 == 0
            and block.group("h")[:5] == top + leaf_match.group("prefix")):
        raise ValueError(f"{path!r} is not a block path (<h3>/<h2>_g<group>/<h>.bin)")
    group = int(leaf_match.group("group"))
    if group >= 1 << (8 * GROUP_IDX_BYTES):
        raise ValueError(f"{path!r}: group {group} does not fit a key's 4-byte group index")
    return bytes.fromhex(block.group("h")) + group.to_bytes(GROUP_IDX_BYTES, "big")


def base_of_blocks_dir(name: str) -> tuple[str, int] | None:
    """``("<model>_<12hex>", rank)`` for a block folder name, else ``None``."""
    match = BLOCKS_DIR_RE.match(name)
    return (match.group("base"), int(match.group("rank"))) if match else None


def read_small_json(path: str) -> dict | None:
    """A small JSON object file, read by :func:`mptier.rootfile.read_root_file`;
    ``None`` when it is missing, not a regular file, too big, unreadable or not a JSON
    object (the offline tools report such a folder as unknown). Never raises
    ``OSError``."""
    try:
        data = read_root_file(path)
    except OSError:  # RootFileError included
        return None
    if data is None:
        return None
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def recorded_block_bytes(base_dir: str) -> int | None:
    """``block_bytes`` from ``<base_dir>/mptier.json``, or ``None`` when not recorded."""
    info = read_small_json(f"{base_dir}/{MPTIER_JSON}")
    value = info.get("block_bytes") if info else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None

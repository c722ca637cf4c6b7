"""Where blocks live on disk: a file layout byte-compatible with vLLM's file-system tier.

    <root>/<model name, "/" -> "_">_<12 hex of sha256(fields)>/config.json
    <root>/<same>/mptier.json        mptier's record: {"block_bytes": N}
    <root>/<same>_r<rank>/<h[0:3]>/<h[3:5]>_g<group>/<h>.bin     h = block_hash.hex()

The twelve hex digits hash the JSON of :attr:`FileMapper.fields` written with sorted
keys and no spaces, so two engines with the same model and parallel layout share a
folder and anything that changes the bytes of a block gets a folder of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from typing import Any

from mptier.keys import GROUP_IDX_BYTES, NAME_MAX
from mptier.rootfile import read_root_file

CONFIG_FILENAME = "config.json"
# mptier's own record beside config.json (vLLM reads only config.json and block files):
# the block size, so two tiers with different block sizes never share a folder.
RECORD_FILENAME = "mptier.json"
BASE_HASH_HEX_DIGITS = 12


def _folder_part(model_name: Any) -> str:
    if not isinstance(model_name, str) or not model_name:
        from mptier.errors import ConfigError

        raise ConfigError(f"model_name = {model_name!r} is invalid: expected a non-empty "
                          "string (it names the cache folder)")
    return model_name.replace("/", "_")


def _rank_part(rank: Any) -> str:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        from mptier.errors import ConfigError

        raise ConfigError(f"rank = {rank!r} is invalid: expected a whole number >= 0 (it "
                          "names the blocks folder, <base>_r<rank>)")
    return str(rank)


def check_folder_name(name: str, model_name: Any, rank: Any) -> None:
    """Raise ``ConfigError`` unless ``name``, a cache folder's name made from
    ``model_name`` and ``rank``, is one plain name beneath the root: no separator, no NUL,
    not "." or "..", at most NAME_MAX bytes. Every path of the layout is built by
    :class:`FileMapper`, from a local configuration or from an engine attaching to a
    service alike: this is the one rule for both."""
    from mptier.errors import ConfigError

    try:
        size = len(os.fsencode(name))
    except UnicodeEncodeError:
        size = -1
    if size < 0 or "/" in name or "\0" in name or name in (".", ".."):
        raise ConfigError(f"model_name = {model_name!r} and rank = {rank!r} make the cache "
                          f"folder name {name!r}, which is not one plain file name (no "
                          "'/', no NUL byte, no lone surrogate); use a plain model_name")
    if size > NAME_MAX:
        raise ConfigError(f"model_name = {model_name!r:.80} makes the cache folder name "
                          f"{size} bytes long, past the file system's {NAME_MAX}-byte limit; "
                          "use a shorter model_name")


class FileMapper:
    """Maps offload keys to block files under ``root_dir``.

    ``parallel_agnostic=True`` collapses tp/pp/pcp/dcp to 1 and rank to 0, so engines
    with different parallel layouts that produce identical blocks share the files.
    ``replicated_layout`` and ``canonical_format`` enter the fields only when set, so
    caches written without them keep their folder.
    """

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        model_name: str,
        tokens_per_hash: int = 16,
        blocks_per_file: int = 1,
        tp_size: int = 1,
        pp_size: int = 1,
        pcp_size: int = 1,
        dcp_size: int = 1,
        rank: int = 0,
        dtype: str = "bfloat16",
        kv_cache_groups: list[dict[str, Any]] | None = None,
        inference_engine: str = "vllm",
        parallel_agnostic: bool = False,
        replicated_layout: bool = False,
        canonical_format: str | None = None,
    ) -> None:
        if parallel_agnostic:
            tp_size = pp_size = pcp_size = dcp_size = 1
            rank = 0
        fields: dict[str, Any] = {
            "model_name": model_name,
            "tokens_per_hash": tokens_per_hash,
            "blocks_per_file": blocks_per_file,
            "tp_size": tp_size,
            "pp_size": pp_size,
            "pcp_size": pcp_size,
            "dcp_size": dcp_size,
            "dtype": str(dtype),
            "kv_cache_groups": list(kv_cache_groups) if kv_cache_groups else [],
            "inference_engine": inference_engine,
        }
        if not parallel_agnostic:
            fields["parallel_agnostic"] = False
        if replicated_layout:
            fields["replicated_layout"] = True
        if canonical_format is not None:
            fields["canonical_format"] = canonical_format
        self.root_dir = os.fspath(root_dir)
        self.rank = rank
        self._fields = fields
        digest = hashlib.sha256(
            json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8")
        ).hexdigest()[:BASE_HASH_HEX_DIGITS]
        base_name = f"{_folder_part(model_name)}_{digest}"
        blocks_name = f"{base_name}_r{_rank_part(rank)}"
        for name in (base_name, blocks_name):
            check_folder_name(name, model_name, rank)
        self.base_path = f"{self.root_dir}/{base_name}"
        self.blocks_dir = f"{self.root_dir}/{blocks_name}"

    @property
    def fields(self) -> dict[str, Any]:
        """The layout fields (a copy); their hash names the cache folder."""
        return dict(self._fields)

    @property
    def config_path(self) -> str:
        return f"{self.base_path}/{CONFIG_FILENAME}"

    def path_for(self, key: bytes) -> str:
        """Path of the block file for ``key``."""
        return f"{self.blocks_dir}/{self.relative_path_for(key)}"

    def relative_path_for(self, key: bytes) -> str:
        """Path of the block file for ``key`` relative to :attr:`blocks_dir` (the root
        the native batch calls resolve beneath)."""
        # (key_block_hash and key_group_idx inlined: a worker makes one path per key of
        # every task, and the two calls were 45 % of it, ~1 µs a key.)
        hex_hash = key[:-GROUP_IDX_BYTES].hex()
        group = int.from_bytes(key[-GROUP_IDX_BYTES:], "big")
        return f"{hex_hash[:3]}/{hex_hash[3:5]}_g{group}/{hex_hash}.bin"

    def config_text(self) -> str:
        """The exact text of ``config.json`` (no trailing newline, as vLLM writes it)."""
        return json.dumps(self._fields, indent=2, sort_keys=True)

    @property
    def record_path(self) -> str:
        return f"{self.base_path}/{RECORD_FILENAME}"

    def prepare(self, block_bytes: int) -> None:
        """Make the folders, write ``config.json`` once and check the block size.

        A folder whose record names another block size was written by a tier with
        other blocks: sharing it would serve truncated blocks or delete the other's as
        short, so this raises ``ConfigError`` naming both sizes. A folder without the
        record (new, or written by vLLM's tier) gets one. Raises ``OSError`` naming the
        path when the root cannot be used, and ``RootFileError`` when a record is a
        symlink, FIFO, device or too large (see :mod:`mptier.rootfile`).
        """
        from mptier.errors import ConfigError

        self.write_config()
        recorded = self.recorded_block_bytes()
        if recorded is None:
            _publish(self.record_path, json.dumps({"block_bytes": block_bytes}))
            recorded = self.recorded_block_bytes()
        if recorded is not None and recorded != block_bytes:
            raise ConfigError(
                f"{self.base_path} holds blocks of {recorded} bytes (see {RECORD_FILENAME})"
                f" but this tier's blocks are {block_bytes} bytes; use another root_dir or"
                " model_name for this buffer, or remove that folder")

    def recorded_block_bytes(self) -> int | None:
        """The block size in the folder's record, or None if it has none (or it is not
        JSON naming one: a record half-written by a crashed tier is rewritten). Raises
        ``RootFileError`` when the record is not a regular file of a sane size, and
        ``OSError`` when it cannot be read."""
        data = read_root_file(self.record_path)
        try:
            value = json.loads(data).get("block_bytes") if data is not None else None
        except (ValueError, AttributeError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) \
            and value > 0 else None

    def write_config(self) -> None:
        """Create the cache folders and write ``config.json`` unless it exists.

        Published with a temporary file and a rename, so a reader never sees half of
        it; an existing regular file is left as it is (vLLM reads it: a symlink, FIFO or
        oversized file there raises ``RootFileError``). Raises ``OSError`` naming the
        path when the root cannot be used.
        """
        for directory in (self.base_path, self.blocks_dir):
            _make_dirs(directory)
        if read_root_file(self.config_path) is not None:
            return
        _publish(self.config_path, self.config_text())


def _publish(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename, so a reader
    never sees half of it. The temporary name is new (``O_EXCL``, never a symlink): a
    file planted at a guessable name is never written through."""
    tmp = f"{path}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        with open(fd, "w", encoding="utf-8", closefd=True) as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        os.unlink(tmp)
        raise


def _make_dirs(directory: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
    except FileExistsError as exc:  # a regular file stands where a folder must be
        raise NotADirectoryError(
            exc.errno, f"cannot use {directory!r} as a folder: a file of that name exists",
            directory) from exc

"""Where blocks live on disk: a file layout byte-compatible with vLLM's file-system tier.

    <root>/<model name, "/" -> "_">_<12 hex of sha256(fields)>/config.json
    <root>/<same>_r<rank>/<h[0:3]>/<h[3:5]>_g<group>/<h>.bin     h = block_hash.hex()

The twelve hex digits hash the JSON of :attr:`FileMapper.fields` written with sorted
keys and no spaces, so two engines with the same model and parallel layout share a
folder and anything that changes the bytes of a block gets a folder of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from mptier.keys import key_block_hash, key_group_idx

CONFIG_FILENAME = "config.json"
BASE_HASH_HEX_DIGITS = 12


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
        self.base_path = f"{self.root_dir}/{model_name.replace('/', '_')}_{digest}"
        self.blocks_dir = f"{self.base_path}_r{rank}"

    @classmethod
    def from_offloading_spec(cls, root_dir: str, offloading_spec: Any,
                             blocks_per_file: int = 1,
                             parallel_agnostic: bool = False) -> FileMapper:
        """Build the mapper vLLM's own file-system tier builds for ``offloading_spec``.

        ``parallel_agnostic`` is an opt-in: it takes effect only where the spec says the
        blocks do not depend on the parallel layout (or uses the replicated layout).
        Works on any object shaped like vLLM 0.33's ``OffloadingSpec``; vLLM is imported
        only when the spec asks for the canonical layout.
        """
        config = offloading_spec.config
        groups = [
            {"tokens_per_block": group.tokens_per_block,
             "layer_names": list(group.layer_names)}
            for group in config.groups
        ]
        parallel = config.parallel
        canonical_format = None
        if getattr(config, "canonical_layout", False):
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
                canonical_format_id,
            )
            canonical_format = canonical_format_id(config.kv_cache_layout)
        replicated = bool(getattr(config, "replicated_layout", False))
        return cls(
            root_dir=root_dir,
            model_name=config.model.name,
            tokens_per_hash=config.cache.tokens_per_hash,
            blocks_per_file=blocks_per_file,
            tp_size=parallel.tp_size,
            pp_size=parallel.pp_size,
            pcp_size=parallel.pcp_size,
            dcp_size=parallel.dcp_size,
            rank=parallel.rank,
            dtype=config.model.dtype,
            kv_cache_groups=groups,
            parallel_agnostic=parallel_agnostic
            and (bool(parallel.is_parallelism_agnostic) or replicated),
            replicated_layout=parallel_agnostic and replicated,
            canonical_format=canonical_format,
        )

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
        hex_hash = key_block_hash(key).hex()
        return f"{hex_hash[:3]}/{hex_hash[3:5]}_g{key_group_idx(key)}/{hex_hash}.bin"

    def config_text(self) -> str:
        """The exact text of ``config.json`` (no trailing newline, as vLLM writes it)."""
        return json.dumps(self._fields, indent=2, sort_keys=True)

    def write_config(self) -> None:
        """Create the cache folders and write ``config.json`` unless it exists.

        Published with a temporary file and a rename, so a reader never sees half of
        it; an existing file is left as it is. Raises ``OSError`` naming the path when
        the root cannot be used.
        """
        for directory in (self.base_path, self.blocks_dir):
            _make_dirs(directory)
        if os.path.exists(self.config_path):
            return
        tmp = f"{self.config_path}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.config_text())
        try:
            os.replace(tmp, self.config_path)
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

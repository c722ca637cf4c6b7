"""The vLLM plug-in's options: what a tier's entry in ``secondary_tiers`` may set, how
it is checked, and the :class:`~mptier.config.TierConfig` it comes to, with the file
layout taken from vLLM's configuration exactly as vLLM's ``fs`` tier derives it.

Pure computation and reading the ``config`` file: creates nothing, starts no worker.
Every error is a :class:`~mptier.errors.ConfigError` naming the tier and the option.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mptier.config import TierConfig, tomllib
from mptier.errors import ConfigError
from mptier.integrations.vllm_compat import check_vllm_release, unsupported_vllm

# The first import of vLLM in the plug-in (vllm.py imports this module first).
check_vllm_release()
try:
    from vllm.v1.kv_offload.base import Locality
    from vllm.v1.kv_offload.file_mapper import FileMapper as VllmFileMapper
except ImportError as _exc:
    raise ImportError(unsupported_vllm(_exc)) from _exc

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

# The plug-in's one logger (users and tests filter on its name). Records logged here
# name the plug-in's line that called (stacklevel=2): vLLM's format shows it.
log = logging.getLogger("mptier.integrations.vllm")
_CALLER = 2

# Layout fields are vLLM's to decide (model, dtype, parallelism...); a tier config that
# set them could write a cache vLLM's own fs tier would not find.
_LAYOUT_KEYS = frozenset({
    "model_name", "tokens_per_hash", "blocks_per_file", "tp_size", "pp_size", "pcp_size",
    "dcp_size", "rank", "dtype", "kv_cache_groups", "inference_engine", "parallel_agnostic",
    "replicated_layout", "canonical_format"})
# Options of vLLM's fs tier that mean something else here.
_RENAMED = {
    "n_read_threads": "n_load_workers (worker processes, default 2, not threads)",
    "n_write_threads": "n_store_workers (worker processes, default 2, not threads)",
    "enable_events": "enable_kv_events (as for vLLM's fs tier)",
}


def vllm_file_mapper(offloading_spec: OffloadingSpec, root_dir: str) -> VllmFileMapper:
    """vLLM's own ``FileMapper`` for this engine, built with the arguments vLLM's fs tier
    passes: one file per chunk (``blocks_per_file=spec.blocks_per_chunk``) and the
    parallel-agnostic opt-in, which vLLM grants only to parallelism-invariant or
    replicated layouts. Pure computation: creates nothing."""
    return VllmFileMapper.from_offloading_spec(
        root_dir, offloading_spec, blocks_per_file=offloading_spec.blocks_per_chunk,
        parallel_agnostic=True)


def _layout_fields(mapper: VllmFileMapper) -> dict[str, Any]:
    """The :class:`TierConfig` layout fields that make mptier's mapper equal ``mapper``."""
    fields = mapper.get_run_config()
    return {
        "model_name": fields["model_name"],
        "tokens_per_hash": fields["tokens_per_hash"],
        "blocks_per_file": fields["blocks_per_file"],
        "tp_size": fields["tp_size"],
        "pp_size": fields["pp_size"],
        "pcp_size": fields["pcp_size"],
        "dcp_size": fields["dcp_size"],
        "rank": mapper.rank,
        "dtype": fields["dtype"],
        "kv_cache_groups": fields["kv_cache_groups"],
        "inference_engine": fields["inference_engine"],
        # vLLM writes "parallel_agnostic": false only when the cache is *not* agnostic.
        "parallel_agnostic": "parallel_agnostic" not in fields,
        "replicated_layout": bool(fields.get("replicated_layout", False)),
        "canonical_format": fields.get("canonical_format"),
    }


def layout_from_spec(offloading_spec: OffloadingSpec, root_dir: str
                     ) -> tuple[dict[str, Any], str]:
    """The :class:`TierConfig` layout fields vLLM's fs tier would use for this engine,
    and the base folder vLLM's fs tier computes for them (see :func:`vllm_file_mapper`)."""
    mapper = vllm_file_mapper(offloading_spec, root_dir)
    return _layout_fields(mapper), mapper.base_path


def parse_checksum(tier_type: str, value: Any) -> bool | str | None:
    """``checksum_blocks`` as given in the tier config: True, False, "auto", or None
    when absent. Raises ``ConfigError`` for anything else."""
    if value is None or isinstance(value, bool) or value == "auto":
        return value
    raise ConfigError(f"{tier_type}: checksum_blocks {value!r} is not accepted; use true "
                      "or false (vLLM's meaning: write and verify a CRC32C per block, or "
                      'not), or "auto" (mptier\'s: on where the root keeps user extended '
                      "attributes, off with a warning elsewhere)")


def requested_checksums(tier_config: Mapping[str, Any]) -> bool | str:
    """What a tier's entry in ``secondary_tiers`` asks of ``checksum_blocks``: its own
    value, else its ``config`` file's, else False (vLLM's default: no checksums).

    Read where the tier is not built (vLLM's metrics front end), so it never raises: a
    value or file it cannot read answers "auto", which declares the checksum metric
    (a declared metric that stays at zero is harmless; an undeclared one that is
    reported is not)."""
    tier_type = str(tier_config.get("type", "mptier"))
    try:
        value = parse_checksum(tier_type, tier_config.get("checksum_blocks"))
        path = tier_config.get("config")
        if value is None and path is not None:
            in_file = _toml_fields(os.fspath(path)).get("checksum_blocks")
            if in_file is not None:  # normalised ("true" -> True) and validated
                value = TierConfig.from_dict({"checksum_blocks": in_file}).checksum_blocks
    except (OSError, ValueError, TypeError, tomllib.TOMLDecodeError):
        return "auto"
    return False if value is None else value


def _toml_fields(path: str) -> dict[str, Any]:
    """The fields a ``config`` file sets, read the way ``TierConfig.from_toml`` reads it
    (flat keys, or under a ``[tier]`` table). Call after ``from_toml`` accepted it."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    table = data.get("tier")
    return table if isinstance(table, dict) else data


def parse_locality(tier_type: str, value: Any) -> Locality | None:
    if value is None:
        return None
    try:
        return Locality(value)
    except ValueError:
        accepted = " or ".join(repr(m.value) for m in Locality)
        raise ConfigError(f"{tier_type}: locality {value!r} is not a vLLM Locality; "
                          f"use exactly {accepted}") from None


def check_options(tier_type: str, service: Any, options: Mapping[str, Any]) -> None:
    """Refuse a ``service`` that is not a name, an option of vLLM's fs tier that means
    something else here, and a layout field (vLLM's configuration decides those)."""
    if service is not None and not isinstance(service, str):
        raise ConfigError(f"{tier_type}: service must be the name of a running "
                          f"`mptier serve --name NAME`, not {service!r}")
    for key in options:
        if key in _RENAMED:
            raise ConfigError(f"{tier_type}: unknown option {key!r}; use "
                              f"{_RENAMED[key]}")
        if key in _LAYOUT_KEYS:
            raise ConfigError(f"{tier_type}: option {key!r} cannot be set here; the "
                              "file layout follows vLLM's configuration")


def events_wanted(tier_type: str, enable_kv_events: Any,
                  offloading_spec: OffloadingSpec) -> bool:
    """Whether the tier publishes events: ``enable_kv_events`` (a bool) and vLLM's KV
    cache events both on; asked for with vLLM's off, it warns and publishes none."""
    if not isinstance(enable_kv_events, bool):
        raise ConfigError(f"{tier_type}: enable_kv_events must be true or false, not "
                          f"{enable_kv_events!r}")
    if enable_kv_events and not offloading_spec.kv_events_config.enable_kv_cache_events:
        log.warning("%s: enable_kv_events is ignored because vLLM's KV cache events "
                    "are off (kv_events_config); this tier publishes no events",
                    tier_type, stacklevel=_CALLER)
        return False
    return enable_kv_events


@dataclass
class ChosenConfig:
    """What :func:`choose_config` made of a tier's options."""

    tier_config: TierConfig
    service: str  # the service to attach to ("" = start workers)
    given_root: str  # root_dir as the tier's entry gave it ("" = not given)
    checksums: bool | str  # checksum_blocks as asked for (False when nobody said)
    explicit_checksums: bool  # the tier's entry or its config file said


def choose_config(tier_type: str, offloading_spec: OffloadingSpec,
                  root_dir: str | os.PathLike[str] | None,
                  config: str | os.PathLike[str] | None, service: str | None,
                  checksums: bool | str | None, events: bool,
                  options: Mapping[str, Any]) -> ChosenConfig:
    """The :class:`TierConfig` of a tier: its ``config`` file (if any), under the
    options given here, under what vLLM decides (the layout, events, the root when a
    service brings its own). Logs the file's layout fields it overrides (INFO) and
    its ``enable_events`` when ignored (WARNING)."""
    file_fields: dict[str, Any] = {}
    file_root = ""
    if config is not None:
        config = os.fspath(config)
        from_file = TierConfig.from_toml(config)  # ConfigError naming the file or key
        file_fields = _toml_fields(config)
        file_root = from_file.root_dir
        service = service or from_file.service or None
        if checksums is None and "checksum_blocks" in file_fields:
            checksums = from_file.checksum_blocks
    explicit_checksums = checksums is not None
    if checksums is None:
        checksums = False  # vLLM's default
    given_root = os.fspath(root_dir) if root_dir is not None else ""
    if not service and not (given_root or file_root):
        raise ConfigError(f"{tier_type}: root_dir is required (the folder the block "
                          "files go into), in the tier config or in its config file, "
                          "unless the tier attaches to a `mptier serve` service")
    # The layout does not depend on the root; the base folder does, so vLLM's mapper
    # for this tier is made once the root is known (a service's is known on attach).
    layout = _layout_fields(vllm_file_mapper(offloading_spec, given_root or "/"))
    fixed = {**layout, "enable_events": events, "checksum_blocks": checksums,
             "service": service or "",
             # A service's root is its own (a root here is only checked against it).
             "root_dir": "" if service else (given_root or file_root)}
    # A copy of configs/default.toml lists every layout field: routine, not alarming.
    overridden = sorted(k for k in _LAYOUT_KEYS & file_fields.keys()
                        if file_fields[k] != layout[k])
    if overridden:
        log.info("%s: layout fields %s in %s are ignored; the file layout follows "
                 "vLLM's configuration", tier_type, ", ".join(overridden), config,
                 stacklevel=_CALLER)
    if file_fields.get("enable_events") and not events:
        log.warning("%s: enable_events in %s is ignored; events follow the tier's "
                    "enable_kv_events and vLLM's kv_events_config", tier_type, config,
                    stacklevel=_CALLER)
    if config is not None:
        tier_config = TierConfig.from_toml(config, **options, **fixed)
    else:
        tier_config = TierConfig.from_dict({**options, **fixed})
    return ChosenConfig(tier_config, service or "", given_root, checksums,
                        explicit_checksums)

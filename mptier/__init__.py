"""mptier: a multi-process file-system tier for LLM KV-cache offload.

The public API::

    from mptier import SharedKVBuffer, FileSystemTier, TierConfig, TransferJob, \
        JobResult, LookupResult, make_key

Names are imported on first use, so a process that needs only part of the package (a
worker imports ``mptier.workers``) does not load the manager, the monitor or the
integrations.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "FileSystemTier": "mptier.manager",
    "SharedKVBuffer": "mptier.shm",
    "TierConfig": "mptier.config",
    "TransferJob": "mptier.jobs",
    "JobResult": "mptier.jobs",
    "LookupResult": "mptier.jobs",
    "TierEvent": "mptier.jobs",
    "FileMapper": "mptier.layout",
    "make_key": "mptier.keys",
    "split_key": "mptier.keys",
    "key_block_hash": "mptier.keys",
    "key_group_idx": "mptier.keys",
    "MptierError": "mptier.errors",
    "ConfigError": "mptier.errors",
    "BatchIOError": "mptier.errors",
    "TierClosedError": "mptier.errors",
}

__all__ = [
    "BatchIOError",
    "ConfigError",
    "FileMapper",
    "FileSystemTier",
    "JobResult",
    "LookupResult",
    "MptierError",
    "SharedKVBuffer",
    "TierClosedError",
    "TierConfig",
    "TierEvent",
    "TransferJob",
    "key_block_hash",
    "key_group_idx",
    "make_key",
    "split_key",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mptier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:
    from mptier.config import TierConfig
    from mptier.errors import (
        BatchIOError,
        ConfigError,
        MptierError,
        TierClosedError,
    )
    from mptier.jobs import JobResult, LookupResult, TierEvent, TransferJob
    from mptier.keys import key_block_hash, key_group_idx, make_key, split_key
    from mptier.layout import FileMapper
    from mptier.manager import FileSystemTier
    from mptier.shm import SharedKVBuffer

"""The cache on disk, off the scheduler's hot path: walk, usage, eviction, leases, tools.

    walk.Walker            incremental, layout-aware, never follows a link
    usage.UsageTracker     usage rebuilt by the walk, adjusted by a tier's own deltas
    usage.plan_eviction    LRU by atime with a bounded heap; usage.evict (inode-checked)
    maintain.BlockIndex    every block walked or told about, oldest atime first
    leases.Lease           a writer's flock-held lease; leases.TempSweeper / sweep_temps
    maintain.RootMaintainer  the one object a worker steps: all of the above per root
    folders.TopFolders     a block folder's <h3> folders, made ahead of the stores
    du / scrub / gc        the offline tools behind ``mptier du|scrub|gc``
"""

from __future__ import annotations

from mptier.storage.folders import (
    FOLDERS_AHEAD_MIN_CAPACITY,
    FOLDERS_AHEAD_MIN_INODES,
    TopFolders,
)
from mptier.storage.leases import (
    DEFAULT_STALE_TEMP_S,
    Lease,
    TempSweeper,
    fs_now,
    lease_state,
    probe_locks,
    sweep_temps,
)
from mptier.storage.maintain import BlockIndex, RootMaintainer, StepReport
from mptier.storage.names import key_of_block_path, temp_name, temp_tag
from mptier.storage.usage import (
    EvictionPlan,
    OldestBlocks,
    Usage,
    UsageTracker,
    evict,
    plan_eviction,
)
from mptier.storage.walk import BAD_KINDS, Entry, Kind, Walker

__all__ = [
    "BAD_KINDS",
    "DEFAULT_STALE_TEMP_S",
    "FOLDERS_AHEAD_MIN_CAPACITY",
    "FOLDERS_AHEAD_MIN_INODES",
    "BlockIndex",
    "Entry",
    "EvictionPlan",
    "Kind",
    "Lease",
    "OldestBlocks",
    "RootMaintainer",
    "StepReport",
    "TempSweeper",
    "TopFolders",
    "Usage",
    "UsageTracker",
    "Walker",
    "evict",
    "fs_now",
    "key_of_block_path",
    "lease_state",
    "plan_eviction",
    "probe_locks",
    "sweep_temps",
    "temp_name",
    "temp_tag",
]

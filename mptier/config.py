"""``TierConfig``: every tunable of the tier, with defaults, validation and TOML loading.

``configs/default.toml`` documents each field; :meth:`TierConfig.from_toml` reads a file
of the same shape. Unknown keys and bad values raise :class:`~mptier.errors.ConfigError`
(a ``ValueError``) naming the key and what would be accepted.

This is the one home of every default: the settings the pool, its supervisor, its
workers and a service are built from (``mptier.workers.PoolSettings``,
``SupervisorSettings``, ``BootSpec``, ``IoSettings``) name their fields as TierConfig
does and take their defaults from :func:`default_of`; tests/test_settings.py fails when
two places disagree. Which fields a service takes from its own configuration is derived
too (:data:`SERVICE_FIELDS`: all but the engine's own, :data:`ENGINE_FIELDS`).

Long because it is the one home of every default: each field carries its reason and its
check, and the derived sets (the service's fields) sit next to them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from mptier.errors import ConfigError
from mptier.fskind import MEMORY_FS_TYPES, fs_type
from mptier.storage.leases import DEFAULT_STALE_TEMP_S
from mptier.storage.maintain import DEFAULT_POLICY, POLICIES
from mptier.units import MiB, parse_byte_count

# task_bytes = "auto" where every root is in memory: there the workers' CPUs are what a
# load or store runs out of, and larger tasks left a burst's last jobs on fewer workers
# (tmpfs 2 MiB loads 0.88x with 32 MiB tasks, docs/performance.md section 20).
MEMORY_TASK_BYTES = 8 * MiB
# ... and where a root is on a disk or a server: each task's end (its last copies and
# records, the report, the next task's opens) leaves the device without that worker's
# I/O, so fewer, larger tasks keep it busier: on ext4, 2 MiB blocks, the disk had a
# request in flight 0.97 of a load phase against 0.88-0.91 with 8 MiB tasks, and 0.92-0.98
# of a store phase against 0.74-0.94 (bench/experiments/block_trace.py, section 20).
DEVICE_TASK_BYTES = 32 * MiB


@dataclass
class TierConfig:
    """Configuration of a :class:`~mptier.FileSystemTier`.

    Tunables that trade one thing for another say so in ``configs/default.toml``.
    """

    # Where block files live (created on demand).
    root_dir: str = ""
    # Several roots instead of root_dir (one per drive, no RAID): each key lives on
    # exactly one, chosen by rendezvous hashing of its block hash with a seed from the
    # root's path (mptier.storage.roots). Give root_dir or root_dirs, not both.
    root_dirs: list[str] = field(default_factory=list)
    # Bytes of blocks each root may hold (0 = unlimited); near it the least recently used
    # blocks are evicted, just the excess. The watermarks: of inodes in use (eviction for
    # inodes starts past high and stops under low).
    capacity_bytes: int = 0
    # Which blocks leave first (mptier.storage.maintain.POLICIES): "two-queue" keeps
    # blocks loaded since their store ahead of blocks never asked for again; "lru" takes
    # the least recently used, whatever it was.
    eviction_policy: str = DEFAULT_POLICY
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    # A store waits at most this long (and a quarter of io_timeout_s) for eviction to
    # make its room, then fails with ENOSPC.
    room_wait_s: float = 2.0
    # Where file locks do not work, a temporary file this old is a dead writer's.
    # (The storage tools' own default, which they need without a TierConfig.)
    stale_temp_s: float = DEFAULT_STALE_TEMP_S
    # Whether a writer's lease lock proves it alive to every node: "auto" (probe each
    # root), true, or false (locks are node-local: temporaries are judged by age only).
    lease_locks: bool | str = "auto"
    # Fault results (EIO, ETIMEDOUT, ENOTCONN, ...) in a row that take a root out of
    # rotation, and how long it stays out before an operation probes it again.
    root_failures_to_fail: int = 3
    root_retry_s: float = 30.0
    # Load-priority worker processes: take loads and lookups first, stores when idle.
    n_load_workers: int = 2
    # Store-priority worker processes: take stores first, loads when idle.
    n_store_workers: int = 2
    # Jobs are cut into tasks of at most this many bytes (at least one block each).
    # "auto": MEMORY_TASK_BYTES where every root is in memory, DEVICE_TASK_BYTES where
    # one is on a disk or a server (task_bytes_for).
    task_bytes: int | str = "auto"
    # A job that finds workers idle is cut into smaller tasks (down to 1 MiB), one for
    # each worker that can run at once, so that a lone job uses every CPU the pool has.
    spread_jobs: bool = True
    # A task running longer than this gets its worker killed (hung mount) and is failed
    # (loads) or retried elsewhere (stores).
    io_timeout_s: float = 60.0
    # How many times a store task whose worker died is retried on another worker.
    max_task_retries: int = 2
    # "auto": probe the root once; True: use where aligned (fall back if refused);
    # False: always buffered I/O.
    use_o_direct: bool | str = "auto"
    # vLLM's option: a CRC32C per block in the user xattr user.vllm.kv_crc32c, written on
    # store and checked on load. "auto": on where the root has user xattrs (probed once),
    # off with one warning elsewhere; true: refuse to start without them; false: none.
    checksum_blocks: bool | str = "auto"
    # Batches through io_uring, several blocks in flight per worker (native core only).
    # "auto": where the kernel allows it and the root is not in memory (tmpfs, ramfs);
    # True: wherever the kernel allows it; False: the system-call loop only.
    io_uring: bool | str = "auto"
    # Process workers load through a private bounce buffer, then copy, so a read that
    # outlives a killed worker never lands in a slot the engine reused. "auto": where a
    # read may outlive its worker (O_DIRECT on a disk; network and FUSE file systems),
    # never on tmpfs; True: also buffered reads from local disks; False: never.
    bounce_loads: bool | str = "auto"
    # Process workers store through the same private buffer: each block copied into a
    # slot of it (in huge pages) and written from there, since a direct write from the
    # engine's 4 KiB pages hands the device one segment per page. "auto": O_DIRECT
    # stores on a local disk (mptier.workers.bounce, BOUNCE_STORES_FS_TYPES); True:
    # wherever not in memory; False: written from the engine's slots (side by side).
    bounce_stores: bool | str = "auto"
    # Bounced loads through io_uring read a task's blocks in waves (at most half the
    # bounce buffer's and of the task's blocks in flight), the next wave sent as the last
    # returns, before its copies. False: every read of a task at once (side by side).
    bounce_waves: bool = True
    # Lookups through io_uring (where loads go through it) open every key of a lookup
    # task at once, so a cold key's metadata reads go to the device together. False: one
    # key after another, as the system-call loop does (side by side).
    ring_lookups: bool = True
    # The caretaker makes the 4,096 top folders of the tier's block folder ahead (a slice
    # per step), and the walk keeps them when empty: a store into a fresh root then
    # makes one folder per block, not two, and no store waits for the lock of the block
    # folder. "auto": on local file systems (disks and memory) unless capacity_bytes is
    # under FOLDERS_AHEAD_MIN_CAPACITY or free inodes under FOLDERS_AHEAD_MIN_INODES
    # (mptier.storage.folders); True: on every root; False: made on demand by the stores
    # and removed when empty (side by side). Cost: 4,096 folders (16 MiB on ext4).
    folders_ahead: bool | str = "auto"
    # Use the compiled C core when it is available (False: the pure-Python twin).
    native: bool = True
    # Emit "stored" events from take_events() for keys of successful stores.
    enable_events: bool = False
    # CPU priority of worker processes (0 = same as the engine, 19 = lowest).
    worker_nice: int = 10
    # CPUs the workers may run on (empty: all). e.g. [1] keeps them off core 0.
    worker_cpus: list[int] = field(default_factory=list)
    # Map the primary buffer's existing pages into each worker when it attaches
    # (MADV_POPULATE_READ of resident pages only: nothing allocated or dirtied), so the
    # first jobs do not pay one minor fault per 4 KiB page.
    prefault: bool = True
    # A worker that has not reported ready by then counts as failed to boot.
    worker_start_timeout_s: float = 60.0
    # Workers SIGKILL cannot end (stuck in the kernel on a dead mount) that are parked,
    # each holding a spare slot, before the tier fails I/O on the root fast instead.
    max_stuck_workers: int = 4
    # Idle workers are pinged this often; one that answers nothing for as long is
    # replaced (0 = no heartbeat).
    heartbeat_s: float = 5.0
    # A worker whose private memory (RSS less the shared buffer) passes this is
    # replaced (0 = no limit).
    max_worker_rss_bytes: int = 0
    # Most keys checked by one lookup task.
    lookup_batch_keys: int = 256
    # Attach to the worker service of this name (`mptier serve --name NAME`) instead of
    # starting workers in this process ("" = start them here).
    service: str = ""
    # Who besides this process's own uid and root may connect to its sockets (attach to
    # a `mptier serve`, read a status socket): members of this group, a name or gid
    # ("" = nobody else). A run folder writable by this group is accepted too.
    service_group: str = ""
    # The user (name or uid) a service this engine attaches to runs as, when that is
    # neither this process's uid nor root: its run folder and listening socket are then
    # believed too ("" = only our own uid and root). See docs/security.md.
    service_user: str = ""
    # Status socket (see mptier.monitor): "auto" = <run dir>/engine-<pid>.status.sock,
    # "" = none, or a name of your own.
    status_socket: str = "auto"
    # Prometheus metrics served by the tier itself on metrics_addr:metrics_port (0 = off).
    metrics_port: int = 0
    metrics_addr: str = "127.0.0.1"
    # File layout fields (vLLM's FileMapper): they name the cache folder.
    model_name: str = "model"
    tokens_per_hash: int = 16
    blocks_per_file: int = 1
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    rank: int = 0
    dtype: str = "bfloat16"
    kv_cache_groups: list[dict[str, Any]] | None = None
    inference_engine: str = "vllm"
    parallel_agnostic: bool = False
    replicated_layout: bool = False
    canonical_format: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    # -- construction -------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any], base: TierConfig | None = None) -> TierConfig:
        """A config from ``values`` on top of ``base`` (or the defaults).

        Raises ``ConfigError`` naming any unknown key.
        """
        known = set(cls.field_names())
        unknown = sorted(set(values) - known)
        if unknown:
            import difflib

            hints = [f"{key!r} (did you mean {close[0]!r}?)" if (
                close := difflib.get_close_matches(key, known, n=1)) else repr(key)
                for key in unknown]
            raise ConfigError(
                f"unknown TierConfig key(s) {', '.join(hints)}; "
                f"known keys: {', '.join(sorted(known))}")
        start = dataclasses.asdict(base) if base is not None else {}
        start.update(values)
        return cls(**start)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], **overrides: Any) -> TierConfig:
        """Load a TOML file (flat keys, or under a ``[tier]`` table); ``overrides`` win."""
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {os.fspath(path)!r} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {os.fspath(path)!r} is not valid TOML: {exc}") \
                from None
        if "tier" in data and isinstance(data["tier"], dict):
            data = data["tier"]
        data.update(overrides)
        return cls.from_dict(data)

    @classmethod
    def from_command_line(cls, path: str | None, workers: str | None,
                          settings: list[str] | None) -> TierConfig:
        """A config as the commands take it: the TOML file ``path`` (or the defaults),
        ``--workers LOAD+STORE`` and ``--set KEY=VALUE`` items on top (a VALUE is JSON
        where it parses as JSON, else a string). Raises ``ConfigError`` naming a bad
        item and its form."""
        overrides: dict[str, Any] = {}
        if workers:
            try:
                loads, stores = (int(x) for x in workers.split("+"))
            except ValueError:
                raise ConfigError(f"--workers {workers!r}: expected LOAD+STORE, e.g. 2+2"
                                  ) from None
            overrides.update(n_load_workers=loads, n_store_workers=stores)
        for item in settings or []:
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. task_bytes=4M")
            try:
                overrides[key] = json.loads(value)
            except json.JSONDecodeError:
                overrides[key] = value
        if path:
            return cls.from_toml(path, **overrides)
        return cls.from_dict(overrides)

    def replace(self, **changes: Any) -> TierConfig:
        return self.from_dict(changes, base=self)

    def roots(self) -> list[str]:
        """The roots in use: ``root_dirs``, else ``[root_dir]`` (normalised paths; empty
        when neither is set)."""
        if self.root_dirs:
            return [os.path.normpath(r) for r in self.root_dirs]
        return [os.path.normpath(self.root_dir)] if self.root_dir else []

    def task_bytes_for(self, roots: list[str] | None = None) -> int:
        """``task_bytes`` in bytes: the number given, or for "auto" MEMORY_TASK_BYTES
        where every root (``roots``, else this config's) is in memory (tmpfs, ramfs,
        hugetlbfs) and DEVICE_TASK_BYTES otherwise. The roots' file systems are read from
        the mount table: nothing here touches a root (one may be a hung mount)."""
        if self.task_bytes != "auto":
            return int(self.task_bytes)
        roots = self.roots() if roots is None else roots
        if roots and all(fs_type(root) in MEMORY_FS_TYPES for root in roots):
            return MEMORY_TASK_BYTES
        return DEVICE_TASK_BYTES

    def layout_kwargs(self) -> dict[str, Any]:
        """Arguments for :class:`mptier.layout.FileMapper` (without ``root_dir``)."""
        return {name: getattr(self, name) for name in LAYOUT_FIELDS}

    @classmethod
    def layout_from(cls, values: Any) -> dict[str, Any]:
        """Layout fields from elsewhere (an engine attaching to a service), checked by
        the rules of a local configuration: the same :meth:`validate`, so there is one
        rule. Returns the :meth:`layout_kwargs` they make (missing ones take the
        defaults). Raises ``ConfigError`` naming a field that is not a layout field or
        a bad value."""
        if not isinstance(values, dict):
            raise ConfigError(f"layout = {values!r:.80} is invalid: expected a table of "
                              f"layout fields ({', '.join(LAYOUT_FIELDS)})")
        other = sorted(str(k) for k in set(values) - set(LAYOUT_FIELDS))
        if other:
            raise ConfigError(f"layout field(s) {', '.join(map(repr, other))} are not "
                              f"layout fields; a layout has only {', '.join(LAYOUT_FIELDS)}")
        return cls.from_dict(values).layout_kwargs()

    # -- validation ---------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad field and what it accepts."""
        self.root_dir = os.fspath(self.root_dir) if self.root_dir is not None else ""
        _want(isinstance(self.root_dir, str), "root_dir", self.root_dir, "a path string")
        self._validate_storage()
        for name in ("n_load_workers", "n_store_workers"):
            _want_int(self, name, low=0, high=256)
        _want(self.n_load_workers + self.n_store_workers >= 1, "n_load_workers",
              self.n_load_workers, "at least one worker in all (n_load_workers + "
              "n_store_workers >= 1)")
        if self.task_bytes != "auto":
            self.task_bytes = _parse_bytes("task_bytes", self.task_bytes)
            _want(self.task_bytes >= 1, "task_bytes", self.task_bytes,
                  'a positive byte count, or "auto"')
        _want_int(self, "max_stuck_workers", low=0, high=1024)
        _want(isinstance(self.heartbeat_s, (int, float)) and not isinstance(
            self.heartbeat_s, bool) and self.heartbeat_s >= 0, "heartbeat_s",
            self.heartbeat_s, "a number of seconds >= 0 (0 turns the heartbeat off)")
        self.max_worker_rss_bytes = _parse_bytes("max_worker_rss_bytes",
                                                 self.max_worker_rss_bytes)
        _want(self.max_worker_rss_bytes >= 0, "max_worker_rss_bytes",
              self.max_worker_rss_bytes, "a byte count >= 0 (0 = no limit)")
        for name in ("io_timeout_s", "worker_start_timeout_s"):
            value = getattr(self, name)
            _want(isinstance(value, (int, float)) and not isinstance(value, bool)
                  and value > 0, name, value, "a positive number of seconds")
        _want_int(self, "max_task_retries", low=0, high=100)
        for name in ("use_o_direct", "checksum_blocks", "io_uring", "lease_locks",
                     "bounce_loads", "bounce_stores", "folders_ahead"):
            setattr(self, name, _tristate(name, getattr(self, name)))
        for name in ("native", "enable_events", "prefault", "parallel_agnostic",
                     "replicated_layout", "spread_jobs", "bounce_waves",
                     "ring_lookups"):
            _want(isinstance(getattr(self, name), bool), name, getattr(self, name),
                  "true or false")
        _want_int(self, "worker_nice", low=0, high=19)
        _want(self.eviction_policy in POLICIES, "eviction_policy", self.eviction_policy,
              " or ".join(f'"{p}"' for p in POLICIES))
        _want(isinstance(self.worker_cpus, (list, tuple))
              and all(isinstance(c, int) and c >= 0 for c in self.worker_cpus),
              "worker_cpus", self.worker_cpus, "a list of CPU numbers, e.g. [1]")
        self.worker_cpus = list(self.worker_cpus)
        _want_int(self, "lookup_batch_keys", low=1, high=1 << 20)
        if self.service:
            from mptier.rundir import check_name

            try:
                check_name(self.service)
            except ConfigError as exc:
                raise ConfigError(f"TierConfig.service: {exc}") from None
        for name in ("service_group", "service_user"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(self, name, str(value))
            _want(isinstance(getattr(self, name), str), name, value,
                  "a name or a number, or \"\" for none")
        from mptier.rundir import MAX_NAME, NAME_RE

        _want(isinstance(self.status_socket, str) and (
            self.status_socket in ("", "auto")
            or NAME_RE.fullmatch(self.status_socket) is not None),
            "status_socket", self.status_socket,
            '"auto" (engine-<pid>), "" (no status socket) or a name of letters, digits, '
            f"'.', '_' and '-' (at most {MAX_NAME} characters, not starting with '.')")
        _want_int(self, "metrics_port", low=0, high=65535)
        _want(isinstance(self.metrics_addr, str) and self.metrics_addr != "", "metrics_addr",
              self.metrics_addr, 'an address to listen on, e.g. "127.0.0.1" or "0.0.0.0"')
        _want(isinstance(self.model_name, str) and self.model_name != "", "model_name",
              self.model_name, "a non-empty string")
        for name in ("tokens_per_hash", "blocks_per_file", "tp_size", "pp_size", "pcp_size",
                     "dcp_size"):
            _want_int(self, name, low=1, high=1 << 30)
        _want_int(self, "rank", low=0, high=1 << 30)
        _want(isinstance(self.dtype, str), "dtype", self.dtype, "a string such as 'bfloat16'")
        _want(self.kv_cache_groups is None or isinstance(self.kv_cache_groups, list),
              "kv_cache_groups", self.kv_cache_groups, "a list of tables, or absent")
        _want(isinstance(self.inference_engine, str), "inference_engine",
              self.inference_engine, "a string")
        _want(self.canonical_format is None or isinstance(self.canonical_format, str),
              "canonical_format", self.canonical_format, "a string, or absent")
        from mptier.layout import FileMapper

        try:  # the folder names they make: the rule every layout path obeys
            FileMapper("", **self.layout_kwargs())
        except ConfigError as exc:
            raise ConfigError(f"TierConfig.{exc}") from None


    def _validate_storage(self) -> None:
        from mptier.storage.roots import MAX_ROOTS

        dirs = self.root_dirs
        _want(isinstance(dirs, (list, tuple)) and all(
            isinstance(d, (str, os.PathLike)) and os.fspath(d) for d in dirs),
            "root_dirs", dirs, 'a list of folder paths, e.g. ["/mnt/nvme0/kv", "/mnt/nvme1/kv"]')
        self.root_dirs = [os.fspath(d) for d in dirs]
        if self.root_dirs and self.root_dir:
            raise ConfigError(
                f"TierConfig.root_dir = {self.root_dir!r} and TierConfig.root_dirs = "
                f"{self.root_dirs!r} are both set: give one root as root_dir, or every root "
                "in root_dirs (then leave root_dir empty)")
        _want(len(self.root_dirs) <= MAX_ROOTS, "root_dirs", self.root_dirs,
              f"at most {MAX_ROOTS} roots")
        normalized = [os.path.normpath(d) for d in self.root_dirs]
        twice = sorted({d for d in normalized if normalized.count(d) > 1})
        _want(not twice, "root_dirs", self.root_dirs,
              f"each root once (listed more than once: {', '.join(twice)})")
        self.capacity_bytes = _parse_bytes("capacity_bytes", self.capacity_bytes)
        _want(self.capacity_bytes >= 0, "capacity_bytes", self.capacity_bytes,
              'a byte count per root >= 0 such as "500G" (0 = unlimited)')
        for name in ("high_watermark", "low_watermark"):
            value = getattr(self, name)
            _want(isinstance(value, (int, float)) and not isinstance(value, bool)
                  and 0 < value <= 1, name, value, "a fraction of capacity_bytes in (0, 1]")
        _want(self.low_watermark < self.high_watermark, "low_watermark", self.low_watermark,
              f"a fraction below high_watermark = {self.high_watermark!r} (0 < "
              "low_watermark < high_watermark <= 1, e.g. 0.85 and 0.95)")
        for name in ("stale_temp_s", "root_retry_s", "room_wait_s"):
            value = getattr(self, name)
            _want(isinstance(value, (int, float)) and not isinstance(value, bool)
                  and value > 0, name, value, "a positive number of seconds")
        _want_int(self, "root_failures_to_fail", low=1, high=1_000_000)


# The fields that name the cache folder (vLLM's FileMapper): an engine's own even when it
# attaches to a service.
LAYOUT_FIELDS = ("model_name", "tokens_per_hash", "blocks_per_file", "tp_size", "pp_size",
                 "pcp_size", "dcp_size", "rank", "dtype", "kv_cache_groups",
                 "inference_engine", "parallel_agnostic", "replicated_layout",
                 "canonical_format")
# The fields only an engine uses, also when it attaches to a service: its layout, how it
# cuts and batches its jobs, its events, which service it attaches to (and whom it
# believes), its own status socket.
ENGINE_FIELDS = (*LAYOUT_FIELDS, "task_bytes", "spread_jobs", "enable_events",
                 "lookup_batch_keys",
                 "service", "service_user", "status_socket")


def default_of(name: str) -> Any:
    """TierConfig's default for field ``name`` (a fresh copy of a list default): what
    every settings class elsewhere takes as its own default of the same name. Raises
    ``KeyError`` for a name TierConfig does not have."""
    spec = TierConfig.__dataclass_fields__[name]
    if spec.default_factory is not MISSING:
        return spec.default_factory()
    return spec.default


# The fields a service takes from its own configuration (its roots, pool, workers and
# monitoring): every field but the engine's own.
SERVICE_FIELDS = tuple(f.name for f in fields(TierConfig) if f.name not in ENGINE_FIELDS)


def _want(ok: bool, name: str, value: Any, accepted: str) -> None:
    if not ok:
        raise ConfigError(f"TierConfig.{name} = {value!r} is invalid: expected {accepted}")


def _tristate(name: str, value: Any) -> bool | str:
    """``"auto"``, true or false (also the strings "true"/"false")."""
    if isinstance(value, str):
        lowered = value.lower()
        mapping = {"auto": "auto", "true": True, "false": False}
        _want(lowered in mapping, name, value, '"auto", true or false')
        return mapping[lowered]
    _want(isinstance(value, bool), name, value, '"auto", true or false')
    return value


def _want_int(config: TierConfig, name: str, *, low: int, high: int) -> None:
    value = getattr(config, name)
    _want(isinstance(value, int) and not isinstance(value, bool) and low <= value <= high,
          name, value, f"a whole number from {low} to {high}")


def _parse_bytes(name: str, value: Any) -> int:
    """Accept 8388608, "8M", "8 MiB", "512k" (binary units)."""
    parsed = parse_byte_count(value)
    if parsed is None:
        raise ConfigError(f"TierConfig.{name} = {value!r} is invalid: expected a byte count "
                          "such as 8388608, \"8M\" or \"512KiB\"")
    return parsed


def parse_bytes(text: str | int) -> int:
    """Parse a byte count with an optional binary unit ("2M", "256KiB")."""
    return _parse_bytes("value", text)

"""Design (a): mptier's own ``FileSystemTier`` with the given config.

Variants pass ``TierConfig`` overrides from the ``--designs`` spec, so pool sizes, task
sizes and CPU priority are compared side by side in one run::

    mptier                      the default pool
    mptier:workers=2+2          n_load_workers=2, n_store_workers=2
    mptier:nice=19              worker_nice=19
    mptier:cpus=1               worker_cpus=[1] (keep the workers off core 0)
    mptier:task_bytes=8M        any other TierConfig field by its own name
    mptier:native=0             the pure-Python I/O twin instead of the C core
    mptier:checksum=true        checksum_blocks=true (against checksum=false: their cost)
    mptier:uring=false          io_uring=false: the C core's system-call loop
    mptier:policy=normal        workers back to SCHED_OTHER after they start (they run
                                SCHED_BATCH; this measures what that buys)
    mptier:roots=3              root_dirs: the design's folder and two sub-folders of it
                                (one file system: it measures the routing and the
                                per-root caretakers, not more drives)
    mptier:capacity_bytes=256M  a capacity budget per root (eviction past 95 %)

The primary buffer must be mptier's ``SharedKVBuffer`` (worker processes map it); the
harness makes one when the class exists.
"""

from __future__ import annotations

import os
from typing import Any

from mptier.bench.base import MODEL_NAME, Design, DesignContext

# Short option names -> TierConfig fields.
_ALIASES = {"nice": "worker_nice", "task": "task_bytes", "prefault": "prefault",
            "o_direct": "use_o_direct", "checksum": "checksum_blocks", "uring": "io_uring"}


def _literal(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def config_overrides(options: dict[str, str]) -> dict[str, Any]:
    """Turn ``--designs`` options into ``TierConfig`` keyword arguments.

    ``workers=L+S`` sets both pool sizes; ``cpus=1,2`` or ``cpus=1-3`` sets
    ``worker_cpus``; ``native``/``prefault`` take 0/1; other keys pass through by name.
    Raises ``ValueError`` for a malformed value.
    """
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key == "policy":
            continue  # not a TierConfig field: the design applies it (worker_policy)
        if key == "workers":
            try:
                load, store = (int(x) for x in value.split("+"))
            except ValueError:
                raise ValueError(f"workers={value!r}: expected LOAD+STORE, e.g. 2+2") from None
            out["n_load_workers"], out["n_store_workers"] = load, store
        elif key == "cpus":
            out["worker_cpus"] = _cpu_list(value)
        elif key in ("native", "prefault", "enable_events"):
            out[key] = value.lower() in ("1", "true", "yes", "on")
        elif key in ("task_bytes", "task"):
            out["task_bytes"] = value  # TierConfig parses "8M"
        else:
            out[_ALIASES.get(key, key)] = _literal(value)
    return out


def _cpu_list(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.replace("+", ",").split(","):
        if "-" in part:
            low, high = (int(x) for x in part.split("-"))
            cpus.extend(range(low, high + 1))
        elif part:
            cpus.append(int(part))
    return cpus


_POLICIES = {"normal": "SCHED_OTHER", "other": "SCHED_OTHER", "batch": "SCHED_BATCH"}


def worker_policy(tier: Any, name: str) -> str:
    """Put every thread of every worker of ``tier`` under scheduling policy ``name``
    ("normal" or "batch"); returns the policy's name. Raises ``ValueError`` for another
    name."""
    import os

    if name not in _POLICIES:
        raise ValueError(f"policy={name!r}: expected one of {sorted(_POLICIES)}")
    policy = getattr(os, _POLICIES[name])
    for pid in tier.worker_pids():
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
    return _POLICIES[name]


def _root_folders(root: str, n: int) -> list[str]:
    """``n`` roots for a ``roots=N`` variant: ``<root>/root<i>``. The first one is the
    harness's own folder (so its clean-up and block_path find blocks there too)."""
    if not 1 <= n <= 32:
        raise ValueError(f"roots={n}: expected 1 to 32")
    folders = [root] + [os.path.join(root, f"root{i}") for i in range(1, n)]
    for folder in folders:
        os.makedirs(folder, exist_ok=True)
    return folders


class MptierDesign(Design):
    letter = "a"
    kind = "mptier"

    def __init__(self, label: str, options: dict[str, str] | None = None) -> None:
        super().__init__(label, options)
        self.overrides = config_overrides(self.options)
        if self.options.get("policy", "normal") not in _POLICIES:
            raise ValueError(f"{label}: policy={self.options['policy']!r}: expected one "
                             f"of {sorted(_POLICIES)}")
        self._tier: Any = None

    @classmethod
    def available(cls) -> str | None:
        try:
            import mptier
            mptier.FileSystemTier  # noqa: B018 - the engine may not be built yet
            mptier.SharedKVBuffer  # noqa: B018
        except (ImportError, AttributeError) as exc:
            return f"mptier.FileSystemTier is not available yet ({exc})"
        return None

    def setup(self, ctx: DesignContext) -> None:
        import mptier

        if ctx.shared is None:
            raise RuntimeError("design (a) needs the buffer in mptier.SharedKVBuffer")
        config = {"model_name": MODEL_NAME, **self.overrides}
        roots = config.pop("roots", None)
        where: dict[str, Any] = {"root_dir": ctx.root}
        if roots is not None:
            where = {"root_dirs": _root_folders(ctx.root, int(roots))}
        mptier.TierConfig(**where, **config)  # raise on a bad override first
        self._tier = mptier.FileSystemTier(ctx.shared, **where, **config)
        self.info.update({k: v for k, v in config.items() if k != "model_name"})
        if "policy" in self.options:
            self.info["worker_policy"] = worker_policy(self._tier, self.options["policy"])
        self.info["workers"] = (f"{self._tier.config.n_load_workers}+"
                                f"{self._tier.config.n_store_workers}")
        stats = getattr(self._tier, "stats", None)
        if callable(stats):
            try:
                snapshot = stats()
            except Exception as exc:  # stats are decoration; never fail the run on them
                self.notes.append(f"stats() failed: {exc}")
            else:
                for key in ("mode", "o_direct", "native", "blocks_per_task"):
                    if isinstance(snapshot, dict) and key in snapshot:
                        self.info[key] = snapshot[key]
                # what the first root got, "auto" decided (e.g. no bounced stores out of
                # an engine buffer in huge pages)
                for key in ("bounce_loads", "bounce_stores"):
                    roots = snapshot.get("roots") if isinstance(snapshot, dict) else None
                    if roots and key in roots[0]:
                        self.info[key] = roots[0][key]

    def block_path(self, ctx: DesignContext, key: bytes) -> str:
        if self._tier is not None:
            return self._tier.path_for(key)  # several roots: the one the key maps to
        return super().block_path(ctx, key)

    def submit_store(self, job: Any) -> None:
        self._tier.submit_store(job)

    def submit_load(self, job: Any) -> None:
        self._tier.submit_load(job)

    def get_finished(self) -> list[Any]:
        return self._tier.get_finished_jobs()

    def lookup(self, key: bytes, req_id: str) -> Any:
        return self._tier.lookup(key, req_id)

    def on_schedule_end(self) -> None:
        self._tier.on_schedule_end()

    def drain(self) -> None:
        self._tier.drain_jobs()

    def close(self) -> None:
        if self._tier is not None:
            tier, self._tier = self._tier, None
            tier.shutdown()

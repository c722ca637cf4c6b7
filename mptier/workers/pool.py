"""The worker pool: what an engine (or a service) talks to. See :mod:`mptier.workers`.

:class:`WorkerPool` runs worker processes and the supervisor thread that keeps them
(:mod:`mptier.workers.supervisor`). :class:`ThreadWorkers` runs the same serving loop on
threads of the engine, for a buffer that cannot be shared with other processes. Both::

    pool = open_pool(settings, memory)    # WorkerPool, or ThreadWorkers when memory given
    pool.start()                          # workers boot; raises MptierError if they cannot
    io = pool.attach(session)             # prepares the root; every worker takes the session
    ...                                   # the engine queues tasks; workers report
    pool.end_session()                    # after the engine closed its lifeline
    pool.stop()                           # workers leave (escalating); idempotent

``start``, ``attach``, ``end_session`` and ``stop`` block (each for a bounded time);
``stats``, ``pids`` and ``unavailable`` do not.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from mptier import fskind, native
from mptier.config import default_of
from mptier.errors import ConfigError, MptierError
from mptier.jobs import TaskKind
from mptier.layout import FileMapper
from mptier.workers.bounce import needs_bounce
from mptier.workers.contract import Pool
from mptier.workers.control import (
    LATENCY_BUCKETS,
    ROOT_COMPLETE,
    ROOT_EVICTING,
    ROOT_INODES_LOW,
    ControlBlock,
    RootState,
    SlotState,
    SlotWriter,
    latency_percentiles,
)
from mptier.workers.health import RootHealth
from mptier.workers.launcher import BootSpec
from mptier.workers.session import (
    ROOM_WAIT_S,
    IoSettings,
    RootIo,
    Session,
    WorkerSession,
)
from mptier.workers.supervisor import (
    Phase,
    PoolCounters,
    Supervisor,
    SupervisorSettings,
)
from mptier.workers.worker import WorkerContext, serve

if TYPE_CHECKING:
    from mptier.config import TierConfig

log = logging.getLogger("mptier.workers")

# stop(): how long workers get to finish their copy and leave when asked, then after
# SIGTERM, then after SIGKILL (a worker stuck in the kernel is then left behind).
STOP_GRACE_S = 10.0
TERM_GRACE_S = 2.0
KILL_GRACE_S = 2.0
# How long end_session() waits for workers to report they detached.
DETACH_GRACE_S = 10.0


@dataclass
class PoolSettings:
    """How a pool runs; built from a :class:`~mptier.config.TierConfig` by
    :meth:`from_config` (a service's config in a service, the engine's otherwise).

    Every field but ``backend`` is the TierConfig field of the same name, with its
    default (:func:`~mptier.config.default_of`); ``backend`` is what ``native`` comes to
    in this process (:func:`backend_name`)."""

    root_dir: str  # the first root (or the only one)
    n_load_workers: int = default_of("n_load_workers")
    n_store_workers: int = default_of("n_store_workers")
    use_o_direct: bool | str = default_of("use_o_direct")
    checksum_blocks: bool | str = default_of("checksum_blocks")
    io_uring: bool | str = default_of("io_uring")
    bounce_loads: bool | str = default_of("bounce_loads")
    backend: str = "native"
    prefault: bool = default_of("prefault")
    worker_nice: int = default_of("worker_nice")
    worker_cpus: list[int] = field(default_factory=list)
    io_timeout_s: float = default_of("io_timeout_s")
    max_task_retries: int = default_of("max_task_retries")
    worker_start_timeout_s: float = default_of("worker_start_timeout_s")
    max_stuck_workers: int = default_of("max_stuck_workers")
    heartbeat_s: float = default_of("heartbeat_s")
    max_worker_rss_bytes: int = default_of("max_worker_rss_bytes")
    root_dirs: list[str] = field(default_factory=list)  # several roots (else root_dir)
    capacity_bytes: int = default_of("capacity_bytes")
    high_watermark: float = default_of("high_watermark")
    low_watermark: float = default_of("low_watermark")
    stale_temp_s: float = default_of("stale_temp_s")
    lease_locks: bool | str = default_of("lease_locks")
    root_failures_to_fail: int = default_of("root_failures_to_fail")
    root_retry_s: float = default_of("root_retry_s")

    @classmethod
    def from_config(cls, cfg: TierConfig) -> PoolSettings:
        """Every field from ``cfg``'s field of the same name (the roots normalised)."""
        roots = cfg.roots()
        same = {f.name: copy.copy(getattr(cfg, f.name)) for f in fields(cls)
                if f.name not in ("root_dir", "root_dirs", "backend")}
        return cls(root_dir=roots[0] if roots else "", root_dirs=roots,
                   backend=backend_name(cfg.native), **same)

    @property
    def roles(self) -> list[str]:
        return ["load"] * self.n_load_workers + ["store"] * self.n_store_workers

    @property
    def roots(self) -> list[str]:
        """Every root, normalised (``root_dirs``, else ``[root_dir]``)."""
        return [os.path.normpath(r) for r in (self.root_dirs or [self.root_dir])]

    @property
    def root_label(self) -> str:
        return ", ".join(self.roots)


def _same_fields(cls: type, settings: PoolSettings) -> dict[str, Any]:
    """The fields of settings class ``cls`` that ``settings`` has by the same name."""
    names = {f.name for f in fields(settings)}
    return {f.name: getattr(settings, f.name) for f in fields(cls) if f.name in names}


def backend_name(prefer_native: bool) -> str:
    """The I/O backend a tier uses: native when asked for, built, and not switched off
    for the whole process with ``MPTIER_NATIVE=0``."""
    return "native" if prefer_native and native.BACKEND == "native" else "python"


def prepare_io(settings: PoolSettings, layout: dict[str, Any], block_bytes: int
               ) -> IoSettings:
    """Make the cache folder for ``layout`` under every root, check its block size and
    probe what each file system offers (O_DIRECT, user xattrs for checksums, O_TMPFILE
    files that survive being published, whether io_uring pays); returns the settings
    workers use. Raises
    ``OSError`` naming the path, or ``ConfigError`` for a block-size clash or
    ``checksum_blocks=true`` on a root without user xattrs. Every root must be usable
    now: a root that is down at start is a configuration to fix (leave it out of
    ``root_dirs``; only its keys move)."""
    roots = [_prepare_root(settings, root, layout, block_bytes) for root in settings.roots]
    first = roots[0]
    return IoSettings(root_dir=first.path, use_o_direct=first.use_o_direct,
                      backend=settings.backend, prefault=settings.prefault,
                      checksum=first.checksum, touch=True, tmpfile=first.tmpfile,
                      uring=first.uring,
                      roots=roots, capacity_bytes=settings.capacity_bytes,
                      high_watermark=settings.high_watermark,
                      low_watermark=settings.low_watermark,
                      stale_temp_s=settings.stale_temp_s,
                      lease_locks=None if settings.lease_locks == "auto"
                      else bool(settings.lease_locks),
                      room_wait_s=min(ROOM_WAIT_S, settings.io_timeout_s / 4))


def _prepare_root(settings: PoolSettings, root: str, layout: dict[str, Any],
                  block_bytes: int) -> RootIo:
    mapper = FileMapper(root, **layout)
    mapper.prepare(block_bytes)
    backend = native.get_backend(settings.backend)
    where = mapper.blocks_dir
    o_direct = settings.use_o_direct
    if o_direct == "auto":
        o_direct = backend.probe_o_direct(where)
        if not o_direct:
            log.warning("mptier: O_DIRECT is not supported under %s; using buffered I/O",
                        root)
    checksum = settings.checksum_blocks
    if checksum is not False and not backend.probe_xattr(where):
        if checksum is True:
            raise ConfigError(
                f"checksum_blocks=true, but {root} does not keep user extended "
                f"attributes, where the block checksums (xattr {native.XATTR_NAME}) live; "
                "mount it with user xattrs (e.g. -o user_xattr), or set checksum_blocks to "
                '"auto" or false')
        log.warning("mptier: %s does not keep user extended attributes; block checksums "
                    "(checksum_blocks) are off for this tier", root)
        checksum = False
    tmpfile = backend.probe_o_tmpfile(where)
    if tmpfile and fskind.fs_magic(where) not in TMPFILE_FILE_SYSTEMS:
        # The probe publishes, closes and reads back, but a FUSE daemon may drop the
        # inode after close() returned (the release is sent asynchronously): measured on
        # JuiceFS 1.4.2, 2 of 4 probes passed and every store of those tiers "succeeded"
        # into files that were gone a moment later. Only file systems known to keep a
        # linked O_TMPFILE file get it; the rest write named temporaries under leases.
        log.info("mptier: %s accepts O_TMPFILE, but its file system (magic %#x) is not "
                 "one known to keep linked O_TMPFILE files; using named temporary files",
                 root, fskind.fs_magic(where) or 0)
        tmpfile = False
    return RootIo(root, use_o_direct=bool(o_direct), checksum=bool(checksum),
                  tmpfile=tmpfile, uring=use_uring(settings.io_uring, backend, where),
                  bounce=needs_bounce(root, bool(o_direct), settings.bounce_loads))


def use_uring(setting: bool | str, backend: Any, where: str) -> bool:
    """Whether workers batch through io_uring (``TierConfig.io_uring``): "auto" where
    this process can use it and the root is not in memory (on tmpfs the loop is as fast:
    docs/performance.md), True wherever it can, False never. Workers whose kernel
    refuses it take the system-call loop anyway."""
    if setting is False or not backend.uring_available():
        return False
    return setting is True or not backend.probe_in_memory(where)


# The local file systems whose O_TMPFILE files survive linkat + close: ext2/3/4, xfs,
# btrfs, tmpfs, f2fs. Not NFS (no O_TMPFILE), not FUSE (JuiceFS loses them).
TMPFILE_FILE_SYSTEMS = frozenset({
    fskind.EXT4_SUPER_MAGIC, fskind.XFS_SUPER_MAGIC, fskind.BTRFS_SUPER_MAGIC,
    fskind.TMPFS_MAGIC, fskind.F2FS_SUPER_MAGIC})


def task_latency(control: ControlBlock) -> dict[str, dict[str, Any]]:
    """Task latency per kind ("store", "load", "lookup": ``p50_s``, ``p99_s``, ``count``)
    over every slot and the pool's whole life, from the workers' latency buckets in the
    control block: what a service reports, which never sees the engine's completions."""
    out = {}
    for kind in TaskKind:
        counts = [0] * LATENCY_BUCKETS
        for slot in range(control.n_slots):
            for i, n in enumerate(control.slot_latency(slot, kind)):
                counts[i] += n
        out[kind.name.lower()] = latency_percentiles(counts)
    return out


def store_figures(control: ControlBlock) -> dict[str, int]:
    """``written_bytes``: bytes of blocks the pool's stores wrote; ``skipped_bytes``:
    bytes of blocks they found on disk already and did not write (over the pool's life,
    from the control block: a service reports them too)."""
    written, skipped = control.store_bytes()
    return {"written_bytes": written, "skipped_bytes": skipped}


def root_figures(control: ControlBlock, io: IoSettings) -> list[dict[str, Any]]:
    """Each root's health and usage as ``stats()`` reports them (from the control block:
    never blocks, any process)."""
    out = []
    now = time.monotonic_ns()
    for index, path in enumerate(io.root_dirs):
        rec = control.root(index)
        out.append({
            "path": path, "in_rotation": rec.state is not RootState.OUT,
            "read_only": rec.state is RootState.READ_ONLY,
            "read_only_stores": control.read_only_stores(index),
            "o_direct": io.roots[index].use_o_direct, "io_uring": io.roots[index].uring,
            "bounce_loads": io.roots[index].bounce,
            "errno": rec.err, "failures": rec.failures, "times_out": rec.outs,
            "probe_in_s": max(0.0, (rec.retry_at_ns - now) / 1e9)
            if rec.state is not RootState.IN else None,
            # the caretaker's figure plus blocks created since it last looked
            "usage_bytes": control.usage_now(index, reserved=False),
            "blocks": rec.usage_blocks,
            "capacity_bytes": io.capacity_bytes,
            "usage_complete": bool(rec.flags & ROOT_COMPLETE),
            "evicting": bool(rec.flags & ROOT_EVICTING),
            "evicted_blocks": rec.evicted_blocks, "evicted_bytes": rec.evicted_bytes,
            "temps_removed": rec.temps_removed, "walk_passes": rec.pass_id,
            **_inode_figures(control, index),
            "caretaker_pid": rec.caretaker_pid or None})
    return out


def _inode_figures(control: ControlBlock, index: int) -> dict[str, Any]:
    total, free, folders, flags = control.root_extra(index)
    return {"inodes_total": total or None, "inodes_free": free if total else None,
            "inodes_low": bool(flags & ROOT_INODES_LOW), "folders_removed": folders,
            "no_space_stores": control.no_space_stores(index)}


def _room_waits(control: ControlBlock, slot: int) -> dict[str, Any]:
    waits, ns = control.slot_waits(slot)
    return {"room_waits": waits, "room_wait_s": ns / 1e9}


def _bounded(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Run ``fn`` on a helper thread and wait at most ``timeout_s`` (a root on a hung
    mount must not hang the caller forever). Raises ``MptierError`` on timeout."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # handed to the caller
            result["error"] = exc

    thread = threading.Thread(target=run, name="mptier-prepare", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise MptierError(f"{what} did not finish within io_timeout_s={timeout_s:g} s: "
                          "the file system is not responding")
    if "error" in result:
        raise result["error"]
    return result.get("value")


class _ControlDoor:
    """The :class:`~mptier.workers.contract.Pool` members a pool in this process answers
    from its own control block (never blocks: shared-memory reads)."""

    control: ControlBlock
    io: IoSettings | None

    def serving(self) -> bool:
        return self.control.pool_serving()

    def refusal(self) -> tuple[int, str]:
        _, err, reason = self.control.pool_state()
        return err, reason

    def news(self) -> bytes:
        return self.control.counters_snapshot()

    def root_figures(self) -> list[dict[str, Any]]:
        return root_figures(self.control, self.io) if self.io is not None else []


class WorkerPool(_ControlDoor, Pool):
    """Worker processes kept by a supervisor thread (see module docstring)."""

    mode = "processes"

    def __init__(self, settings: PoolSettings, in_engine: bool = True) -> None:
        """``in_engine``: this process is the engine whose buffer the workers map (False
        in ``mptier serve``): a worker outliving it may finish the stores it holds."""
        self.settings = settings
        n_workers = len(settings.roles)
        # A parked (stuck) worker keeps its slot; its replacement needs another.
        self.control = ControlBlock(n_workers + settings.max_stuck_workers)
        boot = BootSpec(n_slots=self.control.n_slots, control_block_fd=self.control.fd,
                        in_engine=in_engine, **_same_fields(BootSpec, settings))
        self._supervisor = Supervisor(SupervisorSettings(
            roles=settings.roles, boot=boot, root_label=settings.root_label,
            roots=settings.roots, **_same_fields(SupervisorSettings, settings)),
            self.control)
        self._started = self._stopped = False
        self._last_stats: dict[str, Any] | None = None
        self.io: IoSettings | None = None

    @property
    def counters(self) -> PoolCounters:
        return self._supervisor.counters

    def start(self) -> None:
        """Start every worker; blocks until all are ready. Raises ``MptierError`` naming
        the cause when they cannot start (after cleaning up)."""
        sup = self._supervisor
        self._started = True
        sup.start()
        deadline = time.monotonic() + self.settings.worker_start_timeout_s
        want = len(self.settings.roles)
        with sup.changed:
            while True:
                ready = sum(1 for w in sup.workers if w.phase is not Phase.BOOTING
                            and w.alive)
                if ready >= want:
                    return
                reason, _ = sup.unavailable()
                if reason:  # boot failures in a row: a broken installation or setting
                    raise MptierError(f"mptier workers could not start: {reason}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MptierError(
                        f"only {ready} of {want} mptier workers were ready within "
                        f"worker_start_timeout_s={self.settings.worker_start_timeout_s:g} s")
                sup.changed.wait(min(left, 0.5))

    def attach(self, session: Session) -> IoSettings:
        """Prepare the root for the session's layout and hand the session to every
        worker; blocks until all have taken it -- or, when no worker can serve now
        (``unavailable()``), not for them: the engine fails its jobs with the reason
        until they are back. The pool keeps its own copies of the
        session's descriptors. Raises ``MptierError`` (or ``OSError``/``ConfigError``
        from the root) and leaves no session behind on failure."""
        sup = self._supervisor
        io = _bounded(lambda: prepare_io(self.settings, session.layout, session.block_bytes),
                      self.settings.io_timeout_s, f"preparing {self.settings.root_label}")
        self.io = io
        own = session.dup()
        ids: list[int] = []
        sup.call_soon(lambda: ids.append(sup.attach(own, io)))
        deadline = time.monotonic() + self.settings.worker_start_timeout_s
        with sup.changed:
            while True:
                errors = list(sup.attach_errors)
                if ids and not errors:
                    live = [w for w in sup.workers if w.alive]
                    # A worker still serving an earlier session (in a service whose last
                    # engine died mid-task; the task may hang until io_timeout_s) takes
                    # this one when that task ends: nobody needs waiting for.
                    if live and all(w.phase is Phase.SERVING for w in live):
                        return io
                    if not live and sup.unavailable()[0]:
                        # Nobody can serve now (every worker stuck, or cooling down
                        # after boot failures): the session is the pool's all the same.
                        # The engine reads why from the control block and fails its
                        # jobs at once; workers take the session when they are back.
                        return io
                if errors or time.monotonic() > deadline:
                    break
                sup.changed.wait(0.5)
        self.end_session(ask_workers=True)
        if errors:
            raise MptierError(f"mptier workers could not attach to the buffer: {errors[0]}")
        raise MptierError(f"mptier workers did not attach within "
                          f"worker_start_timeout_s={self.settings.worker_start_timeout_s:g} s")

    def end_session(self, ask_workers: bool = False, timeout_s: float = DETACH_GRACE_S,
                    on_wait: Callable[[], object] | None = None) -> None:
        """End the current session and wait (bounded) until no worker serves it: after
        the engine closed its lifeline, or with ``ask_workers`` to make them stop."""
        sup = self._supervisor
        sup.call_soon(lambda: sup.end_session(ask_workers))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with sup.changed:
                if sup.session is None and not any(
                        w.phase in (Phase.SERVING, Phase.ATTACHING) for w in sup.workers):
                    return
                sup.changed.wait(0.05)
            if on_wait is not None:
                on_wait()

    def unavailable(self) -> tuple[str, int]:
        """``(reason, errno)`` when the pool cannot serve now, else ``("", 0)``."""
        return self._supervisor.unavailable()

    def pids(self) -> list[int]:
        with self._supervisor.lock:
            return [w.pid for w in self._supervisor.workers]

    def worker_stats(self) -> list[dict[str, Any]]:
        """One entry per worker (parked ones included, in state ``"stuck"``)."""
        sup = self._supervisor
        with sup.lock:
            workers = list(sup.workers)
        now = time.monotonic_ns()
        out = []
        for w in workers:
            snap = self.control.snapshot(w.slot)
            busy = snap.state == SlotState.BUSY and snap.started_ns
            state = w.phase.value
            if w.phase is Phase.SERVING:
                state = "busy" if busy else "idle"
                if snap.state == SlotState.REPORTING:  # done; waiting for the engine to read
                    state = "reporting"
            out.append({
                "pid": w.pid, "role": w.role, "slot": w.slot, "state": state,
                "alive": w.alive, "ready": w.phase in (Phase.IDLE, Phase.SERVING),
                "tasks_done": snap.tasks_done, "tasks_failed": snap.tasks_failed,
                "bytes_done": snap.bytes_done, "busy_s": snap.busy_ns / 1e9,
                "task_age_s": (now - snap.started_ns) / 1e9 if busy else None,
                "generation": w.generation, "backend": w.backend,
                **_room_waits(self.control, w.slot),
            })
        return out

    def stats(self) -> dict[str, Any]:
        """Counters, state and workers; after :meth:`stop`, the last figures."""
        if self._last_stats is not None:
            return self._last_stats
        with self._supervisor.lock:
            counters = asdict(self.counters)
        reason, _ = self.unavailable()
        return {"mode": self.mode, "counters": counters, "unavailable": reason,
                "workers": self.worker_stats(), "task_latency": task_latency(self.control),
                **store_figures(self.control),
                "roots": root_figures(self.control, self.io) if self.io else []}

    def stop(self, grace_s: float = STOP_GRACE_S,
             on_wait: Callable[[], object] | None = None) -> list[str]:
        """Ask every worker to leave, then escalate (SIGTERM, SIGKILL); ``on_wait`` runs
        between checks. Returns descriptions of workers that had to be forced or were
        left behind (stuck in the kernel). Idempotent."""
        if self._stopped:
            return []
        self._stopped = True
        sup = self._supervisor
        forced: list[str] = []
        if self._started:
            sup.begin_stop()
            sup.call_soon(sup.ask_to_leave)
            for sig, wait_s in ((None, grace_s), (signal.SIGTERM, TERM_GRACE_S),
                                (signal.SIGKILL, KILL_GRACE_S)):
                with sup.lock:
                    left = [w for w in sup.workers if w.phase is not Phase.STUCK]
                if not left:
                    break
                if sig is not None:
                    for w in left:
                        with contextlib.suppress(OSError):
                            w.proc.send_signal(sig)
                        forced.append(f"{w.role} worker pid {w.pid} needed {sig.name}")
                deadline = time.monotonic() + wait_s
                while time.monotonic() < deadline:
                    with sup.changed:
                        if not any(w in sup.workers for w in left):
                            break
                        sup.changed.wait(0.02)
                    if on_wait is not None:
                        on_wait()
            with sup.lock:
                forced += [f"{w.role} worker pid {w.pid} is stuck in the kernel and was "
                           "left behind" for w in sup.workers]
        self._last_stats = self.stats()
        sup.finish()
        self.control.close()
        return forced


class ThreadWorkers(_ControlDoor, Pool):
    """The serving loop on threads of the engine (a buffer other processes cannot map).

    Same methods as :class:`WorkerPool`. Nothing supervises the threads: a hung I/O
    call cannot be interrupted, so ``io_timeout_s`` is not enforced here.
    """

    mode = "threads"

    def __init__(self, settings: PoolSettings, memory: memoryview) -> None:
        self.settings = settings
        self.control = ControlBlock(len(settings.roles))
        self.counters = PoolCounters()
        self._memory = memory
        self._contexts: list[WorkerContext] = []
        self._threads: list[threading.Thread] = []
        self._stopped = False
        self._last_stats: dict[str, Any] | None = None
        self.io: IoSettings | None = None

    def start(self) -> None:
        pass

    def attach(self, session: Session) -> IoSettings:
        self.io = io = _bounded(
            lambda: prepare_io(self.settings, session.layout, session.block_bytes),
            self.settings.io_timeout_s, f"preparing {self.settings.root_label}")
        backend = native.get_backend(io.backend)
        shared = WorkerSession(queues=session.queues, completion=session.completion,
                               lifeline=session.lifeline, doorbell=session.doorbell,
                               segments=[], nbytes=session.nbytes,
                               block_bytes=session.block_bytes, layout=session.layout,
                               engine_pid=session.engine_pid, label=session.label)
        health = self.health = RootHealth(self.control, io.root_dirs,
                                          self.settings.root_failures_to_fail,
                                          self.settings.root_retry_s)

        def report_root(index: int, ok: bool, err: int, text: str) -> None:
            if ok:
                health.success(index)
            else:
                health.failure(index, err or errno.EIO, text)

        for slot, role in enumerate(self.settings.roles):
            self.control.reset(slot, role)
            ctx = WorkerContext.open(role=role, slot_writer=SlotWriter(self.control, slot, role),
                                     session=shared, io=io, backend=backend,
                                     memory=self._memory)
            ctx.report_root, ctx.report_probe = report_root, health.probing
            self._contexts.append(ctx)
        # Caretakers: each root to one thread, store threads first (nothing supervises
        # the threads, so none is ever designated again).
        order = sorted(self._contexts, key=lambda c: (c.role != "store",
                                                      c.slot_writer.slot))
        for index in range(len(io.root_dirs)):
            order[index % len(order)].caretaker.take([index])
        for ctx in self._contexts:
            thread = threading.Thread(target=self._run, args=(ctx,),
                                      name=f"mptier-{ctx.role}-{ctx.slot_writer.slot}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()
        return io

    @staticmethod
    def _run(ctx: WorkerContext) -> None:
        try:
            serve(ctx, None)
        except Exception:  # nothing to report to; the engine's drain will time out
            log.exception("mptier I/O thread %d failed", ctx.slot_writer.slot)
        finally:
            ctx.close()  # its leases (the engine's descriptors stay the engine's)

    def end_session(self, ask_workers: bool = False, timeout_s: float = DETACH_GRACE_S,
                    on_wait: Callable[[], object] | None = None) -> None:
        self._join(timeout_s, on_wait)

    def _join(self, timeout_s: float, on_wait: Callable[[], object] | None) -> list[str]:
        deadline = time.monotonic() + timeout_s
        stuck = []
        for thread in self._threads:
            while thread.is_alive() and time.monotonic() < deadline:
                thread.join(0.01)
                if on_wait is not None:
                    on_wait()
            if thread.is_alive():
                stuck.append(f"I/O thread {thread.name} still running (hung I/O?)")
        return stuck

    def unavailable(self) -> tuple[str, int]:
        return "", 0

    def pids(self) -> list[int]:
        return []

    def worker_stats(self) -> list[dict[str, Any]]:
        out = []
        for ctx, thread in zip(self._contexts, self._threads):
            w = ctx.slot_writer
            out.append({"pid": os.getpid(), "role": ctx.role, "slot": w.slot,
                        "state": "thread", "alive": thread.is_alive(), "ready": True,
                        "tasks_done": w.tasks_done, "tasks_failed": w.tasks_failed,
                        "bytes_done": w.bytes_done, "busy_s": w.busy_ns / 1e9,
                        "task_age_s": None, "generation": 0,
                        "backend": ctx.backend.name,
                        **_room_waits(self.control, w.slot)})
        return out

    def stats(self) -> dict[str, Any]:
        if self._last_stats is not None:
            return self._last_stats
        return {"mode": self.mode, "counters": asdict(self.counters), "unavailable": "",
                "workers": self.worker_stats(), "task_latency": task_latency(self.control),
                **store_figures(self.control),
                "roots": root_figures(self.control, self.io) if self.io else []}

    def stop(self, grace_s: float = STOP_GRACE_S,
             on_wait: Callable[[], object] | None = None) -> list[str]:
        if self._stopped:
            return []
        self._stopped = True
        stuck = self._join(grace_s, on_wait)
        self._last_stats = self.stats()
        if not stuck:
            self.control.close()
        return stuck


def open_pool(settings: PoolSettings, memory: memoryview | None = None
              ) -> WorkerPool | ThreadWorkers:
    """A :class:`WorkerPool`, or :class:`ThreadWorkers` over ``memory`` when the
    buffer cannot be shared with other processes."""
    return WorkerPool(settings) if memory is None else ThreadWorkers(settings, memory)

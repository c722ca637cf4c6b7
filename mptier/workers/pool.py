"""The supervisor: keeps the pool at size and makes sure no task is lost.

One thread in the engine process (it never touches the scheduler's state) waits on a
wake-up pipe and on every worker's pidfd, and ticks every :data:`TICK_S` to

* notice a worker that died (SIGKILL, OOM): a store task it held is put back on the
  store queue (stores are idempotent; at most ``max_task_retries`` times); a load or
  lookup it had *started* is reported LOST (its keys become a miss); one it had only
  dequeued goes back on its queue. The dead worker's temporary files are removed and a
  new worker takes the slot;
* kill a worker whose task has run longer than ``io_timeout_s`` (a hung mount) and treat
  it as dead at once -- without waiting for a process stuck in the kernel to go;
* push tasks waiting in the queues' overflow lists into the pipes;
* stop respawning after :data:`MAX_BOOT_FAILURES` workers in a row failed to boot (that
  is a broken installation, not a crash), and fail queued work instead of letting it wait.

Workers ask the kernel to kill them if this thread exits, so it lives until every worker
has left (see :meth:`ProcessPool.stop`).

:class:`ThreadPool` runs the same worker loop on threads, for buffers that cannot be
shared with other processes; it cannot enforce ``io_timeout_s``.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mptier.channels import TaskQueue
from mptier.errors import describe_exit
from mptier.jobs import MessageType, TaskKind, decode_task, encode_message, with_attempt
from mptier.layout import FileMapper
from mptier.workers.control import ControlBlock, SlotState, SlotWriter
from mptier.workers.launcher import LaunchSpec, launch
from mptier.workers.worker import WorkerContext, run_worker, temp_tag

log = logging.getLogger(__name__)

# Supervisor tick: bounds how late a hung task is noticed past io_timeout_s and how long
# overflowed tasks wait when the engine is not calling in (deaths wake it at once, through
# the pidfds). Every tick takes the GIL from the scheduler thread for a moment -- and on a
# busy machine getting it back can cost the scheduler milliseconds -- so ticks are rare.
TICK_S = 0.5
# Consecutive workers that die before reporting ready before we stop respawning.
MAX_BOOT_FAILURES = 3
# How long stop() waits at each step of ask -> terminate -> kill.
STOP_GRACE_S = 10.0
KILL_GRACE_S = 2.0
# errno values put on tasks the supervisor fails.
ERR_WORKER_DIED = errno.EOWNERDEAD
ERR_TIMED_OUT = errno.ETIMEDOUT
ERR_NO_WORKERS = errno.ECHILD


@dataclass
class WorkerHandle:
    slot: int
    role: str
    proc: subprocess.Popen | None
    pidfd: int
    started_at: float
    generation: int
    ready: bool = False
    abandoned: bool = False  # killed while hung; slot kept until it is reaped

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0


@dataclass
class PoolCounters:
    spawned: int = 0
    deaths: int = 0
    timeouts: int = 0
    tasks_retried: int = 0
    tasks_lost: int = 0
    boot_failures: int = 0
    last_deaths: list[str] = field(default_factory=list)


class ProcessPool:
    """Worker processes plus the supervisor thread that keeps them."""

    def __init__(self, *, spec: LaunchSpec, roles: list[str], control: ControlBlock,
                 lookup_queue: TaskQueue, load_queue: TaskQueue, store_queue: TaskQueue,
                 completion_fd: int, mapper: FileMapper, io_timeout_s: float, max_task_retries: int,
                 start_timeout_s: float) -> None:
        self._spec = spec
        self._roles = roles
        self._control = control
        self._queues = {"lookup": lookup_queue, "load": load_queue, "store": store_queue}
        self._completion_fd = completion_fd
        self._mapper = mapper
        self._io_timeout_ns = int(io_timeout_s * 1e9)
        self._max_retries = max_task_retries
        self._start_timeout_s = start_timeout_s
        self._handles: list[WorkerHandle] = []  # by role position; replaced in place
        self._abandoned: list[WorkerHandle] = []
        self._free_slots = list(range(control.n_slots - 1, -1, -1))
        self._lock = threading.Lock()  # guards handles and counters for stats()
        self.counters = PoolCounters()
        self._consecutive_boot_failures = 0
        self.broken_reason = ""
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._supervise, name="mptier-supervisor",
                                        daemon=True)
        self._started = threading.Event()

    # -- public ------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn every worker (from the supervisor thread) and return at once."""
        self._thread.start()
        self._started.wait()

    @property
    def supervised(self) -> bool:
        return True

    def worker_stats(self) -> list[dict[str, Any]]:
        with self._lock:
            handles = list(self._handles)
        out = []
        for h in handles:
            snap = self._control.snapshot(h.slot)
            alive = h.proc is not None and h.proc.poll() is None and not h.abandoned
            ready = h.ready or snap.state in (SlotState.IDLE, SlotState.BUSY)
            out.append({
                "pid": h.pid, "role": h.role, "slot": h.slot, "alive": alive,
                "ready": ready, "state": snap.state.name.lower(),
                "tasks_done": snap.tasks_done, "bytes_done": snap.bytes_done,
                "busy_s": snap.busy_ns / 1e9, "errors": snap.errors,
                "generation": h.generation,
            })
        return out

    def pids(self) -> list[int]:
        with self._lock:
            return [h.pid for h in self._handles + self._abandoned if h.proc]

    def mark_ready(self, slot: int, pid: int) -> None:
        with self._lock:
            for h in self._handles:
                if h.slot == slot and h.pid == pid:
                    h.ready = True
                    self._consecutive_boot_failures = 0

    def begin_stop(self) -> None:
        """No more respawns or retries from here on."""
        self._stopping = True
        self._wake()

    def stop(self, grace_s: float = STOP_GRACE_S,
             on_wait: Callable[[], object] | None = None) -> list[str]:
        """Wait for workers to leave (the caller closed the lifeline), escalating to
        SIGTERM and SIGKILL; ``on_wait`` runs between checks (the engine drains the
        completion pipe there). Returns descriptions of workers that had to be forced."""
        self.begin_stop()
        forced = []
        with self._lock:
            handles = [h for h in self._handles + self._abandoned if h.proc]
        for sig, wait_s in ((None, grace_s), (signal.SIGTERM, KILL_GRACE_S),
                            (signal.SIGKILL, KILL_GRACE_S)):
            alive = [h for h in handles if h.proc.poll() is None]
            if not alive:
                break
            if sig is not None:
                for h in alive:
                    with contextlib.suppress(ProcessLookupError):
                        h.proc.send_signal(sig)
                    forced.append(f"{h.role} worker pid {h.pid} needed {sig.name}")
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and any(h.proc.poll() is None for h in alive):
                if on_wait is not None:
                    on_wait()
                time.sleep(0.01)
        self._thread_exit = True
        self._wake()
        self._thread.join(timeout=5)
        for h in handles:
            if h.pidfd >= 0:
                with contextlib.suppress(OSError):
                    os.close(h.pidfd)
                h.pidfd = -1
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        return forced

    # -- supervisor thread ---------------------------------------------------------------

    _thread_exit = False

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _supervise(self) -> None:
        try:
            for position, role in enumerate(self._roles):
                self._handles.append(self._spawn(role, generation=0))
                del position
        finally:
            self._started.set()
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        registered: set[int] = set()
        while not self._thread_exit:
            with self._lock:
                live = [h for h in self._handles + self._abandoned if h.pidfd >= 0]
            for h in live:
                if h.pidfd not in registered:
                    poller.register(h.pidfd, select.POLLIN)
                    registered.add(h.pidfd)
            poller.poll(TICK_S * 1000)
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
            if self._thread_exit:
                break
            self._reap(poller, registered)
            if self._stopping:
                continue
            self._check_timeouts()
            for queue in self._queues.values():
                queue.flush()
            if self.broken_reason:
                self._fail_queued()

    def _spawn(self, role: str, generation: int) -> WorkerHandle:
        slot = self._free_slots.pop()
        self._control.reset(slot, role)
        try:
            proc = launch(self._spec, slot, role)
            pidfd = os.pidfd_open(proc.pid)
        except OSError as exc:
            self._free_slots.append(slot)
            log.error("could not start a %s worker: %s", role, exc)
            self._boot_failed(f"could not start a worker process: {exc}")
            return WorkerHandle(slot=-1, role=role, proc=None, pidfd=-1,
                                started_at=time.monotonic(), generation=generation)
        self.counters.spawned += 1
        return WorkerHandle(slot=slot, role=role, proc=proc, pidfd=pidfd,
                            started_at=time.monotonic(), generation=generation)

    def _reap(self, poller: select.poll, registered: set[int]) -> None:
        with self._lock:
            candidates = list(self._handles) + list(self._abandoned)
        for h in candidates:
            if h.proc is None or h.proc.poll() is None:
                continue
            if h.pidfd >= 0:
                with contextlib.suppress(KeyError, ValueError):
                    poller.unregister(h.pidfd)
                registered.discard(h.pidfd)
                os.close(h.pidfd)
                h.pidfd = -1
            if h.abandoned:
                with self._lock:
                    self._abandoned.remove(h)
                self._free_slots.append(h.slot)
                continue
            if self._stopping:
                continue
            self._worker_gone(h, describe_exit(h.proc.returncode), ERR_WORKER_DIED)
            self._free_slots.append(h.slot)

    def _check_timeouts(self) -> None:
        now = time.monotonic_ns()
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            if h.proc is None:
                self._replace(h)  # a spawn that failed earlier: try again
                continue
            snap = self._control.snapshot(h.slot)
            if not h.ready and snap.state in (SlotState.IDLE, SlotState.BUSY):
                h.ready = True
                self._consecutive_boot_failures = 0
            if snap.state == SlotState.BOOTING and not h.ready and \
                    time.monotonic() - h.started_at > self._start_timeout_s:
                with contextlib.suppress(ProcessLookupError):
                    h.proc.kill()
                continue  # reaped (and counted as a boot failure) next tick
            if snap.started_ns and snap.held_task and \
                    now - snap.started_ns > self._io_timeout_ns:
                with contextlib.suppress(ProcessLookupError):
                    h.proc.kill()
                self.counters.timeouts += 1
                h.abandoned = True  # may sit in the kernel; do not wait for it
                with self._lock:
                    self._abandoned.append(h)
                self._worker_gone(
                    h, f"was killed after its task ran {(now - snap.started_ns) / 1e9:.1f} s "
                       f"(io_timeout_s={self._io_timeout_ns / 1e9:g})", ERR_TIMED_OUT)

    def _worker_gone(self, h: WorkerHandle, how: str, err: int) -> None:
        """Handle the task ``h`` held, then put a new worker in its place."""
        snap = self._control.snapshot(h.slot)
        description = f"{h.role} worker pid {h.pid} {how}"
        booting = snap.state == SlotState.BOOTING and not h.ready
        if booting:
            self._boot_failed(f"{description} before it was ready")
        else:
            self._consecutive_boot_failures = 0
            self.counters.deaths += 1
            log.warning("%s", description)
        self.counters.last_deaths = ([*self.counters.last_deaths, description])[-10:]
        held = snap.held_task
        if held is not None:
            self._handle_held_task(h, self._control.full_record(h.slot), held,
                                   snap.started_ns, description, err)
        self._control.clear_record(h.slot)
        self._control.bump(self._control.supervisor_counter)
        self._replace(h)

    def _replace(self, h: WorkerHandle) -> None:
        if self._stopping or self.broken_reason:
            return
        new = self._spawn(h.role, h.generation + 1)
        with self._lock:
            self._handles[self._handles.index(h)] = new

    def _handle_held_task(self, h: WorkerHandle, record: bytes, held: tuple,
                          started_ns: int, description: str, err: int) -> None:
        kind, task_id, attempt = held
        task = decode_task(record)
        if kind == TaskKind.STORE:
            self._remove_temp_files(task.keys, h.pid)
        retry = attempt < self._max_retries and (kind == TaskKind.STORE or not started_ns)
        if retry:
            queue = self._queues[{TaskKind.STORE: "store", TaskKind.LOAD: "load",
                                  TaskKind.EXISTS: "lookup"}[kind]]
            queue.put(with_attempt(record, attempt + 1))
            self.counters.tasks_retried += 1
            return
        self.counters.tasks_lost += 1
        self._post_lost(task_id, err, f"{description} while running this task")

    def _post_lost(self, task_id: int, err: int, text: str) -> None:
        with contextlib.suppress(OSError):
            os.write(self._completion_fd, encode_message(
                MessageType.LOST, 0xFFFF, os.getpid(), errno=err, task_id=task_id,
                payload=text))
        self._control.bump(self._control.supervisor_counter)

    def _remove_temp_files(self, keys: list[bytes], pid: int) -> None:
        """A killed store leaves ``<final>.<tag>.*.tmp`` files; nothing reads them."""
        pattern = f".{temp_tag(pid).decode()}.*.tmp"
        for key in keys:
            for path in glob.glob(glob.escape(self._mapper.path_for(key)) + pattern):
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def _boot_failed(self, description: str) -> None:
        self.counters.boot_failures += 1
        self._consecutive_boot_failures += 1
        log.error("%s", description)
        if self._consecutive_boot_failures >= MAX_BOOT_FAILURES and not self.broken_reason:
            self.broken_reason = (f"{MAX_BOOT_FAILURES} workers in a row failed to start; "
                                  f"last: {description}")
            log.error("mptier: giving up on respawning workers: %s", self.broken_reason)

    def _fail_queued(self) -> None:
        """No worker will ever run queued tasks: fail them rather than let jobs hang."""
        if any(h.proc is not None and h.proc.poll() is None and h.ready
               for h in self._handles):
            return
        for queue in self._queues.values():
            for record in queue.take_all():
                self.counters.tasks_lost += 1
                self._post_lost(decode_task(record).task_id, ERR_NO_WORKERS,
                                self.broken_reason)


class ThreadPool:
    """The same worker loop on threads in the engine process (unshareable buffer)."""

    def __init__(self, *, roles: list[str], control: ControlBlock, memory: memoryview,
                 lookup_queue: TaskQueue,
                 load_queue: TaskQueue, store_queue: TaskQueue, completion_fd: int,
                 lifeline_fd: int, doorbell: tuple[int, int], mapper: FileMapper,
                 backend: Any, use_o_direct: bool, block_bytes: int) -> None:
        self._contexts = []
        self._threads = []
        for slot, role in enumerate(roles):
            own, other = ((load_queue.read_fd, store_queue.read_fd) if role == "load"
                          else (store_queue.read_fd, load_queue.read_fd))
            writer = SlotWriter(control, slot, role)
            ctx = WorkerContext(slot=slot, role=role, lookup_fd=lookup_queue.read_fd,
                                own_fd=own, other_fd=other,
                                completion_fd=completion_fd, lifeline_fd=lifeline_fd,
                                doorbell_fd=doorbell[0], doorbell_write_fd=doorbell[1],
                                memory=memory, slot_writer=writer, mapper=mapper,
                                backend=backend, use_o_direct=use_o_direct,
                                block_bytes=block_bytes)
            self._contexts.append(ctx)
            self._threads.append(threading.Thread(target=self._run, args=(ctx,),
                                                  name=f"mptier-{role}-{slot}", daemon=True))
        self.counters = PoolCounters()
        self.broken_reason = ""

    @property
    def supervised(self) -> bool:
        return False

    def _run(self, ctx: WorkerContext) -> None:
        try:
            reason = run_worker(ctx)
        except Exception as exc:  # report, so the engine does not wait on this thread
            log.exception("mptier I/O thread %s failed", ctx.slot)
            reason = f"failed: {exc}"
        with contextlib.suppress(OSError):
            os.write(ctx.completion_fd, encode_message(MessageType.LEAVING, ctx.slot,
                                                       os.getpid(), payload=reason))
            ctx.slot_writer.message_sent()

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def mark_ready(self, slot: int, pid: int) -> None:
        pass

    def pids(self) -> list[int]:
        return []

    def worker_stats(self) -> list[dict[str, Any]]:
        out = []
        for ctx, thread in zip(self._contexts, self._threads):
            w = ctx.slot_writer
            out.append({"pid": os.getpid(), "role": ctx.role, "slot": ctx.slot,
                        "alive": thread.is_alive(), "ready": True, "state": "thread",
                        "tasks_done": w.tasks_done, "bytes_done": w.bytes_done,
                        "busy_s": w.busy_ns / 1e9, "errors": w.errors, "generation": 0})
        return out

    def begin_stop(self) -> None:
        pass

    def stop(self, grace_s: float = STOP_GRACE_S,
             on_wait: Callable[[], object] | None = None) -> list[str]:
        deadline = time.monotonic() + grace_s
        stuck = []
        for thread in self._threads:
            while thread.is_alive() and time.monotonic() < deadline:
                thread.join(0.01)
                if on_wait is not None:
                    on_wait()
            if thread.is_alive():
                stuck.append(f"I/O thread {thread.name} still running (hung I/O?)")
        return stuck

"""The pool on threads of the engine, for a buffer other processes cannot map: the same
serving loop as a worker process (:func:`~mptier.workers.serving.serve`), one thread per
role, and nothing supervising them (see :class:`ThreadWorkers`).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from mptier import native
from mptier.mapping import page_bytes
from mptier.workers.context import WorkerContext
from mptier.workers.contract import Pool
from mptier.workers.control import ControlBlock, SlotWriter
from mptier.workers.figures import room_waits, root_figures, store_figures, task_latency
from mptier.workers.health import RootHealth
from mptier.workers.poolbase import DETACH_GRACE_S, STOP_GRACE_S, ControlDoor, PoolSettings
from mptier.workers.probe import bounded, prepare_io
from mptier.workers.serving import serve
from mptier.workers.session import IoSettings, Session, WorkerSession
from mptier.workers.supervised import PoolCounters

log = logging.getLogger("mptier.workers")


class ThreadWorkers(ControlDoor, Pool):
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
        self.io = io = bounded(
            lambda: prepare_io(self.settings, session.layout, session.block_bytes,
                               page_bytes(session.segments)),
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
                        **room_waits(self.control, w.slot)})
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

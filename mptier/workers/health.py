"""Root health: a root whose I/O keeps failing leaves rotation, and is probed to come back.

    worker: run of keys on root r ─ control.root_health(r) ─┬ IN ────────────▶ do the I/O
                                                          ├ OUT, retry due ▶ probe, then I/O
                                                          ├ OUT ──────────▶ fail fast: the
                                                          │     keys are misses / stores fail
                                                          └ READ_ONLY ────▶ loads: do the I/O;
                                                                stores: EROFS at once until
                                                                retry due, then try the I/O
            I/O result ─ a fault errno (EIO, ETIMEDOUT, ENOTCONN, ...) ─▶ failure(r)
                       │   (EROFS: READ_ONLY, not a step towards OUT)
                       └ anything else, when r had failures or was not IN ──▶ success(r)
                             (a READ_ONLY root: a store's success only)
    supervisor: a worker killed for io_timeout_s (or a missed heartbeat) on root r ─▶ failure(r)

:class:`RootHealth` is the only writer of the health half of each root's record in the
control block: the supervisor thread (process workers report over their control socket)
or, for thread workers, whichever thread holds its lock. ``root_failures_to_fail`` fault
results in a row take a root out; then after ``root_retry_s`` the next operation on it
probes it (a fresh open and stat of its block folder), and success brings it back. A
root that is out is never replaced by another: its keys stay its own, reading as misses,
so no other root fills up with blocks that would be unreachable once it comes back.

A read-only root (EROFS: remounted ``ro`` after an error, a snapshot, a read-only
export) still serves what it holds, so it never leaves rotation: it becomes READ_ONLY,
where loads and lookups go on as before and stores fail at once with EROFS, without
I/O, until ``root_retry_s`` has passed; then the next store tries it, and a store that
succeeds brings it back IN. A load's success says nothing about writes and leaves it
READ_ONLY.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Sequence

from mptier.errors import errno_name
from mptier.native.entries import FAULT_ERRNOS
from mptier.workers.control import ControlBlock, RootState

log = logging.getLogger("mptier.workers")

def is_fault(err: int) -> bool:
    """Whether ``err`` counts against the root's health (mptier.native.entries'
    FAULT_ERRNOS: the file system or its device failing, EROFS included)."""
    return err in FAULT_ERRNOS


def out_of_rotation_text(path: str, err: int, failures: int, retry_at_ns: int) -> str:
    """What a fast-failed load or store says (names the root and the cause)."""
    wait = max(0.0, (retry_at_ns - time.monotonic_ns()) / 1e9)
    cause = f"{errno_name(err)}: {os.strerror(err)}" if err else "failures"
    return (f"root {path} is out of rotation after {failures} failed I/O operation(s) "
            f"(last: {cause}); its keys read as misses and stores of them fail until a "
            f"probe succeeds (next in {wait:.1f} s, root_retry_s)")


def read_only_text(path: str, retry_at_ns: int) -> str:
    """What a store failed at once on a read-only root says."""
    wait = max(0.0, (retry_at_ns - time.monotonic_ns()) / 1e9)
    return (f"root {path} is read-only (EROFS: {os.strerror(errno.EROFS)}); stores to it "
            f"fail without I/O until a store tries it again in {wait:.1f} s "
            "(root_retry_s); loads and lookups of its keys are served; remount it "
            "read-write to take stores again")


class RootHealth:
    """The writer of each root's health (see module docstring). Thread-safe."""

    def __init__(self, control: ControlBlock, roots: Sequence[str], failures_to_fail: int,
                 retry_s: float) -> None:
        self.control = control
        self.roots = list(roots)
        self.failures_to_fail = max(1, failures_to_fail)
        self.retry_ns = int(retry_s * 1e9)
        self.last_error = [""] * len(self.roots)
        self._lock = threading.Lock()

    def failure(self, index: int, err: int, text: str = "") -> None:
        """One fault result on root ``index`` (a probe's failure included)."""
        if not 0 <= index < len(self.roots):
            return
        with self._lock:
            rec = self.control.root(index)
            failures = rec.failures + 1
            self.last_error[index] = text or os.strerror(err)
            retry_at = time.monotonic_ns() + self.retry_ns
            if err == errno.EROFS and rec.state is not RootState.OUT:
                # Readable, not writable: stays in rotation for loads (module docstring).
                if rec.state is not RootState.READ_ONLY:
                    log.error("mptier: root %s is read-only (%s); its keys are still "
                              "served, stores to it fail until a store in %.0f s finds it "
                              "writable", self.roots[index], self.last_error[index],
                              self.retry_ns / 1e9)
                self.control.set_root_health(index, RootState.READ_ONLY, err, rec.failures,
                                             rec.outs, retry_at)
            elif rec.state is RootState.OUT:
                self.control.set_root_health(index, RootState.OUT, err, failures, rec.outs,
                                             retry_at)
                log.info("mptier: probe of root %s failed (%s); next probe in %.0f s",
                         self.roots[index], errno_name(err), self.retry_ns / 1e9)
            elif failures >= self.failures_to_fail:
                self.control.set_root_health(index, RootState.OUT, err, failures,
                                             rec.outs + 1, retry_at)
                log.error("mptier: root %s taken out of rotation after %d failed I/O "
                          "operation(s) in a row (last: %s); its keys read as misses and "
                          "stores of them fail; probing it again in %.0f s",
                          self.roots[index], failures, self.last_error[index],
                          self.retry_ns / 1e9)
            else:
                self.control.set_root_health(index, RootState.IN, err, failures, rec.outs, 0)

    def probing(self, index: int) -> None:
        """A worker is about to probe root ``index``: no other starts a probe until
        ``root_retry_s`` from now (a probe of a hung mount hangs its worker; one at a
        time is enough)."""
        if not 0 <= index < len(self.roots):
            return
        with self._lock:
            rec = self.control.root(index)
            if rec.state is not RootState.IN:
                self.control.set_root_health(index, rec.state, rec.err, rec.failures,
                                             rec.outs, time.monotonic_ns() + self.retry_ns)

    def success(self, index: int) -> None:
        """A result on root ``index`` that proves it answers (a probe's included); for
        a READ_ONLY root, only a store's (the worker reports no other)."""
        if not 0 <= index < len(self.roots):
            return
        with self._lock:
            rec = self.control.root(index)
            if rec.state is RootState.OUT:
                log.warning("mptier: root %s answers again: back in rotation",
                            self.roots[index])
            elif rec.state is RootState.READ_ONLY:
                log.warning("mptier: root %s is writable again: stores resume",
                            self.roots[index])
            if rec.state is not RootState.IN or rec.failures:
                self.control.set_root_health(index, RootState.IN, 0, 0, rec.outs, 0)

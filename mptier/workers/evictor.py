"""The unlink threads of a root's caretaker: they remove the blocks its maintainer hands
out for eviction while the worker runs its tasks, and say how many bytes are gone as
each unlink returns (see :class:`Evictor`).
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import logging
import os
import queue
import threading
import time

from mptier.storage import Entry
from mptier.storage.maintain import UNSEEN_INO, evict_told

log = logging.getLogger("mptier.workers")

# Eviction threads per root a caretaker keeps (see Evictor): unlinks run in parallel.
EVICTOR_THREADS = 4
# How long the end of a session waits for the eviction threads to finish their unlinks.
EVICTOR_STOP_S = 2.0


def _wake_promptly() -> None:
    """Put the calling unlink thread back under SCHED_OTHER (Linux: a policy per
    thread; going back from SCHED_BATCH needs no privilege). It inherits its worker's
    SCHED_BATCH, under which a thread woken by its returning unlink waits for the
    running thread's slice to end instead of preempting it: an eviction is ~0.25 ms of
    CPU between waits, and beside busy workers the queue of them crawled
    (``evict_gil.py --policy``: 241 evictions/s under SCHED_BATCH against 2,874 under
    SCHED_OTHER, two busy workers at nice 10 on two cores). The thread keeps its
    worker's nice, so the engine's thread still outweighs it. Best effort."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def backend_evict(backend) -> collections.abc.Callable[[Entry], bool]:
    """:func:`~mptier.storage.maintain.evict_told` as one call of ``backend`` a block
    (:meth:`mptier.native.Backend.evict_block`): the same checks and removals."""
    def evict(entry: Entry) -> bool:
        return backend.evict_block(entry.path, entry.size, entry.ino, entry.atime_ns,
                                   entry.ino == UNSEEN_INO)
    return evict


class Evictor:
    """Threads that remove the blocks a root's maintainer hands out (``evict``: an
    lstat and an unlink each), so eviction goes on while the worker runs its tasks.
    Measured here (2 MiB blocks, ext4 on a shared VM disk): an unlink took 1-8 ms while
    stores wrote beside it; removing between tasks only, the caretaker fell behind and
    stores waited for room (52 waits, 6 s, per 3 GiB stored past a 1 GiB budget). With
    four writers storing, one thread unlinked ~250 blocks/s, two ~430/s, four ~800/s
    (about what the writers stored): EVICTOR_THREADS of them.

    ``evict`` removes one block: :func:`backend_evict` (one native call a block) in a
    worker, :func:`~mptier.storage.maintain.evict_told` by default. A thread needs its
    process's GIL after each system call it makes from Python, and the worker's serving
    thread and caretaker hold it between their native calls: through Python's calls an
    eviction (two ``lstat``, the ``unlink``, one or two ``rmdir``) waited for the GIL up
    to four times (``bench/experiments/evict_gil.py``)."""

    def __init__(self, path: str, n_threads: int,
                 freed: collections.abc.Callable[[int], None] | None = None,
                 evict: collections.abc.Callable[[Entry], bool] = evict_told) -> None:
        self.failures = 0
        self._evict = evict
        # Bytes removed ever, told to ``freed`` (under the lock) as each unlink returns:
        # waiting stores see the room at once, not at the caretaker's next step.
        self.freed_total = 0
        self._freed = freed
        self._lock = threading.Lock()
        self._todo: queue.SimpleQueue[Entry | None] = queue.SimpleQueue()
        self.done: collections.deque[tuple[Entry, bool]] = collections.deque()
        self._threads = [threading.Thread(target=self._run, name=f"mptier-evict {path}",
                                          daemon=True) for _ in range(n_threads)]
        for thread in self._threads:
            thread.start()

    def put(self, entry: Entry) -> None:
        self._todo.put(entry)

    def _run(self) -> None:
        _wake_promptly()
        while True:
            entry = self._todo.get()
            if entry is None:
                return
            try:
                removed = self._evict(entry)
            except OSError as exc:  # a failing root: keep the block, say why once
                if not self.failures:
                    log.warning("mptier: could not evict %s: %s", entry.path, exc)
                self.failures += 1
                removed = False
            if removed and self._freed is not None:
                with self._lock:
                    self.freed_total += entry.size
                    self._freed(self.freed_total)
            self.done.append((entry, removed))

    def stop(self, wait_s: float) -> None:
        for _ in self._threads:
            self._todo.put(None)
        deadline = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

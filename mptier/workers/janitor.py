"""Removing a dead writer's temporary files from a helper process, never the supervisor.

The supervisor must not touch the file system: it runs in the engine's process (or a
service's), and a call on a hung mount can wait in the kernel for ever, SIGKILL or not.
Measured on the FUSE test file system: with a worker's write stuck, ``unlink`` of its
temporary file waits in ``vfs_unlink`` for the file's lock -- the supervisor thread sat
in state D, no retry of the store was ever posted and no worker was replaced or parked
again until the mount came back (``tests/test_reliability_stuck.py``).

So removals run in a short-lived child process, one at a time; patterns asked for
meanwhile wait for the next one. The supervisor asks for a killed writer's files only
once that writer has exited: while it hangs it holds its file's lock, and the unlink
would wait for it holding the folder's lock -- every new block of that folder would
hang behind it. A child stuck on a hung mount delays only later
removals (at most :data:`MAX_PENDING` wait; the oldest are dropped, logged), never
supervision, and it is never waited for longer than a moment.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import subprocess
import sys
import time

log = logging.getLogger("mptier.workers")

# Patterns waiting while a removal runs (e.g. stuck on a hung mount); past this the
# oldest are dropped: a few stray temporary files beat unbounded memory in the engine.
MAX_PENDING = 4096
# Bytes of patterns per child: its command line (one argument may hold 128 KiB).
BATCH_BYTES = 64 << 10

_SCRIPT = """\
import glob, json, os, sys
for pattern in json.loads(sys.argv[1]):
    for path in glob.glob(pattern):
        try:
            os.unlink(path)
        except OSError:
            pass
"""


class Janitor:
    """Removes files matching glob patterns in a child process (see module docstring).

    Called only from the supervisor's thread; never blocks but for starting a process.
    """

    def __init__(self) -> None:
        self._pending: collections.deque[str] = collections.deque()
        self._proc: subprocess.Popen | None = None
        self.dropped = 0

    @property
    def busy(self) -> bool:
        return self._proc is not None or bool(self._pending)

    def remove(self, patterns: list[str]) -> None:
        """Ask for every file matching ``patterns`` to be removed, soon."""
        self._pending.extend(patterns)
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("mptier: %d temporary-file removals dropped: earlier ones are "
                            "still waiting (a hung file system?)", self.dropped)
        self.poll()

    def poll(self) -> None:
        """Reap a finished child and start the next batch."""
        if self._proc is not None:
            if self._proc.poll() is None:
                return
            self._proc = None
        if not self._pending:
            return
        batch: list[str] = []
        size = 0
        while self._pending and (not batch or size + len(self._pending[0]) < BATCH_BYTES):
            pattern = self._pending.popleft()
            batch.append(pattern)
            size += len(pattern) + 4
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _SCRIPT, json.dumps(batch)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, close_fds=True)
        except OSError as exc:  # out of processes or descriptors: try again next tick
            self._pending.extendleft(reversed(batch))
            log.warning("mptier: could not start a process to remove temporary files: %s",
                        exc)

    def close(self, timeout_s: float = 2.0) -> None:
        """Finish what is asked if it takes at most ``timeout_s``; a child still running
        then (stuck on a hung mount) is left to finish by itself."""
        deadline = time.monotonic() + timeout_s
        while self.busy and time.monotonic() < deadline:
            self.poll()
            if self._proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(min(0.05, max(0.0, deadline - time.monotonic())))
        if self.busy:
            log.warning("mptier: temporary-file removal still running at stop (a hung file "
                        "system?); left to finish by itself")

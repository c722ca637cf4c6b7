"""A backend's calls for the worker's serving loop, on task records (:mod:`mptier.jobs`'
wire format) and roots: take a record from the queues, its keys as the layout's paths,
the load of a whole task, whether a root is still the folder the worker opened, and
the eviction of one block by the caretaker's unlink threads. Each is one native call
where the core is built (queue.c, encode.c, mptier_io.c, probes.c, block.c), with no
Python object per key: in Python the take, the decoding and the paths were ~70 us of a
16-block load task's CPU in the worker (bench/experiments/task_cpu.py), and an
eviction took its process's GIL after each of its four or five system calls
(bench/experiments/evict_gil.py). ``_pure_task`` and ``_pure`` hold the twins.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

from mptier.errors import strerror
from mptier.native import _checks, _pure_task


class TaskCalls:
    """Mixed into :class:`mptier.native.Backend` (its ``_impl``: ``_native`` or
    ``_pure``, and its errno layer's ``load`` / ``load_via``)."""

    _impl = None

    def record_taker(self, fds: tuple[int, ...], record) -> Callable[[], tuple[int, bool]]:
        """A function that takes one task record into ``record`` (a writable buffer of a
        whole record) from the first of the non-blocking queues ``fds`` that holds one,
        and returns ``(index of that queue, whether any queue still holds a record)``,
        or ``(-1, False)``. Never blocks; a short read is never run (the record's header
        is zeroed). Raises ``OSError`` for a read that fails otherwise."""
        return self._impl.record_taker(fds, record)

    def same_folder(self, path: bytes, identity: tuple[int, int]) -> int:
        """1 when ``path`` leads to a folder whose ``(st_dev, st_ino)`` is ``identity``
        now, 0 when it leads elsewhere or to a non-folder, -errno when its stat fails:
        one system call, the worker's check before each run on a root."""
        return self._impl.same_folder(path, identity[0], identity[1])

    def evict_block(self, path: str, size: int, ino: int, atime_ns: int,
                    told: bool) -> bool:
        """Remove the block file at ``path`` (absolute) if it is still the block eviction
        chose, then its ``<h2>_g<group>`` and ``<h3>`` folders where that emptied them:
        True when removed, False when kept (gone, not a regular file of ``size`` bytes,
        or changed: ``told``, a block told and never looked at, whose atime moved past
        ``atime_ns``; else another inode than ``ino`` or another atime). Raises
        ``OSError`` when its ``lstat`` (not told) or ``unlink`` fails otherwise. One
        native call a block: an unlink thread takes its process's GIL once."""
        rc = self._impl.evict_block(os.fsencode(path), size, ino, atime_ns, int(told))
        if rc < 0:
            raise OSError(-rc, strerror(-rc), path)
        return rc == 1

    def task_items(self, record, block_bytes: int) -> tuple[list[bytes], list[int]]:
        """``(paths, offsets)`` of a task record (``mptier.jobs``' wire format): the
        layout's path of each key (``FileMapper.relative_path_for``, encoded) and each
        block id times ``block_bytes`` (none for a lookup record). Raises ``ValueError``
        for a record that does not decode (check records with ``jobs.check_task``)."""
        n, paths, offsets = self._impl.task_items(record, block_bytes)
        if n < 0:
            raise ValueError(f"not a task record this backend decodes ({strerror(-n)})")
        return paths, offsets

    def load_task(self, root_fd: int, record, buffer, block_bytes: int, flags: int,
                  bounce=None) -> tuple[int, int, int]:
        """:meth:`load` of a store or load task record's blocks (:meth:`task_items`), or
        :meth:`load_via` through ``bounce`` when given: ``(rc, n_done, fail_index)``, in
        one native call without a Python object per block. No validation (a record that
        does not decode: -EINVAL, nothing done); an injected fault applies."""
        if _checks.fault_set("load"):  # (tests) the fault cuts the batch's lists
            n, paths, offsets = self._impl.task_items(record, block_bytes)
            if n < 0 or record[4] == _pure_task.KIND_LOOKUP:
                return -errno.EINVAL, 0, 0
            if bounce is None:
                return self.load(root_fd, paths, buffer, offsets, block_bytes, flags)
            return self.load_via(root_fd, paths, buffer, offsets, block_bytes, flags,
                                 bounce)
        return self._impl.load_task(root_fd, record, buffer, block_bytes, flags, bounce)

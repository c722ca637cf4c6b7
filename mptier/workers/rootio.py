"""A task's keys on its roots: split into runs of keys on one root, each run gated by the
root's health and its block folder opened (:mod:`~mptier.workers.rootgate`) and, for a
store, by room under the budget; the root leased at first store; the batch I/O through
the native backend (a load on one root: one native call from the task record); what a
failure says about the root's health (rootgate again).

Called by the serving loop (:mod:`~mptier.workers.serving`), on the worker's thread.
"""

from __future__ import annotations

import errno
import logging
import os
import time

from mptier import native
from mptier.jobs import decode_task
from mptier.native.entries import FULL_ERRNOS
from mptier.storage.leases import Lease
from mptier.workers.context import RootHandle, WorkerContext
from mptier.workers.health import is_fault
from mptier.workers.rootgate import folder_removed, gate, health_after, open_root

log = logging.getLogger("mptier.workers")

# A store waiting for its root's caretaker to make room looks again this often.
ROOM_POLL_S = 0.005
# A store under a budget writes in pieces that fit now (the rest waits for eviction,
# which runs meanwhile); it waits for room only when not even this many new blocks fit:
# one native call per few blocks would cost more calls than the wait saves.
STORE_PIECE_BLOCKS = 8
# A store whose block folder keeps vanishing (ENOENT after the core made it again
# MPT_MKDIR_TRIES times) lists the folders above it and goes on, this many times per
# run: on JuiceFS a folder removed through another mount stays in this mount's entries
# until its parent is listed (1-5 stores of ~1,400 failed so in a four-tier run).
STALE_FOLDER_RETRIES = 2


def transfer(ctx: WorkerContext, store: bool, keys: list[bytes], offsets: list[int]
              ) -> tuple[int, int, str]:
    """Store or load ``keys`` in order, as runs of keys on one root, stopping at the
    first failure: ``(errno, n_done, error text)``. n_done counts from the task's
    first key, so the engine's prefix semantics hold across roots."""
    n_done = 0
    for index, start, end in ctx.router.runs(keys):
        whole = start == 0 and end == len(keys)
        root = ctx.roots[index]
        err, done, text = _run_on_root(
            ctx, store, root, _paths(root, keys if whole else keys[start:end]),
            offsets if whole else offsets[start:end])
        n_done += done
        if err:
            return err, n_done, text
    return 0, n_done, ""


def transfer_task(ctx: WorkerContext, store: bool, record: memoryview
                  ) -> tuple[int, int, str]:
    """:func:`transfer` of the keys and slots of a store or load task record (checked:
    ``jobs.check_task``). On one root its items are decoded natively
    (``Backend.task_items``), and a load is one native call from the record
    (``Backend.load_task``): no Python object per key. Several roots: decoded here."""
    if not ctx.router.single:
        task = decode_task(record)
        block_bytes = ctx.block_bytes
        return transfer(ctx, store, task.keys,
                        [block_id * block_bytes for block_id in task.block_ids])
    if store:
        paths, offsets = ctx.backend.task_items(record, ctx.block_bytes)
        return _run_on_root(ctx, True, ctx.roots[0], paths, offsets)
    return _run_on_root(ctx, False, ctx.roots[0], None, None, record)


def _paths(root: RootHandle, keys: list[bytes]) -> list[bytes]:
    """The paths of ``keys`` beneath ``root``'s blocks folder."""
    relative = root.mapper.relative_path_for
    return [relative(key).encode() for key in keys]


def _run_on_root(ctx: WorkerContext, store: bool, root: RootHandle,
                 paths: list[bytes] | None, offsets: list[int] | None,
                 record: memoryview | None = None) -> tuple[int, int, str]:
    """Store or load one run on ``root``: ``paths`` to and from ``offsets``, or (a load,
    ``paths`` None) the blocks of task ``record``."""
    refused = gate(ctx, root, store)
    if refused is not None:
        return refused[0], 0, refused[1]
    ctx.slot_writer.set_root(root.index)  # a timeout now is blamed on this root
    text = ""
    try:
        fd = open_root(ctx, root, create=store)
        rc, n_done, index, text = _move(ctx, store, root, fd, paths, offsets, record)
        if rc == -errno.ENOENT and folder_removed(root):  # an operator wiped the cache
            root.close()  # made again for a store; a load of it is a miss
            log.warning("mptier: %s was removed under the running tier; opening it again",
                        root.mapper.blocks_dir)
            fd = open_root(ctx, root, create=store)
            rc, n_done, index, text = _move(ctx, store, root, fd, paths, offsets, record)
    except OSError as exc:
        rc, n_done, index = -(exc.errno or errno.EIO), 0, 0
        text = f"root {root.path}: {exc}"
    err = -rc
    if err and not text:
        if paths is None:  # (a failure: the paths are made to name the block)
            paths, _ = ctx.backend.task_items(record, ctx.block_bytes)
        text = str(native.batch_error("store" if store else "load", err, n_done, index,
                                      f"{root.mapper.blocks_dir}/{paths[index].decode()}"))
    health_after(ctx, root, store, err, text)
    return err, n_done, text


def _move(ctx: WorkerContext, store: bool, root: RootHandle, fd: int,
          paths: list[bytes] | None, offsets: list[int] | None,
          record: memoryview | None) -> tuple[int, int, int, str]:
    """Store or load one run on ``root``: the native errno layer's ``(rc, n_done,
    fail_index)`` and an error text when the run failed before the native call."""
    if store:
        assert paths is not None and offsets is not None
        return _store_run(ctx, root, fd, paths, offsets)
    bounce = ctx.bounce if root.bounce else None
    if record is not None:
        if bounce is not None:
            rc, n_done, index = bounce.load_task(ctx.backend, fd, record, ctx.memory,
                                                 root.flags)
        else:
            rc, n_done, index = ctx.backend.load_task(fd, record, ctx.memory,
                                                      ctx.block_bytes, root.flags)
    elif bounce is not None:
        rc, n_done, index = bounce.load(ctx.backend, fd, paths, ctx.memory, offsets,
                                        root.flags)
    else:
        rc, n_done, index = ctx.backend.load(fd, paths, ctx.memory, offsets,
                                             ctx.block_bytes, root.flags)
    return rc, n_done, index, ""


def _store_run(ctx: WorkerContext, root: RootHandle, fd: int, paths: list[bytes],
               offsets: list[int]) -> tuple[int, int, int, str]:
    if root.lease is None:  # before the first temporary name carrying our tag
        root.lease = Lease.create(root.path, tag=ctx.tag.decode())
    block_bytes = ctx.block_bytes
    capacity = ctx.io.capacity_bytes
    # Blocks already there are found by the store, which only touches them (names are
    # content hashes) and says so (``found``): they count as skipped, not written, and
    # the new ones are counted exactly, so stats()' usage never lags ours. Under a budget
    # an existence check first keeps them out of the room eviction must make before any
    # write; without one that check would only delay the task's first write by a walk of
    # every path (docs/performance.md, section 23), and every block is reserved (erring
    # high by the blocks found, until the store returns).
    if capacity:
        statuses = ctx.backend.lookup(fd, paths, block_bytes, 0)
        is_new = [status != native.LOOKUP_PRESENT for status in statuses]
    else:
        is_new = [True] * len(paths)
    left = sum(is_new) * block_bytes  # reserved: new bytes not written yet
    writer = ctx.slot_writer
    writer.reserve(root.index, left)  # before any check: every later check counts it
    deadline = time.monotonic() + ctx.io.room_wait_s
    done = refreshed = 0
    if capacity and left > capacity:  # no eviction can make room for more than it all
        writer.reserve(root.index, 0)
        return -errno.ENOSPC, 0, 0, (
            f"root {root.path}: storing {left // block_bytes} new block(s) ({left} bytes) "
            f"takes more than the whole budget, capacity_bytes={capacity}; nothing was "
            "written (raise capacity_bytes or store fewer blocks per job)")
    try:
        while done < len(paths):
            # A piece of the run that fits under the budget now; the rest waits for the
            # caretaker, which sees the whole reservation and evicts for it meanwhile.
            end = len(paths) if not capacity or not left else \
                _piece(ctx, root.index, is_new, done, left, deadline)
            if end == done:
                control = writer.control
                usage = control.usage_now(root.index) - left
                held = control.room_held(root.index)
                shared = f", {held} of them held for other tiers sharing the root" \
                    if held > 0 else ""
                return -errno.ENOSPC, done, done, (
                    f"root {root.path} is full: storing {left // block_bytes} new "
                    f"block(s) ({left} bytes) would take its usage ({usage} bytes"
                    f"{shared}) past capacity_bytes={capacity}, and eviction could not "
                    f"make room within room_wait_s={ctx.io.room_wait_s:g} s; the {done} "
                    "block(s) before were stored")
            found = bytearray(end - done)
            if root.bounce_stores:
                rc, n, index, temp_err = ctx.bounce.store(
                    ctx.backend, fd, paths[done:end], ctx.memory, offsets[done:end],
                    root.flags, ctx.tag, found)
            else:
                rc, n, index, temp_err = ctx.backend.store(
                    fd, paths[done:end], ctx.memory, offsets[done:end], block_bytes,
                    root.flags, ctx.tag, found)
            reserved_done = sum(is_new[done:done + n]) * block_bytes
            reserved_piece = sum(is_new[done:end]) * block_bytes
            for i in range(n):  # the store's own answer: another writer may have been first
                is_new[done + i] = not found[i]
            if -rc in FULL_ERRNOS:  # out of blocks, inodes or quota: the caretaker
                writer.count_no_space(root.index)  # evicts on the rise
            if temp_err:
                log.warning("mptier: a temporary file in %s could not be removed (%s); "
                            "the sweeper removes it once this writer's lease is free",
                            os.path.dirname(f"{root.mapper.blocks_dir}/"
                                            f"{paths[done + index].decode()}"),
                            os.strerror(temp_err))
            written = [paths[i] for i in range(done, done + n) if is_new[i]]
            writer.count_stored(len(written) * block_bytes,
                                (n - len(written)) * block_bytes)
            if written:
                _count_new(ctx, root.index, written)
            if rc == -errno.ENOENT and refreshed < STALE_FOLDER_RETRIES:
                # The block's folder was removed (eviction empties and removes folders)
                # and the core made it again MPT_MKDIR_TRIES times in vain: through a
                # distributed file system's stale entry for it (JuiceFS, removed
                # through another mount) a name keeps leading to the removed folder
                # until its parent is listed. List, then store the rest again.
                refreshed += 1
                left -= reserved_done
                writer.reserve(root.index, left)
                _list_folders_of(root, paths[done + index])
                done += n
                continue
            left -= reserved_piece
            writer.reserve(root.index, left)  # after the count: both for an instant
            if rc:
                return rc, done + n, done + index, ""
            done = end
    finally:
        writer.reserve(root.index, 0)
    return 0, done, 0, ""


def _list_folders_of(root: RootHandle, path: bytes) -> None:
    """List the folders above the block at ``path`` (relative to the blocks folder),
    from the blocks folder down to the first one missing: on a distributed file system
    that refreshes the kernel's entries for their sub-folders (see STALE_FOLDER_RETRIES).
    Errors are left to the store tried again."""
    folder = root.mapper.blocks_dir
    for part in [b"", *path.split(b"/")[:-2]]:
        folder = f"{folder}/{part.decode()}" if part else folder
        try:
            os.listdir(folder)
        except OSError:
            return


def _piece(ctx: WorkerContext, index: int, is_new: list[bool], start: int, left: int,
           deadline: float) -> int:
    """The end of the next piece of a store from ``start``: as many blocks as fit under
    the budget now, counting every other store's reservation and what this one wrote
    already (``left``: its reserved bytes still to write). When not even
    STORE_PIECE_BLOCKS fit (or the rest, if fewer), waits for the caretaker (bounded by
    ``deadline``); returns ``start`` when room did not come."""
    block = ctx.block_bytes
    want = min(left, STORE_PIECE_BLOCKS * block)
    free = _room(ctx, index, left, want, deadline)
    if free < want:
        return start
    end = start
    while end < len(is_new) and (not is_new[end] or free >= block):
        free -= block if is_new[end] else 0
        end += 1
    return end


def _count_new(ctx: WorkerContext, index: int, paths: list[bytes]) -> None:
    """Count blocks this worker created, for usage_now at once (``made``), and tell the
    caretaker their paths (the ring): it counts each exactly against its walk
    (RootMaintainer.record_told) and puts it in its eviction index."""
    writer = ctx.slot_writer
    writer.add_made(index, len(paths) * ctx.block_bytes)  # first: usage_now counts it
    writer.ring_add(index, paths)


def _room(ctx: WorkerContext, index: int, reserved: int, want: int,
          deadline: float) -> int:
    """Bytes free under root ``index``'s budget for this store now: the capacity less
    the exact usage with every other store's reservation (``usage_now`` less this
    store's own ``reserved``) and the room held for other tiers sharing the root (on a
    contributor to the root's walker, that leaves exactly what remains of its grant:
    mptier.storage.election). Below ``want``, waits (until ``deadline``) for its
    caretaker to evict (or get a grant); this worker evicts itself when it is the
    caretaker.

    A store writes only what fits, so the root passes the budget only by what the usage
    figure lags (nothing for this tier's own writes, nor for grants). Eviction runs
    ahead of the stores by the slack and evicts for the whole reservation as soon as it
    sees it, so a store rarely waits, and then only for the part that did not fit."""
    control = ctx.slot_writer.control
    capacity = ctx.io.capacity_bytes

    def free() -> int:
        return capacity - (control.usage_now(index) - reserved)

    room = free()
    if room >= want:
        return room
    started = time.monotonic_ns()
    writer = ctx.slot_writer
    try:
        if ctx.caretaker is not None and index in ctx.caretaker.kept:
            return ctx.caretaker.make_room(index, free, want, deadline)
        writer.want_free(index, want)
        try:
            while time.monotonic() < deadline:
                time.sleep(ROOM_POLL_S)
                room = free()
                if room >= want:
                    return room
            return free()
        finally:
            writer.want_free(index, 0)
    finally:
        writer.waited_for_room(time.monotonic_ns() - started)


def lookup(ctx: WorkerContext, keys: list[bytes]) -> bytes:
    """One lookup status per key; keys of a root out of rotation are misses."""
    if ctx.router.single:
        return _lookup_on(ctx, ctx.roots[0], _paths(ctx.roots[0], keys))
    out = bytearray(len(keys))
    groups: dict[int, list[int]] = {}
    for i, index in enumerate(ctx.router.indices(keys)):
        groups.setdefault(index, []).append(i)
    for index, positions in groups.items():
        root = ctx.roots[index]
        statuses = _lookup_on(ctx, root, _paths(root, [keys[i] for i in positions]))
        for j, i in enumerate(positions):
            out[i] = statuses[j]
    return bytes(out)


def lookup_task(ctx: WorkerContext, record: memoryview) -> bytes:
    """:func:`lookup` of the keys of a lookup task record (checked:
    ``jobs.check_task``); on one root, its paths decoded natively."""
    if not ctx.router.single:
        return lookup(ctx, decode_task(record).keys)
    return _lookup_on(ctx, ctx.roots[0], ctx.backend.task_items(record, ctx.block_bytes)[0])


def _lookup_on(ctx: WorkerContext, root: RootHandle, paths: list[bytes]) -> bytes:
    if gate(ctx, root, store=False) is not None:
        return bytes(len(paths))  # LOOKUP_ABSENT: a miss
    ctx.slot_writer.set_root(root.index)
    try:
        fd = open_root(ctx, root, create=False)
    except OSError as exc:
        if exc.errno is not None and is_fault(exc.errno):
            health_after(ctx, root, False, exc.errno, f"root {root.path}: {exc}")
        return bytes(len(paths))
    return ctx.backend.lookup(fd, paths, ctx.block_bytes, root.flags)

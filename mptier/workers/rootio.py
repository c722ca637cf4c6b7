"""A task's keys on its roots: split into runs of keys on one root, each run gated by the
root's health (in rotation, read-only, out and due for a probe) and, for a store, by
room under the budget; the root's block folder opened (and leased) at first use; the
batch I/O through the native backend; what a failure says about the root's health.

Called by the serving loop (:mod:`~mptier.workers.serving`), on the worker's thread.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time

from mptier import native
from mptier.native.entries import FULL_ERRNOS
from mptier.storage.leases import Lease
from mptier.storage.roots import root_identity
from mptier.workers.context import RootHandle, WorkerContext
from mptier.workers.control import RootState
from mptier.workers.health import is_fault, out_of_rotation_text, read_only_text

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
        err, done, text = _run_on_root(
            ctx, store, ctx.roots[index], keys if whole else keys[start:end],
            offsets if whole else offsets[start:end])
        n_done += done
        if err:
            return err, n_done, text
    return 0, n_done, ""


def _gate(ctx: WorkerContext, root: RootHandle, store: bool) -> tuple[int, str] | None:
    """None when ``root`` may be used now (in rotation; read-only, for a load, or for a
    store once a retry is due; out and due for a probe that just succeeded); else
    ``(errno, text)`` to fail its keys with at once."""
    state, err, failures, retry_at = ctx.slot_writer.control.root_health(root.index)
    if state == RootState.IN:
        return None
    if state == RootState.READ_ONLY:
        if not store:
            return None
        if time.monotonic_ns() < retry_at:
            ctx.slot_writer.count_read_only(root.index)
            return errno.EROFS, read_only_text(root.path, retry_at)
        ctx.report_probe(root.index)  # this store tries it; the others still fail fast
        return None
    if time.monotonic_ns() < retry_at:
        return err or errno.EIO, out_of_rotation_text(root.path, err, failures, retry_at)
    ctx.report_probe(root.index)  # others wait for this probe instead of probing too
    root.close()
    try:
        _probe(ctx, root)
    except OSError as exc:
        perr = exc.errno or errno.EIO
        text = f"probe of root {root.path} failed: {exc}"
        ctx.report_root(root.index, False, perr, text)
        root.close()
        return perr, (f"root {root.path} is out of rotation and a probe of it just "
                      f"failed ({exc}); its keys read as misses and stores of them fail")
    ctx.report_root(root.index, True, 0, "")
    return None


def _probe(ctx: WorkerContext, root: RootHandle) -> None:
    """Does ``root`` answer? The root folder must stat as a folder, and its block
    folder open (a missing block folder is an answer too: a store makes it again).
    Raises OSError when not."""
    if not stat.S_ISDIR(os.stat(root.path).st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", root.path)
    try:
        os.fstat(_open_root(ctx, root, create=False))
    except FileNotFoundError:
        pass


def _open_root(ctx: WorkerContext, root: RootHandle, create: bool) -> int:
    """The root's block folder, opened at first use. A folder removed under a running
    tier is made again for a store (a load or lookup of it is a miss); a root path that
    leads to another folder now is followed (:func:`root_identity`). Raises OSError."""
    try:
        identity = root_identity(root.path)  # one stat per run: followed by path
    except FileNotFoundError:
        if not create:
            raise  # a load or lookup of a root that is not there is a miss
        root.release()  # wiped whole (or never made): a store makes it again
        root.mapper.prepare(ctx.block_bytes)
        identity = root_identity(root.path)
    if root.fd >= 0 and identity != root.identity:
        log.warning("mptier: root %s now leads to another folder (device %d:%d inode %d, "
                    "was %d:%d inode %d: a file system mounted over it or taken away, or "
                    "the folder replaced); following the path", root.path,
                    os.major(identity[0]), os.minor(identity[0]), identity[1],
                    os.major(root.identity[0]), os.minor(root.identity[0]),
                    root.identity[1])
        root.release()  # the lease lives in the old folder's .mptier: take one anew
    if root.fd < 0:
        try:
            root.fd = native.open_root(root.mapper.blocks_dir)
        except FileNotFoundError:
            if not create:
                raise
            root.mapper.prepare(ctx.block_bytes)
            root.fd = native.open_root(root.mapper.blocks_dir)
        root.identity = identity
    return root.fd


def _health_after(ctx: WorkerContext, root: RootHandle, store: bool, err: int,
                  text: str) -> None:
    """Tell the health owner what a run on ``root`` proved: a fault counts against it;
    anything else clears earlier failures (only then: no message on the hot path). A
    load proves nothing about a read-only root's writes."""
    if err and is_fault(err):
        root.close()  # a later use opens it afresh (a remounted file system)
        ctx.report_root(root.index, False, err, text)
        return
    state, _, failures, _ = ctx.slot_writer.control.root_health(root.index)
    if state == RootState.READ_ONLY and not store:
        return
    if failures or state != RootState.IN:
        ctx.report_root(root.index, True, 0, "")


def _run_on_root(ctx: WorkerContext, store: bool, root: RootHandle, keys: list[bytes],
                 offsets: list[int]) -> tuple[int, int, str]:
    gate = _gate(ctx, root, store)
    if gate is not None:
        return gate[0], 0, gate[1]
    ctx.slot_writer.set_root(root.index)  # a timeout now is blamed on this root
    relative = root.mapper.relative_path_for
    paths = [relative(key).encode() for key in keys]
    text = ""
    try:
        fd = _open_root(ctx, root, create=store)
        rc, n_done, index, text = _move(ctx, store, root, fd, paths, offsets)
        if rc == -errno.ENOENT and _folder_removed(root):  # an operator wiped the cache
            root.close()  # made again for a store; a load of it is a miss
            log.warning("mptier: %s was removed under the running tier; opening it again",
                        root.mapper.blocks_dir)
            fd = _open_root(ctx, root, create=store)
            rc, n_done, index, text = _move(ctx, store, root, fd, paths, offsets)
    except OSError as exc:
        rc, n_done, index = -(exc.errno or errno.EIO), 0, 0
        text = f"root {root.path}: {exc}"
    err = -rc
    if err and not text:
        text = str(native.batch_error("store" if store else "load", err, n_done, index,
                                      f"{root.mapper.blocks_dir}/{paths[index].decode()}"))
    _health_after(ctx, root, store, err, text)
    return err, n_done, text


def _move(ctx: WorkerContext, store: bool, root: RootHandle, fd: int, paths: list[bytes],
          offsets: list[int]) -> tuple[int, int, int, str]:
    """Store or load one run on ``root``: the native errno layer's ``(rc, n_done,
    fail_index)`` and an error text when the run failed before the native call."""
    if store:
        return _store_run(ctx, root, fd, paths, offsets)
    if root.bounce and ctx.bounce is not None:
        rc, n_done, index = ctx.bounce.load(ctx.backend, fd, paths, ctx.memory, offsets,
                                            root.flags)
    else:
        rc, n_done, index = ctx.backend.load(fd, paths, ctx.memory, offsets,
                                             ctx.block_bytes, root.flags)
    return rc, n_done, index, ""


def _folder_removed(root: RootHandle) -> bool:
    """Whether the blocks folder ``root`` holds open was removed (its link count is 0;
    a network file system may say ESTALE instead)."""
    if root.fd < 0:
        return False
    try:
        return os.fstat(root.fd).st_nlink == 0
    except OSError as exc:
        return exc.errno == errno.ESTALE


def _store_run(ctx: WorkerContext, root: RootHandle, fd: int, paths: list[bytes],
               offsets: list[int]) -> tuple[int, int, int, str]:
    if root.lease is None:  # before the first temporary name carrying our tag
        root.lease = Lease.create(root.path, tag=ctx.tag.decode())
    block_bytes = ctx.block_bytes
    capacity = ctx.io.capacity_bytes
    # Blocks already there cost this existence check: the store finds them too and only
    # touches them (names are content hashes), writing nothing; the check counts them
    # (skipped, not written) and keeps them out of the room a budget must make. The new
    # ones are counted exactly, budget or not, so stats()' usage never lags ours.
    statuses = ctx.backend.lookup(fd, paths, block_bytes, 0)
    is_new = [status != native.LOOKUP_PRESENT for status in statuses]
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
            rc, n, index, temp_err = ctx.backend.store(
                fd, paths[done:end], ctx.memory, offsets[done:end], block_bytes,
                root.flags, ctx.tag)
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
                left -= sum(is_new[done:done + n]) * block_bytes
                writer.reserve(root.index, left)
                _list_folders_of(root, paths[done + index])
                done += n
                continue
            left -= sum(is_new[done:end]) * block_bytes
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
        return _lookup_on(ctx, ctx.roots[0], keys)
    out = bytearray(len(keys))
    groups: dict[int, list[int]] = {}
    for i, index in enumerate(ctx.router.indices(keys)):
        groups.setdefault(index, []).append(i)
    for index, positions in groups.items():
        statuses = _lookup_on(ctx, ctx.roots[index], [keys[i] for i in positions])
        for j, i in enumerate(positions):
            out[i] = statuses[j]
    return bytes(out)


def _lookup_on(ctx: WorkerContext, root: RootHandle, keys: list[bytes]) -> bytes:
    if _gate(ctx, root, store=False) is not None:
        return bytes(len(keys))  # LOOKUP_ABSENT: a miss
    ctx.slot_writer.set_root(root.index)
    relative = root.mapper.relative_path_for
    paths = [relative(key).encode() for key in keys]
    try:
        fd = _open_root(ctx, root, create=False)
    except OSError as exc:
        if exc.errno is not None and is_fault(exc.errno):
            _health_after(ctx, root, False, exc.errno, f"root {root.path}: {exc}")
        return bytes(len(keys))
    return ctx.backend.lookup(fd, paths, ctx.block_bytes, root.flags)

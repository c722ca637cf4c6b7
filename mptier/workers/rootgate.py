"""A root as the worker's runs of keys meet it: the gate of its health (in rotation,
read-only, out and due for a probe), its block folder opened at first use and followed
by path when the root leads to another folder now, and what a run proved about its
health, told to the health owner.

Called by :mod:`~mptier.workers.rootio` before and after each run of keys on one root,
on the worker's thread.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time

from mptier import native
from mptier.storage.roots import root_identity
from mptier.workers.context import RootHandle, WorkerContext
from mptier.workers.control import RootState
from mptier.workers.health import is_fault, out_of_rotation_text, read_only_text

log = logging.getLogger("mptier.workers")


def gate(ctx: WorkerContext, root: RootHandle, store: bool) -> tuple[int, str] | None:
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
        probe(ctx, root)
    except OSError as exc:
        perr = exc.errno or errno.EIO
        text = f"probe of root {root.path} failed: {exc}"
        ctx.report_root(root.index, False, perr, text)
        root.close()
        return perr, (f"root {root.path} is out of rotation and a probe of it just "
                      f"failed ({exc}); its keys read as misses and stores of them fail")
    ctx.report_root(root.index, True, 0, "")
    return None


def probe(ctx: WorkerContext, root: RootHandle) -> None:
    """Does ``root`` answer? The root folder must stat as a folder, and its block
    folder open (a missing block folder is an answer too: a store makes it again).
    Raises OSError when not."""
    if not stat.S_ISDIR(os.stat(root.path).st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", root.path)
    try:
        os.fstat(open_root(ctx, root, create=False))
    except FileNotFoundError:
        pass


def open_root(ctx: WorkerContext, root: RootHandle, create: bool) -> int:
    """The root's block folder, opened at first use. A folder removed under a running
    tier is made again for a store (a load or lookup of it is a miss); a root path that
    leads to another folder now is followed (:func:`root_identity`). Raises OSError."""
    if root.fd >= 0 and root.identity is not None and \
            ctx.backend.same_folder(root.encoded_path, root.identity) == 1:
        return root.fd  # (the same stat per run as below, in one native call)
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


def health_after(ctx: WorkerContext, root: RootHandle, store: bool, err: int,
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


def folder_removed(root: RootHandle) -> bool:
    """Whether the blocks folder ``root`` holds open was removed (its link count is 0;
    a network file system may say ESTALE instead)."""
    if root.fd < 0:
        return False
    try:
        return os.fstat(root.fd).st_nlink == 0
    except OSError as exc:
        return exc.errno == errno.ESTALE

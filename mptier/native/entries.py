"""What the errno of a task says: the one home of those meanings.

The C core and its twin return these errnos for what they find at a block path (the
table of cases at the top of ``mptier_io.c``): :data:`ENTRY_ERRNOS`, from which
:func:`mptier.native.batch_error` words a failure's text. Other errnos say the root is
full (:data:`FULL_ERRNOS`), read-only, or that its file system is failing
(:data:`FAULT_ERRNOS`, which count against the root's health in
:mod:`mptier.workers.health`).

A worker sums it up as the :class:`Outcome` of the task -- :func:`outcome`, with the
operation known -- and the completion message carries it (:mod:`mptier.jobs`), so the
engine's ledger counts corrupt blocks and bad entries by what the worker saw, without
reading the errno again::

    batch call -errno ─▶ worker: outcome(op, errno) ─▶ message(errno, outcome, text)
                                                           ─▶ ledger counts by outcome
"""

from __future__ import annotations

import enum
import errno
from dataclasses import dataclass

from mptier.native import _pure


class Outcome(enum.IntEnum):
    """How a task ended, as its completion message says (one byte on the wire)."""

    OK = 0
    MISSING = 1  # ENOENT: no block at the path (a miss)
    CORRUPT = 2  # a load found a short block file and removed it
    CHECKSUM = 3  # a load found a block whose checksum record disagrees; removed
    BAD_ENTRY = 4  # not a block file at a block path (a symlink, a folder, ...)
    FULL = 5  # the root is out of room: the budget, blocks, inodes or quota
    READ_ONLY = 6  # EROFS: the root serves loads, refuses stores
    FAULT = 7  # the file system or the device under it is failing
    LOST = 8  # given up on without a result: its worker died or hung, the pool could
    #           not serve, the tier shut down (the supervisor's and engine's own reports)
    OTHER = 9  # anything else: a refused record, a bug reported as EIO, EACCES ...


@dataclass(frozen=True)
class EntryErrno:
    kind: Outcome
    hint: str  # what it means, and what happened to the entry
    store_hint: str = ""  # where a store meets it for another reason


ENTRY_ERRNOS: dict[int, EntryErrno] = {
    errno.ENODATA: EntryErrno(
        Outcome.CORRUPT,
        "the file was shorter than a block, so corrupt; it was removed"),
    errno.EBADMSG: EntryErrno(
        Outcome.CHECKSUM,
        f"checksum mismatch ({_pure.XATTR_NAME} not 4 bytes or not the block's CRC32C); "
        "the file was removed"),
    _pure._EMEDIUMTYPE: EntryErrno(
        Outcome.BAD_ENTRY,
        "not a regular file (a directory, FIFO, socket or device); left in place"),
    errno.ELOOP: EntryErrno(
        Outcome.BAD_ENTRY,
        "a symlink stood at the block path or a sub-folder; it was removed"),
    errno.ENOTDIR: EntryErrno(
        Outcome.BAD_ENTRY,
        "a non-directory stands where a sub-folder must be; left in place"),
    errno.EFBIG: EntryErrno(
        Outcome.BAD_ENTRY, "the file is longer than a block; left in place",
        store_hint="an existing file longer than a block is in the way (left in place), "
                   "or the file-size limit was reached"),
}


# The root is out of room: blocks or inodes (ENOSPC, the budget's refusal too), quota.
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# errno values that say the file system (or the device under it) is failing, as opposed
# to this block's trouble (ENOENT: a miss; ENTRY_ERRNOS; FULL_ERRNOS): these count
# against the root's health (EROFS among them: it makes the root READ_ONLY).
FAULT_ERRNOS = frozenset(
    getattr(errno, name) for name in (
        "EIO", "ETIMEDOUT", "ENOTCONN", "ESTALE", "EROFS", "EHOSTDOWN", "EHOSTUNREACH",
        "ENETDOWN", "ENETUNREACH", "ENETRESET", "ECONNABORTED", "ECONNRESET",
        "ECONNREFUSED", "ENOLINK", "EREMOTEIO", "ENODEV", "ENXIO", "ESHUTDOWN", "ECOMM",
        "ENOMEDIUM", "EUCLEAN")
    if hasattr(errno, name))
# Corruption is a load's finding: a store meets no block to check (OTHER for it).
_LOAD_ONLY = frozenset({Outcome.CORRUPT, Outcome.CHECKSUM})


def outcome(op: str, err: int) -> Outcome:
    """What ``err`` (0 for success) says of a batch ``op`` ("store", "load" or
    "lookup") -- the worker's summary, carried in the task's completion message."""
    if not err:
        return Outcome.OK
    entry = ENTRY_ERRNOS.get(err)
    if entry is not None:
        return entry.kind if op == "load" or entry.kind not in _LOAD_ONLY else Outcome.OTHER
    if err == errno.ENOENT:
        return Outcome.MISSING
    if err in FULL_ERRNOS:
        return Outcome.FULL
    if err == errno.EROFS:
        return Outcome.READ_ONLY
    return Outcome.FAULT if err in FAULT_ERRNOS else Outcome.OTHER


def hint(op: str, err: int) -> str:
    """What ``err`` means for a batch ``op`` ("store" or "load"); "" for other errnos."""
    entry = ENTRY_ERRNOS.get(err)
    if entry is None:
        return ""
    return entry.store_hint if op == "store" and entry.store_hint else entry.hint

"""What each errno of a batch call says about the entry at a block path: the one table
of those meanings.

The C core and its twin return these errnos for what they find at a block path (the
table of cases at the top of ``mptier_io.c``); :func:`mptier.native.batch_error` words
a failure's text from :data:`ENTRY_ERRNOS` (the text the completion message carries to
the engine), and the engine's ledger counts by their :attr:`EntryErrno.kind` which
loads removed a corrupt block and which entries are not block files.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from mptier.native import _pure

# Kinds of entry an errno names.
CORRUPT = "corrupt"  # a load found a short block file and removed it
CHECKSUM = "checksum"  # a load found a block whose checksum record disagrees; removed
BAD_ENTRY = "bad_entry"  # not a block file at a block path (a symlink, a folder, ...)


@dataclass(frozen=True)
class EntryErrno:
    kind: str
    hint: str  # what it means, and what happened to the entry
    store_hint: str = ""  # where a store meets it for another reason


ENTRY_ERRNOS: dict[int, EntryErrno] = {
    errno.ENODATA: EntryErrno(
        CORRUPT, "the file was shorter than a block, so corrupt; it was removed"),
    errno.EBADMSG: EntryErrno(
        CHECKSUM, f"checksum mismatch ({_pure.XATTR_NAME} not 4 bytes or not the block's "
                  "CRC32C); the file was removed"),
    _pure._EMEDIUMTYPE: EntryErrno(
        BAD_ENTRY, "not a regular file (a directory, FIFO, socket or device); left in place"),
    errno.ELOOP: EntryErrno(
        BAD_ENTRY, "a symlink stood at the block path or a sub-folder; it was removed"),
    errno.ENOTDIR: EntryErrno(
        BAD_ENTRY, "a non-directory stands where a sub-folder must be; left in place"),
    errno.EFBIG: EntryErrno(
        BAD_ENTRY, "the file is longer than a block; left in place",
        store_hint="an existing file longer than a block is in the way (left in place), "
                   "or the file-size limit was reached"),
}


def errnos_of(*kinds: str) -> frozenset[int]:
    """The errnos that name an entry of one of ``kinds``."""
    return frozenset(err for err, entry in ENTRY_ERRNOS.items() if entry.kind in kinds)


def hint(op: str, err: int) -> str:
    """What ``err`` means for a batch ``op`` ("store" or "load"); "" for other errnos."""
    entry = ENTRY_ERRNOS.get(err)
    if entry is None:
        return ""
    return entry.store_hint if op == "store" and entry.store_hint else entry.hint

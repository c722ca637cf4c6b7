"""Which file system a path is on: the one home of that fact.

Two ways to ask, for two needs:

* :func:`fs_type` / :func:`mount_of` -- the type *name* ("ext4", "tmpfs", "nfs4",
  "fuse.juicefs") and mount point, from ``/proc/self/mountinfo``. Never touches the
  path itself, so a hung mount cannot hang the caller (and a symlink in the path is
  not followed: resolve it first where that matters).
* :func:`statfs_type` / :func:`fs_magic` -- the kernel's ``statfs`` ``f_type`` magic
  number (``linux/magic.h``), of the file system that really serves the path. Touches
  the path (a system call that a dead mount can stall): for probes of a root at start.

And of an open file in memory (the engine's buffer): :func:`page_bytes_of`, the size of
the pages its file system gives it -- huge on hugetlbfs and on a tmpfs that asks for
transparent huge pages.

The C core asks ``statfs`` itself (``mpt_fs_in_memory``); its magic numbers are checked
against :data:`TMPFS_MAGIC` and :data:`RAMFS_MAGIC` when it is loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

# statfs f_type values (linux/magic.h).
EXT4_SUPER_MAGIC = 0xEF53  # also ext2 and ext3
XFS_SUPER_MAGIC = 0x58465342
BTRFS_SUPER_MAGIC = 0x9123683E
TMPFS_MAGIC = 0x01021994
RAMFS_MAGIC = 0x858458F6
HUGETLBFS_MAGIC = 0x958458F6
F2FS_SUPER_MAGIC = 0xF2F52010
# File systems that keep file data in memory.
MEMORY_MAGICS = frozenset({TMPFS_MAGIC, RAMFS_MAGIC})
# The same, by the type name fs_type gives: no device and no server behind them.
MEMORY_FS_TYPES = frozenset({"tmpfs", "ramfs", "hugetlbfs"})

MOUNTINFO = "/proc/self/mountinfo"
# Which shared-memory files get transparent huge pages: the selected word of this file
# (Documentation/admin-guide/mm/transhuge.rst). "force" and "deny" override every
# tmpfs mount's own huge= option; the kernel's internal mount (memfd_create, SysV shm)
# follows the word itself.
SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
# The size of one transparent huge page (a PMD's reach): 2 MiB on x86-64.
HPAGE_PMD_SIZE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
# huge= values (a mount option, or the internal mount's word) under which a shared-
# memory file's pages are huge wherever the kernel has them; "advise" leaves it to
# each mapping's madvise, which is the engine's and unknown here.
HUGE_SHMEM_POLICIES = frozenset({"always", "within_size", "force"})


class _Statfs(ctypes.Structure):
    # struct statfs begins with f_type (__fsword_t, a long) on every Linux ABI; the rest
    # (120 bytes on 64-bit Linux) is room for the kernel to fill.
    _fields_ = [("f_type", ctypes.c_long), ("f_bsize", ctypes.c_long),
                ("_rest", ctypes.c_char * 256)]


_libc = ctypes.CDLL(None, use_errno=True)


def statfs_type(path: str | bytes) -> int:
    """The ``f_type`` magic of the file system serving ``path``. Raises ``OSError``."""
    buf = _Statfs()
    if _libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(path))
    return buf.f_type & 0xFFFFFFFF


def fs_magic(path: str | bytes) -> int | None:
    """:func:`statfs_type`, or None when ``statfs`` fails."""
    try:
        return statfs_type(path)
    except OSError:
        return None


def _fstatfs(fd: int) -> _Statfs:
    buf = _Statfs()
    if _libc.fstatfs(fd, ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return buf


def _read_word(path: str) -> str:
    """The selected ``[word]`` of a sysfs choice file, or its whole text; "" if none."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else text


def _mountinfo() -> list[tuple[list[str], list[str]]]:
    """Each line of :data:`MOUNTINFO` as its fields before `` - `` and after (type,
    source, file-system options); empty if it cannot be read."""
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.readlines()
    except OSError:
        return []
    out = []
    for line in lines:
        left, _, right = line.partition(" - ")
        out.append((left.split(), right.split()))
    return out


def _super_options(dev: int) -> str | None:
    """The file-system options (after `` - type source``) of the mount whose device
    is ``dev`` (``st_dev``), or None where no mount this process sees has it."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    return next((tail[2] for fields, tail in _mountinfo()
                 if len(fields) > 2 and fields[2] == want and len(tail) > 2), None)


def page_bytes_of(fd: int) -> int:
    """The size of the pages that back the open file ``fd`` in memory: hugetlbfs's own
    page size; a transparent huge page (2 MiB on x86-64) for a tmpfs file whose mount
    asks for them (``huge=always`` or ``within_size``, or ``shmem_enabled`` set to
    ``force``; a file of no visible mount, as from ``memfd_create``, follows
    ``shmem_enabled``'s word); else the base page. Transparent ones are the kernel's
    best effort: a page it could not get whole is 4 KiB. Raises ``OSError``."""
    fs = _fstatfs(fd)
    kind = fs.f_type & 0xFFFFFFFF
    if kind == HUGETLBFS_MAGIC:
        return int(fs.f_bsize)
    if kind == TMPFS_MAGIC:
        policy = _read_word(SHMEM_ENABLED)
        if policy != "deny":
            options = _super_options(os.fstat(fd).st_dev)
            huge = policy if options is None else next(
                (o.partition("=")[2] for o in options.split(",") if o.startswith("huge=")),
                "never")
            if policy == "force" or huge in HUGE_SHMEM_POLICIES:
                with contextlib.suppress(ValueError):
                    return int(_read_word(HPAGE_PMD_SIZE))
    return os.sysconf("SC_PAGE_SIZE")


def mount_table() -> list[tuple[str, str]]:
    """``(mount point, type)`` of every mount this process sees, in mount order (a later
    mount over the same point hides an earlier one); empty if it cannot be read."""
    return [(fields[4].replace("\\040", " ").rstrip("/") or "/", tail[0])
            for fields, tail in _mountinfo() if len(fields) >= 5 and tail]


def mount_of(path: str, mounts: list[tuple[str, str]] | None = None) -> tuple[str, str]:
    """``(type, mount point)`` of the mount holding ``path`` (made absolute, not
    resolved), from ``mounts`` or the current :func:`mount_table`; ``("", "")`` if
    unknown."""
    target = os.path.abspath(path).rstrip("/") or "/"
    best = ("", "")
    best_len = -1
    for point, kind in (mount_table() if mounts is None else mounts):
        inside = point == "/" or target == point or target.startswith(point + "/")
        if inside and len(point) >= best_len:  # later mounts over the same point win
            best, best_len = (kind, point), len(point)
    return best


def fs_type(path: str, mounts: list[tuple[str, str]] | None = None) -> str:
    """Type of the file system mounted at (or above) ``path``; ``""`` if unknown."""
    return mount_of(path, mounts)[0]

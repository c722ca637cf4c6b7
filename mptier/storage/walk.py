"""An incremental, layout-aware walk of a root: every entry classified, nothing followed.

    Walker(root).step(budget) -> [Entry, ...]     at most ``budget`` directory entries
      stack of directory frames, each a name-sorted list of os.scandir entries
        root ──▶ <base>_r<rank> ──▶ <h3> ──▶ <h2>_g<group> ──▶ <h>.bin / temp files
          ├───▶ <base>/config.json, mptier.json
          └───▶ .mptier/leases/<tag>.lease

A worker walks a huge root a slice at a time between I/O tasks: the walker keeps its
place (a stack of directory listings) between calls, and a tier's start never waits for
a full walk. Facts it relies on:

- Nothing is followed: types come from the directory entry (``d_type``), sizes and times
  from ``lstat`` (``DirEntry.stat(follow_symlinks=False)``); a FIFO is never opened; a
  symlinked folder is reported, never entered; foreign folders are not descended.
- One ``lstat`` per file and none per layout folder keeps a walk of millions cheap.
- The tree may change underneath (other nodes store and evict): an entry or folder that
  vanishes between listing and ``lstat`` is skipped and counted in ``vanished``; an
  unreadable folder is counted in ``errors`` (the first few kept in ``error_samples``).
- Each folder's names are visited in sorted order, so the walk has a position: a path is
  either ahead of it or not (:meth:`Walker.will_visit`). Usage accounting uses this to
  merge a tier's own stores and evictions into a walk in progress without counting
  anything twice or missing it. Sorting costs one listing per folder in
  memory (layout folders hold at most 4096 names; a leaf a handful).

``step`` blocks its thread on file-system metadata calls (a slow mount makes it slow);
it never raises ``OSError`` for entries or folders below the root; it raises the
``OSError`` of listing the root itself (missing, unmounted) at every step until the
root can be listed.

Long because the Walker is one state machine (a stack of listings resumed across calls)
whose every branch classifies one kind of entry of the layout; the helpers after it are
the few that act on what it found.
"""

from __future__ import annotations

import bisect
import enum
import os
import stat
from collections.abc import Iterator, Mapping
from typing import NamedTuple

from mptier.storage import names as N

# Folders whose listing failed for a reason other than vanishing keep this many samples.
MAX_ERROR_SAMPLES = 20
# Walker.top_position: the walk has not reached a block folder / is done with it.
TOP_NOT_REACHED = -1
TOP_PASSED = 0xFFF
# Entries per step of walk_all(): large enough to amortise the call, small enough that
# a consumer sees progress often.
WALK_ALL_SLICE = 4096


class Kind(enum.Enum):
    """What an entry is. ``BAD_*`` kinds stand where the layout expects something else."""

    BLOCK = "block"              # regular file of the block size (or size not known)
    TEMP = "temp"                # a store in progress or left by a dead writer
    LEASE = "lease"              # a writer's lease file (or one being created)
    CONFIG = "config"            # config.json / mptier.json of a cache folder
    META = "meta"                # anything else mptier keeps under .mptier/
    BAD_SYMLINK = "bad_symlink"  # a symlink at a block path or a layout folder name
    BAD_DIR = "bad_dir"          # a directory at a block path
    BAD_SPECIAL = "bad_special"  # a FIFO, socket or device at a block path
    BAD_SIZE = "bad_size"        # a regular file at a block path, not the block size
    BAD_NOT_DIR = "bad_not_dir"  # something other than a folder at a layout folder name
    FOREIGN = "foreign"          # a name the layout does not use (not descended)
    EMPTY_FOLDER = "empty_folder"  # an <h3> or <h2>_g<group> folder that listed empty


BAD_KINDS = frozenset({Kind.BAD_SYMLINK, Kind.BAD_DIR, Kind.BAD_SPECIAL, Kind.BAD_SIZE,
                       Kind.BAD_NOT_DIR})


class Entry(NamedTuple):
    """One classified entry. Times are nanoseconds since the epoch, from ``lstat``."""

    path: str
    kind: Kind
    size: int
    atime_ns: int
    mtime_ns: int
    ino: int
    folder: str          # the first path component under the root ("" at the root)
    tag: str | None      # lease tag of a TEMP or LEASE entry (None: legacy temp)


# Levels of the walk; a frame's level says how its names are classified.
_ROOT, _BASE, _BLOCKS, _TOP, _LEAF, _META, _LEASES = range(7)


class _Frame:
    __slots__ = ("block_bytes", "entries", "folder", "i", "level", "names", "prefix", "rel")

    def __init__(self, rel: tuple[str, ...], level: int, entries: list[os.DirEntry],
                 folder: str, block_bytes: int | None = None, prefix: str = "") -> None:
        self.rel = rel                # the folder's path components under the root
        self.level = level
        self.entries: list[os.DirEntry | None] = list(entries)
        self.names = [e.name for e in entries]   # sorted: the walk's position is i
        self.i = 0
        self.folder = folder
        self.block_bytes = block_bytes
        self.prefix = prefix          # first 3 (then 5) hex digits a name must start with


def relative_to(root: str, path: str) -> str:
    """``os.path.relpath(path, root)`` for a normalised absolute ``root``. A path the
    tier made itself (``root`` + "/" + plain names: what the caretaker reads from the
    workers' rings, one per block stored) is cut by string, in ~0.3 µs where relpath's
    two ``abspath`` calls took ~15 µs (a quarter of a 256 KiB tmpfs store's CPU, for
    the caretaker's accounting alone); anything else goes through relpath."""
    n = len(root)
    rest = path[n:]  # "/" + the relative path, when it is one
    if path.startswith(root) and rest[:1] == "/" and len(rest) > 1 and "//" not in rest \
            and "/." not in rest and not rest.endswith("/"):
        return rest[1:]
    return os.path.relpath(path, root)


def _by_name(entry: os.DirEntry) -> str:
    return entry.name


class Walker:
    """Walks ``root`` once, a slice at a time. Not thread-safe; one thread drives it.

    ``default_block_bytes`` (an int for every cache folder, or a mapping from base folder
    name ``<model>_<12hex>`` to bytes) gives the block size where ``mptier.json`` does not
    record one; where neither does, any regular file at a block path counts as a block.
    """

    def __init__(self, root: str | os.PathLike[str], *,
                 default_block_bytes: int | Mapping[str, int] | None = None) -> None:
        self.root = os.path.normpath(os.fspath(root))
        self._default = default_block_bytes
        self._block_bytes: dict[str, int | None] = {}
        self._stack: list[_Frame] = []
        self.started = False
        self.done = False
        self.entries = 0        # directory entries visited so far
        self.vanished = 0       # entries or folders gone between listing and lstat
        self.errors = 0         # folders that could not be listed (not counting vanished)
        self.error_samples: list[str] = []
        self._listing_cache: tuple[_Frame, bytes] | None = None

    # -- position ------------------------------------------------------------------------

    def _components(self, path: str) -> tuple[str, ...]:
        rel = relative_to(self.root, os.fspath(path))
        if rel == "." or rel.startswith(".." + os.sep) or rel == "..":
            raise ValueError(f"{path!r} is not under the walked root {self.root!r}")
        return tuple(rel.split(os.sep))

    def will_visit(self, path: str) -> bool:
        """Whether the walk in progress is still to reach ``path``: a file created there
        now will be counted by this walk, one removed now will not. False once done.

        True when the deepest folder of ``path`` that the walk has open still lists the
        next component of ``path`` ahead of its position (a folder not yet listed counts
        as ahead: it will be listed with whatever it holds then). Raises ``ValueError``
        for a path outside the root.
        """
        components = self._components(path)
        if self.done or not self.started:
            return not self.done
        frame = None
        for candidate in self._stack:
            depth = len(candidate.rel)
            if depth < len(components) and components[:depth] == candidate.rel:
                frame = candidate
            else:
                break
        if frame is None:  # the root itself is off the stack only once done
            return False
        name = components[len(frame.rel)]
        i = bisect.bisect_left(frame.names, name)
        # Not in the listing at all: created after it was taken, so never visited.
        return i < len(frame.names) and frame.names[i] == name and i >= frame.i

    def top_position(self, folder: str) -> int:
        """Where this walk stands in block folder ``folder`` (a name at the root), for
        writers that cannot call :meth:`will_visit` (other processes): the index
        (0..4095) of the last ``<h3>`` folder in it that the walk entered or passed.
        A block created now whose h3 is greater will be counted by this pass (unless its
        h3 folder is new since the folder was listed); one whose h3 is not greater may
        not be. :data:`TOP_NOT_REACHED` (-1): the walk has not listed ``folder`` yet, so
        everything in it is still ahead; :data:`TOP_PASSED` (4095): done with it, or it
        will never list it. Pure bookkeeping, no I/O."""
        if self.done:
            return TOP_PASSED
        if not self.started:
            return TOP_NOT_REACHED
        stack = self._stack
        if len(stack) >= 2 and stack[1].rel == (folder,):
            frame = stack[1]
            for i in range(frame.i - 1, -1, -1):
                if N.TOP_RE.match(frame.names[i]):
                    return int(frame.names[i], 16)
            return TOP_NOT_REACHED
        top = stack[0]
        i = bisect.bisect_left(top.names, folder)
        if i < len(top.names) and top.names[i] == folder and i >= top.i:
            return TOP_NOT_REACHED
        return TOP_PASSED

    def top_listing(self, folder: str) -> bytes | None:
        """The ``<h3>`` folders of block folder ``folder`` that this pass listed, as a
        4096-bit map (bit ``n`` of byte ``n >> 3`` for name ``n``): a block in a folder
        missing from it is not counted by this pass, even if ahead of
        :meth:`top_position`. None while ``folder`` is not being walked (not listed yet,
        or done with). Computed once per listing."""
        stack = self._stack
        if len(stack) < 2 or stack[1].rel != (folder,):
            return None
        frame = stack[1]
        cached = self._listing_cache
        if cached is not None and cached[0] is frame:
            return cached[1]
        bits = bytearray(4096 // 8)
        for name in frame.names:
            if N.TOP_RE.match(name):
                top = int(name, 16)
                bits[top >> 3] |= 1 << (top & 7)
        self._listing_cache = (frame, bytes(bits))
        return self._listing_cache[1]

    # -- walking -------------------------------------------------------------------------

    def block_bytes_for(self, base: str) -> int | None:
        """Block size of cache folder ``base`` (``mptier.json``, else the default)."""
        if base not in self._block_bytes:
            size = N.recorded_block_bytes(f"{self.root}/{base}")
            if size is None:
                default = self._default
                size = default.get(base) if isinstance(default, Mapping) else default
            self._block_bytes[base] = size
        return self._block_bytes[base]

    def _list(self, path: str) -> list[os.DirEntry] | None:
        try:
            with os.scandir(path) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            self.vanished += 1
            return None
        except OSError as exc:
            self.errors += 1
            if len(self.error_samples) < MAX_ERROR_SAMPLES:
                self.error_samples.append(f"{path}: {exc.strerror or exc}")
            return None
        entries.sort(key=_by_name)
        return entries

    def _start(self) -> None:
        # A root that cannot be listed is the caller's error, raised at every step
        # until it can be: the walk must never look complete (and empty) because of it.
        with os.scandir(self.root) as it:
            entries = sorted(it, key=_by_name)
        self._stack.append(_Frame((), _ROOT, entries, ""))
        self.started = True

    def step(self, budget: int) -> list[Entry]:
        """Visit at most ``budget`` (>= 1) directory entries; return the classified files
        and bad entries among them (layout folders that are entered are not returned).

        Blocks on metadata calls only: one ``lstat`` per returned entry and one listing
        per folder entered. Returns ``[]`` once :attr:`done`.
        """
        if budget < 1:
            raise ValueError(f"budget must be at least 1 entry, got {budget}")
        if not self.started:
            self._start()
        out: list[Entry] = []
        stack = self._stack
        visited = 0
        while visited < budget and stack:
            frame = stack[-1]
            if frame.i >= len(frame.entries):
                stack.pop()
                continue
            entry = frame.entries[frame.i]
            assert entry is not None
            frame.entries[frame.i] = None  # free each DirEntry once visited
            frame.i += 1
            visited += 1
            result = self._visit(frame, entry)
            if result is not None:
                out.append(result)
        self.entries += visited
        if not stack:
            self.done = True
        return out

    def walk_all(self) -> Iterator[Entry]:
        """Every remaining entry, walking to the end (a convenience for offline tools)."""
        while not self.done:
            yield from self.step(WALK_ALL_SLICE)

    def __iter__(self) -> Iterator[Entry]:
        return self.walk_all()

    # -- classification -----------------------------------------------------------------

    def _descend(self, de: os.DirEntry, level: int, folder: str,
                 block_bytes: int | None = None, prefix: str = "") -> Entry | None:
        """Enter folder ``de``; an empty block sub-folder is returned as EMPTY_FOLDER
        (its inode and blocks are disk a caretaker gives back: remove_empty_folder)."""
        entries = self._list(de.path)
        if entries:
            rel = (*self._stack[-1].rel, de.name)
            self._stack.append(_Frame(rel, level, entries, folder, block_bytes, prefix))
        elif entries is not None and level in (_TOP, _LEAF):
            return self._entry(de, Kind.EMPTY_FOLDER, folder)
        return None

    def _entry(self, de: os.DirEntry, kind: Kind, folder: str,
               tag: str | None = None) -> Entry | None:
        try:
            st = de.stat(follow_symlinks=False)
        except FileNotFoundError:
            self.vanished += 1
            return None
        except OSError:
            self.errors += 1
            return None
        return Entry(de.path, kind, st.st_size, st.st_atime_ns, st.st_mtime_ns, st.st_ino,
                     folder, tag)

    def _layout_folder(self, frame: _Frame, de: os.DirEntry, level: int, folder: str,
                       block_bytes: int | None = None, prefix: str = "") -> Entry | None:
        """A name the layout uses for a folder: enter it when it is one."""
        if de.is_dir(follow_symlinks=False):
            return self._descend(de, level, folder, block_bytes, prefix)
        if de.is_symlink():
            return self._entry(de, Kind.BAD_SYMLINK, folder)
        return self._entry(de, Kind.BAD_NOT_DIR, folder)

    def _visit(self, frame: _Frame, de: os.DirEntry) -> Entry | None:
        name = de.name
        level = frame.level
        if level == _LEAF:
            return self._visit_leaf(frame, de)
        if level == _TOP:
            match = N.LEAF_RE.match(name)
            if match:
                return self._layout_folder(frame, de, _LEAF, frame.folder, frame.block_bytes,
                                           frame.prefix + match.group("prefix"))
            return self._entry(de, Kind.FOREIGN, frame.folder)
        if level == _BLOCKS:
            if N.TOP_RE.match(name):
                return self._layout_folder(frame, de, _TOP, frame.folder, frame.block_bytes,
                                           name)
            if N.PROBE_TEMP_RE.match(name):  # a tier probes its block folder
                return self._typed(de, Kind.TEMP, frame.folder)
            return self._entry(de, Kind.FOREIGN, frame.folder)
        if level == _ROOT:
            return self._visit_root(frame, de)
        if level == _BASE:
            if name in (N.CONFIG_JSON, N.MPTIER_JSON):
                return self._typed(de, Kind.CONFIG, frame.folder)
            if name.startswith((N.CONFIG_JSON + ".tmp.", N.MPTIER_JSON + ".tmp.")):
                # FileMapper's temporaries (layout._publish)
                return self._typed(de, Kind.TEMP, frame.folder)
            return self._entry(de, Kind.FOREIGN, frame.folder)
        if level == _META:
            if name == N.LEASES_DIR and de.is_dir(follow_symlinks=False):
                self._descend(de, _LEASES, frame.folder)
                return None
            return self._entry(de, Kind.META, frame.folder)
        # _LEASES
        match = N.LEASE_RE.match(name)
        if match and de.is_file(follow_symlinks=False):
            return self._entry(de, Kind.LEASE, frame.folder, match.group("tag"))
        return self._entry(de, Kind.META, frame.folder)

    def _visit_root(self, frame: _Frame, de: os.DirEntry) -> Entry | None:
        name = de.name
        if name == N.META_DIR:
            return self._layout_folder(frame, de, _META, name)
        blocks = N.base_of_blocks_dir(name)
        if blocks is not None:
            block_bytes = self.block_bytes_for(blocks[0])
            return self._layout_folder(frame, de, _BLOCKS, name, block_bytes)
        if N.BASE_RE.match(name):
            return self._layout_folder(frame, de, _BASE, name)
        if N.PROBE_TEMP_RE.match(name):
            return self._typed(de, Kind.TEMP, "")
        return self._entry(de, Kind.FOREIGN, "")

    def _typed(self, de: os.DirEntry, kind: Kind, folder: str,
               tag: str | None = None) -> Entry | None:
        """``kind`` when ``de`` is a regular file, else the bad kind of its type."""
        if de.is_symlink():
            return self._entry(de, Kind.BAD_SYMLINK, folder)
        if de.is_dir(follow_symlinks=False):
            return self._entry(de, Kind.BAD_DIR, folder)
        result = self._entry(de, kind, folder, tag)
        if result is not None and not stat.S_ISREG(_mode_of(de)):
            return result._replace(kind=Kind.BAD_SPECIAL, tag=None)
        return result

    def _visit_leaf(self, frame: _Frame, de: os.DirEntry) -> Entry | None:
        name = de.name
        match = N.BLOCK_RE.match(name)
        if match and match.group("h").startswith(frame.prefix) \
                and len(match.group("h")) % 2 == 0:
            result = self._typed(de, Kind.BLOCK, frame.folder)
            if result is not None and result.kind is Kind.BLOCK and (
                    result.size != frame.block_bytes if frame.block_bytes is not None
                    else result.size == 0):  # no block is empty, whatever its size
                return result._replace(kind=Kind.BAD_SIZE)
            return result
        match = N.TEMP_RE.match(name)
        if match and match.group("h").startswith(frame.prefix):
            return self._typed(de, Kind.TEMP, frame.folder, match.group("tag"))
        match = N.LEGACY_TEMP_RE.match(name)
        if match and match.group("h").startswith(frame.prefix):
            return self._typed(de, Kind.TEMP, frame.folder)
        return self._entry(de, Kind.FOREIGN, frame.folder)

    def close(self) -> None:
        """Drop the walk's state (its listings); the walker then reports done."""
        self._stack.clear()
        self.started = self.done = True

    def __enter__(self) -> Walker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _mode_of(de: os.DirEntry) -> int:
    # Cached by DirEntry after the lstat in _entry, so no second system call.
    return de.stat(follow_symlinks=False).st_mode


def remove_empty_folder(path: str) -> bool:
    """Remove the block sub-folder ``path`` if it is empty (``rmdir``: the kernel
    checks, so a file a writer just made in it keeps it). Returns whether it removed.

    Safe beside writers: a store that finds its folder gone, or its parent gone while it
    made the folder, makes it again and retries (``MPT_MKDIR_TRIES`` in the native core,
    ``MKDIR_TRIES`` in the pure twin); a writer without that retry (another program) sees
    one store fail, never a wrong block."""
    try:
        os.rmdir(path)
    except OSError:  # not empty, gone already, or the file system refuses: keep it
        return False
    return True


def remove_empty_parents(block_path: str) -> int:
    """After a block was removed: remove its ``<h2>_g<group>`` folder and then its
    ``<h3>`` folder where they are now empty (never the block folder). Returns how many
    were removed."""
    leaf = os.path.dirname(block_path)
    if not remove_empty_folder(leaf):
        return 0
    return 1 + remove_empty_folder(os.path.dirname(leaf))


def unlink_if_unchanged(entry: Entry) -> bool:
    """Unlink ``entry.path`` only if it is still what the walk saw (same inode, same
    mtime): a file replaced since (a new store under the same name) is kept. Never
    follows a symlink (a symlink entry removes the link). Returns whether it removed."""
    try:
        st = os.lstat(entry.path)
        if st.st_ino != entry.ino or st.st_mtime_ns != entry.mtime_ns:
            return False
        os.unlink(entry.path)
    except FileNotFoundError:
        return False
    return True

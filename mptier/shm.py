"""The primary KV buffer in shared memory, as the engine and the workers see it.

:class:`SharedKVBuffer` is either

* **created** by mptier (``create``): a POSIX shared-memory object named
  ``/mptier.<pid>.<start time>.<random>.buf``; the creator alone unlinks it;
* **attached** by name (``attach``), e.g. by another process of the engine; or
* **adopted** from the engine's own memory (``from_memoryview``): the address range is
  looked up in ``/proc/self/maps``. If it is a shared mapping of files (vLLM's
  ``/dev/shm/vllm_offload_<id>.mmap`` plus ``.1``, ``.2``... segments), those files are
  opened *now* -- vLLM may unlink them later -- and workers get the descriptors. Anything
  else (anonymous or private memory) cannot be shared: ``shareable`` is False and the
  tier runs its I/O on threads instead.

Whoever creates or attaches an object holds a shared lock on it while using it, so
:func:`cleanup_stale` can tell the objects of dead engines (nobody holds them) from live
ones -- even those of a process in another PID namespace. An object is locked *before*
it gets its name (an unnamed ``O_TMPFILE`` file locked, sized, then linked in; where that
is refused, a temporary name locked and then linked to the real one), so no process ever
sees an unlocked live object and no grace period is needed: an engine killed a moment
after its start leaves nothing that the next sweep keeps. Names carry the creator's pid
and start time for the reader, not for liveness.

Long because the three ways to come by a buffer (create, attach, adopt from
/proc/self/maps) share the naming, locking and stale-object rules that make them safe
together.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import stat
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import posix_ipc

from mptier.errors import ConfigError, MptierError
from mptier.mapping import PAGE_SIZE, Segment

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "mptier."
# The suffix of an object's temporary name while its creator locks it (only where
# O_TMPFILE is refused); such a name younger than STALE_GRACE_S may not be locked yet.
CREATING_SUFFIX = ".creating"
STALE_GRACE_S = 5.0


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = data[data.rindex(b")") + 2:].split()
    return int(fields[19])


def unique_name(kind: str) -> str:
    """A fresh object name (without the leading "/") owned by this process."""
    pid = os.getpid()
    return f"{NAME_PREFIX}{pid}.{process_start_ticks(pid) or 0}.{secrets.token_hex(4)}.{kind}"


def hold(fd: int) -> None:
    """Mark the object behind ``fd`` as in use by this process: a shared lock, held
    while the descriptor stays open (every holder can hold one at once)."""
    fcntl.flock(fd, fcntl.LOCK_SH)


def create_locked(name: str, nbytes: int, directory: str = SHM_DIR) -> int:
    """A new object ``name`` of ``nbytes`` zero bytes in ``directory``, already held.

    Returns its descriptor (close-on-exec), whose shared lock proves it alive from the
    moment the name exists. Raises ``FileExistsError`` if the name is taken, ``OSError``
    otherwise; nothing is left behind on failure.
    """
    path = os.path.join(directory, name)
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError:
        return _create_locked_by_rename(path, nbytes)
    try:
        hold(fd)
        os.ftruncate(fd, nbytes)
        # linkat(AT_SYMLINK_FOLLOW) through /proc gives the unnamed file its name (EEXIST
        # if taken); a directory descriptor is what makes Python call linkat with it.
        fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.link(str(fd), path, src_dir_fd=fds, follow_symlinks=True)
        finally:
            os.close(fds)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _create_locked_by_rename(path: str, nbytes: int) -> int:
    """:func:`create_locked` where the directory refuses ``O_TMPFILE``: lock under a
    temporary name, then link the real name to it (never replaces an existing one)."""
    temporary = path + CREATING_SUFFIX
    fd = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o600)
    try:
        hold(fd)
        os.ftruncate(fd, nbytes)
        os.link(temporary, path)
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
    return fd


def cleanup_stale(directory: str = SHM_DIR, min_age_s: float | None = None) -> list[str]:
    """Remove mptier objects nobody holds. Returns their names.

    Liveness is proven by locks, never by whether the creator's pid is visible: the
    creator and every attacher hold a shared ``flock`` on the object for as long as they
    use it (file locks work across PID namespaces on one kernel, so a container sharing
    ``/dev/shm`` keeps its buffers), and an object is removed only when an exclusive lock
    can be taken. Objects are locked before they are named (:func:`create_locked`), so
    any age will do; ``min_age_s`` (default 0) spares younger ones, for objects made by
    other means. A temporary name of :func:`create_locked` younger than
    ``STALE_GRACE_S`` is always spared: its creator may be about to lock it.
    """
    grace = 0.0 if min_age_s is None else min_age_s
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not name.startswith(NAME_PREFIX):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            held = os.fstat(fd)
            spare = STALE_GRACE_S if name.endswith(CREATING_SUFFIX) else grace
            if not stat.S_ISREG(held.st_mode) or now - held.st_ctime < spare:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # someone holds it: alive
            named = os.stat(path, follow_symlinks=False)
            if (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
                os.unlink(path)
                removed.append(name)
                log.info("removed stale shared-memory object %s (nobody holds it)", name)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


@dataclass(frozen=True)
class _MapEntry:
    start: int
    end: int
    shared: bool
    offset: int
    dev: tuple[int, int]
    inode: int
    path: str
    deleted: bool


def _read_maps() -> list[_MapEntry]:
    entries = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].rstrip("\n") if len(parts) > 5 else ""
            deleted = path.endswith(" (deleted)")
            if deleted:
                path = path[: -len(" (deleted)")]
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            entries.append(_MapEntry(start, end, parts[1][3] == "s", int(parts[2], 16),
                                     (major, minor), int(parts[4]), path, deleted))
    return entries


def _same_file(fd: int, entry: _MapEntry) -> bool:
    st = os.fstat(fd)
    return st.st_ino == entry.inode and (os.major(st.st_dev), os.minor(st.st_dev)) == entry.dev


def _open_mapped_file(entry: _MapEntry) -> int:
    """Open the file behind a mapping, even if it was unlinked. Raises OSError."""
    candidates = []
    if not entry.deleted:
        candidates.append(entry.path)
    candidates.append(f"/proc/self/map_files/{entry.start:x}-{entry.end:x}")
    with contextlib.suppress(OSError):
        candidates.extend(f"/proc/self/fd/{n}" for n in os.listdir("/proc/self/fd"))
    for candidate in candidates:
        try:
            fd = os.open(candidate, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        if _same_file(fd, entry):
            return fd
        os.close(fd)
    raise OSError(f"cannot reopen {entry.path!r}{' (deleted)' if entry.deleted else ''}: no "
                  "path, map_files entry or open descriptor leads to it")


class SharedKVBuffer:
    """A primary KV buffer of ``num_blocks`` blocks of ``block_bytes`` bytes.

    ``view`` is a writable numpy ``uint8`` array of shape ``(num_blocks, block_bytes)``.
    Use as a context manager: on exit it closes, and the creator also unlinks.
    """

    def __init__(self, *, view: np.ndarray, name: str | None, owner: bool,
                 segments: list[Segment], shareable: bool, reason: str = "",
                 mapping: mmap.mmap | None = None) -> None:
        self.view = view
        self.name = name
        self.num_blocks, self.block_bytes = view.shape
        self.shareable = shareable
        self.unshareable_reason = reason
        self._owner = owner
        self._segments = segments
        self._mmap = mapping
        self._closed = False

    # -- construction -------------------------------------------------------------------

    @classmethod
    def create(cls, num_blocks: int, block_bytes: int, name: str | None = None
               ) -> SharedKVBuffer:
        """A new zero-filled buffer in POSIX shared memory (page-aligned)."""
        for label, value in (("num_blocks", num_blocks), ("block_bytes", block_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{label} must be a positive whole number, got {value!r}")
        cleanup_stale()
        name = name or unique_name("buf")
        nbytes = num_blocks * block_bytes
        try:
            fd = create_locked(name, nbytes)
        except FileExistsError:
            raise MptierError(f"shared-memory object {name!r} already exists") from None
        except OSError as exc:
            raise MptierError(f"cannot create shared-memory object {name!r} in {SHM_DIR}: "
                              f"{exc.strerror}") from None
        try:
            mapping = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))
            raise
        return cls._from_mmap(mapping, name, fd, owner=True, num_blocks=num_blocks,
                              block_bytes=block_bytes)

    @classmethod
    def attach(cls, name: str, block_bytes: int) -> SharedKVBuffer:
        """Map an existing buffer by the ``name`` its creator reports."""
        try:
            shm = posix_ipc.SharedMemory("/" + name.lstrip("/"))
        except posix_ipc.ExistentialError:
            raise MptierError(f"no shared-memory object named {name!r}") from None
        fd = shm.fd
        try:
            os.set_inheritable(fd, False)
            hold(fd)
            size = shm.size
            if size % block_bytes:
                raise ConfigError(f"buffer {name!r} is {size} bytes, not a multiple of "
                                  f"block_bytes={block_bytes}")
            mapping = mmap.mmap(fd, size)
        except BaseException:
            shm.close_fd()
            raise
        return cls._from_mmap(mapping, name.lstrip("/"), fd, owner=False,
                              num_blocks=size // block_bytes, block_bytes=block_bytes)

    @classmethod
    def _from_mmap(cls, mapping: mmap.mmap, name: str, fd: int, *, owner: bool,
                   num_blocks: int, block_bytes: int) -> SharedKVBuffer:
        # numpy is imported here, not at the top: the sweeps of /dev/shm (the watchdog's,
        # in every pool and service) need none, and a service never maps a buffer.
        import numpy as np
        view = np.frombuffer(mapping, dtype=np.uint8, count=num_blocks * block_bytes)
        view = view.reshape(num_blocks, block_bytes)
        # The descriptor stays open while the buffer is: it holds the lock that proves
        # the object alive, and workers get duplicates of it.
        segment = Segment(fd=fd, file_offset=0, length=num_blocks * block_bytes,
                          buffer_offset=0, path=os.path.join(SHM_DIR, name))
        return cls(view=view, name=name, owner=owner, segments=[segment], shareable=True,
                   mapping=mapping)

    @classmethod
    def from_memoryview(cls, memory: object, block_bytes: int | None = None
                        ) -> SharedKVBuffer:
        """Adopt the engine's own buffer (a memoryview, numpy array, mmap...).

        ``block_bytes`` defaults to the row stride of a 2-D buffer (as vLLM's
        ``primary_kv_view``). The memory is not copied and stays the caller's.
        """
        mv = memoryview(memory)
        if block_bytes is None:
            if mv.ndim < 2 or not mv.strides:
                raise ConfigError("block_bytes is required for a 1-D buffer (pass "
                                  "block_bytes=, or a 2-D view of shape (blocks, bytes))")
            block_bytes = mv.strides[0]
        if not mv.c_contiguous:
            raise ConfigError("the primary buffer must be C-contiguous")
        import numpy as np
        flat = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv,
                             dtype=np.uint8)
        if flat.nbytes % block_bytes:
            raise ConfigError(f"the buffer's {flat.nbytes} bytes are not a multiple of "
                              f"block_bytes={block_bytes}")
        view = flat.reshape(flat.nbytes // block_bytes, block_bytes)
        if not view.flags.writeable:
            raise ConfigError("the primary buffer must be writable (loads write into it)")
        segments, reason = _segments_of(view.ctypes.data, view.nbytes)
        return cls(view=view, name=None, owner=False, segments=segments,
                   shareable=not reason, reason=reason)

    # -- what workers need ---------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def open_segments(self) -> list[Segment]:
        """Segments with freshly opened descriptors (the caller closes them).

        Raises ``MptierError`` if the buffer is not shareable or its object is gone.
        """
        if not self.shareable:
            raise MptierError(f"buffer cannot be shared: {self.unshareable_reason}")
        out = []
        try:
            for seg in self._segments:
                fd = os.dup(seg.fd) if seg.fd >= 0 else os.open(seg.path, os.O_RDWR |
                                                                   os.O_CLOEXEC)
                out.append(Segment(fd, seg.file_offset, seg.length, seg.buffer_offset,
                                   seg.path))
        except OSError as exc:
            for seg in out:
                os.close(seg.fd)
            raise MptierError(f"cannot open the primary buffer's memory for workers: {exc}"
                              ) from exc
        return out

    # -- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Drop this process's mapping (kept alive while numpy views of it exist) and
        its hold on the object."""
        if self._closed:
            return
        self._closed = True
        for fd in {seg.fd for seg in self._segments if seg.fd >= 0}:
            with contextlib.suppress(OSError):
                os.close(fd)
        mapping, self._mmap = self._mmap, None
        self.view = None  # type: ignore[assignment]
        if mapping is not None:
            with contextlib.suppress(BufferError):  # views still exported: freed with them
                mapping.close()

    def unlink(self) -> None:
        """Remove the name (creator only); mappings stay valid until closed."""
        if self.name and self._owner:
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory("/" + self.name)
            self._owner = False

    def __enter__(self) -> SharedKVBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.unlink()

    def __repr__(self) -> str:
        where = self.name or ("shared files" if self.shareable else "private memory")
        return f"<SharedKVBuffer {self.num_blocks} x {self.block_bytes} B in {where}>"


def _segments_of(address: int, nbytes: int) -> tuple[list[Segment], str]:
    """Segments (with open descriptors) backing ``[address, address + nbytes)``, or an
    empty list and the reason the range cannot be shared."""
    end = address + nbytes
    covering = [e for e in _read_maps() if e.end > address and e.start < end]
    pos = address
    segments: list[Segment] = []
    opened: dict[tuple[tuple[int, int], int], int] = {}

    def fail(reason: str) -> tuple[list[Segment], str]:
        for fd in opened.values():
            os.close(fd)
        return [], reason

    for entry in sorted(covering, key=lambda e: e.start):
        if entry.start > pos:
            return fail(f"address range has a hole at {pos:#x}")
        if not entry.path or entry.path.startswith("[") or entry.inode == 0:
            return fail("anonymous memory (not backed by a file)")
        if not entry.shared:
            return fail(f"private (copy-on-write) mapping of {entry.path}")
        ident = (entry.dev, entry.inode)
        if ident not in opened:
            try:
                opened[ident] = _open_mapped_file(entry)
            except OSError as exc:
                return fail(str(exc))
        piece_end = min(entry.end, end)
        segments.append(Segment(fd=opened[ident],
                                file_offset=entry.offset + (pos - entry.start),
                                length=piece_end - pos, buffer_offset=pos - address,
                                path=entry.path))
        pos = piece_end
        if pos >= end:
            break
    if pos < end:
        return fail("address range is not fully mapped")
    return _merge(segments), ""


def _merge(segments: list[Segment]) -> list[Segment]:
    """Join pieces that continue the same file (the kernel may split one mapping)."""
    merged: list[Segment] = []
    for seg in segments:
        last = merged[-1] if merged else None
        if (last is not None and last.fd == seg.fd
                and last.file_offset + last.length == seg.file_offset
                and last.buffer_offset + last.length == seg.buffer_offset):
            merged[-1] = Segment(last.fd, last.file_offset, last.length + seg.length,
                                 last.buffer_offset, last.path)
        else:
            merged.append(seg)
    return merged


__all__ = ["PAGE_SIZE", "SharedKVBuffer", "cleanup_stale"]

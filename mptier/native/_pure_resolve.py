"""The pure-Python twin of ``resolve.c``: reaching a path beneath a root without
following a symlink, by walking it one component at a time (O_PATH | O_DIRECTORY |
O_NOFOLLOW). A symlink met at a sub-folder or the leaf is removed; "..", which
validation already refuses, says EXDEV as RESOLVE_BENEATH would. Functions return a
descriptor or ``-errno`` and raise nothing, as in C.
"""

from __future__ import annotations

import errno
import os

MKDIR_TRIES = 3  # rounds of "make the folder, open it again" against a concurrent rmdir
_O_FOLDER = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _close_dir(dirfd: int, root: int) -> None:
    if dirfd >= 0 and dirfd != root:
        os.close(dirfd)


def _split(rel: bytes) -> tuple[bytes, bytes]:
    """(folder part, leaf) of a relative path."""
    cut = rel.rfind(b"/")
    return (b"", rel) if cut < 0 else (rel[:cut], rel[cut + 1 :])


def _unlink_symlink(dirfd: int, name: bytes) -> int:
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        if _is_link(st.st_mode):
            os.unlink(name, dir_fd=dirfd)
    except FileNotFoundError:
        pass
    except OSError as e:
        return -e.errno
    return 0


def _is_link(mode: int) -> bool:
    return (mode & 0o170000) == 0o120000


def _is_reg(mode: int) -> bool:
    return (mode & 0o170000) == 0o100000


def _is_dir(mode: int) -> bool:
    return (mode & 0o170000) == 0o040000


def _open_component(cur: int, name: bytes, create: bool, made: list[bool] | None = None
                    ) -> int:
    """Open one folder below ``cur`` (twin of the inner loop of ``mpt_walk``); with
    ``made``, ``made[0]`` says whether this call made the folder."""
    fd = -errno.ENOENT
    for tries in range(MKDIR_TRIES + 1):
        try:
            return os.open(name, _O_FOLDER, dir_fd=cur)
        except OSError as e:
            fd = -e.errno
        if tries >= MKDIR_TRIES:
            break
        if fd == -errno.ENOENT and create:
            try:
                os.mkdir(name, 0o777, dir_fd=cur)
                if made is not None:
                    made[0] = True
            except FileExistsError:
                pass
            except OSError as e:
                return -e.errno
            continue
        if fd not in (-errno.ENOTDIR, -errno.ELOOP):
            break
        try:
            st = os.stat(name, dir_fd=cur, follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError as e:
            return -e.errno
        if not _is_link(st.st_mode):
            if _is_dir(st.st_mode):
                continue
            return -errno.ENOTDIR
        rc = _unlink_symlink(cur, name)
        if rc:
            return rc
        if not create:
            return -errno.ELOOP
    return fd


def _walk(root: int, folder: bytes, create: bool, made: list[bool] | None = None) -> int:
    """Twin of ``mpt_walk``: the folder's descriptor (``root`` for b"") or -errno; with
    ``made``, ``made[0]`` says whether the walk made the last folder itself."""
    cur = root
    for name in folder.split(b"/"):
        if not name:
            continue
        if made is not None:
            made[0] = False
        if len(name) > 255:
            rc = -errno.ENAMETOOLONG
        elif name == b"..":
            rc = -errno.EXDEV
        else:
            rc = _open_component(cur, name, create, made)
        if rc < 0:
            _close_dir(cur, root)
            return rc
        _close_dir(cur, root)
        cur = rc
    return cur


def _open_beneath(root: int, rel: bytes, oflags: int) -> int:
    """Twin of ``mpt_open_beneath`` (walk path): a descriptor or -errno."""
    folder, leaf = _split(rel)
    dirfd = _walk(root, folder, False)
    if dirfd < 0:
        return dirfd
    try:
        return os.open(leaf, oflags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            _unlink_symlink(dirfd, leaf)
        return -e.errno
    finally:
        _close_dir(dirfd, root)


def _remove_if_same(root: int, rel: bytes, dev: int, ino: int) -> None:
    folder, leaf = _split(rel)
    dirfd = _walk(root, folder, False)
    if dirfd < 0:
        return
    try:
        named = os.stat(leaf, dir_fd=dirfd, follow_symlinks=False)
        if (named.st_dev, named.st_ino) == (dev, ino):
            os.unlink(leaf, dir_fd=dirfd)
    except OSError:
        pass
    finally:
        _close_dir(dirfd, root)


def _remove_if_same_fd(root: int, rel: bytes, fd: int) -> None:
    held = os.fstat(fd)
    _remove_if_same(root, rel, held.st_dev, held.st_ino)

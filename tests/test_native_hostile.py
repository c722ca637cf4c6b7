"""Hostile entries at a block path: what lookup, load and store answer, and what is left.

Each entry is made at a real layout path (``<h[:3]>/<h[3:5]>_g0/<h>.bin``) under a fresh
root, then one operation runs; the observed row (answer and what remains at the path)
must equal the table's. Every row runs on the compiled core with openat2, on its
O_NOFOLLOW walk and on the pure-Python twin. Files the entries point at, inside and
outside the root, must come through every operation unchanged.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

import pytest
from native_support import (  # noqa: F401  (fixtures)
    BLOCK,
    aligned,
    block_paths,
    io_fixture,
    no_fault_fixture,
    temp_files,
    write_file,
)

from mptier import native
from mptier.errors import BatchIOError

REL = block_paths(1, "hostile")[0]
TOP, SUB, LEAF = REL.split("/")
GOOD = bytes(range(256)) * (BLOCK // 256)  # a whole block some other party owns
OURS_SEED = 99

P, S, B, SH = (native.LOOKUP_PRESENT, native.LOOKUP_SYMLINK, native.LOOKUP_BAD,
               native.LOOKUP_SHORT)
OK = "ok"


def make_entry(kind: str, root: Path, outside: Path) -> None:
    leaf = root / REL
    if kind != "file at a sub-folder" and not kind.startswith("symlinked"):
        leaf.parent.mkdir(parents=True)
    if kind == "symlink to a block inside":
        write_file(root / "elsewhere" / "inside.bin", GOOD)
        os.symlink(root / "elsewhere" / "inside.bin", leaf)
    elif kind == "symlink to a block outside":
        os.symlink(outside / "outside.bin", leaf)
    elif kind == "dangling symlink":
        os.symlink(root / "nowhere.bin", leaf)
    elif kind == "symlinked sub-folder":
        write_file(outside / "tree" / SUB / LEAF, GOOD)
        os.symlink(outside / "tree", root / TOP)
    elif kind == "symlinked second sub-folder":
        (root / TOP).mkdir()
        write_file(outside / "tree2" / LEAF, GOOD)
        os.symlink(outside / "tree2", root / TOP / SUB)
    elif kind == "directory":
        leaf.mkdir()
        (leaf / "keep").write_bytes(b"someone's")
    elif kind == "FIFO":
        os.mkfifo(leaf)
    elif kind == "socket":
        os.mknod(leaf, stat.S_IFSOCK | 0o600)
    elif kind == "character device":
        if os.geteuid() != 0:
            pytest.skip("mknod of a device needs root")
        os.mknod(leaf, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # what /dev/null is
    elif kind == "shorter file":
        leaf.write_bytes(GOOD[:-1])
    elif kind == "empty file":
        leaf.write_bytes(b"")
    elif kind == "longer file":
        leaf.write_bytes(GOOD + b"!")
    elif kind == "file at a sub-folder":
        write_file(root / TOP / SUB, GOOD)  # a file where the folder <h[3:5]>_g0 must be
    else:
        raise AssertionError(kind)


def state(root: Path, ours: bytes) -> str:
    """What stands at REL, looked at without following anything."""
    cur = root
    parts = REL.split("/")
    for i, part in enumerate(parts):
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return "absent"
        if i < len(parts) - 1:
            if stat.S_ISLNK(st.st_mode):
                return "folder link"
            if not stat.S_ISDIR(st.st_mode):
                return "file at folder"
            continue
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode):
        return "device"
    data = cur.read_bytes()
    if data == ours and os.getxattr(cur, native.XATTR_NAME) == native.get_backend(
            "python").crc32c(ours).to_bytes(4, "big"):
        return "our block"
    return f"file {len(data)}"


# entry: (lookup, after lookup), (load, after load), (store, after store); a store runs
# named and with O_TMPFILE, both must give the same row.
TABLE = {
    "symlink to a block inside": ((S, "absent"), (errno.ELOOP, "absent"), (OK, "our block")),
    "symlink to a block outside": ((S, "absent"), (errno.ELOOP, "absent"), (OK, "our block")),
    "dangling symlink": ((S, "absent"), (errno.ELOOP, "absent"), (OK, "our block")),
    "symlinked sub-folder": ((S, "absent"), (errno.ELOOP, "absent"), (OK, "our block")),
    "symlinked second sub-folder": ((S, "absent"), (errno.ELOOP, "absent"),
                                    (OK, "our block")),
    "directory": ((B, "dir"), (errno.EMEDIUMTYPE, "dir"), (errno.EMEDIUMTYPE, "dir")),
    "FIFO": ((B, "fifo"), (errno.EMEDIUMTYPE, "fifo"), (errno.EMEDIUMTYPE, "fifo")),
    "socket": ((B, "socket"), (errno.EMEDIUMTYPE, "socket"), (errno.EMEDIUMTYPE, "socket")),
    "character device": ((B, "device"), (errno.EMEDIUMTYPE, "device"),
                         (errno.EMEDIUMTYPE, "device")),
    "shorter file": ((SH, f"file {BLOCK - 1}"), (errno.ENODATA, "absent"), (OK, "our block")),
    "empty file": ((SH, "file 0"), (errno.ENODATA, "absent"), (OK, "our block")),
    "longer file": ((B, f"file {BLOCK + 1}"), (errno.EFBIG, f"file {BLOCK + 1}"),
                    (errno.EFBIG, f"file {BLOCK + 1}")),
    "file at a sub-folder": ((B, "file at folder"), (errno.ENOTDIR, "file at folder"),
                             (errno.ENOTDIR, "file at folder")),
}


def _bounded(fn, what: str, fifo: Path | None):
    """Run ``fn`` on a thread; a call still blocked after 20 s is a hang: release it (open
    the FIFO's other end) and fail."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BatchIOError as e:
            box["out"] = e
        except BaseException as e:  # reported below
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():
        if fifo is not None:
            fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
            os.close(fd)
        thread.join(5)
        pytest.fail(f"{what} blocked on the entry")
    if "error" in box:
        raise box["error"]
    return box["out"]


@pytest.mark.parametrize("kind", list(TABLE))
def test_hostile_entry(io, tmp_path, kind):
    ours = bytes(aligned(BLOCK, seed=OURS_SEED))
    observed = []
    for n, op in enumerate(("lookup", "load", "store named", "store tmpfile")):
        root, outside = tmp_path / f"root{n}", tmp_path / f"outside{n}"
        root.mkdir()
        write_file(outside / "outside.bin", GOOD)
        make_entry(kind, root, outside)
        fifo = root / REL if kind == "FIFO" else None
        buf = aligned(2 * BLOCK, seed=OURS_SEED)
        buf[BLOCK:] = 0x77
        if op == "lookup":
            answer = _bounded(lambda r=root: io.batch_lookup(r, [REL], BLOCK)[0], op, fifo)
        elif op == "load":
            answer = _bounded(lambda r=root, b=buf: io.batch_load(
                r, [REL], b, [BLOCK], BLOCK, checksum=True), op, fifo)
            assert set(buf[BLOCK:].tolist()) == {0x77}, "a failed load wrote the slot"
        else:
            tmpfile = op.endswith("tmpfile")
            answer = _bounded(lambda r=root, b=buf, t=tmpfile: io.batch_store(
                r, [REL], b, [0], BLOCK, checksum=True, tmpfile=t), op, fifo)
        if isinstance(answer, BatchIOError):
            assert answer.filename == str(root / REL)
            answer = answer.errno
        elif answer is None:
            answer = OK
        observed.append((answer, state(root, ours)))
        # what the entries pointed at is never touched
        assert (outside / "outside.bin").read_bytes() == GOOD
        for target in (root / "elsewhere" / "inside.bin", outside / "tree" / SUB / LEAF,
                       outside / "tree2" / LEAF):
            if target.exists():
                assert target.read_bytes() == GOOD, target
        assert temp_files(root) == []
        if kind == "directory" and state(root, ours) == "dir":
            assert (root / REL / "keep").read_bytes() == b"someone's"
    lookup, load, store = TABLE[kind]
    assert observed == [lookup, load, store, store]


def test_store_over_a_removed_symlink_is_a_real_file_then_a_hit(io, tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    write_file(outside / "outside.bin", GOOD)
    make_entry("symlink to a block outside", root, outside)
    buf = aligned(2 * BLOCK, seed=OURS_SEED)
    io.batch_store(root, [REL], buf, [0], BLOCK)
    assert stat.S_ISREG(os.lstat(root / REL).st_mode)
    assert io.batch_lookup(root, [REL], BLOCK) == [P]
    io.batch_load(root, [REL], buf, [BLOCK], BLOCK)
    assert bytes(buf[BLOCK:]) == bytes(buf[:BLOCK]) != GOOD
    assert (outside / "outside.bin").read_bytes() == GOOD

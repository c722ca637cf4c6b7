"""Helpers for the storage tests: real cache trees in the vLLM layout."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

from mptier.keys import make_key
from mptier.layout import FileMapper
from mptier.storage.names import MPTIER_JSON


def make_cache(root: str, model: str = "org/model", block_bytes: int = 4096,
               record_size: bool = True, rank: int = 0) -> FileMapper:
    """A cache folder with config.json (and mptier.json when ``record_size``)."""
    os.makedirs(root, exist_ok=True)
    mapper = FileMapper(root, model, rank=rank)
    mapper.write_config()
    if record_size:
        with open(f"{mapper.base_path}/{MPTIER_JSON}", "w") as f:
            json.dump({"block_bytes": block_bytes}, f)
    return mapper


def key_for(i: int, group: int = 0) -> bytes:
    """Key of block ``i``: a 32-byte hash (spread over the folders, like vLLM's)."""
    return make_key(hashlib.sha256(i.to_bytes(8, "big")).digest(), group)


def block_content(key: bytes, block_bytes: int) -> bytes:
    pattern = key * (block_bytes // len(key) + 1)
    return pattern[:block_bytes]


def write_block(mapper: FileMapper, key: bytes, block_bytes: int = 4096,
                atime_ns: int | None = None, size: int | None = None) -> str:
    """Write a block file (``size`` bytes, default the block size); set its atime."""
    path = mapper.path_for(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(block_content(key, block_bytes if size is None else size))
    if atime_ns is not None:
        st = os.stat(path)
        os.utime(path, ns=(atime_ns, st.st_mtime_ns))
    return path


def file_totals(root: str, block_bytes: int) -> tuple[int, int]:
    """(blocks, bytes) of regular files of ``block_bytes`` named *.bin under ``root``,
    counted independently of the walker (os.walk, no symlinks followed)."""
    blocks = total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if name.endswith(".bin") and os.path.isfile(path) and not os.path.islink(path) \
                    and st.st_size == block_bytes:
                blocks += 1
                total += st.st_size
    return blocks, total


LEASE_HOLDER = textwrap.dedent("""
    import os, sys, time
    from mptier.storage import Lease
    root, final, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    lease = Lease.create(root)
    for _ in range(n):
        with open(lease.temp_name(final), "wb") as f:
            f.write(b"x" * 100)
    print(lease.tag, flush=True)
    time.sleep(600)
""")


def start_lease_holder(root: str, final: str, n_temps: int = 2) -> tuple[subprocess.Popen, str]:
    """A child process that takes a lease on ``root`` and leaves ``n_temps`` temporary
    files for ``final``; returns (process, tag) once they exist."""
    proc = subprocess.Popen([sys.executable, "-c", LEASE_HOLDER, root, final, str(n_temps)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    tag = proc.stdout.readline().strip()
    assert len(tag) == 16, f"lease holder failed to start (exit {proc.poll()})"
    return proc, tag


def change_block(path: str, change: str, spare: str, t0: int) -> None:
    """Change the block file at ``path`` (atime ``t0``) as ``change`` says, for the
    tests of what eviction keeps; ``spare``: a folder to hold a link to the old inode."""
    st = os.lstat(path)
    if change == "used since":
        os.utime(path, ns=(t0 + 1, st.st_mtime_ns))
    elif change == "atime older (clock skew)":
        os.utime(path, ns=(t0 - 10**9, st.st_mtime_ns))
    elif change == "replaced by a new file":
        os.link(path, f"{spare}/old-inode")  # keeps the old inode number from reuse
        with open(path, "rb") as src, open(f"{path}.new", "wb") as dst:
            dst.write(src.read())
        os.utime(f"{path}.new", ns=(t0, st.st_mtime_ns))  # only the inode differs
        os.rename(f"{path}.new", path)
    elif change == "another size":
        with open(path, "ab") as f:
            f.write(b"x")
        os.utime(path, ns=(t0, st.st_mtime_ns))
    elif change == "a folder now":
        os.unlink(path)
        os.mkdir(path)
        os.utime(path, ns=(t0, st.st_mtime_ns))
    elif change == "a symlink now":
        os.unlink(path)
        os.symlink("/etc/hostname", path)
    elif change == "gone":
        os.unlink(path)
    else:
        assert change == "unchanged"

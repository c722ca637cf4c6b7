"""Which root a key lives on, when a tier has several (``root_dirs``).

Each key maps to exactly one root by rendezvous (highest-random-weight) hashing::

    score(root, key) = blake2b(block_hash(key), key=seed(root), 8 bytes)
    root(key)        = the root with the highest score

``seed(root)`` is a digest of the root's *path* (normalised, not resolved), so every node
must list the same paths for the same roots. A lookup stays one probe (the key names its
root). Adding a root moves only the keys whose new highest score is the new root's --
about ``1/(n+1)`` of them -- and every other key keeps its root; removing a root moves
only its own keys. The order of ``root_dirs`` does not matter.

All groups of one block (keys differing only in their group index) share a root: the
score reads the block hash only.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Sequence

from mptier.keys import GROUP_IDX_BYTES

# Most roots one tier may have: each has a fixed record in the control block's header
# page (mptier.workers.control). Thirty-two NVMe drives per host is past any machine
# we know of.
MAX_ROOTS = 32
_SEED_PERSON = b"mptier-root-seed"  # blake2b personalisation: seeds are for this only
_SCORE_BYTES = 8


def normalize_root(path: str | os.PathLike[str]) -> str:
    """The form of a root path that identifies it (and seeds its hash): ``normpath``,
    without resolving symlinks -- two spellings of one folder are two roots."""
    return os.path.normpath(os.fspath(path))


def root_identity(path: str) -> tuple[int, int]:
    """``(st_dev, st_ino)`` of the folder the configured root ``path`` leads to now.

    A tier follows its roots by path, not by the folder it first opened: a file system
    mounted over a root, or a new folder put where the old one was renamed away, is
    adopted (the caller compares identities). Anything but a folder there raises
    ``OSError(ESTALE)`` naming what is there, which counts against the root's health, so
    the root leaves rotation until a folder is back. Other errors (ENOENT, a hung mount's
    EIO...) are raised as they are."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ESTALE, f"the root is no longer a folder (mode {st.st_mode:o} "
                      "is there now); it is out of use until a folder is back", path)
    return st.st_dev, st.st_ino


def root_seed(path: str | os.PathLike[str]) -> bytes:
    """The 16-byte hashing seed of a root, from its normalised path."""
    return hashlib.blake2b(normalize_root(path).encode("utf-8", "surrogateescape"),
                           digest_size=16, person=_SEED_PERSON).digest()


class RootRouter:
    """Routes keys to roots (see module docstring). Cheap to build; thread-safe."""

    def __init__(self, roots: Sequence[str | os.PathLike[str]]) -> None:
        if not roots:
            raise ValueError("a tier needs at least one root")
        self.roots = [normalize_root(r) for r in roots]
        self._seeds = [root_seed(r) for r in self.roots]
        self.single = len(self.roots) == 1

    def __len__(self) -> int:
        return len(self.roots)

    def index_of(self, key: bytes) -> int:
        """The index (into ``roots``) of the root ``key`` lives on."""
        if self.single:
            return 0
        block_hash = key[:-GROUP_IDX_BYTES]
        best = -1
        best_score = b""
        for i, seed in enumerate(self._seeds):
            score = hashlib.blake2b(block_hash, digest_size=_SCORE_BYTES, key=seed).digest()
            if score > best_score:  # equal lengths: bytes order is the numbers' order
                best, best_score = i, score
        return best

    def indices(self, keys: Sequence[bytes]) -> list[int]:
        if self.single:
            return [0] * len(keys)
        index_of = self.index_of
        return [index_of(k) for k in keys]

    def runs(self, keys: Sequence[bytes]) -> list[tuple[int, int, int]]:
        """``keys`` cut into runs of consecutive keys on one root, in order:
        ``[(root index, start, end), ...]`` covering ``0..len(keys)``."""
        n = len(keys)
        if self.single or n == 0:
            return [(0, 0, n)] if n else []
        out: list[tuple[int, int, int]] = []
        where = self.indices(keys)
        start = 0
        for i in range(1, n + 1):
            if i == n or where[i] != where[start]:
                out.append((where[start], start, i))
                start = i
        return out

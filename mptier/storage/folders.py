"""A block folder's top folders, made ahead of the stores that need them.

Every block lives two folders down: ``<h3>/<h2>_g<group>/<hash>.bin`` (the layout's
``FileMapper.relative_path_for``), and there are 4,096 ``<h3>`` folders. A store into a
fresh root makes both folders of nearly every block. Making an ``<h3>`` folder locks
the block folder itself (the kernel's lock of a folder whose entries change), and
every other store's mkdir and path walk through the block folder waits on that lock
meanwhile -- on ext4 for milliseconds, since the holder's own metadata reads queue
behind the writes on the disk. Measured on this project's VM (ext4, four processes
storing 2,048 fresh 256 KiB blocks through the core's io_uring path): 4.0 s of the
io_uring helper threads' time waiting for that lock in a 1.2 s fill, none with the
4,096 folders made first; through the tier, fills of a fresh root ran 1.22-1.27x as
fast (medians of six interleaved rounds; docs/storage.md, "Folders made ahead"). An
``<h2>_g<group>`` folder is made inside its ``<h3>`` folder, a lock 4,096 folders
share.

So the caretaker of a root makes the missing ``<h3>`` folders of its tier's block
folder, a slice per step (:class:`TopFolders`), and the walk keeps them when empty
(``RootMaintainer(keep_top_folders=True)``). They cost a folder each (4 KiB on ext4:
16 MiB for all) and are made once per block folder; ``TierConfig.folders_ahead`` says
where (docs/storage.md, "Folders made ahead").
"""

from __future__ import annotations

import errno
import os
import time

# The <h3> folder names relative_path_for makes: the first three hex digits of the
# block hash.
TOP_FOLDER_NAMES = tuple(f"{i:03x}" for i in range(16 ** 3))
# A step makes folders for at most this long (then the caretaker's other work, or the
# worker's next task, goes on): ~50 folders on ext4 (93 µs each), all 4,096 on tmpfs.
MAKE_STEP_S = 0.005
# The mode the native core makes block folders with (mkdirat 0777, less the umask).
FOLDER_MODE = 0o777
# TierConfig.folders_ahead = "auto" leaves a capacity under this alone: the 4,096
# folders (16 MiB on ext4, which the budget does not count) would be more than a 64th
# of it.
FOLDERS_AHEAD_MIN_CAPACITY = 1 << 30
# ... and a file system with fewer free inodes than this: the folders would take more
# than a 64th of them, which blocks (one inode each, and their <h2>_g folders) need.
FOLDERS_AHEAD_MIN_INODES = 64 * len(TOP_FOLDER_NAMES)


class TopFolders:
    """The ``<h3>`` folders of ``blocks_dir`` still to make. Not thread-safe."""

    def __init__(self, blocks_dir: str) -> None:
        self.blocks_dir = blocks_dir
        self._left: list[str] | None = None  # None: the block folder not listed yet
        self.made = 0

    @property
    def done(self) -> bool:
        return self._left is not None and not self._left

    def step(self, budget_s: float = MAKE_STEP_S) -> int:
        """Make missing folders for at most ``budget_s`` (at least one); returns how many
        it made. A block folder not there yet (its first store makes it) is looked at
        again next step. Raises ``OSError`` for anything else (a read-only or full
        file system: the caller gives up, and stores make the folders they need)."""
        if self._left is None:
            try:
                listed = set(os.listdir(self.blocks_dir))
            except FileNotFoundError:
                return 0
            self._left = [name for name in TOP_FOLDER_NAMES if name not in listed]
            self._left.reverse()  # made from the end of the list: in name order
        deadline = time.monotonic() + budget_s
        made = 0
        while self._left:
            name = self._left[-1]
            try:
                os.mkdir(os.path.join(self.blocks_dir, name), FOLDER_MODE)
                made += 1
            except FileExistsError:
                pass  # a store (or another tier) made it first
            except OSError as exc:
                if exc.errno == errno.ENOENT:  # the block folder went: list it again
                    self._left = None
                    break
                raise
            self._left.pop()
            if time.monotonic() >= deadline:
                break
        self.made += made
        return made

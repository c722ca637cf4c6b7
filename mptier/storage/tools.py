"""The offline tools behind ``mptier du``, ``mptier scrub`` and ``mptier gc``.

Each walks the root once with :class:`~mptier.storage.walk.Walker` (scrub twice when a
cache folder does not record its block size) and returns a plain dict — the ``--json``
output, printed for humans by :mod:`mptier.storage.cli`. They block their thread for the
whole walk and call ``progress(entries_walked, detail)`` after every slice. Safe to run
while tiers use the root: removals re-check the inode (and atime or mtime) first.
"""

from __future__ import annotations

import collections
import errno
import os
import re
import time
from collections.abc import Callable, Iterator

from mptier.native import XATTR_NAME
from mptier.storage import names as N
from mptier.storage.leases import DEFAULT_STALE_TEMP_S, TempSweeper, fs_now
from mptier.storage.usage import evict
from mptier.storage.walk import BAD_KINDS, Entry, Kind, Walker, unlink_if_unchanged

Progress = Callable[[int, str], None]
CRC_XATTR = XATTR_NAME     # "user.vllm.kv_crc32c": vLLM's record, 4 bytes big-endian
CRC_BYTES = 4
# Bad entries listed by `du` (all of them are counted); scrub lists every problem.
MAX_SAMPLES = 20
# Entries per walk slice between progress updates.
SLICE = 2048
# Bad kinds scrub --repair removes. A directory, or a file where a folder belongs, may
# hold someone's data: listed, left for a human.
REPAIRABLE = {Kind.BAD_SIZE, Kind.BAD_SYMLINK, Kind.BAD_SPECIAL}
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd])\s*$", re.IGNORECASE)


class UsageError(ValueError):
    """Bad input on the command line: the message names the value and the fix."""


def parse_duration(text: str) -> float:
    """Seconds in ``"90s"``, ``"15m"``, ``"12h"``, ``"7d"`` (a unit is required).

    Raises :class:`UsageError` naming the value and the accepted forms.
    """
    match = _DURATION_RE.match(text)
    if not match:
        hint = " (add a unit)" if re.fullmatch(r"\s*\d+(\.\d*)?\s*", text) else ""
        raise UsageError(f"{text!r} is not a duration{hint}: use a number and a unit, "
                         f"s, m, h or d, e.g. 90s, 15m, 12h, 7d")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def check_root(root: str) -> str:
    """The root as a normalised path; :class:`UsageError` unless it is a folder."""
    path = os.path.normpath(os.path.abspath(root))
    if not os.path.exists(path):
        raise UsageError(f"root {root!r} does not exist: pass the folder a tier uses as "
                         f"root_dir")
    if not os.path.isdir(path):
        raise UsageError(f"root {root!r} is not a folder: pass the folder a tier uses as "
                         f"root_dir")
    return path


def _walk(walker: Walker, progress: Progress | None, detail: Callable[[], str]
          ) -> Iterator[Entry]:
    while not walker.done:
        yield from walker.step(SLICE)
        if progress is not None:
            progress(walker.entries, detail())


def _sample(entry: Entry) -> dict:
    return {"path": entry.path, "kind": entry.kind.value, "size": entry.size}


def _folder_info(root: str, base: str) -> tuple[str | None, int | None]:
    config = N.read_small_json(f"{root}/{base}/{N.CONFIG_JSON}")
    model = config.get("model_name") if config else None
    return (model if isinstance(model, str) else None,
            N.recorded_block_bytes(f"{root}/{base}"))


def _walk_report(walker: Walker, started: float) -> dict:
    return {"entries": walker.entries, "vanished": walker.vanished, "errors": walker.errors,
            "error_samples": list(walker.error_samples),
            "seconds": round(time.monotonic() - started, 3)}


def du(root: str, *, progress: Progress | None = None) -> dict:
    """Blocks and bytes per cache folder and rank; temps, leases, bad entries and
    foreign entries counted apart. Removes nothing."""
    root = check_root(root)
    started = time.monotonic()
    ranks: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    temps = [0, 0]
    foreign = [0, 0]
    leases = 0
    bad: collections.Counter[str] = collections.Counter()
    samples: list[dict] = []
    total = [0, 0]
    bases: set[str] = set()     # cache folders with a config.json, blocks or not
    walker = Walker(root)
    for entry in _walk(walker, progress, lambda: f"{total[0]:,} blocks"):
        kind = entry.kind
        if kind is Kind.CONFIG:
            bases.add(entry.folder)
        elif kind is Kind.BLOCK:
            slot = ranks[entry.folder]
            slot[0] += 1
            slot[1] += entry.size
            total[0] += 1
            total[1] += entry.size
        elif kind is Kind.TEMP:
            temps[0] += 1
            temps[1] += entry.size
        elif kind is Kind.LEASE:
            leases += 1
        elif kind in BAD_KINDS:
            bad[kind.value] += 1
            if len(samples) < MAX_SAMPLES:
                samples.append(_sample(entry))
        elif kind is Kind.FOREIGN:
            foreign[0] += 1
            foreign[1] += entry.size
    folders: dict[str, dict] = {}
    for blocks_dir, (count, nbytes) in sorted(ranks.items()):
        base, rank = N.base_of_blocks_dir(blocks_dir) or (blocks_dir, -1)
        if base not in folders:
            model, block_bytes = _folder_info(root, base)
            folders[base] = {"folder": base, "model": model, "block_bytes": block_bytes,
                             "blocks": 0, "bytes": 0, "ranks": []}
        info = folders[base]
        info["blocks"] += count
        info["bytes"] += nbytes
        info["ranks"].append({"rank": rank, "folder": blocks_dir, "blocks": count,
                              "bytes": nbytes})
    for base in bases - set(folders):
        model, block_bytes = _folder_info(root, base)
        folders[base] = {"folder": base, "model": model, "block_bytes": block_bytes,
                         "blocks": 0, "bytes": 0, "ranks": []}
    return {"root": root, "blocks": total[0], "bytes": total[1],
            "folders": [folders[k] for k in sorted(folders)],
            "temps": {"files": temps[0], "bytes": temps[1]}, "leases": leases,
            "bad_entries": {"total": sum(bad.values()), "by_kind": dict(sorted(bad.items())),
                            "samples": samples},
            "foreign": {"entries": foreign[0], "bytes": foreign[1]},
            **_walk_report(walker, started)}


# -- scrub ------------------------------------------------------------------------------

def _crc32c_function() -> Callable[[bytes], int] | None:
    from mptier import native

    return getattr(native, "crc32c", None)


def _block_sizes(root: str, block_bytes: int | None, progress: Progress | None
                 ) -> dict[str, tuple[int | None, str]]:
    """Block size per cache folder and where it came from. Folders without
    ``mptier.json`` take ``block_bytes``, else the most common size of their files
    (a survey walk; only when some folder needs it)."""
    sizes: dict[str, tuple[int | None, str]] = {}
    unknown = []
    with os.scandir(root) as it:
        for de in it:
            parsed = N.base_of_blocks_dir(de.name)
            if parsed is None or not de.is_dir(follow_symlinks=False):
                continue
            recorded = N.recorded_block_bytes(f"{root}/{parsed[0]}")
            if recorded is not None:
                sizes[parsed[0]] = (recorded, N.MPTIER_JSON)
            elif block_bytes is not None:
                sizes[parsed[0]] = (block_bytes, "--block-bytes")
            else:
                unknown.append(parsed[0])
    if unknown:
        counts: dict[str, collections.Counter[int]] = collections.defaultdict(
            collections.Counter)
        survey = Walker(root)
        for entry in _walk(survey, progress, lambda: "surveying block sizes"):
            if entry.kind is Kind.BLOCK:
                base = N.base_of_blocks_dir(entry.folder)
                if base is not None and base[0] in unknown:
                    counts[base[0]][entry.size] += 1
        for base in unknown:
            common = counts[base].most_common(1)
            sizes[base] = (common[0][0], "most common size") if common else (None, "no blocks")
    return sizes


def _read_block(entry: Entry) -> bytes | None:
    """The block's bytes, or None if it is no longer the file the walk saw."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # never hang on FIFO
    try:
        fd = os.open(entry.path, flags | os.O_NOATIME)  # checking is not using
    except PermissionError:
        fd = os.open(entry.path, flags)
    try:
        st = os.fstat(fd)
        if st.st_ino != entry.ino:
            return None
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def _check_crc(entry: Entry, crc32c: Callable[[bytes], int] | None, stats: dict
               ) -> tuple[str, str] | None:
    """(problem kind, detail) when the recorded checksum does not hold."""
    try:
        record = os.getxattr(entry.path, CRC_XATTR, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.ENOENT):
            stats["checksums_missing"] += 1
            return None
        return "unreadable", f"reading {CRC_XATTR}: {exc.strerror}"
    if len(record) != CRC_BYTES:
        return "bad_checksum_record", f"{CRC_XATTR} holds {len(record)} bytes, expected 4"
    if crc32c is None:
        stats["checksums_unverified"] += 1
        return None
    try:
        data = _read_block(entry)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return "unreadable", f"reading the block: {exc.strerror}"
    if data is None:
        return None
    stats["checksums_checked"] += 1
    stats["bytes_checked"] += len(data)
    recorded, computed = int.from_bytes(record, "big"), crc32c(data)
    if recorded != computed:
        return "checksum_mismatch", f"recorded {recorded:08x}, computed {computed:08x}"
    return None


def scrub(root: str, *, repair: bool = False, block_bytes: int | None = None,
          progress: Progress | None = None) -> dict:
    """Check every block's size and, where recorded, its CRC32C; list each problem
    (and with ``repair`` remove it if it is still the same file). ``problems`` empty
    means a clean root."""
    root = check_root(root)
    started = time.monotonic()
    sizes = _block_sizes(root, block_bytes, progress)
    crc32c = _crc32c_function()
    stats = collections.Counter(blocks_checked=0, bytes_checked=0, checksums_checked=0,
                                checksums_missing=0, checksums_unverified=0)
    problems: list[dict] = []
    walker = Walker(root, default_block_bytes={b: s for b, (s, _) in sizes.items()
                                                if s is not None})

    def add(entry: Entry, kind: str, detail: str, removable: bool) -> None:
        removed = bool(repair and removable and unlink_if_unchanged(entry))
        problems.append({"path": entry.path, "kind": kind, "detail": detail,
                         "size": entry.size, "removed": removed,
                         "left_because": None if removed or not repair else
                         ("changed since checked" if removable else
                          "may hold someone's data: inspect and remove by hand")})

    for entry in _walk(walker, progress, lambda: f"{stats['blocks_checked']:,} blocks, "
                       f"{len(problems)} problems"):
        if entry.kind is Kind.BLOCK:
            stats["blocks_checked"] += 1
            found = _check_crc(entry, crc32c, stats)
            if found is not None:
                add(entry, found[0], found[1], found[0] != "unreadable")
        elif entry.kind in BAD_KINDS:
            base = N.base_of_blocks_dir(entry.folder)
            expected = sizes.get(base[0], (None, ""))[0] if base else None
            detail = {Kind.BAD_SIZE: f"{entry.size} bytes, block size {expected}",
                      Kind.BAD_SYMLINK: "a symlink where the layout has a block or folder",
                      Kind.BAD_DIR: "a directory at a block path",
                      Kind.BAD_SPECIAL: "a FIFO, socket or device at a block path",
                      Kind.BAD_NOT_DIR: "not a folder where the layout has one"}[entry.kind]
            add(entry, entry.kind.value, detail, entry.kind in REPAIRABLE)
    return {"root": root, "repair": repair, "crc32c_available": crc32c is not None,
            "block_sizes": {b: {"block_bytes": s, "source": src}
                            for b, (s, src) in sorted(sizes.items())},
            **dict(stats), "problems": problems,
            "removed": sum(p["removed"] for p in problems),
            **_walk_report(walker, started)}


# -- gc ---------------------------------------------------------------------------------

def gc(root: str, *, older_than_s: float, dry_run: bool = False,
       stale_temp_s: float = DEFAULT_STALE_TEMP_S, locks_work: bool | None = None,
       progress: Progress | None = None) -> dict:
    """Remove blocks whose last use (atime) is older than ``older_than_s`` by the file
    system's clock, and stale temporary files and dead leases (lease rules). A block
    used again after the walk saw it is kept (:func:`~mptier.storage.usage.evict`)."""
    root = check_root(root)
    if older_than_s < 0:
        raise UsageError(f"--older-than {older_than_s} s is negative: give an age >= 0")
    started = time.monotonic()
    now = fs_now(root)
    cutoff = now - int(older_than_s * 1e9)
    sweeper = TempSweeper(root, locks_work=locks_work, stale_temp_s=stale_temp_s,
                          now_ns=lambda: now, dry_run=dry_run)
    counts = collections.Counter(blocks_removed=0, bytes_removed=0, blocks_kept=0,
                                 refused=0)
    walker = Walker(root)
    verb = "would remove" if dry_run else "removed"
    for entry in _walk(walker, progress,
                       lambda: f"{verb} {counts['blocks_removed']:,} blocks"):
        if entry.kind is Kind.BLOCK:
            if entry.atime_ns < cutoff:
                if dry_run or evict(entry):
                    counts["blocks_removed"] += 1
                    counts["bytes_removed"] += entry.size
                else:
                    counts["refused"] += 1
            else:
                counts["blocks_kept"] += 1
        else:
            sweeper.offer(entry)
    return {"root": root, "dry_run": dry_run, "older_than_s": older_than_s,
            "cutoff_ns": cutoff, "now_ns": now, "locks_work": sweeper.locks_work,
            "stale_temp_s": stale_temp_s, **dict(counts), **sweeper.counts.as_dict(),
            **_walk_report(walker, started)}

"""Designs (b) and (c): the reference in-process design, rebuilt here as the baseline.

This mirrors vLLM 0.33's built-in file-system tier, which runs its I/O on threads of
the engine process:

    engine process (one interpreter, one GIL)
    ┌──────────────────────────────────────────────────────────────────────────┐
    │ scheduler thread: submit_* ─▶ [load deque] [store deque] ◀─ one Condition │
    │                   get_finished ◀── finished deque ◀─┐                     │
    │ 16 load-priority threads:  take a load job first, else a store job ──────┤
    │ 16 store-priority threads: take a store job first, else a load job ──────┘
    │   each thread runs one whole job at a time, block after block:           │
    │   (b) pure Python: store = exists? / makedirs / open tmp O_EXCL / write /  │
    │       rename;  load = open / readv into the buffer slice                   │
    │   (c) the same pool calling mptier.native.batch_store / batch_load        │
    │ 1 lookup thread: existence checks, one batch per scheduler step           │
    └──────────────────────────────────────────────────────────────────────────┘

Like the reference, a finishing job wakes every thread waiting on the shared condition
(``notify_all``), O_DIRECT is probed once per root, block paths are computed on the
scheduler thread inside ``submit_*``, and offsets are checked on the I/O thread.

Long because it rebuilds one whole design, vLLM's in-process thread pool, in both its
variants, to be measured against; kept whole so it can be compared with its original.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from mptier.bench.base import Design, DesignContext
from mptier.bench.measure import PAGE, probe_o_direct
from mptier.jobs import JobResult

O_DIRECT = getattr(os, "O_DIRECT", 0)
DEFAULT_THREADS = (16, 16)  # (load-priority, store-priority), the reference's defaults

_local = threading.local()


def _tmp_suffix() -> str:
    """A temporary-file suffix unique to this thread (and process)."""
    try:
        return _local.suffix
    except AttributeError:
        _local.suffix = f".{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}.tmp"
        return _local.suffix


def _check_offsets(memory: memoryview, offsets: Sequence[int], block_bytes: int) -> None:
    size = len(memory)
    for offset in offsets:
        if offset < 0 or offset + block_bytes > size:
            raise ValueError(f"block offset {offset} (+{block_bytes}) is outside the "
                             f"{size}-byte buffer")


def py_store_blocks(paths: Sequence[str], memory: memoryview, offsets: Sequence[int],
                    block_bytes: int, use_o_direct: bool) -> None:
    """Store blocks one by one in pure Python; raise ``OSError`` at the first failure.

    Per block: an existing file is done; else create the parent folders, write a
    temporary file opened ``O_EXCL`` (``O_DIRECT`` when asked), rename it onto the final
    name (``EEXIST`` from the rename counts as done) and remove it on any error.
    """
    _check_offsets(memory, offsets, block_bytes)
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | (O_DIRECT if use_o_direct else 0)
    suffix = _tmp_suffix()
    for path, offset in zip(paths, offsets, strict=True):
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + suffix
        try:
            fd = os.open(tmp, flags, 0o644)
            try:
                written = os.write(fd, memory[offset:offset + block_bytes])
            finally:
                os.close(fd)
            if written != block_bytes:
                raise OSError(errno.EIO, f"short write: {written} of {block_bytes} bytes", tmp)
            try:
                os.rename(tmp, path)
            except FileExistsError:  # another writer published the same content first
                os.unlink(tmp)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def py_load_blocks(paths: Sequence[str], memory: memoryview, offsets: Sequence[int],
                   block_bytes: int, use_o_direct: bool) -> None:
    """Load blocks one by one in pure Python; raise ``OSError`` at the first failure.

    A file shorter than a block is corrupt: it is removed and the load fails.
    """
    _check_offsets(memory, offsets, block_bytes)
    flags = os.O_RDONLY | (O_DIRECT if use_o_direct else 0)
    for path, offset in zip(paths, offsets, strict=True):
        fd = os.open(path, flags)
        try:
            got = os.readv(fd, [memory[offset:offset + block_bytes]])
        finally:
            os.close(fd)
        if got < block_bytes:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise OSError(errno.EIO, f"short read: {got} of {block_bytes} bytes", path)


class DualQueuePool:
    """Two job queues, two groups of threads, one condition (the reference's pool).

    Each thread takes one whole job, runs it, and appends ``(job_id, ok, seconds)`` to
    the finished deque, which :meth:`finished` drains without a lock (one popper).
    """

    def __init__(self, n_load: int, n_store: int, name: str = "bench-pool") -> None:
        self._load_q: deque[tuple[int, Callable[[], None]]] = deque()
        self._store_q: deque[tuple[int, Callable[[], None]]] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._finished: deque[tuple[int, bool, float]] = deque()
        self._inflight = 0
        self._stop = False
        self.errors: deque[str] = deque(maxlen=20)
        self._threads = [
            threading.Thread(target=self._run, args=(load_first,), daemon=True,
                             name=f"{name}-{'l' if load_first else 's'}{i}")
            for load_first, count in ((True, n_load), (False, n_store))
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job_id: int, is_load: bool, fn: Callable[[], None]) -> None:
        with self._cond:
            (self._load_q if is_load else self._store_q).append((job_id, fn))
            self._inflight += 1
            self._cond.notify()

    def finished(self) -> list[tuple[int, bool, float]]:
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._inflight == 0, timeout)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._load_q.clear()
            self._store_q.clear()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=30)

    def _run(self, load_first: bool) -> None:
        mine, other = ((self._load_q, self._store_q) if load_first
                       else (self._store_q, self._load_q))
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or mine or other)
                if self._stop:
                    return
                job_id, fn = mine.popleft() if mine else other.popleft()
            start = time.monotonic()
            try:
                fn()
                ok = True
            except Exception as exc:  # a failed job is a result, not a crash of the pool
                ok = False
                self.errors.append(f"job {job_id}: {type(exc).__name__}: {exc}")
            self._finished.append((job_id, ok, time.monotonic() - start))
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()


class AsyncLookup:
    """Existence checks off the scheduler thread, one batch per scheduler step.

    ``lookup`` answers ``True``/``False`` once the key was checked and ``None`` (retry)
    before; ``flush`` (the scheduler's ``on_schedule_end``) posts the step's new keys to
    the lookup thread, which checks them with ``exists_batch``.
    """

    def __init__(self, path_for: Callable[[bytes], str],
                 exists_batch: Callable[[list[str]], Sequence[bool]]) -> None:
        self._path_for = path_for
        self._exists_batch = exists_batch
        self._state: dict[bytes, list[Any]] = {}  # key -> [verdict or None, request ids]
        self._req_keys: dict[str, set[bytes]] = {}
        self._batch: list[bytes] = []
        self._todo: queue.SimpleQueue[list[bytes] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[list[tuple[bytes, bool]]] = queue.SimpleQueue()
        self._need_drain = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-lookup")
        self._thread.start()

    def lookup(self, key: bytes, req_id: str) -> bool | None:
        if self._need_drain:
            self._drain()
            self._need_drain = False
        state = self._state.get(key)
        if state is None:
            state = self._state[key] = [None, set()]
            self._batch.append(key)
        state[1].add(req_id)
        self._req_keys.setdefault(req_id, set()).add(key)
        return state[0]

    def flush(self) -> None:
        self._drain()
        self._need_drain = True
        if self._batch:
            self._todo.put(self._batch)
            self._batch = []

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=30)

    def _drain(self) -> None:
        while True:
            try:
                results = self._done.get_nowait()
            except queue.Empty:
                return
            for key, found in results:
                state = self._state.get(key)
                if state is not None:
                    state[0] = found

    def _run(self) -> None:
        while (keys := self._todo.get()) is not None:
            try:
                found = list(self._exists_batch([self._path_for(k) for k in keys]))
            except OSError:
                found = [False] * len(keys)
            self._done.put(list(zip(keys, found, strict=True)))


def _py_exists_batch(paths: list[str]) -> list[bool]:
    return [os.path.exists(p) for p in paths]


def parse_threads(text: str) -> tuple[int, int]:
    """``"16+16"`` -> ``(16, 16)`` (load-priority + store-priority)."""
    try:
        load, store = (int(x) for x in text.split("+"))
    except ValueError:
        raise ValueError(f"threads={text!r}: expected LOAD+STORE, e.g. 16+16") from None
    if load < 0 or store < 0 or load + store < 1:
        raise ValueError(f"threads={text!r}: need at least one thread")
    return load, store


class ThreadPoolDesign(Design):
    """(b): the reference pool with pure-Python per-block I/O.

    Options: ``threads=L+S`` (default 16+16), ``o_direct=auto|0|1``.
    """

    letter = "b"
    kind = "threads"
    io_name = "python"

    def __init__(self, label: str, options: dict[str, str] | None = None) -> None:
        super().__init__(label, options)
        opts = dict(self.options)
        self.n_load, self.n_store = parse_threads(opts.pop("threads", "16+16"))
        self.o_direct_choice = opts.pop("o_direct", "auto")
        if self.o_direct_choice not in ("auto", "0", "1"):
            raise ValueError(f"{label}: o_direct must be auto, 0 or 1")
        if opts:
            raise ValueError(f"{label}: unknown option(s) {', '.join(sorted(opts))} "
                             "(known: threads, o_direct)")
        self._pool: DualQueuePool | None = None
        self._lookup: AsyncLookup | None = None

    # I/O backend ------------------------------------------------------------------------
    def _backend(self, ctx: DesignContext) -> tuple[Callable[..., None], Callable[..., None],
                                                    Callable[[list[str]], Sequence[bool]],
                                                    Callable[[str], bool]]:
        return py_store_blocks, py_load_blocks, _py_exists_batch, probe_o_direct

    def _path_function(self, ctx: DesignContext) -> Callable[[bytes], str]:
        return ctx.mapper.path_for

    def setup(self, ctx: DesignContext) -> None:
        os.makedirs(ctx.mapper.blocks_dir, exist_ok=True)
        ctx.mapper.write_config()
        store, load, exists_batch, probe = self._backend(ctx)
        aligned = ctx.block_bytes % PAGE == 0 and ctx.array.ctypes.data % PAGE == 0
        supported = probe(ctx.mapper.blocks_dir)
        if self.o_direct_choice == "auto":
            use = supported and aligned
        else:
            use = self.o_direct_choice == "1"
        self._o_direct = use
        self._memory = ctx.memory
        self._block_bytes = ctx.block_bytes
        self._path_for = self._path_function(ctx)
        self._store = store
        self._load = load
        self.info.update(threads=f"{self.n_load}+{self.n_store}", io=self.io_name,
                         o_direct=use, o_direct_supported=supported)
        self._pool = DualQueuePool(self.n_load, self.n_store, name=f"bench-{self.letter}")
        self._lookup = AsyncLookup(self._path_for, exists_batch)

    def submit_store(self, job: Any) -> None:
        path_for = self._path_for
        block_bytes = self._block_bytes
        task = functools.partial(
            self._store, [path_for(k) for k in job.keys], self._memory,
            [int(b) * block_bytes for b in job.block_ids], block_bytes, self._o_direct)
        self._pool.submit(job.job_id, False, task)

    def submit_load(self, job: Any) -> None:
        path_for = self._path_for
        block_bytes = self._block_bytes
        task = functools.partial(
            self._load, [path_for(k) for k in job.keys], self._memory,
            [int(b) * block_bytes for b in job.block_ids], block_bytes, self._o_direct)
        self._pool.submit(job.job_id, True, task)

    def get_finished(self) -> list[JobResult]:
        return [JobResult(job_id=job_id, success=ok, transfer_time=seconds)
                for job_id, ok, seconds in self._pool.finished()]

    def lookup(self, key: bytes, req_id: str) -> bool | None:
        return self._lookup.lookup(key, req_id)

    def on_schedule_end(self) -> None:
        self._lookup.flush()

    def drain(self) -> None:
        if self._pool is not None and not self._pool.wait_idle(timeout=600):
            raise TimeoutError(f"{self.label}: jobs still running after 600 s")

    def close(self) -> None:
        if self._pool is not None:
            self.notes.extend(list(self._pool.errors)[:3])
            self._pool.close()
            self._pool = None
        if self._lookup is not None:
            self._lookup.close()
            self._lookup = None


class NativePoolDesign(ThreadPoolDesign):
    """(c): the same pool, each job one call into ``mptier.native.batch_store/load``."""

    letter = "c"
    io_name = "native"

    @classmethod
    def available(cls) -> str | None:
        try:
            import mptier.native  # noqa: F401
        except ImportError as exc:
            return f"mptier.native is not importable ({exc})"
        return None

    _root_fd = -1

    def _path_function(self, ctx: DesignContext) -> Callable[[bytes], str]:
        return ctx.mapper.relative_path_for  # beneath the root fd the calls take

    def _backend(self, ctx: DesignContext):
        from mptier import native

        root = self._root_fd = native.open_root(ctx.mapper.blocks_dir)
        block = ctx.block_bytes

        def store(paths, memory, offsets, block_bytes, use_o_direct):
            native.batch_store(root, paths, memory, offsets, block_bytes, o_direct=use_o_direct)

        def load(paths, memory, offsets, block_bytes, use_o_direct):
            native.batch_load(root, paths, memory, offsets, block_bytes, o_direct=use_o_direct)

        def exists(paths):
            return [s == native.LOOKUP_PRESENT for s in native.batch_lookup(root, paths, block)]

        self.info["native_backend"] = native.BACKEND
        return store, load, exists, native.probe_o_direct

    def close(self) -> None:
        super().close()
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

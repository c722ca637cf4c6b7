"""Design (v): vLLM 0.33's own file-system tier, ``FileSystemTierManager``, run as is.

Only where vLLM can be imported (the environment ``scripts/vllm-env.sh`` makes). vLLM's
tier does its batch stores, batch loads and batch lookups in its C extension
``vllm.fs_io_C`` when that loads (``vllm.v1.kv_offload.tiering.fs.io._HAS_FSIO_C`` and
``...fs.manager._HAS_BATCH_LOOKUP_C``), as on every CUDA deployment, and per block in
Python (``os.write`` / ``os.readv`` / ``os.path.exists``) otherwise. The wheel's extension
links CUDA libraries, so ``scripts/vllm-env.sh`` builds it from vLLM's sdist for the CPU
torch. Design ``vllm`` is the real thing: it refuses to run (an error naming the flag)
when the extension did not load, rather than quietly measure the fallback. Design
``vllm-py`` (letter ``w``) is the fallback on purpose: it sets both flags False for its
own run alone and restores them at close. Both count which of vLLM's entry points ran
(per batch, not per block) and report it in ``info["io_path"]`` and ``info["io_calls"]``
and a note.

The
tier is built the way vLLM's ``SecondaryTierFactory`` builds it, from a real
``TieringOffloadingSpec`` made without a GPU (docs/vllm-integration-notes.md, section
2), over the harness's primary buffer viewed as vLLM's ``(chunks, chunk_bytes)`` int8
view. Its I/O runs on its own thread pool in this process (16 + 16 threads by default),
with vLLM's own O_DIRECT probe and its own file layout under the design's folder.

Options: ``threads=R+W`` (``n_read_threads`` + ``n_write_threads``, default 16+16).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import numpy as np

from mptier.bench.base import MODEL_NAME, Design, DesignContext

DEFAULT_THREADS = (16, 16)

IO_MODULE = "vllm.v1.kv_offload.tiering.fs.io"
MANAGER_MODULE = "vllm.v1.kv_offload.tiering.fs.manager"
# vLLM's switches between its C extension and its Python fallback: module globals read
# at every call, so setting them reaches vLLM's code.
C_FLAGS = ((IO_MODULE, "_HAS_FSIO_C"), (MANAGER_MODULE, "_HAS_BATCH_LOOKUP_C"))
# The entry points counted: (module, attribute, counter). The C ones run only on the C
# path; the manager's batch_* run on both (the Python path is their difference). Each is
# called once per job or lookup batch, so counting costs nothing measurable.
COUNTED = (
    (MANAGER_MODULE, "batch_store_block", "store_batches"),
    (MANAGER_MODULE, "batch_load_block", "load_batches"),
    (IO_MODULE, "batch_store_block_C", "store_batches_c"),
    (IO_MODULE, "batch_load_block_C", "load_batches_c"),
    (MANAGER_MODULE, "batch_lookup_C", "lookup_batches_c"),
)
PATH_C = "C extension vllm.fs_io_C"
PATH_PYTHON = "Python fallback (per-block os.write / os.readv / os.path.exists)"


def c_flags() -> dict[str, bool]:
    """vLLM's two C-path flags as its modules set them, keyed ``module.FLAG``."""
    import importlib

    return {f"{mod}.{flag}": bool(getattr(importlib.import_module(mod), flag))
            for mod, flag in C_FLAGS}


def missing_extension() -> str | None:
    """``None`` when both of vLLM's C paths are on, else the error naming the flag."""
    off = [name for name, on in c_flags().items() if not on]
    if not off:
        return None
    reason = ""
    try:
        import vllm.fs_io_C  # noqa: F401
    except ImportError as exc:
        reason = f" (import vllm.fs_io_C: {exc})"
    return (f"{' and '.join(off)} {'is' if len(off) == 1 else 'are'} False: vLLM's C "
            f"extension did not load{reason}, so its tier would run its Python fallback, "
            "which no CUDA deployment runs. Run scripts/vllm-env.sh (it builds "
            "vllm.fs_io_C from vLLM's sdist) and use its .venv-vllm; design vllm-py "
            "measures the fallback on purpose")


class _Counter:
    """Wraps one of vLLM's module functions and counts its calls (from any thread) and
    the time spent in them (``ns``: set against the time a lookup took to be answered,
    it says how much of that was the C call and how much the wait for its thread)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.n = self.ns = 0
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return self.fn(*args, **kwargs)
        finally:
            spent = time.perf_counter_ns() - start
            with self._lock:
                self.n += 1
                self.ns += spent


class VllmTierDesign(Design):
    letter = "v"
    kind = "vllm"
    # True in vllm-py: vLLM's Python fallback on purpose.
    python_io = False

    def __init__(self, label: str, options: dict[str, str] | None = None) -> None:
        super().__init__(label, options)
        opts = dict(self.options)
        threads = opts.pop("threads", None)
        if threads is None:
            self.n_read, self.n_write = DEFAULT_THREADS
        else:
            try:
                self.n_read, self.n_write = (int(x) for x in threads.split("+"))
            except ValueError:
                raise ValueError(f"{label}: threads={threads!r}: expected READ+WRITE, "
                                 "e.g. 16+16") from None
            if min(self.n_read, self.n_write) < 0 or self.n_read + self.n_write < 1:
                raise ValueError(f"{label}: threads={threads!r}: need at least one thread")
        if opts:
            raise ValueError(f"{label}: unknown option(s) {', '.join(sorted(opts))} "
                             "(known: threads)")
        self._tier: Any = None
        self._contexts: dict[str, Any] = {}
        self._saved_flags: list[tuple[Any, str, Any]] = []
        self._counters: list[tuple[Any, str, _Counter, str]] = []

    @classmethod
    def available(cls) -> str | None:
        try:
            import vllm.v1.kv_offload.tiering.fs.manager  # noqa: F401
            from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: F401
        except Exception as exc:  # ImportError, or vLLM failing inside its import
            return (f"vLLM's file-system tier cannot be imported here ({type(exc).__name__}"
                    f": {exc}); run the bench from the environment scripts/vllm-env.sh "
                    "makes")
        return None

    def refusal(self) -> str | None:
        """Why this design must not run here even though vLLM imports (an error, where
        :meth:`available`'s reason is a skip): design ``vllm`` without vLLM's C
        extension."""
        if self.python_io or self.available() is not None:
            return None
        return missing_extension()

    def _switch_and_count(self) -> None:
        import importlib

        if self.python_io:
            for mod, flag in C_FLAGS:
                module = importlib.import_module(mod)
                self._saved_flags.append((module, flag, getattr(module, flag)))
                setattr(module, flag, False)
        for mod, attr, name in COUNTED:
            module = importlib.import_module(mod)
            fn = getattr(module, attr, None)
            if fn is not None:  # the *_C names exist only when the extension loaded
                counter = _Counter(fn)
                self._counters.append((module, attr, counter, name))
                setattr(module, attr, counter)

    def _restore(self) -> None:
        calls = {name: counter.n for _, _, counter, name in self._counters}
        spent = {name: counter.ns for _, _, counter, name in self._counters}
        for module, attr, counter, _ in reversed(self._counters):
            setattr(module, attr, counter.fn)
        self._counters.clear()
        for module, flag, value in reversed(self._saved_flags):
            setattr(module, flag, value)
        self._saved_flags.clear()
        if not calls:
            return
        calls = {name: calls.get(name, 0) for _, _, name in COUNTED}
        calls["store_batches_python"] = calls["store_batches"] - calls["store_batches_c"]
        calls["load_batches_python"] = calls["load_batches"] - calls["load_batches_c"]
        ran_c = calls["store_batches_c"] + calls["load_batches_c"]
        ran_py = calls["store_batches_python"] + calls["load_batches_python"]
        path = PATH_C if ran_c and not ran_py else PATH_PYTHON if ran_py and not ran_c \
            else "both" if ran_c else "none"
        lookups = calls["lookup_batches_c"]
        lookup_ms = spent.get("lookup_batches_c", 0) / 1e6 / lookups if lookups else None
        self.info.update(io_calls=calls, io_path=path, lookup_batch_c_ms=lookup_ms)
        self.notes.append(
            f"I/O path that ran: {path} ({ran_c} batches in C, {ran_py} in Python, "
            f"{lookups} C lookup batches"
            + (f", {lookup_ms:.2f} ms each in C)" if lookup_ms is not None else ")"))

    def setup(self, ctx: DesignContext) -> None:
        refusal = self.refusal()
        if refusal is not None:
            raise RuntimeError(refusal)
        from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingGroupConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        n_chunks = ctx.array.shape[0]
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=16,
                                          layer_names=("model.layers.0.self_attn.attn",),
                                          group_id=0),),
            worker_kv_bytes_per_block=ctx.block_bytes,
            enable_kv_cache_events=False,
            extra_config={"cpu_bytes_to_use": n_chunks * ctx.block_bytes},
            engine_id=f"mptier-bench-{os.getpid()}",
            model=OffloadingModelConfig(name=MODEL_NAME, dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=True),
        )
        self._switch_and_count()
        self.info.update(c_flags=c_flags())
        spec = TieringOffloadingSpec(config)
        # vLLM hands its tiers an int8 (chunks, chunk_bytes) view of the primary region.
        view = memoryview(ctx.array.view(np.int8))
        self._tier = SecondaryTierFactory.create_secondary_tier(
            {"type": "fs", "root_dir": ctx.root, "n_read_threads": self.n_read,
             "n_write_threads": self.n_write}, view, spec)
        self._req_context = ReqContext
        self._end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
        self.info.update(threads=f"{self.n_read}+{self.n_write}",
                         o_direct=getattr(self._tier, "_use_o_direct", None),
                         io=f"vllm.v1.kv_offload.tiering.fs, "
                            f"{PATH_PYTHON if self.python_io else PATH_C}")

    def block_path(self, ctx: DesignContext, key: bytes) -> str:
        return self._tier.file_mapper.get_file_name(key)

    def make_job(self, job_id: int, keys: list[bytes], block_ids: list[int],
                 kind: str = "store") -> Any:
        from vllm.v1.kv_offload.tiering.base import TransferJob

        req_id = f"r{job_id}"  # the harness looks keys up under this request id
        context = self._contexts.get(req_id)
        if context is None:
            context = self._contexts[req_id] = self._req_context(req_id=req_id)
        return TransferJob(job_id=job_id, keys=keys,
                           chunk_ids=np.asarray(block_ids, dtype=np.int32),
                           is_promotion=kind == "load", req_context=context)

    def submit_store(self, job: Any) -> None:
        self._tier.submit_store(job)

    def submit_load(self, job: Any) -> None:
        self._tier.submit_load(job)

    def get_finished(self) -> list[Any]:
        return list(self._tier.get_finished_jobs())

    def lookup(self, key: bytes, req_id: str) -> Any:
        return self._tier.lookup(key, self._contexts[req_id])

    def on_schedule_end(self) -> None:
        self._tier.on_schedule_end(self._end)

    def drain(self) -> None:
        self._tier.drain_jobs()

    def close(self) -> None:
        try:
            if self._tier is not None:
                tier, self._tier = self._tier, None
                tier.shutdown()
                del tier
                self._contexts.clear()
                gc.collect()  # the tier holds the buffer's view in a reference cycle
        finally:
            self._restore()  # after shutdown: vLLM's threads read the flags per call


class VllmPythonDesign(VllmTierDesign):
    """(w) vLLM's tier on its Python fallback, the extension's flags set False for this
    design's run alone: what the bench measured as ``vllm`` before the extension was
    built (and what a vLLM without it runs)."""

    letter = "w"
    kind = "vllm-py"
    python_io = True

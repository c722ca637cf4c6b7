"""Design (v): vLLM 0.33's own file-system tier, ``FileSystemTierManager``, run as is.

Only where vLLM can be imported (the environment ``scripts/vllm-env.sh`` makes). The
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
from typing import Any

import numpy as np

from mptier.bench.base import MODEL_NAME, Design, DesignContext

DEFAULT_THREADS = (16, 16)


class VllmTierDesign(Design):
    letter = "v"
    kind = "vllm"

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

    def setup(self, ctx: DesignContext) -> None:
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
                         io="vllm.v1.kv_offload.tiering.fs (Python path: its C "
                            "extension needs CUDA libraries)")

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
        if self._tier is not None:
            tier, self._tier = self._tier, None
            tier.shutdown()
            del tier
            self._contexts.clear()
            gc.collect()  # the tier holds the buffer's view in a reference cycle

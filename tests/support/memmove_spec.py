"""Test support, never product code: vLLM's tiering spec with a worker side that runs
on the CPU platform, so a real vLLM engine can drive mptier on a machine without a GPU.

vLLM's own ``CPUOffloadingSpec.get_worker`` refuses the CPU platform and its worker
asserts CUDA tensors, but everything on the scheduler side of tiered offloading
(``TieringOffloadingManager``, the shared primary region
``/dev/shm/vllm_offload_<engine_id>.mmap``, the secondary tiers) is platform
independent. This spec keeps all of that and replaces only the worker: it copies blocks
between the engine's KV cache (ordinary CPU tensors here) and the worker's view of the
shared region with ``memmove``, at the addresses vLLM's ``compute_sub_block_ptrs``
gives. vLLM calls ``submit_load`` before the forward pass and ``submit_store`` at the
next step, on the model runner's thread, so copying right away, synchronously, is what
a CUDA stream would do once it ran. Loaded into an engine with::

    "spec_name": "MemmoveTieringSpec", "spec_module_path": "support.memmove_spec"

(``tests`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from support import engine_probe

# vLLM imports this module wherever it runs the engine core (this process, or an
# EngineCore process of its own): the probe follows the mptier tiers made there.
engine_probe.install()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class MemmoveWorker(OffloadingWorker):
    """Copies whole pages between the engine's KV cache tensors and the shared region,
    one ``memmove`` per (block, layer tensor); every job is finished when submitted."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 region: SharedOffloadRegion) -> None:
        self._region = region
        self._blocks_per_chunk = blocks_per_chunk
        self._refs = kv_caches.group_data_refs
        self._engine: list[torch.Tensor] = []
        self._shared: list[torch.Tensor] = []
        for t in kv_caches.tensors:
            assert t.tensor.device.type == "cpu", t.tensor.device
            self._engine.append(t.tensor.view(torch.int8).view((-1, t.page_size_bytes)))
            self._shared.append(region.create_next_worker_view(
                t.page_size_bytes * blocks_per_chunk))
        self._finished: list[TransferResult] = []

    def _copy(self, job_id: int, engine_spec: GPULoadStoreSpec, shared_spec: LoadStoreSpec,
              to_shared: bool) -> bool:
        assert isinstance(shared_spec, BlockIDsLoadStoreSpec)
        start = time.perf_counter()
        engine_blocks, shared_blocks = engine_spec.block_ids, shared_spec.block_ids
        engine_at = shared_at = 0
        moved = 0
        for g_idx, (size, first) in enumerate(zip(engine_spec.group_sizes,
                                                   engine_spec.block_indices)):
            if size == 0:
                continue
            # The first shared chunk may start part-way (an engine block inside it).
            skip = first % self._blocks_per_chunk
            n_shared = _cdiv(size + skip, self._blocks_per_chunk)
            group_engine = engine_blocks[engine_at:engine_at + size]
            group_shared = shared_blocks[shared_at:shared_at + n_shared]
            for ref in self._refs[g_idx]:
                engine_ptrs = np.empty(size, dtype=np.uint64)
                shared_ptrs = np.empty(size, dtype=np.uint64)
                compute_sub_block_ptrs(group_engine, 1, engine_ptrs,
                                       self._engine[ref.tensor_idx])
                compute_sub_block_ptrs(group_shared, self._blocks_per_chunk, shared_ptrs,
                                       self._shared[ref.tensor_idx], skip_count=skip)
                pairs = zip(engine_ptrs, shared_ptrs)
                for e, s in pairs:
                    dst, src = (int(s), int(e)) if to_shared else (int(e), int(s))
                    ctypes.memmove(dst, src, ref.page_size_bytes)
                moved += size * ref.page_size_bytes
            engine_at += size
            shared_at += n_shared
        assert engine_at == len(engine_blocks) and shared_at == len(shared_blocks)
        self._finished.append(TransferResult(job_id=job_id, success=True,
                                             transfer_size=moved,
                                             transfer_time=time.perf_counter() - start))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_shared=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    *_: object, **__: object) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_shared=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every job finished when it was submitted

    def shutdown(self) -> None:
        self._region.cleanup()


class MemmoveTieringSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` with :class:`MemmoveWorker` as its worker."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self.config.engine_id, num_chunks=self.num_chunks, rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker)
            try:
                self._worker = MemmoveWorker(kv_caches, self.blocks_per_chunk, region)
            except BaseException:
                region.cleanup()
                raise
        return self._worker

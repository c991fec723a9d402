"""vLLM ``OffloadingWorker`` adapter over :class:`~kvtier.slots.TransferWorker`.

Imports vLLM; the rest of :mod:`kvtier.slots` does not, so import this module
only where vLLM is present (the vLLM offloading spec's ``get_worker``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.base import TransferResult as VllmTransferResult

from kvtier.slots.jobs import CudaCopy
from kvtier.slots.region import SlotRegion
from kvtier.slots.worker import TransferWorker, as_block_bytes

logger = logging.getLogger(__name__)


def group_tensor_indices(kv_caches: CanonicalKVCaches) -> list[list[int]]:
    """Distinct canonical-tensor indices of each KV group, in reference order."""
    return [
        list(dict.fromkeys(ref.tensor_idx for ref in refs)) for refs in kv_caches.group_data_refs
    ]


def _slot_ids(spec: LoadStoreSpec) -> np.ndarray:
    if not isinstance(spec, BlockIDsLoadStoreSpec):
        raise TypeError(f"expected a block-ids spec for CPU slots, got {spec!r}")
    return spec.block_ids


class VllmSlotWorker(OffloadingWorker):
    """vLLM's worker-side transfer interface, backed by a kvtier TransferWorker.

    Owns the TransferWorker and, when ``own_region`` is set, the slot region
    (closed on ``shutdown``). One offloaded block is one engine block (vLLM
    ``blocks_per_chunk == 1``); the CPU-side spec's ``block_ids`` are slot ids.
    ``submit_*`` return True: a failed copy surfaces as ``success=False`` in
    ``get_finished`` (which vLLM 0.32's connector turns into an assertion). A
    CPU-side spec that is not a block-ids spec is a caller's error: ``TypeError``.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        region: SlotRegion,
        *,
        blocks_per_chunk: int = 1,
        copy_threads: int = 1,
        cuda_copy: CudaCopy = "auto",
        own_region: bool = False,
    ) -> None:
        if blocks_per_chunk != 1:
            raise NotImplementedError(
                f"kvtier slots hold one engine block each; blocks_per_chunk="
                f"{blocks_per_chunk} is not supported"
            )
        tensors = [as_block_bytes(t.tensor) for t in kv_caches.tensors]
        for index, (tensor, canonical) in enumerate(zip(tensors, kv_caches.tensors, strict=True)):
            if tensor.shape[1] != canonical.page_size_bytes:
                raise ValueError(
                    f"canonical tensor {index} has {tensor.shape[1]}-byte rows but "
                    f"a {canonical.page_size_bytes}-byte page"
                )
        self.region = region
        self._own_region = own_region
        self.worker = TransferWorker(
            tensors,
            region,
            groups=group_tensor_indices(kv_caches),
            copy_threads=copy_threads,
            cuda_copy=cuda_copy,
        )

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Engine blocks ``src_spec.block_ids`` -> slots ``dst_spec.block_ids``."""
        self.worker.store(job_id, src_spec.block_ids, _slot_ids(dst_spec), _sizes(src_spec))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Slots ``src_spec.block_ids`` -> engine blocks ``dst_spec.block_ids``."""
        self.worker.load(job_id, _slot_ids(src_spec), dst_spec.block_ids, _sizes(dst_spec))
        return True

    def get_finished(self) -> list[VllmTransferResult]:
        return [
            VllmTransferResult(
                job_id=r.job_id,
                success=r.success,
                transfer_size=r.num_bytes if r.success else None,
                transfer_time=r.seconds,
            )
            for r in self.worker.get_finished()
        ]

    def wait(self, job_ids: set[int]) -> None:
        self.worker.wait(job_ids)

    def shutdown(self) -> None:
        self.worker.shutdown()
        if self._own_region:
            self.region.close()


def _sizes(spec: GPULoadStoreSpec) -> Sequence[int] | None:
    sizes = getattr(spec, "group_sizes", None)
    return None if sizes is None else [int(s) for s in sizes]

"""CUDA IPC transport for colocated trainer and engine (same GPU): weights shared by handle, no copy on the wire.

The transport of the ``ipc`` weight-sync design: the trainer packs HF-layout GPU tensors into flat ``uint8`` buckets
(so one IPC handle covers many tensors, like slime's ``FlattenedTensorBucket``) and passes picklable handles plus
metadata; the engine side (:func:`open_shared_weights`) maps each bucket and yields ``(name, tensor)`` views for
``reload_weights``. The trainer must keep the returned buffers alive until every receiver is done.

Not wired into a registered strategy yet (vLLM's native IPC weight-transfer engine is the target on GPU engines);
tested between two processes on one H200 by ``bench/ipc_weight_sync.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from vime_core.weight_sync.nccl import DEFAULT_BUCKET_BYTES, buckets


def share_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Trainer side: copy tensors (CUDA) into flat buckets and make IPC handles for them.

    :param named_tensors: ``(hf_name, CUDA tensor)``.
    :param bucket_bytes: bucket size in bytes (a larger tensor gets a bucket alone).
    :return: ``(buffers, payload)``: keep ``buffers`` alive while receivers use them; ``payload`` is picklable,
        one dict per bucket ``{"handle", "names", "dtypes", "shapes", "nbytes"}``.
    :raises ValueError: for a tensor that is not on a CUDA device.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    buffers, payload = [], []
    for bucket in buckets(named_tensors, bucket_bytes):
        for name, t in bucket:
            if not t.is_cuda:
                raise ValueError(f"{name}: CUDA IPC needs CUDA tensors, got {t.device}")
        buf = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])
        buffers.append(buf)
        payload.append(
            {
                "handle": reduce_tensor(buf),
                "names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "nbytes": [t.numel() * t.element_size() for _, t in bucket],
            }
        )
    return buffers, payload


def open_shared_weights(payload: list[dict[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Engine side: map each bucket by its handle and yield ``(hf_name, tensor)`` views into it (no copy)."""
    for bucket in payload:
        rebuild, args = bucket["handle"]
        buf = rebuild(*args)
        offset = 0
        for name, dtype, shape, n in zip(
            bucket["names"], bucket["dtypes"], bucket["shapes"], bucket["nbytes"], strict=True
        ):
            yield name, buf[offset : offset + n].view(getattr(torch, dtype)).reshape(shape)
            offset += n

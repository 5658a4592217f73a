"""Bucketed broadcast of HF-layout weights over a ``torch.distributed`` process group (NCCL on GPUs, Gloo on CPU).

The transport of the ``nccl`` weight-sync design: trainer rank 0 (after gathering TP shards and converting to HF
layout) packs tensors into buckets of at most ``bucket_bytes`` and broadcasts each bucket's metadata (names, dtypes,
shapes, optional xxh3-128 digests) and then its bytes as one flat ``uint8`` buffer; every receiver runs
:func:`receive_weights`, the engine-side receive code, which yields ``(name, tensor)`` pairs ready for vLLM's
``reload_weights(weights_iterator=...)``.

Not wired into a registered strategy yet: the rollout manager applies updates engine by engine from its own
process, while a broadcast needs the trainer and every engine worker in one collective at the same time (and vLLM
workers need a stateless process group, e.g. vLLM's native weight-transfer API). See the closing note of issue 7.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_BUCKET_BYTES = 512 * 2**20  # slime's --update-weight-buffer-size


@dataclass
class BroadcastStats:
    """What one :func:`broadcast_weights` moved: ``num_bytes`` (tensor bytes), ``num_tensors``, ``num_buckets``,
    ``seconds`` (wall time, including the receivers' waits)."""

    num_bytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    seconds: float = 0.0


def buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into lists of at most ``bucket_bytes`` bytes (a larger tensor gets a bucket alone).

    :raises ValueError: if ``bucket_bytes`` < 1.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def _device(group: Any) -> torch.device:
    import torch.distributed as dist

    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def broadcast_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    src: int = 0,
    group: Any = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    checksums: bool = False,
) -> BroadcastStats:
    """Sender side: broadcast every tensor from rank ``src`` of ``group`` in buckets, then an end marker.

    :param named_tensors: ``(hf_name, tensor)`` on any device (copied into a flat buffer on the group's device).
    :param checksums: add the xxh3-128 digest of each tensor's bytes to the metadata (receivers verify; costs a
        host copy per tensor).
    :return: bytes, tensors, buckets and seconds moved.
    """
    import torch.distributed as dist

    from vime_core.weight_sync.disk_delta import checksum, tensor_bytes

    t0 = time.perf_counter()
    dev = _device(group)
    stats = BroadcastStats()
    for bucket in buckets(named_tensors, bucket_bytes):
        flats = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
        meta = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "nbytes": [int(f.numel()) for f in flats],
        }
        if checksums:
            meta["checksums"] = [checksum(tensor_bytes(t)) for _, t in bucket]
        dist.broadcast_object_list([meta], src=src, group=group, device=dev)
        buf = torch.cat([f.to(dev, non_blocking=True) for f in flats])
        dist.broadcast(buf, src=src, group=group)
        stats.num_bytes += int(buf.numel())
        stats.num_tensors += len(bucket)
        stats.num_buckets += 1
    dist.broadcast_object_list([None], src=src, group=group, device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    stats.seconds = time.perf_counter() - t0
    return stats


class ChecksumMismatch(RuntimeError):
    """A received tensor's xxh3-128 digest differs from the sender's."""


def receive_weights(*, src: int = 0, group: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Engine side: yield ``(hf_name, tensor)`` for every tensor :func:`broadcast_weights` sends, until its end
    marker. Tensors live on the group's device (views of one bucket buffer); feed them to ``reload_weights``.

    :raises ChecksumMismatch: when the sender attached digests and a tensor's bytes differ.
    """
    import torch.distributed as dist

    from vime_core.weight_sync.disk_delta import checksum, tensor_bytes

    dev = _device(group)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=src, group=group, device=dev)
        meta = box[0]
        if meta is None:
            return
        buf = torch.empty(sum(meta["nbytes"]), dtype=torch.uint8, device=dev)
        dist.broadcast(buf, src=src, group=group)
        offset = 0
        for i, (name, dtype, shape, n) in enumerate(
            zip(meta["names"], meta["dtypes"], meta["shapes"], meta["nbytes"], strict=True)
        ):
            t = buf[offset : offset + n].view(getattr(torch, dtype)).reshape(shape)
            offset += n
            if "checksums" in meta and checksum(tensor_bytes(t)) != meta["checksums"][i]:
                raise ChecksumMismatch(f"{name}: received bytes differ from the sender's (xxh3-128)")
            yield name, t

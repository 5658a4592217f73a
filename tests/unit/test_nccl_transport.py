"""The bucketed broadcast transport of vime_core.weight_sync.nccl, run over Gloo between two real processes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from vime_core.weight_sync.tensor_io import buckets

pytestmark = pytest.mark.unit


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(300, 16, generator=g),  # 19,200 bytes: a bucket of its own
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(16, generator=g).to(torch.float16),
        "model.norm.weight": torch.tensor([1.0, -0.0, float("inf"), float("nan")]),
        "buffer.int": torch.arange(7, dtype=torch.int64),
    }


def _worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    from vime_core.weight_sync.nccl import broadcast_weights, receive_weights

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == 0:
            stats = broadcast_weights(_tensors().items(), bucket_bytes=4096, checksums=True)
            queue.put(("sender", stats.num_bytes, stats.num_tensors, stats.num_buckets))
        else:
            got = {n: t.clone() for n, t in receive_weights()}
            queue.put(
                (
                    "receiver",
                    {n: (t.dtype, tuple(t.shape), t.view(torch.uint8).reshape(-1).tolist()) for n, t in got.items()},
                )
            )
    finally:
        dist.destroy_process_group()


def test_buckets_respect_the_size_and_keep_order():
    sizes = [b for b in buckets(_tensors().items(), 4096)]
    assert [len(b) for b in sizes] == [1, 4]
    assert [n for b in sizes for n, _ in b] == list(_tensors())
    with pytest.raises(ValueError):
        next(buckets([], 0))


def test_broadcast_round_trip_is_bit_exact_over_gloo():
    from vime_core.cluster.net import find_free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    env = os.environ.copy()
    for p in procs:
        p.start()
    try:
        results = dict((item[0], item[1:]) for item in (queue.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=60)
    os.environ.update(env)
    sent = _tensors()
    nbytes, ntensors, nbuckets = results["sender"]
    assert (ntensors, nbuckets) == (5, 2) and nbytes == sum(t.numel() * t.element_size() for t in sent.values())
    (got,) = results["receiver"]
    assert list(got) == list(sent)
    for name, t in sent.items():
        dtype, shape, raw = got[name]
        assert dtype == t.dtype and shape == tuple(t.shape)
        assert raw == t.contiguous().view(torch.uint8).reshape(-1).tolist(), name

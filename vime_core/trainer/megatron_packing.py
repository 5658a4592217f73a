"""Packed micro-batches for the ``megatron`` backend (``--qkv-format thd``): every sample of a micro-batch back to back
in one row, no padding, as the torch backend packs (:mod:`vime_core.trainer.packing`).

megatron-core takes such a row as its ``thd`` format: ``PackedSeqParams`` with the samples' cumulative lengths, which
its attention uses to apply RoPE per sample (positions restart at 0) and hands to the core attention.
:func:`thd_sdpa` is that core attention for :class:`~vime_core.trainer.megatron_model.SDPACoreAttention`: causal
SDPA once per sample. Only the positions that predict a response token reach the log-softmax
(:attr:`~vime_core.trainer.packing.PackedBatch.predict_index`).
"""

from __future__ import annotations

from typing import Any

import torch

from vime_core.trainer.packing import PackedBatch, packed_batch
from vime_core.types import Sample


def thd_batch(samples: list[Sample], multiple: int = 1, device: torch.device | str = "cpu") -> PackedBatch:
    """:func:`~vime_core.trainer.packing.packed_batch` of ``samples``, its row padded to a multiple of ``multiple``
    tokens (sequence parallelism splits the row over the tensor-parallel ranks) by one more segment of token 0 at the
    end, which ``cu_seq_lens`` closes like a sample's (so no sample attends to it) and no prediction reads.

    Every tensor goes to ``device`` but ``cu_seq_lens``, which stays on the CPU: megatron-core's ``thd`` RoPE and
    :func:`thd_sdpa` read it as Python ints in every layer, which from a GPU tensor would wait for the GPU each time.

    :param multiple: the row length must be a multiple of this (the tensor-parallel size under sequence parallelism).
    :raises ValueError: as :func:`~vime_core.trainer.packing.packed_batch`.
    """
    b = packed_batch(samples, "cpu")
    pad = (-b.total) % multiple
    ids, pos, cu, max_len = b.input_ids, b.position_ids, b.cu_seq_lens, b.max_len
    if pad:
        ids = torch.cat([ids, torch.zeros((1, pad), dtype=ids.dtype)], dim=1)
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype).unsqueeze(0)], dim=1)
        cu = torch.cat([cu, torch.tensor([b.total + pad], dtype=cu.dtype)])
        max_len = max(max_len, pad)
    return PackedBatch(
        input_ids=ids.to(device),
        position_ids=pos.to(device),
        cu_seq_lens=cu,
        max_len=max_len,
        predict_index=b.predict_index.to(device),
        targets=b.targets.to(device),
        response_lengths=b.response_lengths,
    )


def packed_seq_params(batch: PackedBatch) -> Any:
    """megatron-core's ``PackedSeqParams`` (``qkv_format="thd"``) of a packed row (imports megatron-core)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch.cu_seq_lens,
        cu_seqlens_kv=batch.cu_seq_lens,
        max_seqlen_q=batch.max_len,
        max_seqlen_kv=batch.max_len,
    )


def thd_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each packed sample on its own (``torch.nn.functional.scaled_dot_product_attention``).

    :param query: ``[t, heads, head_dim]`` (megatron-core's ``thd`` layout: ``t`` tokens of every sample).
    :param key: ``[t, kv_heads, head_dim]``; ``value`` likewise (grouped-query heads are repeated to ``heads``).
    :param cu_seqlens: ``[n + 1]`` int cumulative sample lengths, ``cu_seqlens[-1] == t``.
    :return: ``[t, heads * head_dim]``.
    :raises ValueError: if ``cu_seqlens`` does not end at ``t``.
    """
    import torch.nn.functional as F

    t, heads, dim = query.shape
    lengths = cu_seqlens.diff().tolist()
    if sum(lengths) != t:
        raise ValueError(f"cu_seqlens covers {sum(lengths)} tokens, the packed row has {t}")
    if key.shape[1] != heads:  # GQA: flash kernels want equal head counts
        rep = heads // key.shape[1]
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    outs = []
    # split, not slicing: split's backward is one cat, a slice's a zero-filled full-size gradient per sample
    for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths), strict=True):
        q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))  # [1, heads, L, dim]
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale)
        outs.append(o[0].permute(1, 0, 2))  # [L, heads, dim]
    return torch.cat(outs).reshape(t, heads * dim)

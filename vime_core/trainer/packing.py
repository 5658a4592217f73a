"""The packed (padding-free) batch of the ``torch`` backend's forward passes (policy and reference log-probs, critic
values): every sample of a micro-batch back to back in one row, no padding token anywhere.

:func:`packed_batch` builds the row (``position_ids`` restarting per sample, ``cu_seq_lens``);
:func:`enable_packed_attention` switches a model to :data:`PACKED_ATTENTION`, causal SDPA once per sample instead
of a dense block-diagonal mask; only the hidden states that predict a response token reach the LM or value head
(:attr:`PackedBatch.predict_index`). Details: docs/algorithms.md, "One RL step, both backends".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vime_core.types import Sample

PACKED_ATTENTION = "vime_packed_sdpa"


@dataclass(frozen=True)
class PackedBatch:
    """Model inputs for samples packed into one row (no padding).

    :ivar input_ids: ``[1, total]`` int64, the samples' ``tokens`` concatenated (``total = sum(len(s.tokens))``).
    :ivar position_ids: ``[1, total]`` int64, 0 at each sample's first token.
    :ivar cu_seq_lens: ``[n + 1]`` int32 cumulative sample lengths (``cu_seq_lens[i]``: sample ``i``'s first index).
    :ivar max_len: the longest sample's ``len(tokens)``.
    :ivar predict_index: ``[M]`` int64 indices into the row, ``M = sum(response_length)``: sample by sample, the
        positions whose hidden state predicts each response token (the position just before it).
    :ivar targets: ``[M]`` int64, the response tokens those positions predict (``input_ids[0, predict_index + 1]``).
    :ivar response_lengths: each sample's ``response_length`` (splits ``[M, ...]`` tensors per sample).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seq_lens: torch.Tensor
    max_len: int
    predict_index: torch.Tensor
    targets: torch.Tensor
    response_lengths: list[int]

    @property
    def total(self) -> int:
        """Tokens in the row (all real: there is no padding)."""
        return int(self.input_ids.shape[1])

    def attention_kwargs(self) -> dict[str, Any]:
        """The keyword arguments a Hugging Face model forwards to its attention function (flash-attention's varlen
        names), read by :func:`packed_sdpa_attention`."""
        return {
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_len,
            "max_length_k": self.max_len,
        }

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Per-sample views of ``x`` (``[M, ...]``, rows in :attr:`predict_index` order): ``[response_length, ...]``
        each, graph kept."""
        return list(torch.split(x, self.response_lengths))


def packed_batch(samples: list[Sample], device: torch.device | str = "cpu") -> PackedBatch:
    """Pack ``samples`` into one row on ``device``.

    :param samples: at least one sample; ``tokens`` is the prompt (``>= 1`` token when ``response_length >= 1``)
        followed by the ``response_length`` response tokens.
    :param device: where the tensors go.
    :raises ValueError: if a sample has a response but no prompt token before it, or no tokens at all.
    """
    lengths, predict = [], []
    start = 0
    for s in samples:
        n, r = len(s.tokens), s.response_length
        if n == 0 or r > n - 1:
            raise ValueError(f"sample of {n} tokens with response_length {r}: needs at least one prompt token")
        predict.append(torch.arange(start + n - r - 1, start + n - 1))
        lengths.append(n)
        start += n
    ids = torch.tensor([t for s in samples for t in s.tokens], dtype=torch.long)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    index = torch.cat(predict)
    return PackedBatch(
        input_ids=ids.unsqueeze(0).to(device),
        position_ids=pos.unsqueeze(0).to(device),
        cu_seq_lens=cu.to(device),
        max_len=max(lengths),
        predict_index=index.to(device),
        targets=ids[index + 1].to(device),
        response_lengths=[s.response_length for s in samples],
    )


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention of every packed sample on its own (a Hugging Face ``AttentionInterface`` function).

    :param query: ``[1, heads, total, head_dim]``; ``key``/``value``: ``[1, kv_heads, total, head_dim]``.
    :param cu_seq_lens_q: ``[n + 1]`` cumulative sample lengths (:attr:`PackedBatch.cu_seq_lens`); None: Hugging
        Face's ``sdpa`` on the whole batch as given (``attention_mask`` honoured).
    :return: ``([1, total, heads, head_dim], None)``, the layout Hugging Face's ``sdpa`` returns.
    :raises ValueError: if packed inputs come with a batch dimension other than 1 or with an ``attention_mask``, or
        if a sample is longer than the layer's sliding window (``module.sliding_window``: not applied here).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError("packed attention takes one row and no attention_mask (cu_seq_lens_q marks the samples)")
    lengths = cu_seq_lens_q.diff().tolist()
    window = getattr(module, "sliding_window", None)
    if window is not None and max(lengths) > window:
        raise ValueError(f"packed attention has no sliding window; a sample of {max(lengths)} > {window} tokens")
    # split, not slicing: split's backward is one cat, a slice's a zero-filled full-size gradient per sample
    outs = [
        sdpa_attention_forward(module, q, k, v, None, dropout, scaling, is_causal=True)[0]
        for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)
    ]
    return torch.cat(outs, dim=1), None


def _packed_sdpa_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """The mask function registered with :data:`PACKED_ATTENTION`: no mask for packed rows (the samples' bounds
    travel as ``cu_seq_lens_q``), Hugging Face's ``sdpa`` mask when a 2D ``attention_mask`` is given."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def enable_packed_attention(model: torch.nn.Module) -> bool:
    """Register :data:`PACKED_ATTENTION` with Hugging Face (once per process) and switch ``model`` (a
    ``PreTrainedModel`` whose attention goes through ``AttentionInterface``; its submodules follow) to it.

    Unpacked calls behave as with ``sdpa``; packed calls must pass :meth:`PackedBatch.attention_kwargs` (a packed
    row without them would attend across samples).

    :return: whether ``model`` now uses it (False for a model that cannot switch its attention: Hugging Face logs
        a warning and leaves it; callers fall back to left-padded batches).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if PACKED_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)
        AttentionMaskInterface.register(PACKED_ATTENTION, _packed_sdpa_mask)
    if model.config._attn_implementation != PACKED_ATTENTION:
        model.set_attn_implementation(PACKED_ATTENTION)
    return model.config._attn_implementation == PACKED_ATTENTION


def packed_hidden_states(backbone: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """The final hidden states of a packed row.

    :param backbone: a Hugging Face base model (``AutoModel``, or a causal LM's ``base_model``) with
        :func:`enable_packed_attention` applied (checked).
    :return: ``[total, hidden]`` (graph attached when grad is enabled).
    :raises ValueError: if ``backbone`` is not switched to :data:`PACKED_ATTENTION`.
    """
    if backbone.config._attn_implementation != PACKED_ATTENTION:
        raise ValueError(f"packed forward needs attn_implementation {PACKED_ATTENTION!r} (enable_packed_attention)")
    out = backbone(
        input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **batch.attention_kwargs()
    )
    return out.last_hidden_state[0]

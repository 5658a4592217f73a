"""The ``megatron`` backend's process and model setup: ``torch.distributed`` initialisation (torchrun's environment or
a one-process group) and the transformer-layer spec (Transformer Engine's, or Megatron's local spec with
:class:`SDPACoreAttention`). megatron-core is imported inside the functions: this module imports without it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from vime_core.net import find_free_port
from vime_core.trainer.megatron_convert import unshard


def have_transformer_engine() -> bool:
    """Whether ``transformer_engine.pytorch`` imports."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "no TE"
        return False
    return True


def init_distributed(timeout_minutes: int = 30) -> tuple[int, int, int]:
    """Initialise ``torch.distributed`` (NCCL) if needed: torchrun's environment, or a one-process group.

    :return: ``(rank, world_size, local_rank)``; the current CUDA device is set to ``local_rank``.
    :raises RuntimeError: without CUDA.
    """
    import datetime

    import torch.distributed as dist

    if not torch.cuda.is_available():
        raise RuntimeError(
            "the megatron trainer needs a CUDA GPU: megatron-core's model code calls torch.cuda "
            "unconditionally (use --trainer torch on CPU)"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(
                RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port())
            )
        dist.init_process_group(
            "nccl", timeout=datetime.timedelta(minutes=timeout_minutes), device_id=torch.device("cuda", local_rank)
        )
    return dist.get_rank(), dist.get_world_size(), local_rank


class SDPACoreAttention(torch.nn.Module):
    """Megatron core-attention module (the ``core_attention`` submodule of ``SelfAttention``) computed with
    ``torch.nn.functional.scaled_dot_product_attention``.

    Same interface as ``megatron.core.transformer.dot_product_attention.DotProductAttention``: ``query``
    ``[sq, b, np, hn]``, ``key``/``value`` ``[sk, b, ng, hn]`` (bf16), returns ``[sq, b, np * hn]``. Causal masks
    are implicit (``is_causal``); an explicit Megatron mask (``True`` = masked out) is inverted for SDPA. Context
    parallelism and packed sequences are not supported.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        **_: Any,
    ) -> None:
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        self.config = config
        self.causal = attn_mask_type == AttnMaskType.causal
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
        **_: Any,
    ) -> torch.Tensor:
        import torch.nn.functional as F

        if packed_seq_params is not None:
            raise ValueError("SDPACoreAttention does not support packed sequences")
        sq, b, heads, hn = query.shape
        if key.shape[2] != heads:  # GQA: expand key/value groups (flash kernels want equal head counts)
            rep = heads // key.shape[2]
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        mask = None if (self.causal or attention_mask is None) else ~attention_mask
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal and mask is None,
            scale=self.scale,
        )
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)


def layer_spec(attention: str, te: bool) -> Any:
    """The transformer-layer ``ModuleSpec``: TE's (``attention == "te"``), or the local spec with SDPA (``"sdpa"``)
    or Megatron's own unfused attention (``"local"``).

    :raises ValueError: on an unknown ``attention`` or ``"te"`` without Transformer Engine.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if attention == "te":
        if not te:
            raise ValueError("--megatron-attention te needs transformer_engine, which does not import here")
        return specs.get_gpt_layer_with_transformer_engine_spec()
    if attention not in ("sdpa", "local"):
        raise ValueError(f"--megatron-attention must be te, sdpa or local, got {attention!r}")
    spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def tp_full(p: torch.Tensor, layout_name: str, tp: int, group: Any) -> torch.Tensor:
    """The full tensor of parameter ``p``, sharded over ``tp`` tensor-parallel ranks as the Megatron tensor
    ``layout_name`` is: every rank's part gathered over ``group`` and joined
    (:func:`~vime_core.trainer.megatron_convert.unshard`); ``p.data`` itself when ``tp`` is 1. Collective under TP:
    every rank of ``group`` calls it for the same parameter."""
    if tp == 1:
        return p.data
    import torch.distributed as dist

    parts = [torch.empty_like(p) for _ in range(tp)]
    dist.all_gather(parts, p.data.contiguous(), group=group)
    return unshard(layout_name, parts)

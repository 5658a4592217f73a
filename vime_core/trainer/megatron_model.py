"""The ``megatron`` backend's process and model setup: ``torch.distributed`` initialisation (torchrun's environment or
a one-process group) and the transformer-layer spec (Transformer Engine's, or Megatron's local spec with
:class:`SDPACoreAttention`). megatron-core is imported inside the functions: this module imports without it.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from vime_core.cluster.net import find_free_port
from vime_core.models.families import ArchConfig
from vime_core.trainer.megatron_convert import unshard
from vime_core.trainer.megatron_moe_model import moe_block_spec


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
    are implicit (``is_causal``); an explicit Megatron mask (``True`` = masked out) is inverted for SDPA. Packed
    sequences (``thd``, ``--qkv-format thd``): :func:`vime_core.trainer.megatron_packing.thd_sdpa`. Context
    parallelism is not supported.
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

        if packed_seq_params is not None:  # --qkv-format thd: [t, heads, head_dim], one causal pass per sample
            from vime_core.trainer.megatron_packing import thd_sdpa

            if getattr(packed_seq_params, "qkv_format", None) != "thd" or not self.causal:
                raise ValueError("SDPACoreAttention takes packed sequences in the causal thd format only")
            dropout = self.dropout if self.training else 0.0
            return thd_sdpa(query, key, value, packed_seq_params.cu_seqlens_q, self.scale, dropout)
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
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # heads × the value's width (MLA: v_head_dim)


def layer_spec(attention: str, te: bool, arch: ArchConfig | None = None, config: Any = None) -> Any:
    """The transformer-layer ``ModuleSpec`` of ``arch``: TE's (``attention == "te"``), or the local spec with SDPA
    (``"sdpa"``) or Megatron's own unfused attention (``"local"``); with ``arch.qk_layernorm`` its attention has
    ``q_layernorm`` / ``k_layernorm`` (RMSNorm over each head, Qwen3). An MoE or MLA ``arch`` gets a decoder block
    spec of one layer spec per layer built from ``config`` (its ``TransformerConfig``:
    :func:`vime_core.trainer.megatron_moe_model.moe_block_spec`).

    :raises ValueError: on an unknown ``attention``, ``"te"`` without Transformer Engine, an MoE/MLA ``arch``
        without ``config``, or MLA with ``"local"``.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    qk = bool(arch is not None and arch.qk_layernorm)
    if attention == "te" and not te:
        raise ValueError("--megatron-attention te needs transformer_engine, which does not import here")
    if attention not in ("te", "sdpa", "local"):
        raise ValueError(f"--megatron-attention must be te, sdpa or local, got {attention!r}")
    if arch is not None and (arch.moe is not None or arch.attention == "mla"):
        if config is None:
            raise ValueError(f"model_type {arch.model_type!r}: its layer spec needs the TransformerConfig")
        if arch.attention == "mla" and attention == "local":
            raise ValueError(
                "--megatron-attention local cannot build multi-latent attention (megatron-core's DotProductAttention "
                "has no key width of its own); use sdpa or te"
            )
        return moe_block_spec(config, attention == "te", SDPACoreAttention if attention == "sdpa" else None)
    if attention == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk)
    spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk)
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def transformer_config_fields(arch: ArchConfig) -> dict[str, Any]:
    """The ``TransformerConfig`` fields that come from the model's architecture (the trainer adds parallelism,
    precision and recomputation): sizes, ``kv_channels = head_dim`` (independent of hidden / heads), RMSNorm and its
    epsilon, gated SiLU MLP, biases, ``qk_layernorm``. The MoE/MLA families' own fields (experts, router, MLA sizes)
    come from :func:`vime_core.trainer.megatron_moe_model.moe_config_fields`, their config class from
    :func:`~vime_core.trainer.megatron_moe_model.transformer_config_class`."""
    return dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
    )


def gpt_model_fields(arch: ArchConfig) -> dict[str, Any]:
    """The ``GPTModel`` arguments that come from the architecture: context length and RoPE (the trainer adds the
    config, layer spec, padded vocabulary and tying)."""
    return dict(
        max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        rotary_percent=1.0,
    )


def rope_inv_freq(arch: ArchConfig) -> torch.Tensor:
    """``[head_dim / 2]`` float32 RoPE inverse frequencies of ``arch``, computed as transformers does
    (``modeling_rope_utils``: default, ``linear`` = default / factor, ``llama3`` = Llama 3.1's frequency-dependent
    scaling: wavelengths above ``original_max_position_embeddings / low_freq_factor`` divided by ``factor``, below
    ``... / high_freq_factor`` kept, smoothly interpolated between), operation for operation, on the CPU."""
    d = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(dtype=torch.float) / d))
    r = arch.rope_scaling
    if r is None:
        return inv_freq
    if r.rope_type == "linear":
        return inv_freq / r.factor
    if r.rope_type != "llama3":
        raise ValueError(f"RoPE type {r.rope_type!r} has no inverse frequencies here")
    old_context_len = r.original_max_position_embeddings
    low_freq_wavelen = old_context_len / r.low_freq_factor
    high_freq_wavelen = old_context_len / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / r.factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / r.factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def install_rope(gpt: Any, arch: ArchConfig) -> None:
    """Give a new ``GPTModel``'s rotary embedding the inverse frequencies of :func:`rope_inv_freq` where
    megatron-core cannot compute them from the HF config itself: RoPE scaling (its ``rope_scaling`` knows only
    llama3's factor, with low/high frequency factors and original context fixed at 1 / 4 / 8192, and its
    ``seq_len_interpolation_factor`` scales positions rather than frequencies, which rounds differently from
    transformers' ``linear``) or a fractional ``rope_theta`` (``GPTModel`` takes an int). Plain RoPE with an
    integral base is left to megatron-core. Call before the first forward (megatron-core caches the embedding by
    sequence length)."""
    if arch.rope_scaling is None and arch.rope_theta == int(arch.rope_theta):
        return
    rotary = gpt.rotary_pos_emb
    rotary.inv_freq = rope_inv_freq(arch).to(rotary.inv_freq.device)


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

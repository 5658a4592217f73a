"""Hugging Face ↔ Megatron-Core weight mapping for Llama-family (Llama, SmolLM2, Mistral-dense) and Qwen2 models.

Pure torch (no megatron import), so it is tested exhaustively on CPU: :func:`hf_to_megatron` / :func:`megatron_to_hf`
(full tensors, local or Transformer Engine spec names; moved, concatenated and split, never cast, so a round trip is
bit-exact), :func:`shard` / :func:`unshard` (tensor parallelism) and :func:`pad_vocab` / :func:`unpad_vocab`. The
layout, and why it is hand-written: docs/gpu.md, "HF ↔ Megatron weights".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch


class ConversionError(ValueError):
    """A checkpoint does not fit the architecture (missing/unexpected tensor, bad shape, unsupported feature)."""


@dataclass(frozen=True)
class ArchConfig:
    """What the mapping needs to know about the model (from an HF config via :meth:`from_hf`).

    :ivar num_layers: decoder layers. :ivar hidden_size: model width ``H``.
    :ivar num_attention_heads: query heads ``nh``. :ivar num_query_groups: key/value heads ``ng`` (divides ``nh``).
    :ivar head_dim: per-head width ``d``. :ivar ffn_hidden_size: MLP width ``F``. :ivar vocab_size: ``V``.
    :ivar tie_word_embeddings: ``lm_head`` shares ``embed_tokens``. :ivar qkv_bias: q/k/v projections have biases.
    :ivar rms_norm_eps: RMSNorm epsilon. :ivar rope_theta: RoPE base. :ivar max_position_embeddings: context.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    @classmethod
    def from_hf(cls, config: Any) -> ArchConfig:
        """From a transformers ``LlamaConfig`` / ``Qwen2Config`` (or anything with the same attributes).

        :raises ConversionError: for unsupported features (RoPE scaling other than none/default, MoE, hidden act
            other than SiLU, sliding-window attention in use).
        """
        model_type = getattr(config, "model_type", "llama")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise ConversionError(f"model_type {model_type!r} is not supported (llama, qwen2, mistral)")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ConversionError(f"hidden_act {config.hidden_act!r} is not supported (silu)")
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in (None, "default"):
            raise ConversionError(f"RoPE scaling {rope_type!r} is not supported yet")
        theta = getattr(config, "rope_theta", None)
        if theta is None and isinstance(rope, dict):
            theta = rope.get("rope_theta")
        heads = int(config.num_attention_heads)
        groups = int(getattr(config, "num_key_value_heads", None) or heads)
        if heads % groups:
            raise ConversionError(f"{heads} attention heads are not a multiple of {groups} key/value heads")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        qkv_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        if getattr(config, "mlp_bias", False):
            raise ConversionError("mlp_bias is not supported")
        return cls(
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_attention_heads=heads,
            num_query_groups=groups,
            head_dim=int(head_dim),
            ffn_hidden_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            rope_theta=float(theta or 10000.0),
            max_position_embeddings=int(getattr(config, "max_position_embeddings", 4096)),
        )


def _names(te: bool) -> dict[str, str]:
    """Megatron names of the two per-layer norms (TE fuses them into the following linear layer)."""
    if te:
        return {
            "input_layernorm": "self_attention.linear_qkv.layer_norm_weight",
            "post_attention_layernorm": "mlp.linear_fc1.layer_norm_weight",
        }
    return {"input_layernorm": "input_layernorm.weight", "post_attention_layernorm": "pre_mlp_layernorm.weight"}


def _dims(cfg: ArchConfig) -> tuple[int, int, int, int, int, int, int]:
    """The sizes both directions of the mapping use: hidden, attention heads, query groups, head dim, FFN hidden,
    vocab, and heads per query group."""
    nh, ng = cfg.num_attention_heads, cfg.num_query_groups
    return cfg.hidden_size, nh, ng, cfg.head_dim, cfg.ffn_hidden_size, cfg.vocab_size, nh // ng


def _take(src: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    t = src.pop(name, None)
    if t is None:
        raise ConversionError(f"missing tensor {name}")
    if tuple(t.shape) != tuple(shape):
        raise ConversionError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def hf_to_megatron(hf: dict[str, torch.Tensor], cfg: ArchConfig, *, te: bool = False) -> dict[str, torch.Tensor]:
    """HF tensors → full (unsharded) Megatron GPTModel tensors.

    :param hf: HF name → tensor (any dtype; unchanged). ``lm_head.weight`` is ignored when tied.
    :param cfg: the architecture.
    :param te: Transformer Engine spec names (fused norms) instead of the local spec's.
    :return: Megatron name → tensor.
    :raises ConversionError: on a missing, unexpected or mis-shaped tensor.
    """
    src = dict(hf)
    h, nh, ng, d, f, v, per = _dims(cfg)
    norms = _names(te)
    out: dict[str, torch.Tensor] = {}
    out["embedding.word_embeddings.weight"] = _take(src, "model.embed_tokens.weight", (v, h))
    for i in range(cfg.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + norms["input_layernorm"]] = _take(src, p + "input_layernorm.weight", (h,))
        q = _take(src, p + "self_attn.q_proj.weight", (nh * d, h)).reshape(ng, per * d, h)
        k = _take(src, p + "self_attn.k_proj.weight", (ng * d, h)).reshape(ng, d, h)
        vv = _take(src, p + "self_attn.v_proj.weight", (ng * d, h)).reshape(ng, d, h)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, vv], dim=1).reshape(-1, h)
        if cfg.qkv_bias:
            qb = _take(src, p + "self_attn.q_proj.bias", (nh * d,)).reshape(ng, per * d)
            kb = _take(src, p + "self_attn.k_proj.bias", (ng * d,)).reshape(ng, d)
            vb = _take(src, p + "self_attn.v_proj.bias", (ng * d,)).reshape(ng, d)
            out[m + "self_attention.linear_qkv.bias"] = torch.cat([qb, kb, vb], dim=1).reshape(-1)
        out[m + "self_attention.linear_proj.weight"] = _take(src, p + "self_attn.o_proj.weight", (h, nh * d))
        out[m + norms["post_attention_layernorm"]] = _take(src, p + "post_attention_layernorm.weight", (h,))
        gate = _take(src, p + "mlp.gate_proj.weight", (f, h))
        up = _take(src, p + "mlp.up_proj.weight", (f, h))
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[m + "mlp.linear_fc2.weight"] = _take(src, p + "mlp.down_proj.weight", (h, f))
    out["decoder.final_layernorm.weight"] = _take(src, "model.norm.weight", (h,))
    if cfg.tie_word_embeddings:
        src.pop("lm_head.weight", None)
    else:
        out["output_layer.weight"] = _take(src, "lm_head.weight", (v, h))
    src = {k: t for k, t in src.items() if not k.endswith("rotary_emb.inv_freq")}
    if src:
        raise ConversionError(f"unexpected HF tensors: {sorted(src)[:8]}")
    return out


def megatron_to_hf(mc: dict[str, torch.Tensor], cfg: ArchConfig, *, te: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded) Megatron tensors → HF tensors (inverse of :func:`hf_to_megatron`; ``_extra_state`` entries
    of TE modules are ignored). The HF tensors are views/slices of the inputs: ``.contiguous()`` before saving.

    :raises ConversionError: on a missing, unexpected or mis-shaped tensor.
    """
    src = {k: t for k, t in mc.items() if not k.endswith("_extra_state")}
    h, nh, ng, d, f, v, per = _dims(cfg)
    norms = _names(te)
    out: dict[str, torch.Tensor] = {}
    out["model.embed_tokens.weight"] = _take(src, "embedding.word_embeddings.weight", (v, h))
    for i in range(cfg.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = _take(src, m + norms["input_layernorm"], (h,))
        qkv = _take(src, m + "self_attention.linear_qkv.weight", ((nh + 2 * ng) * d, h)).reshape(ng, (per + 2) * d, h)
        q, k, vv = torch.split(qkv, [per * d, d, d], dim=1)
        out[p + "self_attn.q_proj.weight"] = q.reshape(nh * d, h)
        out[p + "self_attn.k_proj.weight"] = k.reshape(ng * d, h)
        out[p + "self_attn.v_proj.weight"] = vv.reshape(ng * d, h)
        if cfg.qkv_bias:
            b = _take(src, m + "self_attention.linear_qkv.bias", ((nh + 2 * ng) * d,)).reshape(ng, (per + 2) * d)
            qb, kb, vb = torch.split(b, [per * d, d, d], dim=1)
            out[p + "self_attn.q_proj.bias"] = qb.reshape(nh * d)
            out[p + "self_attn.k_proj.bias"] = kb.reshape(ng * d)
            out[p + "self_attn.v_proj.bias"] = vb.reshape(ng * d)
        out[p + "self_attn.o_proj.weight"] = _take(src, m + "self_attention.linear_proj.weight", (h, nh * d))
        out[p + "post_attention_layernorm.weight"] = _take(src, m + norms["post_attention_layernorm"], (h,))
        gate, up = torch.split(_take(src, m + "mlp.linear_fc1.weight", (2 * f, h)), [f, f], dim=0)
        out[p + "mlp.gate_proj.weight"] = gate
        out[p + "mlp.up_proj.weight"] = up
        out[p + "mlp.down_proj.weight"] = _take(src, m + "mlp.linear_fc2.weight", (h, f))
    out["model.norm.weight"] = _take(src, "decoder.final_layernorm.weight", (h,))
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = _take(src, "output_layer.weight", (v, h))
    else:
        src.pop("output_layer.weight", None)
    if src:
        raise ConversionError(f"unexpected Megatron tensors: {sorted(src)[:8]}")
    return out


# ---------------------------------------------------------------------------------------------- tensor parallel
_COLUMN = re.compile(r"(linear_qkv\.(weight|bias)|word_embeddings\.weight|output_layer\.weight)$")
_ROW = re.compile(r"(linear_proj|linear_fc2)\.weight$")
_FC1 = re.compile(r"linear_fc1\.weight$")


def shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part (of ``size``) of the full Megatron tensor ``name`` (a view where possible).

    :raises ConversionError: if the split dimension is not divisible by ``size``.
    """
    if size == 1:
        return full
    if _FC1.search(name):
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([_split(name, gate, 0, rank, size), _split(name, up, 0, rank, size)], dim=0)
    if _COLUMN.search(name):
        return _split(name, full, 0, rank, size)
    if _ROW.search(name):
        return _split(name, full, 1, rank, size)
    return full


def _split(name: str, t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ConversionError(f"{name}: dim {dim} of size {t.shape[dim]} does not split into {size} ranks")
    return torch.chunk(t, size, dim=dim)[rank]


def unshard(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`shard`: the full tensor from every rank's part (in rank order)."""
    if len(parts) == 1:
        return parts[0]
    if _FC1.search(name):
        halves = [torch.chunk(p, 2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if _COLUMN.search(name):
        return torch.cat(parts, dim=0)
    if _ROW.search(name):
        return torch.cat(parts, dim=1)
    return parts[0]


def pad_vocab(mc: dict[str, torch.Tensor], padded_vocab: int) -> dict[str, torch.Tensor]:
    """Zero rows appended to ``word_embeddings`` / ``output_layer`` up to ``padded_vocab`` (for TP divisibility;
    the trainer masks the padded logits)."""
    out = dict(mc)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        t = out.get(name)
        if t is not None and t.shape[0] < padded_vocab:
            out[name] = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])], dim=0)
    return out


def unpad_vocab(mc: dict[str, torch.Tensor], vocab: int) -> dict[str, torch.Tensor]:
    """Inverse of :func:`pad_vocab`."""
    out = dict(mc)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in out:
            out[name] = out[name][:vocab]
    return out

"""Hugging Face ↔ Megatron-Core weight mapping of every family the ``megatron`` trainer builds
(:mod:`vime_core.models.families`: Llama 3.x, Mistral-dense, Qwen2, Qwen3, ...).

Pure torch (no megatron import), so it is tested exhaustively on CPU: :func:`hf_to_megatron` / :func:`megatron_to_hf`
(full tensors, local or Transformer Engine spec names; moved, concatenated and split, never cast, so a round trip is
bit-exact), :func:`shard` / :func:`unshard` (tensor parallelism, by :data:`TP_RULES`) and :func:`pad_vocab` /
:func:`unpad_vocab`. A decoder layer is two :class:`LayerPart` mappings — attention (:data:`ATTENTION`, by
:attr:`ArchConfig.attention`) and MLP (:data:`MLP`, by :meth:`ArchConfig.mlp_kind`) — which MLA and MoE families
extend. The layout, and why it is hand-written: docs/gpu.md, "HF ↔ Megatron weights"; families: docs/models.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vime_core.models.families import ArchConfig, ConversionError
from vime_core.trainer.megatron_moe import MOE_TP_RULES, mla_to_hf, mla_to_megatron, moe_to_hf, moe_to_megatron

__all__ = [
    "ATTENTION",
    "MLP",
    "TP_RULES",
    "ArchConfig",
    "ConversionError",
    "LayerPart",
    "Tensors",
    "hf_to_megatron",
    "megatron_to_hf",
    "pad_vocab",
    "shard",
    "unpad_vocab",
    "unshard",
]


# ------------------------------------------------------------------------------------------------ per-layer parts
class Tensors:
    """The tensors not mapped yet (a copy of the input), taken one by one with their expected shapes."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.left = dict(tensors)

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Remove and return ``name``.

        :raises ConversionError: if it is missing or its shape is not ``shape``.
        """
        t = self.left.pop(name, None)
        if t is None:
            raise ConversionError(f"missing tensor {name}")
        if tuple(t.shape) != tuple(shape):
            raise ConversionError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
        return t


#: maps one part of decoder layer ``i``: ``(src, hf_prefix, megatron_prefix, cfg, te) -> {name: tensor}``, where
#: the prefixes are ``model.layers.{i}.`` and ``decoder.layers.{i}.``; to Megatron it returns Megatron names, to HF
#: HF names, taking its inputs from ``src`` (:class:`Tensors`)
PartMap = Callable[[Tensors, str, str, ArchConfig, bool], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class LayerPart:
    """The HF ↔ Megatron mapping of one part of a decoder layer (attention, or MLP), with the norm in front of it:
    under Transformer Engine's spec that norm is fused into the part's first linear layer (``te=True`` names).

    :ivar to_megatron: HF → Megatron. :ivar to_hf: Megatron → HF (exact inverse; views/slices of its inputs).
    """

    to_megatron: PartMap
    to_hf: PartMap


def _gqa_to_megatron(src: Tensors, p: str, m: str, cfg: ArchConfig, te: bool) -> dict[str, torch.Tensor]:
    h, nh, ng, d, per = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim, _per(cfg)
    norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
    out = {m + norm: src.take(p + "input_layernorm.weight", (h,))}
    q = src.take(p + "self_attn.q_proj.weight", (nh * d, h)).reshape(ng, per * d, h)
    k = src.take(p + "self_attn.k_proj.weight", (ng * d, h)).reshape(ng, d, h)
    vv = src.take(p + "self_attn.v_proj.weight", (ng * d, h)).reshape(ng, d, h)
    out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, vv], dim=1).reshape(-1, h)
    if cfg.qkv_bias:
        qb = src.take(p + "self_attn.q_proj.bias", (nh * d,)).reshape(ng, per * d)
        kb = src.take(p + "self_attn.k_proj.bias", (ng * d,)).reshape(ng, d)
        vb = src.take(p + "self_attn.v_proj.bias", (ng * d,)).reshape(ng, d)
        out[m + "self_attention.linear_qkv.bias"] = torch.cat([qb, kb, vb], dim=1).reshape(-1)
    if cfg.qk_layernorm:
        out[m + "self_attention.q_layernorm.weight"] = src.take(p + "self_attn.q_norm.weight", (d,))
        out[m + "self_attention.k_layernorm.weight"] = src.take(p + "self_attn.k_norm.weight", (d,))
    out[m + "self_attention.linear_proj.weight"] = src.take(p + "self_attn.o_proj.weight", (h, nh * d))
    return out


def _gqa_to_hf(src: Tensors, p: str, m: str, cfg: ArchConfig, te: bool) -> dict[str, torch.Tensor]:
    h, nh, ng, d, per = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim, _per(cfg)
    norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
    out = {p + "input_layernorm.weight": src.take(m + norm, (h,))}
    qkv = src.take(m + "self_attention.linear_qkv.weight", ((nh + 2 * ng) * d, h)).reshape(ng, (per + 2) * d, h)
    q, k, vv = torch.split(qkv, [per * d, d, d], dim=1)
    out[p + "self_attn.q_proj.weight"] = q.reshape(nh * d, h)
    out[p + "self_attn.k_proj.weight"] = k.reshape(ng * d, h)
    out[p + "self_attn.v_proj.weight"] = vv.reshape(ng * d, h)
    if cfg.qkv_bias:
        b = src.take(m + "self_attention.linear_qkv.bias", ((nh + 2 * ng) * d,)).reshape(ng, (per + 2) * d)
        qb, kb, vb = torch.split(b, [per * d, d, d], dim=1)
        out[p + "self_attn.q_proj.bias"] = qb.reshape(nh * d)
        out[p + "self_attn.k_proj.bias"] = kb.reshape(ng * d)
        out[p + "self_attn.v_proj.bias"] = vb.reshape(ng * d)
    if cfg.qk_layernorm:
        out[p + "self_attn.q_norm.weight"] = src.take(m + "self_attention.q_layernorm.weight", (d,))
        out[p + "self_attn.k_norm.weight"] = src.take(m + "self_attention.k_layernorm.weight", (d,))
    out[p + "self_attn.o_proj.weight"] = src.take(m + "self_attention.linear_proj.weight", (h, nh * d))
    return out


def _dense_mlp_to_megatron(src: Tensors, p: str, m: str, cfg: ArchConfig, te: bool) -> dict[str, torch.Tensor]:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    norm = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"
    out = {m + norm: src.take(p + "post_attention_layernorm.weight", (h,))}
    gate = src.take(p + "mlp.gate_proj.weight", (f, h))
    up = src.take(p + "mlp.up_proj.weight", (f, h))
    out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    out[m + "mlp.linear_fc2.weight"] = src.take(p + "mlp.down_proj.weight", (h, f))
    return out


def _dense_mlp_to_hf(src: Tensors, p: str, m: str, cfg: ArchConfig, te: bool) -> dict[str, torch.Tensor]:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    norm = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"
    out = {p + "post_attention_layernorm.weight": src.take(m + norm, (h,))}
    gate, up = torch.split(src.take(m + "mlp.linear_fc1.weight", (2 * f, h)), [f, f], dim=0)
    out[p + "mlp.gate_proj.weight"] = gate
    out[p + "mlp.up_proj.weight"] = up
    out[p + "mlp.down_proj.weight"] = src.take(m + "mlp.linear_fc2.weight", (h, f))
    return out


def _per(cfg: ArchConfig) -> int:
    """Query heads per key/value group."""
    return cfg.num_attention_heads // cfg.num_query_groups


#: attention parts by :attr:`ArchConfig.attention`: ``gqa`` (MHA/GQA/MQA, fused ``linear_qkv`` in Megatron's
#: per-group [q…, k, v] order, optional q/k/v bias and q/k RMSNorm), ``mla`` (multi-latent attention,
#: :mod:`vime_core.trainer.megatron_moe`).
ATTENTION: dict[str, LayerPart] = {
    "gqa": LayerPart(_gqa_to_megatron, _gqa_to_hf),
    "mla": LayerPart(mla_to_megatron, mla_to_hf),
}
#: MLP parts by :meth:`ArchConfig.mlp_kind`: ``dense`` (gated SiLU, fused ``linear_fc1`` = [gate; up]), ``moe``
#: (router, correction bias, experts, shared experts: :mod:`vime_core.trainer.megatron_moe`).
MLP: dict[str, LayerPart] = {
    "dense": LayerPart(_dense_mlp_to_megatron, _dense_mlp_to_hf),
    "moe": LayerPart(moe_to_megatron, moe_to_hf),
}


def _parts(cfg: ArchConfig, layer: int) -> tuple[LayerPart, LayerPart]:
    attention, mlp = ATTENTION.get(cfg.attention), MLP.get(cfg.mlp_kind(layer))
    if attention is None or mlp is None:
        raise ConversionError(
            f"layer {layer}: no mapping for attention {cfg.attention!r} / MLP {cfg.mlp_kind(layer)!r} "
            f"(have attention {sorted(ATTENTION)}, MLP {sorted(MLP)})"
        )
    return attention, mlp


# ------------------------------------------------------------------------------------------------- whole models
def hf_to_megatron(hf: dict[str, torch.Tensor], cfg: ArchConfig, *, te: bool = False) -> dict[str, torch.Tensor]:
    """HF tensors → full (unsharded) Megatron GPTModel tensors.

    :param hf: HF name → tensor (any dtype; unchanged). ``lm_head.weight`` is ignored when tied.
    :param cfg: the architecture (its attention and MLP parts: :data:`ATTENTION`, :data:`MLP`).
    :param te: Transformer Engine spec names (fused norms) instead of the local spec's.
    :return: Megatron name → tensor.
    :raises ConversionError: on a missing, unexpected or mis-shaped tensor.
    """
    src = Tensors(hf)
    h, v = cfg.hidden_size, cfg.vocab_size
    out: dict[str, torch.Tensor] = {}
    out["embedding.word_embeddings.weight"] = src.take("model.embed_tokens.weight", (v, h))
    for i in range(cfg.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for part in _parts(cfg, i):
            out.update(part.to_megatron(src, p, m, cfg, te))
    out["decoder.final_layernorm.weight"] = src.take("model.norm.weight", (h,))
    if cfg.tie_word_embeddings:
        src.left.pop("lm_head.weight", None)
    else:
        out["output_layer.weight"] = src.take("lm_head.weight", (v, h))
    left = sorted(k for k in src.left if not k.endswith("rotary_emb.inv_freq"))
    if left:
        raise ConversionError(f"unexpected HF tensors: {left[:8]}")
    return out


def megatron_to_hf(mc: dict[str, torch.Tensor], cfg: ArchConfig, *, te: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded) Megatron tensors → HF tensors (inverse of :func:`hf_to_megatron`; ``_extra_state`` entries
    of TE modules are ignored): the names vLLM and transformers load. The HF tensors are views/slices of the inputs:
    ``.contiguous()`` before saving.

    :raises ConversionError: on a missing, unexpected or mis-shaped tensor.
    """
    src = Tensors({k: t for k, t in mc.items() if not k.endswith("_extra_state")})
    h, v = cfg.hidden_size, cfg.vocab_size
    out: dict[str, torch.Tensor] = {}
    out["model.embed_tokens.weight"] = src.take("embedding.word_embeddings.weight", (v, h))
    for i in range(cfg.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for part in _parts(cfg, i):
            out.update(part.to_hf(src, p, m, cfg, te))
    out["model.norm.weight"] = src.take("decoder.final_layernorm.weight", (h,))
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = src.take("output_layer.weight", (v, h))
    else:
        src.left.pop("output_layer.weight", None)
    if src.left:
        raise ConversionError(f"unexpected Megatron tensors: {sorted(src.left)[:8]}")
    return out


# ---------------------------------------------------------------------------------------------- tensor parallel
#: how each Megatron tensor splits over tensor-parallel ranks, first match wins, no match: replicated (norms, q/k
#: norms): ``column`` (dim 0), ``row`` (dim 1), ``gated`` (dim 0 of each half [gate; up] of a fused fc1).
#: The MoE/MLA names' rules come first (:data:`vime_core.trainer.megatron_moe.MOE_TP_RULES`; routers stay replicated,
#: each expert splits like a dense MLP over the expert-TP ranks); expert parallelism (which experts a rank holds) is
#: a separate split on top of this one (:func:`vime_core.trainer.megatron_moe.ep_shard`).
TP_RULES: list[tuple[re.Pattern[str], str]] = [
    *MOE_TP_RULES,
    (re.compile(r"linear_fc1\.weight$"), "gated"),
    (re.compile(r"(linear_qkv\.(weight|bias)|word_embeddings\.weight|output_layer\.weight)$"), "column"),
    (re.compile(r"(linear_proj|linear_fc2)\.weight$"), "row"),
]


def _rule(name: str) -> str:
    for pattern, kind in TP_RULES:
        if pattern.search(name):
            return kind
    return "replicated"


def shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part (of ``size``) of the full Megatron tensor ``name`` (a view where possible).

    :raises ConversionError: if the split dimension is not divisible by ``size``.
    """
    if size == 1:
        return full
    kind = _rule(name)
    if kind == "gated":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([_split(name, gate, 0, rank, size), _split(name, up, 0, rank, size)], dim=0)
    if kind == "column":
        return _split(name, full, 0, rank, size)
    if kind == "row":
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
    kind = _rule(name)
    if kind == "gated":
        halves = [torch.chunk(p, 2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if kind == "column":
        return torch.cat(parts, dim=0)
    if kind == "row":
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

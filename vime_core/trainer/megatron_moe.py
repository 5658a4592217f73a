"""The HF ↔ Megatron-Core mapping parts of the MoE families (:mod:`vime_core.models.moe_families`): the MoE MLP
(router, correction bias, routed experts, shared experts) and multi-latent attention, registered by
:mod:`vime_core.trainer.megatron_convert` as ``MLP["moe"]`` and ``ATTENTION["mla"]``; and expert parallelism's split
of the experts over EP ranks (:func:`ep_shard` / :func:`ep_unshard`). Pure torch, tensors moved, concatenated and
split, never cast (bit-exact round trips). Names: docs/models.md, "MoE and MLA names".

Megatron names (``decoder.layers.{i}.`` + ...), local spec / Transformer Engine spec where they differ:

* router ``mlp.router.weight`` ``[E, H]`` ← ``mlp.gate.weight``; correction bias ``mlp.router.expert_bias`` ``[E]``
  (a buffer) ← ``mlp.gate.e_score_correction_bias``;
* expert ``e``: ``mlp.experts.local_experts.{e}.linear_fc1.weight`` ``[2 F_e, H]`` = [gate; up] and
  ``...linear_fc2.weight`` ``[H, F_e]`` (SequentialMLP) / ``mlp.experts.linear_fc1.weight{e}``,
  ``mlp.experts.linear_fc2.weight{e}`` (TE grouped GEMM) ← ``mlp.experts.{e}.{gate,up,down}_proj.weight``, or
  transformers' fused in-memory ``mlp.experts.gate_up_proj`` ``[E, 2 F_e, H]`` / ``mlp.experts.down_proj``;
* shared experts ``mlp.shared_experts.linear_fc{1,2}.weight`` ← ``mlp.shared_experts.{gate,up,down}_proj.weight``;
* the MoE layer's norm stays ``pre_mlp_layernorm.weight`` under TE too (megatron-core fuses it only into a dense
  MLP's fc1);
* MLA: ``self_attention.linear_q_down_proj`` ← ``q_a_proj``, ``linear_q_up_proj`` ← ``q_b_proj`` (or
  ``linear_q_proj`` ← ``q_proj`` without a q LoRA rank), ``linear_kv_down_proj`` ← ``kv_a_proj_with_mqa``,
  ``linear_kv_up_proj`` ← ``kv_b_proj``, ``linear_proj`` ← ``o_proj``; the latent norms ``q_layernorm`` /
  ``kv_layernorm`` ← ``q_a_layernorm`` / ``kv_a_layernorm`` (TE: ``linear_q_up_proj.layer_norm_weight``,
  ``linear_kv_up_proj.layer_norm_weight``). Per-head layouts ([nope, rope] queries, [nope, v] keys/values, interleaved
  RoPE) are the same on both sides, so nothing is permuted.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from vime_core.models.families import ArchConfig, ConversionError

_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_GROUPED_EXPERT = re.compile(r"^(.*\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


def _expert_names(m: str, e: int, te: bool) -> tuple[str, str]:
    if te:
        return f"{m}mlp.experts.linear_fc1.weight{e}", f"{m}mlp.experts.linear_fc2.weight{e}"
    base = f"{m}mlp.experts.local_experts.{e}."
    return base + "linear_fc1.weight", base + "linear_fc2.weight"


def moe_to_megatron(src: Any, p: str, m: str, cfg: ArchConfig, te: bool) -> dict[str, torch.Tensor]:
    """One MoE layer's MLP part, HF → Megatron (see the module docstring for the names)."""
    moe, h = cfg.moe, cfg.hidden_size
    e_n, f = moe.num_experts, moe.expert_hidden_size
    out = {m + "pre_mlp_layernorm.weight": src.take(p + "post_attention_layernorm.weight", (h,))}
    out[m + "mlp.router.weight"] = src.take(p + "mlp.gate.weight", (e_n, h))
    if moe.expert_bias:
        out[m + "mlp.router.expert_bias"] = src.take(p + "mlp.gate.e_score_correction_bias", (e_n,))
    fused = p + "mlp.experts.gate_up_proj" in src.left  # transformers' in-memory layout
    if fused:
        gate_up = src.take(p + "mlp.experts.gate_up_proj", (e_n, 2 * f, h))
        down = src.take(p + "mlp.experts.down_proj", (e_n, h, f))
    for e in range(e_n):
        fc1, fc2 = _expert_names(m, e, te)
        if fused:
            out[fc1], out[fc2] = gate_up[e], down[e]
            continue
        q = f"{p}mlp.experts.{e}."
        gate, up = src.take(q + "gate_proj.weight", (f, h)), src.take(q + "up_proj.weight", (f, h))
        out[fc1] = torch.cat([gate, up], dim=0)
        out[fc2] = src.take(q + "down_proj.weight", (h, f))
    if moe.shared_expert_hidden_size:
        fs, q = moe.shared_expert_hidden_size, p + "mlp.shared_experts."
        gate, up = src.take(q + "gate_proj.weight", (fs, h)), src.take(q + "up_proj.weight", (fs, h))
        out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[m + "mlp.shared_experts.linear_fc2.weight"] = src.take(q + "down_proj.weight", (h, fs))
    return out


def moe_to_hf(src: Any, p: str, m: str, cfg: ArchConfig, te: bool) -> dict[str, torch.Tensor]:
    """Inverse of :func:`moe_to_megatron`, always to the checkpoint's per-expert names (what vLLM loads)."""
    moe, h = cfg.moe, cfg.hidden_size
    e_n, f = moe.num_experts, moe.expert_hidden_size
    out = {p + "post_attention_layernorm.weight": src.take(m + "pre_mlp_layernorm.weight", (h,))}
    out[p + "mlp.gate.weight"] = src.take(m + "mlp.router.weight", (e_n, h))
    if moe.expert_bias:
        out[p + "mlp.gate.e_score_correction_bias"] = src.take(m + "mlp.router.expert_bias", (e_n,))
    for e in range(e_n):
        fc1, fc2 = _expert_names(m, e, te)
        q = f"{p}mlp.experts.{e}."
        out[q + "gate_proj.weight"], out[q + "up_proj.weight"] = torch.split(src.take(fc1, (2 * f, h)), [f, f])
        out[q + "down_proj.weight"] = src.take(fc2, (h, f))
    if moe.shared_expert_hidden_size:
        fs, q = moe.shared_expert_hidden_size, p + "mlp.shared_experts."
        gate, up = torch.split(src.take(m + "mlp.shared_experts.linear_fc1.weight", (2 * fs, h)), [fs, fs])
        out[q + "gate_proj.weight"], out[q + "up_proj.weight"] = gate, up
        out[q + "down_proj.weight"] = src.take(m + "mlp.shared_experts.linear_fc2.weight", (h, fs))
    return out


def _mla_pairs(cfg: ArchConfig, te: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(HF suffix, Megatron suffix, shape)`` of one MLA attention part (see the module docstring)."""
    mla, h, nh = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    a = "self_attention."
    pairs = [("input_layernorm.weight", "input_layernorm.weight", (h,))]
    if mla.q_lora_rank:
        r = mla.q_lora_rank
        q_norm = a + ("linear_q_up_proj.layer_norm_weight" if te else "q_layernorm.weight")
        pairs += [
            ("self_attn.q_a_proj.weight", a + "linear_q_down_proj.weight", (r, h)),
            ("self_attn.q_a_layernorm.weight", q_norm, (r,)),
            ("self_attn.q_b_proj.weight", a + "linear_q_up_proj.weight", (nh * qk, r)),
        ]
    else:
        pairs.append(("self_attn.q_proj.weight", a + "linear_q_proj.weight", (nh * qk, h)))
    kv = mla.kv_lora_rank
    kv_norm = a + ("linear_kv_up_proj.layer_norm_weight" if te else "kv_layernorm.weight")
    return pairs + [
        ("self_attn.kv_a_proj_with_mqa.weight", a + "linear_kv_down_proj.weight", (kv + mla.qk_rope_head_dim, h)),
        ("self_attn.kv_a_layernorm.weight", kv_norm, (kv,)),
        (
            "self_attn.kv_b_proj.weight",
            a + "linear_kv_up_proj.weight",
            (nh * (mla.qk_nope_head_dim + mla.v_head_dim), kv),
        ),
        ("self_attn.o_proj.weight", a + "linear_proj.weight", (h, nh * mla.v_head_dim)),
    ]


def mla_to_megatron(src: Any, p: str, m: str, cfg: ArchConfig, te: bool) -> dict[str, torch.Tensor]:
    """One layer's multi-latent attention part, HF → Megatron (tensors moved, none reshaped)."""
    return {m + mg: src.take(p + hf, shape) for hf, mg, shape in _mla_pairs(cfg, te)}


def mla_to_hf(src: Any, p: str, m: str, cfg: ArchConfig, te: bool) -> dict[str, torch.Tensor]:
    """Inverse of :func:`mla_to_megatron`."""
    return {p + hf: src.take(m + mg, shape) for hf, mg, shape in _mla_pairs(cfg, te)}


#: tensor-parallel rules of the MoE and MLA names (inserted first into ``megatron_convert.TP_RULES``): TE's grouped
#: expert weights split like the dense fc1/fc2; the MLA projections as the local spec builds them (column-parallel
#: down and up projections, whose outputs megatron-core gathers); routers and correction biases stay replicated
MOE_TP_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"mlp\.experts\.linear_fc1\.weight\d+$"), "gated"),
    (re.compile(r"mlp\.experts\.linear_fc2\.weight\d+$"), "row"),
    (re.compile(r"linear_(q_proj|q_down_proj|q_up_proj|kv_down_proj|kv_up_proj)\.weight$"), "column"),
]


# ---------------------------------------------------------------------------------------------- expert parallel
def expert_of(name: str) -> tuple[str, int, str] | None:
    """``(prefix, expert index, suffix)`` of a routed expert's Megatron tensor name (SequentialMLP's
    ``...local_experts.{e}.<rest>`` or TE's ``...linear_fc1.weight{e}``), else ``None``."""
    m = _LOCAL_EXPERT.match(name)
    if m:
        return m.group(1), int(m.group(2)), m.group(3)
    m = _GROUPED_EXPERT.match(name)
    if m:
        return m.group(1), int(m.group(2)), ""
    return None


def ep_shard(mc: dict[str, torch.Tensor], rank: int, size: int, num_experts: int) -> dict[str, torch.Tensor]:
    """EP rank ``rank``'s tensors of the full Megatron dict ``mc``: every non-expert tensor (replicated over EP) and
    the experts ``rank * E / size`` … ``(rank + 1) * E / size - 1`` under their local indices 0 … ``E / size - 1``
    (megatron-core's contiguous assignment).

    :raises ConversionError: if ``size`` does not divide ``num_experts`` or ``mc`` holds an expert beyond it.
    """
    if num_experts % size:
        raise ConversionError(f"{num_experts} experts do not split over --expert-model-parallel-size {size}")
    per = num_experts // size
    out = {}
    for name, t in mc.items():
        ex = expert_of(name)
        if ex is None:
            out[name] = t
            continue
        prefix, e, suffix = ex
        if e >= num_experts:
            raise ConversionError(f"{name}: expert {e} of {num_experts}")
        if e // per == rank:
            out[f"{prefix}{e - rank * per}{suffix}"] = t
    return out


def ep_unshard(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`ep_shard`: the full dict from every EP rank's (in rank order; the non-expert tensors are
    rank 0's).

    :raises ConversionError: if the ranks hold different tensor names or expert counts.
    """
    names = [sorted(p) for p in parts]
    if any(n != names[0] for n in names):
        raise ConversionError("the EP ranks hold different tensor names")
    out = {}
    for rank, part in enumerate(parts):
        per = 1 + max((ex[1] for ex in map(expert_of, part) if ex is not None), default=-1)
        for name, t in part.items():
            ex = expert_of(name)
            if ex is None:
                if rank == 0:
                    out[name] = t
                continue
            prefix, e, suffix = ex
            out[f"{prefix}{rank * per + e}{suffix}"] = t
    return out

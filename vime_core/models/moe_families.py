"""The mixture-of-experts families of the family registry (:mod:`vime_core.models.families`): Qwen3-MoE and
DeepSeek-V3-style models (multi-latent attention, shared experts, first dense layers, sigmoid routing with a
correction bias). Torch-free, like the registry; imported by :mod:`vime_core.models`, so the families are registered
whenever the registry is read. Their mappings: :mod:`vime_core.trainer.megatron_moe`; docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from vime_core.models.families import (
    ArchConfig,
    ConversionError,
    Features,
    HFConfig,
    ModelFamily,
    UnsupportedFeature,
    _full_attention,
    register_family,
)


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts part of an :class:`~vime_core.models.families.ArchConfig`.

    :ivar num_experts: routed experts ``E``. :ivar top_k: experts per token.
    :ivar expert_hidden_size: one expert's MLP width ``F_e`` (``moe_intermediate_size``).
    :ivar score_function: ``softmax`` (Qwen3-MoE) or ``sigmoid`` (DeepSeek-V3).
    :ivar norm_topk_prob: the top-k weights are renormalised to sum to 1.
    :ivar expert_bias: the router has a correction bias that ranks experts but is no weight (DeepSeek-V3's
        ``e_score_correction_bias``, Megatron's ``expert_bias``).
    :ivar num_groups: expert groups of group-limited routing (``n_group``; ``None``: none).
    :ivar group_topk: groups each token may use (``topk_group``).
    :ivar scaling_factor: the weights' factor (``routed_scaling_factor``; ``None``: 1).
    :ivar shared_expert_hidden_size: width of the shared experts' MLP (0: none).
    :ivar dense_layers: decoder layers (0-based) with a dense MLP of width ``ArchConfig.ffn_hidden_size``.
    """

    num_experts: int
    top_k: int
    expert_hidden_size: int
    score_function: str = "softmax"
    norm_topk_prob: bool = True
    expert_bias: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float | None = None
    shared_expert_hidden_size: int = 0
    dense_layers: tuple[int, ...] = ()

    def mlp_kind(self, layer: int) -> str:
        """``dense`` for :attr:`dense_layers`, else ``moe`` (keys of ``megatron_convert.MLP``)."""
        return "dense" if layer in self.dense_layers else "moe"


@dataclass(frozen=True)
class MLAConfig:
    """Multi-latent attention sizes (DeepSeek-V2/V3).

    :ivar q_lora_rank: rank of the query's low-rank projection (``None``: one full query projection).
    :ivar kv_lora_rank: rank of the compressed key/value latent. :ivar qk_nope_head_dim: per-head q/k width without
        RoPE. :ivar qk_rope_head_dim: per-head q/k width with RoPE (the key's part shared by all heads).
    :ivar v_head_dim: per-head value width.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


def _common(cfg: HFConfig) -> None:
    """What every MoE family refuses alike: an activation other than SiLU, a RoPE type other than default."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedFeature(f"hidden_act {cfg.get('hidden_act')!r}", "hidden_act silu")
    rope_type, rope, _ = cfg.rope()
    if rope_type != "default":
        raise UnsupportedFeature(f"rope_type {rope_type!r}", "rope_type default")
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise UnsupportedFeature("partial_rotary_factor < 1", "rotary embeddings over the whole head")


def _experts(cfg: HFConfig, name: str) -> int:
    """The routed experts: ``name`` or ``num_local_experts`` (what transformers 5.19 writes for both families).

    :raises ConversionError: when neither is there."""
    value = cfg.get(name, cfg.get("num_local_experts"))
    if value is None:
        raise ConversionError(f"the model's config has no {name} (nor num_local_experts)")
    return int(value)


def _read_qwen3_moe(cfg: HFConfig) -> ArchConfig:
    """Qwen3-MoE: Qwen3's attention (q/k RMSNorm, ``head_dim`` of its own) and softmax top-k routing over
    ``num_experts`` experts (``norm_topk_prob``), no shared expert; dense layers where ``mlp_only_layers`` or
    ``decoder_sparse_step`` say."""
    _common(cfg)
    _full_attention(cfg, use_flag=True)
    if cfg.get("attention_bias", False):
        raise UnsupportedFeature("attention_bias", "q/k/v projections without biases")
    layers = int(cfg.require("num_hidden_layers"))
    step = int(cfg.get("decoder_sparse_step", 1))
    only = {int(i) for i in cfg.get("mlp_only_layers", []) or []}
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    heads = int(cfg.require("num_attention_heads"))
    groups = int(cfg.get("num_key_value_heads", heads))
    if heads % groups:
        raise ConversionError(f"{heads} attention heads are not a multiple of {groups} key/value heads")
    hidden = int(cfg.require("hidden_size"))
    _, _, theta = cfg.rope()
    top_k, norm = int(cfg.require("num_experts_per_tok")), bool(cfg.get("norm_topk_prob", False))
    if top_k == 1 and norm:  # megatron-core refuses a softmax over a single logit (zero gradient)
        raise UnsupportedFeature("num_experts_per_tok 1 with norm_topk_prob", "num_experts_per_tok >= 2")
    return ArchConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=int(cfg.get("head_dim", hidden // heads)),
        ffn_hidden_size=int(cfg.get("intermediate_size", 0)),
        vocab_size=int(cfg.require("vocab_size")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=False,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        model_type="qwen3_moe",
        qk_layernorm=True,
        moe=MoEConfig(
            num_experts=_experts(cfg, "num_experts"),
            top_k=top_k,
            expert_hidden_size=int(cfg.require("moe_intermediate_size")),
            score_function="softmax",
            norm_topk_prob=norm,
            dense_layers=dense,
        ),
    )


def _read_deepseek_v3(cfg: HFConfig) -> ArchConfig:
    """DeepSeek-V3-style: multi-latent attention (q/kv LoRA ranks, rope/nope head dims, interleaved RoPE), the first
    ``first_k_dense_replace`` layers dense, then MoE layers of ``n_routed_experts`` experts with sigmoid routing, the
    correction bias, group-limited top-k and ``n_shared_experts`` shared experts."""
    _common(cfg)
    if cfg.get("attention_bias", False):
        raise UnsupportedFeature("attention_bias", "MLA projections without biases")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UnsupportedFeature(
            f"routing {cfg.get('scoring_func')!r}/{cfg.get('topk_method')!r}",
            "scoring_func sigmoid, topk_method noaux_tc",
        )
    if not cfg.get("rope_interleave", True):
        raise UnsupportedFeature("rope_interleave false", "interleaved RoPE (rope_interleave true)")
    top_k = int(cfg.require("num_experts_per_tok"))
    groups, group_topk = int(cfg.get("n_group", 1)), int(cfg.get("topk_group", 1))
    if groups > 1 and top_k // group_topk != 2:
        # transformers ranks a group by its best 2 scores, megatron-core by its best top_k // group_topk
        raise UnsupportedFeature(
            f"group-limited routing with num_experts_per_tok {top_k} / topk_group {group_topk} != 2",
            "num_experts_per_tok / topk_group == 2 when n_group > 1",
        )
    if not cfg.get("norm_topk_prob", True) and top_k > 1:
        raise UnsupportedFeature(
            "norm_topk_prob false", "norm_topk_prob true (megatron-core renormalises sigmoid weights)"
        )
    layers = int(cfg.require("num_hidden_layers"))
    heads = int(cfg.require("num_attention_heads"))
    _, _, theta = cfg.rope()
    mla = MLAConfig(
        q_lora_rank=(int(cfg.get("q_lora_rank")) if cfg.get("q_lora_rank") else None),
        kv_lora_rank=int(cfg.require("kv_lora_rank")),
        qk_nope_head_dim=int(cfg.require("qk_nope_head_dim")),
        qk_rope_head_dim=int(cfg.require("qk_rope_head_dim")),
        v_head_dim=int(cfg.require("v_head_dim")),
    )
    n_shared = int(cfg.get("n_shared_experts", 0) or 0)
    expert_width = int(cfg.require("moe_intermediate_size"))
    return ArchConfig(
        num_layers=layers,
        hidden_size=int(cfg.require("hidden_size")),
        num_attention_heads=heads,
        num_query_groups=heads,
        head_dim=mla.v_head_dim,
        ffn_hidden_size=int(cfg.require("intermediate_size")),
        vocab_size=int(cfg.require("vocab_size")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=False,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        model_type="deepseek_v3",
        qk_layernorm=True,  # q_a_layernorm, kv_a_layernorm
        attention="mla",
        mla=mla,
        moe=MoEConfig(
            num_experts=_experts(cfg, "n_routed_experts"),
            top_k=top_k,
            expert_hidden_size=expert_width,
            score_function="sigmoid",
            norm_topk_prob=True,
            expert_bias=True,
            num_groups=groups if groups > 1 else None,
            group_topk=group_topk if groups > 1 else None,
            scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            shared_expert_hidden_size=n_shared * expert_width,
            dense_layers=tuple(range(min(int(cfg.get("first_k_dense_replace", 0)), layers))),
        ),
    )


#: the MoE families on the Megatron trainer: TP and EP, routing replay; LoRA on experts is not built
MOE_MEGATRON = Features(tp=True, ep=True, routing_replay=True)
#: the torch trainer replays these families' routers (vime_core/trainer/routing_replay.py)
MOE_TORCH = Features(lora=True, routing_replay=True)

QWEN3_MOE = register_family(
    ModelFamily(
        name="Qwen3-MoE",
        model_types=("qwen3_moe",),
        examples="Qwen3-30B-A3B, Qwen3-235B-A22B",
        read_arch=_read_qwen3_moe,
        features={"megatron": MOE_MEGATRON, "torch": MOE_TORCH},
        notes="softmax top-k (norm_topk_prob), router in fp32, q/k RMSNorm; RoPE default; full attention",
    )
)
DEEPSEEK_V3 = register_family(
    ModelFamily(
        name="DeepSeek-V3",
        model_types=("deepseek_v3",),
        examples="DeepSeek-V3-style (tiny configs tested; yarn RoPE not built)",
        read_arch=_read_deepseek_v3,
        features={"megatron": MOE_MEGATRON, "torch": MOE_TORCH},
        notes="MLA (q/kv LoRA ranks, rope/nope dims); shared experts; first dense layers; sigmoid routing with the "
        "correction bias, group-limited top-k; RoPE default",
    )
)

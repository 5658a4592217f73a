"""megatron-core model pieces of the MoE families (:mod:`vime_core.models.moe_families`): their ``TransformerConfig``
fields (router, experts, shared experts, dense layers, MLA sizes), their decoder block spec (megatron-core's MoE
layer with local experts, ``SequentialMLP``, on the local spec; TE's grouped experts on the TE spec), and rollout
routing replay through megatron-core's own facility (``moe_enable_routing_replay``: each ``TopKRouter``'s
``RouterReplay``; :func:`set_replay_routes`). megatron-core is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

import torch

from vime_core.models.families import ArchConfig


def moe_config_fields(arch: ArchConfig, *, aux_loss_coeff: float = 0.0, routing_replay: bool = False) -> dict:
    """The ``TransformerConfig`` fields of ``arch``'s experts and MLA (empty for a dense GQA model).

    Routing as transformers computes it: softmax families with ``norm_topk_prob`` take megatron-core's top-k of the
    logits then a softmax over the k (the same weights: p_i / Σ_topk p); without it the softmax over every expert
    first (``moe_router_pre_softmax``); sigmoid families the correction bias (``moe_router_enable_expert_bias``, kept
    as loaded: ``moe_router_bias_update_rate`` 0), group-limited top-k and ``routed_scaling_factor``. The router
    runs in fp32 (``moe_router_dtype``), tokens are exchanged by all-to-all (expert parallelism), local experts are
    ``SequentialMLP`` (no grouped GEMM without TE).

    :param aux_loss_coeff: ``--moe-aux-loss-coeff``: the load-balancing loss (0: none).
    :param routing_replay: ``--use-rollout-routing-replay``: each router gets a ``RouterReplay``.
    """
    out: dict[str, Any] = {}
    moe = arch.moe
    if moe is not None:
        out.update(
            num_moe_experts=moe.num_experts,
            moe_router_topk=moe.top_k,
            moe_ffn_hidden_size=moe.expert_hidden_size,
            moe_router_score_function=moe.score_function,
            moe_router_pre_softmax=moe.score_function == "softmax" and not moe.norm_topk_prob,
            moe_router_enable_expert_bias=moe.expert_bias,
            moe_router_bias_update_rate=0.0,
            moe_router_num_groups=moe.num_groups,
            moe_router_group_topk=moe.group_topk,
            moe_router_topk_scaling_factor=moe.scaling_factor,
            moe_shared_expert_intermediate_size=moe.shared_expert_hidden_size or None,
            moe_layer_freq=[0 if i in moe.dense_layers else 1 for i in range(arch.num_layers)],
            moe_router_dtype="fp32",
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=float(aux_loss_coeff),
            moe_enable_routing_replay=bool(routing_replay),
        )
    if arch.attention == "mla":
        mla = arch.mla
        out.update(
            multi_latent_attention=True,
            q_lora_rank=mla.q_lora_rank,
            kv_lora_rank=mla.kv_lora_rank,
            qk_head_dim=mla.qk_nope_head_dim,
            qk_pos_emb_head_dim=mla.qk_rope_head_dim,
            v_head_dim=mla.v_head_dim,
            rope_type="rope",
            rotary_base=arch.rope_theta,
            kv_channels=None,
        )
    return out


def megatron_core_without_te() -> None:
    """Two gaps of megatron-core 0.16.1 without Transformer Engine (0.19 has neither), closed where present: its fp32
    router GEMM names ``te_general_gemm``, defined only when TE imports (``NameError`` at the first MoE forward):
    defined as ``None`` here, which selects the plain ``torch.mm`` path; and its MLA layer believes TE is there
    (``HAVE_TE`` true, ``TELinear`` a placeholder: ``isinstance() arg 2 must be a type``): told it is not. No-op
    elsewhere."""
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if getattr(mla, "HAVE_TE", False) and not isinstance(getattr(mla, "TELinear", None), type):
        mla.HAVE_TE = False


def transformer_config_class(arch: ArchConfig) -> Any:
    """megatron-core's ``MLATransformerConfig`` for multi-latent attention, else ``TransformerConfig``."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig if arch.attention == "mla" else TransformerConfig


def moe_block_spec(config: Any, te: bool, core_attention: Any = None) -> Any:
    """The decoder block spec of an MoE/MLA model: megatron-core's layer specs per layer (dense layers where
    ``config.moe_layer_freq`` has 0), local spec (``SequentialMLP`` experts) or TE's; ``core_attention`` (the local
    spec's SDPA module) replaces the core attention of every layer.

    :param config: the model's ``TransformerConfig`` (:func:`moe_config_fields`).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    megatron_core_without_te()
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    if core_attention is not None:
        for spec in {id(s): s for s in block.layer_specs}.values():
            spec.submodules.self_attention.submodules.core_attention = core_attention
    return block


def routers(model: Any) -> dict[int, Any]:
    """The model's ``TopKRouter`` modules by 0-based decoder layer (``layer_number - 1``)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return {int(m.layer_number) - 1: m for m in model.modules() if isinstance(m, TopKRouter)}


def set_replay_routes(model: Any, routes: torch.Tensor | None) -> None:
    """Make every router of ``model`` route its tokens as ``routes`` says (megatron-core's ``RouterReplay``, action
    ``REPLAY_FORWARD``, which gathers the router's own scores at the given experts; a layer recomputed in the
    backward pass replays the same ids), or route live again (``None``).

    :param routes: ``[layers, N, top_k]`` int64 expert ids of the ``N`` tokens the routers see, in their order
        (:func:`vime_core.trainer.routing_replay.megatron_routes`).
    :raises RuntimeError: if the model was built without ``moe_enable_routing_replay``.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for layer, router in routers(model).items():
        replay = getattr(router, "router_replay", None)
        if replay is None:
            raise RuntimeError(f"layer {layer}: the router has no RouterReplay (moe_enable_routing_replay is off)")
        replay.clear_indices()
        if routes is None:
            replay.clear_router_replay_action()
            continue
        replay.set_target_indices(routes[layer].to(router.weight.device))
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

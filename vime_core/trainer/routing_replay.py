"""Rollout routing replay (R3) on the ``torch`` trainer: every MoE router of a Hugging Face model routes each token to
the experts the engine routed it to, with the gate weights computed from the trainer's own router scores.

A forward hook on each router (transformers' ``Qwen3MoeTopKRouter``, ``DeepseekV3TopkRouter``:
:data:`REPLAY_GATES`) replaces the router's top-k choice with the recorded one and recomputes the gate weights as the
router would for those experts; the model's code is left as it is. The routes of a forward pass are laid out like its
tokens (:func:`packed_routes`, :func:`padded_routes`) and stay set until the next pass's, so a gradient-checkpointed
layer recomputed during the backward pass replays the same routes. Algorithm: Ma et al., "Stabilizing MoE
Reinforcement Learning by Aligning Training and Inference Routers" (arXiv 2510.11370); docs/routing_replay.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from vime_core.types import Sample, check_routed_experts, sample_name

#: no recorded route: the router's own choice (each sample's last token, padding)
NO_ROUTE = -1


def _softmax_topk_weights(router: torch.nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE: softmax over every expert in fp32, the chosen experts' probabilities, renormalised over
    them with ``norm_topk_prob``, cast back to the logits' dtype (transformers' ``Qwen3MoeTopKRouter.forward``)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, idx)
    if router.norm_topk_prob:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.to(logits.dtype)


def _sigmoid_topk_weights(router: torch.nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3: the chosen experts' sigmoid scores (the correction bias only ranks experts, it is not a weight),
    renormalised with ``norm_topk_prob``, times ``routed_scaling_factor`` (``DeepseekV3TopkRouter.forward``)."""
    weights = logits.sigmoid().gather(1, idx)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


#: router class name → the gate weights of given experts from the router's logits (``[N, E]``) and ``[N, K]`` ids
REPLAY_GATES: dict[str, Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "Qwen3MoeTopKRouter": _softmax_topk_weights,
    "DeepseekV3TopkRouter": _sigmoid_topk_weights,
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class RoutingReplayError(ValueError):
    """A model whose routers cannot replay routes, or routes that do not fit the model or the batch."""


def moe_shape(config: Any) -> tuple[int, int, int]:
    """``(decoder layers, experts per token, routed experts)`` of an HF MoE config (``num_experts`` or
    ``n_routed_experts``).

    :raises RoutingReplayError: for a config without experts.
    """
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k:
        raise RoutingReplayError(
            f"--use-rollout-routing-replay needs an MoE model; model_type {getattr(config, 'model_type', '?')!r} has "
            "no routed experts (num_experts / n_routed_experts, num_experts_per_tok)"
        )
    return int(config.num_hidden_layers), int(top_k), int(experts)


class RoutingReplay:
    """The replay hooks of one model (:meth:`of` installs them once per model).

    :ivar routes: ``[layers, N, top_k]`` int64 expert ids of the current forward pass's ``N`` token positions (in the
        order the routers see them), :data:`NO_ROUTE` where the router chooses itself; ``None``: every router routes
        live. Kept until :meth:`set_routes` replaces it (a checkpointed layer's recomputation replays it too).
    :ivar chosen: ``{layer: [N, top_k] expert ids}`` the routers used in the last forward pass (what the experts were
        called with).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers, self.top_k, self.num_experts = moe_shape(model.config)
        self.routes: torch.Tensor | None = None
        self.chosen: dict[int, torch.Tensor] = {}
        self.routers: dict[int, torch.nn.Module] = {}
        for name, module in model.named_modules():
            cls = type(module).__name__
            if cls in REPLAY_GATES:
                match = _LAYER.search(name)
                if match is None:
                    raise RoutingReplayError(f"router {name} ({cls}): no layer index in its name")
                layer = int(match.group(1))
                self.routers[layer] = module
                module.register_forward_hook(self._hook(layer, REPLAY_GATES[cls]))
            elif cls.endswith(("Router", "TopkRouter")) or (cls.endswith("Gate") and hasattr(module, "top_k")):
                raise RoutingReplayError(
                    f"router {name} ({cls}) of model_type {model.config.model_type!r}: routing replay on the torch "
                    f"trainer knows {', '.join(sorted(REPLAY_GATES))}"
                )
        if not self.routers:
            raise RoutingReplayError(
                f"--use-rollout-routing-replay: model_type {model.config.model_type!r} has no router the torch "
                f"trainer can replay ({', '.join(sorted(REPLAY_GATES))})"
            )

    @classmethod
    def of(cls, model: torch.nn.Module) -> RoutingReplay:
        """The model's replay hooks, installed on first use.

        :raises RoutingReplayError: for a model without replayable routers (see :data:`REPLAY_GATES`).
        """
        replay = getattr(model, "_vime_routing_replay", None)
        if replay is None:
            replay = cls(model)
            model._vime_routing_replay = replay  # type: ignore[assignment]
        return replay

    def set_routes(self, routes: torch.Tensor | None) -> None:
        """Replay ``routes`` (``[layers, N, top_k]``, see :attr:`routes`) from the next forward pass on."""
        if routes is not None and (
            routes.dim() != 3 or routes.shape[0] != self.layers or routes.shape[2] != self.top_k
        ):
            raise RoutingReplayError(
                f"routes of shape {tuple(routes.shape)}, expected [{self.layers}, tokens, {self.top_k}]"
            )
        self.routes = routes
        self.chosen = {}

    def _hook(self, layer: int, gate: Callable[..., torch.Tensor]) -> Callable[..., Any]:
        def replay(router: torch.nn.Module, args: Any, output: tuple[torch.Tensor, ...]) -> Any:
            logits, _, live = output
            if self.routes is None:
                self.chosen[layer] = live.detach()
                return None
            idx = self.routes[layer].to(live.device)
            if idx.shape[0] != logits.shape[0]:
                raise RoutingReplayError(
                    f"layer {layer}: routes for {idx.shape[0]} token positions, but the router sees {logits.shape[0]}"
                )
            idx = torch.where(idx[:, :1] == NO_ROUTE, live, idx)
            self.chosen[layer] = idx
            return logits, gate(router, logits, idx), idx

        return replay


def sample_routes(sample: Sample, layers: int, top_k: int, num_experts: int) -> torch.Tensor:
    """The sample's recorded routes as ``[len(tokens), layers, top_k]`` int64: its ``routed_experts`` and a
    :data:`NO_ROUTE` row for the last token (never forwarded by the engine; its position predicts nothing).

    :raises ValueError: naming the sample: no routes, the wrong shape (:func:`~vime_core.types.check_routed_experts`),
        or an expert id outside ``[0, num_experts)``.
    """
    routes = check_routed_experts(sample, layers, top_k)
    if routes.size and (int(routes.min()) < 0 or int(routes.max()) >= num_experts):
        raise ValueError(
            f"{sample_name(sample)}: routed_experts holds expert ids {int(routes.min())}..{int(routes.max())}, "
            f"the model has {num_experts} experts"
        )
    last = np.full((1, layers, top_k), NO_ROUTE, dtype=np.int64)
    return torch.from_numpy(np.concatenate([routes.astype(np.int64), last]))


def packed_routes(samples: list[Sample], replay: RoutingReplay) -> torch.Tensor:
    """``[layers, total, top_k]`` routes of the packed row of ``samples`` (:func:`vime_core.trainer.packing.
    packed_batch`: the samples' tokens one after another)."""
    rows = [sample_routes(s, replay.layers, replay.top_k, replay.num_experts) for s in samples]
    return torch.cat(rows).permute(1, 0, 2).contiguous()


def padded_routes(samples: list[Sample], seq_len: int, replay: RoutingReplay) -> torch.Tensor:
    """``[layers, batch * seq_len, top_k]`` routes of the left-padded batch of ``samples``
    (:func:`vime_core.trainer.padding.left_padded_batch`), :data:`NO_ROUTE` on the padding."""
    out = torch.full((len(samples), seq_len, replay.layers, replay.top_k), NO_ROUTE, dtype=torch.long)
    for i, s in enumerate(samples):
        out[i, seq_len - len(s.tokens) :] = sample_routes(s, replay.layers, replay.top_k, replay.num_experts)
    return out.reshape(-1, replay.layers, replay.top_k).permute(1, 0, 2).contiguous()


def megatron_routes(
    samples: list[Sample], seq_len: int, layers: int, top_k: int, num_experts: int, tp_rank: int = 0, tp_size: int = 1
) -> torch.Tensor:
    """``[layers, N, top_k]`` routes of the megatron trainer's right-padded ``[batch, seq_len]`` batch, in the order
    megatron-core's routers see its tokens: sequence-major (``[seq_len, batch]`` flattened), this TP rank's slice of
    the sequence under sequence parallelism (``tp_size`` > 1; ``seq_len`` a multiple of it). Positions without a
    recorded route (each sample's last token, padding) get experts ``0 … top_k - 1``: megatron-core's replay has no
    live fall-back, and those positions predict no trained token.

    :raises ValueError: naming a sample whose routes are missing or do not fit (:func:`sample_routes`).
    """
    out = torch.arange(top_k, dtype=torch.long).expand(seq_len, len(samples), layers, top_k).clone()
    for i, s in enumerate(samples):
        routes = sample_routes(s, layers, top_k, num_experts)[:-1]  # the last token's NO_ROUTE row stays 0 … k-1
        out[: routes.shape[0], i] = routes
    if tp_size > 1:
        per = seq_len // tp_size
        out = out[tp_rank * per : (tp_rank + 1) * per]
    return out.reshape(-1, layers, top_k).permute(1, 0, 2).contiguous()

"""Expert-parallel bookkeeping of the ``megatron`` trainer for MoE families: the up-front checks of
``--expert-model-parallel-size`` and ``--use-rollout-routing-replay`` against the model and the trainer's GPUs, the
correction-bias buffers loaded and saved like parameters, and the gather of every EP rank's experts under their global
indices (the inverse of :func:`vime_core.trainer.megatron_moe.ep_shard`, across GPUs). Docs: docs/models.md,
"Expert parallelism".
"""

from __future__ import annotations

from typing import Any

import torch

from vime_core.models.families import ArchConfig
from vime_core.trainer.megatron_moe import expert_of


def check_expert_parallel(arch: ArchConfig, ep: int, tp: int, world: int) -> int:
    """``--expert-model-parallel-size`` checked against the model and the trainer's ranks.

    :return: ``ep``.
    :raises ValueError: naming the flag: EP < 1, EP > 1 for a dense model, EP not dividing the experts, or EP × TP
        not dividing the trainer's GPUs (megatron-core places each expert-TP × EP group inside the world).
    """
    if ep < 1:
        raise ValueError(f"--expert-model-parallel-size must be >= 1, got {ep}")
    if ep == 1:
        return ep
    if arch.moe is None:
        raise ValueError(f"--expert-model-parallel-size {ep}: model_type {arch.model_type!r} has no experts")
    if arch.moe.num_experts % ep:
        raise ValueError(
            f"--expert-model-parallel-size {ep} must divide the model's {arch.moe.num_experts} experts "
            f"(model_type {arch.model_type!r})"
        )
    if world % (ep * tp):
        raise ValueError(
            f"--expert-model-parallel-size {ep} × --tensor-model-parallel-size {tp} must divide the trainer's "
            f"{world} GPUs"
        )
    return ep


def check_routing_replay(arch: ArchConfig, on: bool) -> None:
    """:raises ValueError: ``--use-rollout-routing-replay`` for a model without experts."""
    if on and arch.moe is None:
        raise ValueError(f"--use-rollout-routing-replay needs an MoE model; model_type {arch.model_type!r} has none")


def expert_bias_buffers(gpt: Any) -> dict[str, torch.Tensor]:
    """The routers' correction biases (``...mlp.router.expert_bias``: buffers, not parameters) by Megatron name."""
    return {n: b for n, b in gpt.named_buffers() if n.endswith("mlp.router.expert_bias")}


def gather_experts(local: dict[str, torch.Tensor], ep: int, group: Any) -> dict[str, torch.Tensor]:
    """Every EP rank's experts under their global indices (``rank × E / ep + local``), from this rank's ``local``
    tensors (experts under local indices; the other tensors, replicated over EP, kept as they are). Collective over
    the EP ``group``: every rank calls it with the same names."""
    import torch.distributed as dist

    out: dict[str, torch.Tensor] = {}
    per = 1 + max((ex[1] for ex in map(expert_of, local) if ex is not None), default=-1)
    for name, t in local.items():
        ex = expert_of(name)
        if ex is None:
            out[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(ep)]
        dist.all_gather(parts, t.contiguous(), group=group)
        prefix, e, suffix = ex
        for rank, part in enumerate(parts):
            out[f"{prefix}{rank * per + e}{suffix}"] = part
    return out


def float16_module(config: Any, gpt: Any) -> Any:
    """megatron-core's ``Float16Module`` around ``gpt`` with the routers' correction biases kept exactly as loaded:
    ``Float16Module`` casts every buffer to bf16 and the router turns its bias back to fp32 only at its next
    forward, rounded; the bias ranks experts, where one ulp can flip a near-tie."""
    from megatron.core.transformer.module import Float16Module

    saved = {n: b.detach().float().clone() for n, b in expert_bias_buffers(gpt).items()}
    module = Float16Module(config, gpt)
    for name, bias in expert_bias_buffers(gpt).items():
        bias.data = saved[name].to(bias.device)
    return module

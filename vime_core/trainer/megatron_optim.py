"""Megatron optimizer helpers shared by the ``megatron`` policy trainer and its critic
(:mod:`vime_core.trainer.megatron_critic`): the optimizer step after gradient finalisation, and saving/restoring a
Megatron (distributed) optimizer's state. megatron-core is imported inside :func:`megatron_step` only.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch


def megatron_step(ddp: Any, optimizer: Any, label: str) -> float:
    """Finalize a Megatron DDP model's gradients (DP reduce-scatter, SP layernorm grads across TP), clip and step its
    optimizer; the gradient norm before clipping.

    :param label: names the norm in the error, e.g. ``"grad norm"`` or ``"critic grad norm"``.
    :raises FloatingPointError: ``non-finite <label> <norm>`` on a non-finite gradient norm (Megatron skips the
        update).
    """
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ddp])
    ok, grad_norm, _ = optimizer.step()
    grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
    if not ok or not math.isfinite(grad_norm):
        raise FloatingPointError(f"non-finite {label} {grad_norm}")
    return grad_norm


def save_optimizer(optimizer: Any, path: Path, rank: int) -> None:
    """A Megatron optimizer's state: ``optimizer.pt`` (rank 0) and ``optimizer_param_state.pt`` (collective)."""
    if rank == 0:
        torch.save(optimizer.state_dict(), path / "optimizer.pt")
    optimizer.save_parameter_state(str(path / "optimizer_param_state.pt"))


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside a Megatron (chained) optimizer."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer]) if hasattr(o, "optimizer")]


def load_optimizer(optimizer: Any, path: Path) -> None:
    """Restore what :func:`save_optimizer` wrote, after the model weights were loaded (the fp32 main parameters are
    re-read from them); without ``optimizer.pt`` (saved before the first step) the optimizer starts fresh."""
    optimizer.reload_model_params()  # fp32 main params <- the loaded bf16 weights
    inner = inner_optimizers(optimizer)
    if (path / "optimizer.pt").exists():
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
        # megatron-core 0.19.2 with torch's AdamW (no apex / TE): load_state_dict puts the common "step" into
        # every parameter state, which load_parameter_state then looks for in the file (KeyError 'step');
        # set it aside around that call
        steps = [(st, st.pop("step")) for o in inner for st in getattr(o, "state", {}).values() if "step" in st]
        try:
            optimizer.load_parameter_state(str(path / "optimizer_param_state.pt"))
        finally:
            for st, step in steps:
                st["step"] = step
    else:
        for o in inner:
            o.state.clear()  # torch optimizers re-create per-parameter state on their next step

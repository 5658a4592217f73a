"""PPO with a critic: generalised advantage estimation and the clipped value loss (pure functions).

GAE: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
arXiv:1506.02438. Value clipping: the PPO reference implementation (OpenAI baselines ``ppo2``; Engstrom et al.
2020, arXiv:2005.12729 §3), with slime's semantics (``value_loss_function``: ``max`` of the clipped and unclipped
squared errors, no ``1/2`` factor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vime_core.algorithms.policy_loss import aggregate, masked_mean, zero_masked


def gae(
    token_rewards: Sequence[float],
    values: Sequence[float],
    *,
    gamma: float,
    lambd: float,
    mask: Sequence[int] | None = None,
) -> tuple[list[float], list[float]]:
    """Advantages and returns of one response by GAE(γ, λ).

    ``δ_t = r_t + γ·V_{t+1} - V_t`` (``V`` after the last step is 0: the episode ends with the response),
    ``A_t = δ_t + γλ·A_{t+1}``, ``R_t = A_t + V_t`` (the value target).

    With ``mask``, only trained tokens (``mask == 1``) are time steps: the recursion skips masked tokens (tool output
    is not an action), their rewards and values are ignored, and they get advantage and return ``0.0``.

    :param token_rewards: ``[T]`` per-token rewards (outcome on the last trained token, optional KL shaping).
    :param values: ``[T]`` critic values ``V_t`` (old critic, no grad).
    :param gamma: discount in ``[0, 1]``.
    :param lambd: GAE λ in ``[0, 1]``.
    :param mask: ``[T]`` 0/1 loss mask (default: all ones).
    :return: ``(advantages [T], returns [T])`` as float lists.
    :raises ValueError: on length mismatches.
    """
    n = len(token_rewards)
    mask = [1] * n if mask is None else list(mask)
    if len(values) != n or len(mask) != n:
        raise ValueError(f"gae: {n} rewards, {len(values)} values, {len(mask)} mask entries")
    adv, ret = [0.0] * n, [0.0] * n
    next_value, next_adv = 0.0, 0.0
    for t in reversed(range(n)):
        if not mask[t]:
            continue
        delta = token_rewards[t] + gamma * next_value - values[t]
        next_adv = delta + gamma * lambd * next_adv
        adv[t], ret[t] = next_adv, next_adv + values[t]
        next_value = values[t]
    return adv, ret


@dataclass
class ValueLossOutput:
    """Scalar value loss (differentiable) and detached metrics ``value_loss``, ``value_clipfrac``."""

    loss: torch.Tensor
    metrics: dict[str, float]


def value_loss(
    values: list[torch.Tensor],
    old_values: list[torch.Tensor],
    returns: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    *,
    value_clip: float = 0.2,
    per_token: bool = False,
) -> ValueLossOutput:
    """Clipped value loss ``max((V_clip - R)², (V - R)²)`` with ``V_clip = V_old + clip(V - V_old, -c, c)``.

    :param values: one ``[T_i]`` float tensor of current critic values per sample (requires grad).
    :param old_values: one ``[T_i]`` tensor of the critic's values at rollout time (no grad).
    :param returns: one ``[T_i]`` tensor of value targets (from :func:`gae`).
    :param loss_masks: one ``[T_i]`` 0/1 tensor per sample.
    :param value_clip: ``c`` (same units as the values), ``> 0``.
    :param per_token: aggregate like :func:`vime_core.algorithms.policy_loss.policy_loss` (per-sample mean
        by default, token mean over the batch when True).
    :return: the loss and metrics ``value_loss`` and ``value_clipfrac`` (trained-token fraction with
        ``|V - V_old| > c``). Masked tokens never contribute (no NaN even if their values are).
    """
    values, old_values, returns = (zero_masked(x, loss_masks) for x in (values, old_values, returns))
    token_losses, clipped = [], []
    for v, old, ret in zip(values, old_values, returns, strict=True):
        v_clip = old + (v - old).clamp(-value_clip, value_clip)
        token_losses.append(torch.maximum((v_clip - ret).square(), (v - ret).square()))
        clipped.append(((v.detach() - old).abs() > value_clip).float())
    loss = aggregate(token_losses, loss_masks, per_token)
    with torch.no_grad():
        metrics = {
            "value_loss": float(loss.detach()),
            "value_clipfrac": float(masked_mean(torch.cat(clipped), torch.cat(loss_masks))) if clipped else 0.0,
        }
    return ValueLossOutput(loss=loss, metrics=metrics)

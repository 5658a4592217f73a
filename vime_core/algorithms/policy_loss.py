"""The policy loss shared by every trainer backend (one implementation; backends only supply log-probs).

PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with slime's asymmetric clip
(``eps_clip_high``, DAPO "clip-higher", Yu et al. 2025, arXiv:2503.14476).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyLossOutput:
    """Scalar loss (differentiable) and detached metrics (floats)."""

    loss: torch.Tensor
    metrics: dict[str, float]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask == 1``; 0 (not NaN) when the mask is empty. Shapes must match."""
    denom = mask.sum()
    return (values * mask).sum() / denom.clamp(min=1)


def ppo_clip_token_losses(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate ``max(-A·ρ, -A·clip(ρ, 1-ε, 1+ε_high))`` with ``ρ = exp(logp - old_logp)``.

    :param log_probs: ``[T]`` float32 current-policy log-probs (requires grad).
    :param old_log_probs: ``[T]`` behaviour-policy log-probs (no grad).
    :param advantages: ``[T]`` per-token advantages.
    :return: ``(losses [T], clipped [T] as float 0/1)``.
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + high)
    losses = torch.maximum(unclipped, clipped)
    return losses, (clipped > unclipped).float()


def policy_loss(
    log_probs: list[torch.Tensor],
    old_log_probs: list[torch.Tensor],
    advantages: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    per_token: bool = False,
    rollout_log_probs: list[torch.Tensor] | None = None,
) -> PolicyLossOutput:
    """PPO-clip policy loss over a batch of samples.

    Each list has one ``[response_length]`` tensor per sample (float32; masks 0/1).

    Aggregation: by default each sample's masked token-mean, averaged over samples (slime's default); with
    ``per_token=True`` the masked mean over all tokens of the batch. Samples whose mask is all zero contribute 0
    to the sum and are not counted in the sample average.

    Metrics: ``pg_loss``, ``pg_clipfrac``, ``ppo_kl`` (mean ``old - new``), and, when ``rollout_log_probs`` is
    given, ``train_rollout_logprob_abs_diff`` (mean ``|trainer - engine|`` log-prob over trained tokens).
    """
    token_losses, clip_flags = [], []
    for lp, old, adv in zip(log_probs, old_log_probs, advantages):
        tl, cf = ppo_clip_token_losses(lp, old, adv, eps_clip=eps_clip, eps_clip_high=eps_clip_high)
        token_losses.append(tl)
        clip_flags.append(cf)
    masks = loss_masks
    if per_token:
        loss = masked_mean(torch.cat(token_losses), torch.cat(masks))
    else:
        per_sample = [masked_mean(tl, m) for tl, m in zip(token_losses, masks)]
        counted = sum(1 for m in masks if m.sum() > 0)
        loss = torch.stack(per_sample).sum() / max(counted, 1)
    all_mask = torch.cat(masks)
    with torch.no_grad():
        metrics = {
            "pg_loss": float(loss.detach()),
            "pg_clipfrac": float(masked_mean(torch.cat(clip_flags), all_mask)),
            "ppo_kl": float(masked_mean(torch.cat(old_log_probs) - torch.cat(log_probs).detach(), all_mask)),
        }
        if rollout_log_probs is not None:
            diff = (torch.cat(log_probs).detach() - torch.cat(rollout_log_probs)).abs()
            metrics["train_rollout_logprob_abs_diff"] = float(masked_mean(diff, all_mask))
    return PolicyLossOutput(loss=loss, metrics=metrics)

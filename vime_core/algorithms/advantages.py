"""Advantage estimators. Each maps per-group rewards to per-token advantages.

Built-ins register through :func:`vime_core.builtins.vime_register_advantage_estimators`; a plugin adds its own
through the same hook.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it computes: registering the estimators (a flag check) needs none
    import torch

GRPO_EPS = 1e-6


def grpo_advantages(rewards: Sequence[float], *, normalize_std: bool = True, eps: float = GRPO_EPS) -> list[float]:
    """Group-relative advantages of one group (GRPO, Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300).

    ``A_i = (r_i - mean(r)) / (std(r) + eps)`` with the unbiased (Bessel-corrected) std, as slime computes it;
    ``normalize_std=False`` gives Dr.GRPO's ``A_i = r_i - mean(r)`` (Liu et al. 2025, arXiv:2503.20783).

    :param rewards: the group's scalar rewards (one per sample, ``n >= 1``).
    :return: one advantage per reward. All-equal rewards give exact zeros; a group of one gives ``[0.0]``.
    :raises ValueError: on an empty group or a NaN/inf reward.
    """
    if len(rewards) == 0:
        raise ValueError("a group needs at least one reward")
    if any(not math.isfinite(r) for r in rewards):
        raise ValueError(f"non-finite reward in group: {list(rewards)}")
    if max(rewards) == min(rewards):  # also a group of one; the float mean of equal values can be off by an ulp
        return [0.0] * len(rewards)
    import torch

    r = torch.tensor(rewards, dtype=torch.float64)
    centered = r - r.mean()
    if normalize_std:
        std = r.std(unbiased=True)
        centered = centered / (std + eps)
    return [float(x) for x in centered]


def broadcast_to_tokens(advantage: float, response_length: int) -> list[float]:
    """Per-token advantages for an outcome reward: the sample's advantage on every response token."""
    return [advantage] * response_length


def _check_rewards(rewards: Sequence[float]) -> None:
    if len(rewards) == 0:
        raise ValueError("a group needs at least one reward")
    if any(not math.isfinite(r) for r in rewards):
        raise ValueError(f"non-finite reward in group: {list(rewards)}")


def rloo_advantages(rewards: Sequence[float]) -> list[float]:
    """Leave-one-out advantages of one group (RLOO, Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740;
    Kool et al. 2019).

    ``A_i = r_i - mean_{j != i}(r_j) = k / (k - 1) · (r_i - mean(r))`` for a group of ``k`` rewards.

    :param rewards: the group's scalar rewards (one per rollout, ``k >= 1``).
    :return: one advantage per reward (float64 arithmetic). A group of one has no baseline: ``[0.0]``;
        all-equal rewards give exact zeros.
    :raises ValueError: on an empty group or a NaN/inf reward.
    """
    _check_rewards(rewards)
    k = len(rewards)
    if k == 1 or max(rewards) == min(rewards):
        return [0.0] * k
    total = math.fsum(rewards)
    return [r - (total - r) / (k - 1) for r in rewards]


def discounted_returns(token_rewards: Sequence[float], mask: Sequence[int], gamma: float) -> list[float]:
    """Per-token discounted return ``G_t = sum_{s >= t} gamma^(n(t, s)) · r_s`` over the trained tokens.

    Only tokens with ``mask == 1`` are time steps: ``n(t, s)`` counts the trained tokens in ``[t, s)`` and the
    rewards of masked tokens (tool output, environment text) are ignored; masked positions get return ``0.0``.
    (slime discounts over every response position; the two agree for single-turn responses and for
    ``gamma == 1``.) REINFORCE (Williams 1992); used by REINFORCE++ (Hu et al. 2025, arXiv:2501.03262).

    :param token_rewards: ``[T]`` per-token rewards (floats).
    :param mask: ``[T]`` loss mask (0/1).
    :param gamma: discount factor in ``[0, 1]``.
    :return: ``[T]`` returns (floats).
    :raises ValueError: on a length mismatch.
    """
    if len(token_rewards) != len(mask):
        raise ValueError(f"{len(token_rewards)} token rewards but {len(mask)} mask entries")
    out = [0.0] * len(mask)
    running = 0.0
    for t in reversed(range(len(mask))):
        if mask[t]:
            running = token_rewards[t] + gamma * running
            out[t] = running
    return out


def outcome_returns(reward: float, mask: Sequence[int], gamma: float) -> list[float]:
    """Discounted return of an outcome reward placed on the last trained token (REINFORCE++, Hu et al. 2025,
    arXiv:2501.03262, Eq. for ``r(s_t, a_t)`` without its KL term).

    Trained token ``t`` gets ``gamma^(k) · reward`` where ``k`` is the number of trained tokens after it; masked
    tokens get ``0.0``; an all-masked response gets all zeros (never NaN).

    :param reward: the sample's scalar reward (finite).
    :param mask: ``[T]`` loss mask (0/1).
    :param gamma: discount factor in ``[0, 1]``.
    :return: ``[T]`` per-token returns.
    """
    rewards = [0.0] * len(mask)
    last = max((i for i, m in enumerate(mask) if m), default=None)
    if last is not None:
        rewards[last] = reward
    return discounted_returns(rewards, mask, gamma)


WHITEN_EPS = 1e-8


def masked_whiten(
    values: list[torch.Tensor], masks: list[torch.Tensor], eps: float = WHITEN_EPS
) -> list[torch.Tensor]:
    """Whiten per-token values over every trained token of a batch, as slime's ``distributed_masked_whiten`` and
    verl's ``masked_whiten`` do (used by REINFORCE++'s global batch normalisation, Hu et al. 2025,
    arXiv:2501.03262, and by ``--normalize-advantages``).

    ``x' = (x - mean) / sqrt(var + eps)`` with mean and unbiased (Bessel-corrected, when there are at least two
    trained tokens) variance taken over the tokens with ``mask == 1``. Masked tokens come back as ``0.0``; a
    batch without trained tokens, or whose trained values are all equal, comes back as exact zeros (never NaN).

    :param values: one ``[T_i]`` float tensor per sample.
    :param masks: one ``[T_i]`` 0/1 tensor per sample.
    :param eps: added to the variance (same units as ``values``²).
    :return: one ``[T_i]`` float32 tensor per sample.
    """
    import torch

    flat = torch.cat([v.double() for v in values]) if values else torch.zeros(0, dtype=torch.float64)
    keep = torch.cat([m.bool() for m in masks]) if masks else torch.zeros(0, dtype=torch.bool)
    picked = flat[keep]
    if picked.numel() == 0 or bool((picked == picked[0]).all()):
        return [torch.zeros_like(v, dtype=torch.float32) for v in values]
    mean = picked.mean()
    var = picked.var(unbiased=picked.numel() >= 2)
    out = torch.where(keep, (flat - mean) / torch.sqrt(var + eps), torch.zeros_like(flat)).float()
    return list(out.split([len(v) for v in values]))

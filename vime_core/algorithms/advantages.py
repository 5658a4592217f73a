"""Advantage estimators. Each maps per-group rewards to per-token advantages.

Built-ins register through :func:`vime_core.builtins.vime_register_advantage_estimators`; a plugin adds its own
through the same hook.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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
    r = torch.tensor(rewards, dtype=torch.float64)
    centered = r - r.mean()
    if len(rewards) == 1:
        return [0.0]
    if normalize_std:
        std = r.std(unbiased=True)
        centered = centered / (std + eps)
    return [float(x) for x in centered]


def broadcast_to_tokens(advantage: float, response_length: int) -> list[float]:
    """Per-token advantages for an outcome reward: the sample's advantage on every response token."""
    return [advantage] * response_length

"""From scored groups to a :class:`RolloutBatch`: the exclusion rule and the advantage estimator, in one place.

:func:`build_batch` runs the group-level estimator (in the loop); :func:`postprocess_advantages` is the batch-level
step (KL reward shaping, whitening) that a trainer backend runs once it has the reference log-probs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from vime_core.algorithms.advantages import discounted_returns, masked_whiten
from vime_core.algorithms.options import BATCH_WHITENED_ESTIMATORS, opt
from vime_core.types import RolloutBatch, Sample

AdvantageFn = Callable[[argparse.Namespace, list[Sample]], list[list[float]]]


def build_batch(
    args: argparse.Namespace, groups: list[list[Sample]], estimator: AdvantageFn, step: int = 0
) -> RolloutBatch:
    """Keep the trainable samples of each group (:meth:`Sample.is_trainable`) and compute their advantages.

    Advantages are computed over the trainable members of a group only: a failed or aborted member is excluded,
    never counted as reward 0. A group with no trainable member contributes nothing.

    :return: the batch; ``metrics`` has ``rollout/num_trained_samples`` and ``rollout/num_excluded_samples``.
    :raises ValueError: if a trainable sample has no reward (from :meth:`Sample.reward_value`).
    """
    samples: list[Sample] = []
    advantages: list[list[float]] = []
    excluded = 0
    for group in groups:
        members = [s for s in group if s.is_trainable()]
        excluded += len(group) - len(members)
        if not members:
            continue
        adv = estimator(args, members)
        if len(adv) != len(members) or any(len(a) != s.response_length for a, s in zip(adv, members, strict=True)):
            raise ValueError(f"advantage estimator {args.advantage_estimator!r} returned wrongly shaped advantages")
        samples.extend(members)
        advantages.extend(adv)
    metrics = {"rollout/num_trained_samples": float(len(samples)), "rollout/num_excluded_samples": float(excluded)}
    return RolloutBatch(samples=samples, advantages=advantages, step=step, metrics=metrics)


def postprocess_advantages(
    args: argparse.Namespace,
    samples: list[Sample],
    advantages: list[torch.Tensor],
    *,
    kl: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The batch-level step after the group-level estimator; a trainer backend runs it at the start of a train step,
    once it has the reference log-probs (every backend calls this one function).

    1. **KL reward shaping** (``--kl-coef β``, REINFORCE++ estimators only): the per-token rewards become
       ``r_t - β·KL_t``, so the discounted KL return ``-β · sum_{s >= t} γ^(n(t, s)) KL_s`` (trained tokens only,
       :func:`~vime_core.algorithms.advantages.discounted_returns`) is added to each token's advantage (Hu et al.
       2025, arXiv:2501.03262 Eq. 3; Ouyang et al. 2022, arXiv:2203.02155).
    2. **Batch whitening** (``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, or any estimator with
       ``--normalize-advantages``): :func:`~vime_core.algorithms.advantages.masked_whiten` over every trained token
       of the batch (REINFORCE++'s global advantage normalisation).

    :param samples: the batch's samples (their ``loss_mask`` selects the trained tokens).
    :param advantages: one ``[response_length]`` float tensor per sample, from the estimator.
    :param kl: one ``[response_length]`` per-token KL tensor per sample (behaviour policy vs reference,
        :func:`~vime_core.algorithms.kl.approx_kl` with ``--kl-loss-type``); required when ``--kl-coef != 0``.
    :return: ``(advantages, metrics)``; metrics ``adv/mean`` and ``adv/std`` (trained tokens, after the step) and,
        with shaping, ``adv/kl_shaping_mean`` (mean per-token KL penalty ``β·KL``).
    :raises ValueError: if ``--kl-coef`` is non-zero and ``kl`` is missing.
    """
    masks = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples]
    out = [a.float() for a in advantages]
    metrics: dict[str, float] = {}
    beta, gamma = opt(args, "kl_coef"), opt(args, "gamma")
    if beta != 0.0:
        if kl is None:
            raise ValueError("--kl-coef is non-zero but no per-token KL was given to postprocess_advantages")
        shaped = []
        for a, k, s in zip(out, kl, samples, strict=True):
            penalty = (-beta * k.double()).tolist()
            shaped.append(a + torch.tensor(discounted_returns(penalty, s.loss_mask, gamma), dtype=torch.float32))
        out = shaped
        penalties = (beta * torch.cat(kl).double())[torch.cat(masks).bool()]
        metrics["adv/kl_shaping_mean"] = float(penalties.mean()) if penalties.numel() else 0.0
    if opt(args, "advantage_estimator") in BATCH_WHITENED_ESTIMATORS or opt(args, "normalize_advantages"):
        out = masked_whiten(out, masks)
    if out:
        picked = torch.cat(out)[torch.cat(masks).bool()].double()
        if picked.numel():
            metrics["adv/mean"] = float(picked.mean())
            metrics["adv/std"] = float(picked.std(unbiased=False))
    return out, metrics

"""From scored groups to a :class:`RolloutBatch`: the exclusion rule and the advantage estimator, in one place."""

from __future__ import annotations

import argparse
from collections.abc import Callable

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
        if len(adv) != len(members) or any(len(a) != s.response_length for a, s in zip(adv, members)):
            raise ValueError(f"advantage estimator {args.advantage_estimator!r} returned wrongly shaped advantages")
        samples.extend(members)
        advantages.extend(adv)
    metrics = {"rollout/num_trained_samples": float(len(samples)), "rollout/num_excluded_samples": float(excluded)}
    return RolloutBatch(samples=samples, advantages=advantages, step=step, metrics=metrics)

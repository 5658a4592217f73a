"""From scored groups to a :class:`RolloutBatch`: the exclusion rule and the advantage estimator, in one place.

:func:`build_batch` runs the group-level estimator (in the loop); :func:`postprocess_advantages` is the batch-level
step (KL reward shaping, whitening) that a trainer backend runs once it has the reference log-probs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vime_core.algorithms.advantages import discounted_returns, masked_whiten
from vime_core.algorithms.distill import distill_advantages, teacher_and_student_log_probs
from vime_core.algorithms.gae import gae
from vime_core.algorithms.options import BATCH_WHITENED_ESTIMATORS, DISTILL_ESTIMATOR, distill_enabled
from vime_core.config import AlgorithmConfig
from vime_core.config.context import PluginContext
from vime_core.types import RolloutBatch, Sample

AdvantageFn = Callable[[PluginContext, list[Sample]], list[list[float]]]


def build_batch(ctx: PluginContext, groups: list[list[Sample]], estimator: AdvantageFn, step: int = 0) -> RolloutBatch:
    """Keep the trainable samples of each group (:meth:`Sample.is_trainable`) and compute their advantages.

    Advantages are computed over the trainable members of a group only: a failed or aborted member is excluded,
    never counted as reward 0. A group with no trainable member contributes nothing.

    On-policy distillation (``--distill-teacher``, :mod:`vime_core.algorithms.distill`): with any estimator other
    than ``on_policy_distill`` (which is the term alone), ``--distill-coef λ`` times the per-token reverse-KL
    advantage ``logπ_T - logπ_s`` is added to the estimator's output (slime's ``--use-opd``); for ``ppo`` that
    output is the per-token reward, so the term is reward shaping before GAE.

    :param ctx: the run's configuration, passed on to ``estimator`` (a plugin function); the algorithm flags are
        read from ``ctx.algorithm``.
    :return: the batch; ``metrics`` has ``rollout/num_trained_samples`` and ``rollout/num_excluded_samples``, and
        with a teacher ``rollout/distill_reverse_kl`` (mean ``logπ_s - logπ_T`` over the trained tokens, nats).
    :raises ValueError: if a trainable sample has no reward (from :meth:`Sample.reward_value`), or, with a
        teacher, no teacher log-probs.
    """
    cfg = ctx.algorithm
    samples: list[Sample] = []
    advantages: list[list[float]] = []
    excluded = 0
    for group in groups:
        members = [s for s in group if s.is_trainable()]
        excluded += len(group) - len(members)
        if not members:
            continue
        adv = estimator(ctx, members)
        if len(adv) != len(members) or any(len(a) != s.response_length for a, s in zip(adv, members, strict=True)):
            raise ValueError(f"advantage estimator {cfg.advantage_estimator!r} returned wrongly shaped advantages")
        if distill_enabled(cfg) and cfg.advantage_estimator != DISTILL_ESTIMATOR:
            coef = cfg.distill_coef
            terms = [distill_advantages(*teacher_and_student_log_probs(s), s.loss_mask, coef) for s in members]
            adv = [[a + d for a, d in zip(row, term, strict=True)] for row, term in zip(adv, terms, strict=True)]
        samples.extend(members)
        advantages.extend(adv)
    metrics = {"rollout/num_trained_samples": float(len(samples)), "rollout/num_excluded_samples": float(excluded)}
    if distill_enabled(cfg) and samples:
        gaps = [
            s - t
            for smp in samples
            for t, s, m in zip(*teacher_and_student_log_probs(smp), smp.loss_mask, strict=True)
            if m
        ]
        metrics["rollout/distill_reverse_kl"] = sum(gaps) / max(len(gaps), 1)
    return RolloutBatch(samples=samples, advantages=advantages, step=step, metrics=metrics)


def postprocess_advantages(
    cfg: AlgorithmConfig,
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
    beta, gamma = cfg.kl_coef, cfg.gamma
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
    if cfg.advantage_estimator in BATCH_WHITENED_ESTIMATORS or cfg.normalize_advantages:
        out = masked_whiten(out, masks)
    if out:
        picked = torch.cat(out)[torch.cat(masks).bool()].double()
        if picked.numel():
            metrics["adv/mean"] = float(picked.mean())
            metrics["adv/std"] = float(picked.std(unbiased=False))
    return out, metrics


def gae_advantages(
    cfg: AlgorithmConfig,
    samples: list[Sample],
    token_rewards: list[torch.Tensor],
    values: list[torch.Tensor],
    *,
    kl: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
    """The batch-level step of ``--advantage-estimator ppo`` (in place of :func:`postprocess_advantages`): per-token
    rewards and the critic's values → GAE advantages and value targets. Every backend with a critic calls this.

    1. **KL reward shaping** (``--kl-coef β``): ``r_t ← r_t - β·KL_t`` per token (Ouyang et al. 2022,
       arXiv:2203.02155; Stiennon et al. 2020, arXiv:2009.01325); GAE then discounts it.
    2. **GAE(γ, λ)** per sample over its trained tokens (:func:`vime_core.algorithms.gae.gae`, Schulman et al.
       2016, arXiv:1506.02438), ``--gamma`` / ``--lambd``; returns ``R_t = A_t + V_t`` (before any whitening).
    3. **Whitening** with ``--normalize-advantages`` (:func:`~vime_core.algorithms.advantages.masked_whiten`).

    :param samples: the batch's samples (their ``loss_mask`` selects the trained tokens).
    :param token_rewards: one ``[response_length]`` tensor per sample: the ``ppo`` estimator's output (the outcome
        reward on the last trained token, plus any distillation term).
    :param values: one ``[response_length]`` tensor per sample: the critic's values ``V_t`` before the update.
    :param kl: one ``[response_length]`` per-token KL tensor per sample; required when ``--kl-coef != 0``.
    :return: ``(advantages, returns, metrics)``, float32 tensors of each sample's length (masked tokens 0);
        metrics ``adv/mean``, ``adv/std``, ``critic/values_mean``, ``critic/returns_mean`` (trained tokens), and with
        shaping ``adv/kl_shaping_mean``.
    :raises ValueError: if ``--kl-coef`` is non-zero and ``kl`` is missing, or on a length mismatch.
    """
    beta, gamma, lambd = cfg.kl_coef, cfg.gamma, cfg.lambd
    if beta != 0.0 and kl is None:
        raise ValueError("--kl-coef is non-zero but no per-token KL was given to gae_advantages")
    masks = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples]
    advs, rets = [], []
    metrics: dict[str, float] = {}
    for i, (s, r, v) in enumerate(zip(samples, token_rewards, values, strict=True)):
        rewards = r.double()
        if beta != 0.0:
            rewards = rewards - beta * kl[i].double()
        a, ret = gae(rewards.tolist(), v.double().tolist(), gamma=gamma, lambd=lambd, mask=s.loss_mask)
        advs.append(torch.tensor(a, dtype=torch.float32))
        rets.append(torch.tensor(ret, dtype=torch.float32))
    if beta != 0.0 and samples:
        penalties = (beta * torch.cat(kl).double())[torch.cat(masks).bool()]
        metrics["adv/kl_shaping_mean"] = float(penalties.mean()) if penalties.numel() else 0.0
    if cfg.normalize_advantages:
        advs = masked_whiten(advs, masks)
    if samples:
        keep = torch.cat(masks).bool()
        for key, xs in (("adv/mean", advs), ("critic/values_mean", values), ("critic/returns_mean", rets)):
            picked = torch.cat([x.double() for x in xs])[keep]
            if picked.numel():
                metrics[key] = float(picked.mean())
                if key == "adv/mean":
                    metrics["adv/std"] = float(picked.std(unbiased=False))
    return advs, rets, metrics

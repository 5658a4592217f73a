"""Built-in algorithm plugins: advantage estimators and dynamic sampling filters.

Every estimator is ``fn(ctx, group: list[Sample]) -> list[list[float]]`` over the trainable members of one prompt
group (:func:`vime_core.algorithms.batch.build_batch`), one advantage per response token; segments sharing an
``episode_id`` count once and share their rollout's advantage. The REINFORCE++ estimators return the group-level
part only (the batch-level part is :func:`vime_core.algorithms.batch.postprocess_advantages`). The estimators:
docs/algorithms.md, "Advantage estimators".
"""

from __future__ import annotations

from vime_core.algorithms.advantages import grpo_advantages, outcome_returns, rloo_advantages
from vime_core.algorithms.distill import distill_advantages, teacher_and_student_log_probs
from vime_core.algorithms.filters import check_reward_nonzero_std
from vime_core.config.context import takes_context
from vime_core.plugins.hookspecs import hookimpl
from vime_core.types import Sample


def rollout_rewards(reward_key: str | None, group: list[Sample]) -> tuple[list[float], list[int]]:
    """One reward per rollout of ``group`` and, per sample, the index of its rollout.

    :param reward_key: ``--reward-key``, the entry of a dict reward to use (None: the reward is a number).
    :return: ``(rewards, which)`` with ``rewards[which[i]]`` the reward of ``group[i]``'s rollout.
    :raises ValueError: if a reward is missing or NaN (:meth:`Sample.reward_value`), or if the segments of one
        rollout carry different rewards.
    """
    rewards: list[float] = []
    which: list[int] = []
    seen: dict[str, int] = {}
    for s in group:
        r = s.reward_value(reward_key)
        if s.episode_id is None:
            which.append(len(rewards))
            rewards.append(r)
        elif s.episode_id in seen:
            j = seen[s.episode_id]
            if rewards[j] != r:
                raise ValueError(f"episode {s.episode_id!r}: its segments have different rewards {rewards[j]} and {r}")
            which.append(j)
        else:
            seen[s.episode_id] = len(rewards)
            which.append(len(rewards))
            rewards.append(r)
    return rewards, which


def _broadcast(per_rollout: list[float], which: list[int], group: list[Sample]) -> list[list[float]]:
    return [[per_rollout[j]] * s.response_length for j, s in zip(which, group, strict=True)]


@takes_context
def grpo(ctx, group):
    """GRPO (Shao et al. 2024, arXiv:2402.03300): ``(r - mean) / (std + 1e-6)`` over the group's rollouts, broadcast
    to every response token; Dr.GRPO (Liu et al. 2025, arXiv:2503.20783) with ``--disable-grpo-std-normalization``:
    ``r - mean``."""
    cfg = ctx.algorithm
    rewards, which = rollout_rewards(cfg.reward_key, group)
    adv = grpo_advantages(rewards, normalize_std=not cfg.disable_grpo_std_normalization)
    return _broadcast(adv, which, group)


@takes_context
def gspo(ctx, group):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071): GRPO's advantages; the
    difference is the sequence-level importance ratio in the loss, which ``--advantage-estimator gspo`` selects
    (:meth:`vime_core.algorithms.policy_loss.PolicyLossOptions.from_config`)."""
    return grpo(ctx, group)


@takes_context
def rloo(ctx, group):
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): ``r_i - mean_{j != i} r_j`` over the group's rollouts,
    broadcast to every response token. A group of one rollout gets 0."""
    cfg = ctx.algorithm
    rewards, which = rollout_rewards(cfg.reward_key, group)
    return _broadcast(rloo_advantages(rewards), which, group)


@takes_context
def reinforce_plus_plus(ctx, group):
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262), group-level part: the discounted return
    ``γ^(k) · r`` of the outcome reward placed on the last trained token (``k`` = trained tokens after the token;
    ``--gamma``, default 1: ``r`` on every trained token); masked tokens get 0. No baseline: the batch step adds the
    KL-shaped return (``--kl-coef``) and whitens over the whole batch
    (:func:`vime_core.algorithms.batch.postprocess_advantages`).

    :raises ValueError: on a missing/NaN reward.
    """
    cfg = ctx.algorithm
    rewards, which = rollout_rewards(cfg.reward_key, group)
    return [outcome_returns(rewards[j], s.loss_mask, cfg.gamma) for j, s in zip(which, group, strict=True)]


@takes_context
def reinforce_plus_plus_baseline(ctx, group):
    """REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262 v2; OpenRLHF ``reinforce_baseline``), group-level part:
    ``r - mean(r)`` over the group's rollouts (no std division), as the discounted return of the last trained token
    (``--gamma``); masked tokens get 0. The batch step adds the KL-shaped return and whitens over the batch.

    Differs from slime, which adds ``-β·KL_t`` per token instead of its discounted sum (equal only when ``β = 0``).
    """
    cfg = ctx.algorithm
    rewards, which = rollout_rewards(cfg.reward_key, group)
    centered = grpo_advantages(rewards, normalize_std=False)
    return [outcome_returns(centered[j], s.loss_mask, cfg.gamma) for j, s in zip(which, group, strict=True)]


@takes_context
def ppo(ctx, group):
    """PPO with a critic (Ouyang et al. 2022, arXiv:2203.02155; GAE, Schulman et al. 2016, arXiv:1506.02438),
    group-level part: the **per-token rewards** — the raw outcome reward on the last trained token, 0 elsewhere
    (no group baseline: the critic is the baseline). The trainer backend turns them into GAE advantages with its
    critic's values (:func:`vime_core.algorithms.batch.gae_advantages`), after KL shaping (``--kl-coef``).

    :raises ValueError: on a missing/NaN reward.
    """
    cfg = ctx.algorithm
    rewards, which = rollout_rewards(cfg.reward_key, group)
    out = []
    for j, s in zip(which, group, strict=True):
        row = [0.0] * s.response_length
        last = max((i for i, m in enumerate(s.loss_mask) if m), default=None)
        if last is not None:
            row[last] = rewards[j]
        out.append(row)
    return out


@takes_context
def on_policy_distill(ctx, group):
    """On-policy distillation (Agarwal et al. 2024, GKD, arXiv:2306.13649; Thinking Machines Lab 2025, "On-Policy
    Distillation"): the per-token reverse-KL advantage ``λ·(logπ_T - logπ_s)`` of each sampled token, from the
    teacher engines' ``teacher_log_probs`` and the student's sampling-time ``rollout_log_probs``
    (:func:`vime_core.algorithms.distill.distill_advantages`, ``--distill-coef λ``). Rewards are not used.

    :raises ValueError: if a sample has no teacher log-probs (no ``--distill-teacher``).
    """
    coef = ctx.algorithm.distill_coef
    return [distill_advantages(*teacher_and_student_log_probs(s), s.loss_mask, coef) for s in group]


@hookimpl
def vime_register_advantage_estimators(register):
    register("grpo", grpo)
    register("gspo", gspo)
    register("rloo", rloo)
    register("reinforce_plus_plus", reinforce_plus_plus)
    register("reinforce_plus_plus_baseline", reinforce_plus_plus_baseline)
    register("ppo", ppo)
    register("on_policy_distill", on_policy_distill)


@hookimpl
def vime_register_dynamic_sampling_filters(register):
    register("check_reward_nonzero_std", check_reward_nonzero_std)

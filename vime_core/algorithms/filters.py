"""Dynamic sampling filters: which scored groups are kept for training (DAPO, Yu et al. 2025, arXiv:2503.14476 §3.2).

A filter is ``fn(ctx, group: list[Sample]) -> bool`` (True = keep), registered by name through
``vime_register_dynamic_sampling_filters`` and chosen with ``--dynamic-sampling-filter NAME``. The rollout manager
over-samples prompts and refills until enough groups pass (slime's ``--dynamic-sampling-filter-path``).
"""

from __future__ import annotations

from vime_core.config.context import PluginContext, takes_context
from vime_core.types import Sample


@takes_context
def check_reward_nonzero_std(ctx: PluginContext, group: list[Sample]) -> bool:
    """Keep a group iff its rewards are not all equal (DAPO's dynamic sampling: a group whose samples are all right
    or all wrong has zero GRPO advantage everywhere and only dilutes the batch). slime's
    ``check_reward_nonzero_std``.

    Only trainable members count (:meth:`Sample.is_trainable`: failed or aborted samples are excluded, not scored 0),
    with ``--reward-key`` picking a dict reward's entry. A group with fewer than two trainable members has no
    spread and is dropped.

    :param ctx: the run's configuration (``--reward-key``: ``ctx.reward``).
    :param group: the samples of one prompt.
    :return: True to keep the group.
    :raises ValueError: if a trainable member has no reward or a NaN one (from :meth:`Sample.reward_value`).
    """
    key = ctx.reward.reward_key
    rewards = [s.reward_value(key) for s in group if s.is_trainable()]
    return len(rewards) >= 2 and max(rewards) > min(rewards)

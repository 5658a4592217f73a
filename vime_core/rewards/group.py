"""Group rewards: score a whole group (the samples of one prompt) at once (``--group-reward NAME``).

A group reward function is ``async def fn(ctx, group: list[Sample]) -> list[float | dict[str, float]]``, one score
per sample in the order given; it is registered with ``vime_register_group_reward_functions`` and sees only the
group's samples that finished generating (completed or truncated). It is what pairwise-preference and rank-based
rewards need: a score that depends on the other responses to the same prompt.

Built-in: ``rank``: each sample's pairwise win rate within its group under the per-sample ``--reward``.
"""

from __future__ import annotations

import asyncio

from vime_core.config.context import PluginContext, takes_context
from vime_core.rewards.call import call_reward
from vime_core.types import Sample


def win_rates(scores: list[float]) -> list[float]:
    """Pairwise win rate of each score against the others: ``(#lower + 0.5 * #equal) / (n - 1)`` (ties count half;
    a group of one scores 0.5). E.g. ``[1, 0, 0, 1]`` → ``[5/6, 1/6, 1/6, 5/6]``."""
    n = len(scores)
    if n == 1:
        return [0.5]
    return [(sum(o < s for o in scores) + 0.5 * (sum(o == s for o in scores) - 1)) / (n - 1) for s in scores]


@takes_context
async def rank_reward(ctx: PluginContext, group: list[Sample]) -> list[float]:
    """Score every sample with ``--reward`` (its ``--reward-key`` entry for a dict reward), then replace the scores
    by their within-group pairwise win rates (:func:`win_rates`), in [0, 1].

    :raises Exception: whatever the per-sample reward raises (the whole group then fails as ``reward_error``).
    :raises RuntimeError: the context carries no plugins to resolve ``--reward`` with (vime's always does).
    """
    cfg = ctx.reward
    if ctx.plugins is None:
        raise RuntimeError("rank: the plugin context carries no plugins to resolve --reward with")
    fn = ctx.plugins.resolve("reward", cfg.reward)
    raw = await asyncio.gather(*(call_reward(fn, ctx, s, cfg.reward_timeout) for s in group))
    key = cfg.reward_key
    scores = []
    for s, r in zip(group, raw, strict=True):
        if isinstance(r, dict):
            if key not in r:
                raise ValueError(f"rank: sample {s.group_index}/{s.index}: dict reward {sorted(r)} needs --reward-key")
            r = r[key]
        scores.append(float(r))
    return win_rates(scores)

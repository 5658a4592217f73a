"""An ``(args, ...)`` plugin may still call vime's built-in plugin functions with its Namespace during the
deprecation window (a custom generate wrapping the default one, a reward wrapping ``reasoning_gym_reward``, as
examples/multi_agent does): the built-ins map the Namespace back to the run's context."""

import asyncio

import pytest

from vime_core.cli.arguments import default_args
from vime_core.config.context import PluginContext, adapt_legacy, as_context, legacy_args
from vime_core.rewards.math_answer import math_reward
from vime_core.testing.plugin_context import run_config
from vime_core.types import Sample

pytestmark = pytest.mark.unit


def test_the_namespace_vime_hands_out_maps_back_to_its_context():
    cfg = run_config(rollout_batch_size=3)
    ctx = as_context(legacy_args(cfg))
    assert ctx.config is cfg and as_context(ctx) is ctx
    assert ctx.plugin(type(cfg.plugins[0])) is cfg.plugins[0]  # plugin configs included
    with pytest.warns(DeprecationWarning, match="passing an argparse.Namespace"):
        hand_built = as_context(default_args(rollout_batch_size=5))
    assert hand_built.rollout.rollout_batch_size == 5
    with pytest.raises(TypeError, match="got dict"):
        as_context({"rollout_batch_size": 5})


def test_an_old_style_reward_calling_a_builtin_scores_exactly_as_the_builtin():
    async def wrapping(args, sample):  # the (args, ...) form, calling the built-in with its own args
        return await math_reward(args, sample) * 2.0

    with pytest.warns(DeprecationWarning, match="takes \\(args, ...\\)"):
        adapted = adapt_legacy(wrapping, "reward", "wrapping")
    ctx = PluginContext(run_config(math_verify_workers=1))
    right, wrong = Sample(response="The answer is \\boxed{42}", label="42"), Sample(response="\\boxed{41}", label="42")
    assert asyncio.run(math_reward(ctx, right)) == 1.0 and asyncio.run(math_reward(ctx, wrong)) == 0.0
    assert (asyncio.run(adapted(ctx, right)), asyncio.run(adapted(ctx, wrong))) == (2.0, 0.0)

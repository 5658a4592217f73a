"""An old-style plugin, written against vime 0.1's ``(args, ...)`` signatures, still works for one minor version:
through the contract kit, the registry and the observation hooks, each with a DeprecationWarning naming the new
signature (docs/plugins.md, "Migrating from (args, ...)")."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from vime_core import hookimpl
from vime_core.plugins.manager import Plugins
from vime_core.testing import GroupRewardFunctionContract, RewardFunctionContract
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample

pytestmark = pytest.mark.contract


async def legacy_reward(args, sample):
    """vime 0.1 style: reads a framework flag from the Namespace."""
    assert isinstance(args, argparse.Namespace)
    return float(sample.response.strip() == str(sample.label)) + (0.5 if args.reward_key == "bonus" else 0.0)


async def legacy_group_reward(args, group):
    return [float(len(s.response)) + args.rollout_temperature for s in group]


def legacy_filter(args, group):
    return len(group) >= args.n_samples_per_prompt


class LegacyPlugin:
    @staticmethod
    @hookimpl
    def vime_register_reward_functions(register):
        register("legacy", legacy_reward)

    @staticmethod
    @hookimpl
    def vime_register_dynamic_sampling_filters(register):
        register("legacy_filter", legacy_filter)

    @staticmethod
    @hookimpl
    def vime_on_train_step_end(args, step, metrics):
        metrics["legacy/lr"] = args.lr + step


class TestLegacyReward(RewardFunctionContract):
    @pytest.fixture
    def reward_fn(self):
        return legacy_reward

    @pytest.fixture
    def reward_ctx(self):
        return plugin_context(reward_key="bonus")

    @pytest.fixture
    def cases(self):
        return [(Sample(response=" 4 ", label="4"), 1.5), (Sample(response="5", label="4"), 0.5)]


class TestLegacyGroupReward(GroupRewardFunctionContract):
    @pytest.fixture
    def group_reward_fn(self):
        return legacy_group_reward

    @pytest.fixture
    def reward_ctx(self):
        return plugin_context(rollout_temperature=0.25)

    @pytest.fixture
    def group_cases(self):
        return [([Sample(response="a"), Sample(response="bb")], [1.25, 2.25])]


def test_registry_wraps_old_style_functions_once_with_a_deprecation_warning():
    p = Plugins()
    p.pm.register(LegacyPlugin, name="legacy-plugin")
    with pytest.warns(DeprecationWarning) as record:
        p.load()
    messages = sorted(str(w.message) for w in record if "deprecated" in str(w.message))
    assert [m.split(" (")[0] for m in messages if "legacy" in m.split(" (")[0]] == [
        "dynamic_filter 'legacy_filter'",
        "reward 'legacy'",
    ]
    assert any("use async def reward(ctx: PluginContext, sample)" in m for m in messages)
    assert any("use def filter(ctx: PluginContext, group) -> bool" in m for m in messages)
    reward = p.resolve("reward", "legacy")
    assert reward is p.resolve("reward", "legacy")  # wrapped once, at registration
    ctx = plugin_context(reward_key="bonus")
    assert asyncio.run(reward(ctx, Sample(response="4", label="4"))) == 1.5
    keep = p.resolve("dynamic_filter", "legacy_filter")
    assert keep(plugin_context(n_samples_per_prompt=2), [Sample(), Sample()]) is True
    assert keep(plugin_context(n_samples_per_prompt=3), [Sample(), Sample()]) is False


def test_old_style_hook_gets_a_namespace_with_a_deprecation_warning():
    p = Plugins()
    with pytest.warns(DeprecationWarning, match=r"implement vime_on_train_step_end\(ctx, step, metrics\)"):
        p.pm.register(LegacyPlugin, name="legacy-plugin")
    p.load()
    from vime_core.config.context import legacy_args

    ctx = plugin_context(lr=0.5)
    metrics: dict[str, float] = {}
    p.pm.hook.vime_on_train_step_end(ctx=ctx, step=2, metrics=metrics, args=legacy_args(ctx.config))
    assert metrics == {"legacy/lr": 2.5}

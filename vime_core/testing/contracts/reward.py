"""Contracts of reward functions and group reward functions."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

from vime_core.config.context import PluginContext, adapt_legacy, is_legacy
from vime_core.rewards.call import validate_reward
from vime_core.testing.contracts.base import _Contract, adapted
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample


class RewardFunctionContract(_Contract):
    """Contract of ``vime_register_reward_functions`` providers.

    Fixtures to supply: ``reward_fn`` (the async function ``reward(ctx, sample)``) and ``cases``: a list of
    ``(Sample, expected)`` with exact expected values (float, or dict for dict rewards). Optional fixtures:
    ``reward_ctx`` (the :class:`~vime_core.config.context.PluginContext` it is called with; default every flag at its
    default, :func:`vime_core.testing.plugin_context.plugin_context`) and ``error_cases``: samples the reward must
    refuse by raising (a missing label, a malformed row); the rollout manager then marks them failed
    (``reward_error``) instead of scoring them.
    """

    @pytest.fixture
    def reward_ctx(self) -> PluginContext:
        return plugin_context()

    @pytest.fixture
    def error_cases(self) -> list[Sample]:
        return []

    def test_is_async_with_ctx_sample(self, reward_fn: Any) -> None:
        assert inspect.iscoroutinefunction(reward_fn), "a reward function must be `async def reward(ctx, sample)`"
        reward_fn = getattr(reward_fn, "__vime_legacy__", reward_fn)  # the registry's wrapper of an (args, ...) one
        params = list(inspect.signature(reward_fn).parameters)
        if is_legacy(reward_fn):  # the deprecated (args, sample) form still works, with a warning
            with pytest.warns(DeprecationWarning, match=r"async def reward\(ctx: PluginContext, sample\)"):
                adapt_legacy(reward_fn, "reward", "contract")
            params[0] = "ctx"
        assert params[:2] == ["ctx", "sample"], f"parameters must start with (ctx, sample), got {params}"

    def test_exact_values(self, reward_fn: Any, cases: list[tuple[Sample, Any]], reward_ctx) -> None:
        assert cases, "supply at least one (sample, expected) case"
        fn = adapted(reward_fn, "reward")
        for sample, expected in cases:
            got = asyncio.run(fn(reward_ctx, sample))
            assert isinstance(got, (float, int, dict)), f"reward must be a float or dict, got {type(got).__name__}"
            validate_reward(got)  # finite, as the rollout manager requires (else the sample would fail)
            assert got == pytest.approx(expected), f"{sample.response!r}: expected {expected}, got {got}"

    def test_error_cases_raise(self, reward_fn: Any, error_cases: list[Sample], reward_ctx) -> None:
        if not error_cases:
            pytest.skip(f"{type(self).__name__} supplies no error_cases")
        fn = adapted(reward_fn, "reward")
        for sample in error_cases:
            with pytest.raises(Exception):  # noqa: B017 - any exception: the manager classifies it
                asyncio.run(fn(reward_ctx, sample))


class GroupRewardFunctionContract(_Contract):
    """Contract of ``vime_register_group_reward_functions`` providers.

    Fixtures to supply: ``group_reward_fn`` (the async function ``group_reward(ctx, group)``) and ``group_cases``:
    a list of ``(list[Sample], expected)`` where ``expected`` holds one exact score per sample, in order. Optional
    fixture ``reward_ctx`` (a :class:`~vime_core.config.context.PluginContext`).
    """

    @pytest.fixture
    def reward_ctx(self) -> PluginContext:
        return plugin_context()

    def test_is_async_with_ctx_group(self, group_reward_fn: Any) -> None:
        assert inspect.iscoroutinefunction(group_reward_fn), "a group reward must be `async def fn(ctx, group)`"
        group_reward_fn = getattr(
            group_reward_fn, "__vime_legacy__", group_reward_fn
        )  # the registry's wrapper of an (args, ...) one
        params = list(inspect.signature(group_reward_fn).parameters)
        if is_legacy(group_reward_fn):
            with pytest.warns(DeprecationWarning, match=r"async def group_reward\(ctx: PluginContext, group\)"):
                adapt_legacy(group_reward_fn, "group_reward", "contract")
            params[0] = "ctx"
        assert params[:2] == ["ctx", "group"], f"parameters must start with (ctx, group), got {params}"

    def test_exact_values(self, group_reward_fn: Any, group_cases: list[tuple[list[Sample], list[Any]]], reward_ctx):
        assert group_cases, "supply at least one (group, expected) case"
        fn = adapted(group_reward_fn, "group_reward")
        for group, expected in group_cases:
            got = asyncio.run(fn(reward_ctx, list(group)))
            assert isinstance(got, (list, tuple)) and len(got) == len(group), f"one score per sample, got {got!r}"
            assert list(got) == pytest.approx(list(expected)), f"expected {expected}, got {got}"

    def test_scores_follow_their_samples(self, group_reward_fn: Any, group_cases, reward_ctx) -> None:
        """Reversing the group reverses the scores: a score belongs to its sample, not to a position."""
        fn = adapted(group_reward_fn, "group_reward")
        for group, expected in group_cases:
            got = asyncio.run(fn(reward_ctx, list(reversed(group))))
            assert list(got) == pytest.approx(list(reversed(expected)))

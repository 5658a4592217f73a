"""Contracts of reward functions and group reward functions."""

from __future__ import annotations

import argparse
import asyncio
import inspect
from typing import Any

import pytest

from vime_core.arguments import complete_args, default_args
from vime_core.rewards.call import validate_reward
from vime_core.testing.contracts.base import _Contract
from vime_core.types import Sample


class RewardFunctionContract(_Contract):
    """Contract of ``vime_register_reward_functions`` providers.

    Fixtures to supply: ``reward_fn`` (the async function) and ``cases``: a list of ``(Sample, expected)`` with
    exact expected values (float, or dict for dict rewards). Optional fixtures: ``reward_args`` (a Namespace; the flags
    it lacks take their defaults, :func:`vime_core.arguments.complete_args`) and
    ``error_cases``: samples the reward must refuse by raising (a missing label, a malformed row); the rollout
    manager then marks them failed (``reward_error``) instead of scoring them.
    """

    @pytest.fixture
    def reward_args(self) -> argparse.Namespace:
        return default_args()

    @pytest.fixture
    def error_cases(self) -> list[Sample]:
        return []

    def test_is_async_with_args_sample(self, reward_fn: Any) -> None:
        assert inspect.iscoroutinefunction(reward_fn), "a reward function must be `async def reward(args, sample)`"
        params = list(inspect.signature(reward_fn).parameters)
        assert params[:2] == ["args", "sample"], f"parameters must start with (args, sample), got {params}"

    def test_exact_values(self, reward_fn: Any, cases: list[tuple[Sample, Any]], reward_args) -> None:
        assert cases, "supply at least one (sample, expected) case"
        for sample, expected in cases:
            got = asyncio.run(reward_fn(complete_args(reward_args), sample))
            assert isinstance(got, (float, int, dict)), f"reward must be a float or dict, got {type(got).__name__}"
            validate_reward(got)  # finite, as the rollout manager requires (else the sample would fail)
            assert got == pytest.approx(expected), f"{sample.response!r}: expected {expected}, got {got}"

    def test_error_cases_raise(self, reward_fn: Any, error_cases: list[Sample], reward_args) -> None:
        if not error_cases:
            pytest.skip(f"{type(self).__name__} supplies no error_cases")
        for sample in error_cases:
            with pytest.raises(Exception):  # noqa: B017 - any exception: the manager classifies it
                asyncio.run(reward_fn(complete_args(reward_args), sample))


class GroupRewardFunctionContract(_Contract):
    """Contract of ``vime_register_group_reward_functions`` providers.

    Fixtures to supply: ``group_reward_fn`` (the async function) and ``group_cases``: a list of
    ``(list[Sample], expected)`` where ``expected`` holds one exact score per sample, in order. Optional fixture
    ``reward_args`` (a Namespace).
    """

    @pytest.fixture
    def reward_args(self) -> argparse.Namespace:
        return default_args()

    def test_is_async_with_args_group(self, group_reward_fn: Any) -> None:
        assert inspect.iscoroutinefunction(group_reward_fn), "a group reward must be `async def fn(args, group)`"
        params = list(inspect.signature(group_reward_fn).parameters)
        assert params[:2] == ["args", "group"], f"parameters must start with (args, group), got {params}"

    def test_exact_values(self, group_reward_fn: Any, group_cases: list[tuple[list[Sample], list[Any]]], reward_args):
        assert group_cases, "supply at least one (group, expected) case"
        for group, expected in group_cases:
            got = asyncio.run(group_reward_fn(complete_args(reward_args), list(group)))
            assert isinstance(got, (list, tuple)) and len(got) == len(group), f"one score per sample, got {got!r}"
            assert list(got) == pytest.approx(list(expected)), f"expected {expected}, got {got}"

    def test_scores_follow_their_samples(self, group_reward_fn: Any, group_cases, reward_args) -> None:
        """Reversing the group reverses the scores: a score belongs to its sample, not to a position."""
        for group, expected in group_cases:
            got = asyncio.run(group_reward_fn(complete_args(reward_args), list(reversed(group))))
            assert list(got) == pytest.approx(list(reversed(expected)))

"""Calling reward functions: the time limit and the value check every caller applies (rollout, evaluation).

A reward is a finite number (``bool``/``int``/``float``, numpy scalars included) or a dict of finite numbers. A
reward function that raises, exceeds its time limit, or returns anything else raises :class:`SampleFailure` here
(or lets its own exception through); the rollout manager then marks the sample ``failed`` with the cause
(:mod:`vime_core.failures`): it is excluded, never scored 0 and never trained as NaN.
"""

from __future__ import annotations

import asyncio
import math
import numbers
from collections.abc import Awaitable, Callable
from typing import Any

from vime_core.config.context import PluginContext
from vime_core.failures import FailureCause, SampleFailure
from vime_core.types import Sample

RewardFn = Callable[[PluginContext, Sample], Awaitable[Any]]
GroupRewardFn = Callable[[PluginContext, list[Sample]], Awaitable[Any]]


def _finite(value: Any, what: str) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, str):
        f = float(value)
        if math.isfinite(f):
            return f
        raise SampleFailure(FailureCause.REWARD_INVALID, f"{what} is {f!r}, not a finite number")
    raise SampleFailure(FailureCause.REWARD_INVALID, f"{what} is {type(value).__name__} {value!r:.200}, not a number")


def validate_reward(value: Any, what: str = "reward") -> float | dict[str, float]:
    """``value`` as a float (or a dict of floats).

    :raises SampleFailure: (``reward_invalid``) NaN, ±inf, ``None``, a string, a dict with a non-string key or a
        non-finite entry, or any other type.
    """
    if isinstance(value, dict):
        if not value:
            raise SampleFailure(FailureCause.REWARD_INVALID, f"{what} is an empty dict")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise SampleFailure(FailureCause.REWARD_INVALID, f"{what} has a non-string key {k!r}")
            out[k] = _finite(v, f"{what}[{k!r}]")
        return out
    return _finite(value, what)


async def _with_timeout(coro: Awaitable[Any], timeout_s: float | None, what: str) -> Any:
    if not timeout_s:
        return await coro
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except asyncio.TimeoutError as e:  # TimeoutError itself on Python 3.11+, not on 3.10
        raise SampleFailure(
            FailureCause.REWARD_TIMEOUT, f"{what} did not return within {timeout_s:g} s (--reward-timeout)"
        ) from e


async def call_reward(
    fn: RewardFn, ctx: PluginContext, sample: Sample, timeout_s: float | None = None
) -> float | dict[str, float]:
    """``await fn(ctx, sample)``, cut at ``timeout_s`` seconds (``None``/0: no limit), then validated.

    The limit cancels the coroutine; a reward that blocks the event loop with CPU work cannot be cut this way and
    must run its work elsewhere (the ``math`` reward verifies in a worker process for this reason).

    :raises SampleFailure: ``reward_timeout`` past the limit, ``reward_invalid`` for a value that is not finite.
    :raises Exception: whatever ``fn`` raises (the caller classifies it as ``reward_error``).
    """
    value = await _with_timeout(fn(ctx, sample), timeout_s, "the reward function")
    return validate_reward(value)


async def call_group_reward(
    fn: GroupRewardFn, ctx: PluginContext, group: list[Sample], timeout_s: float | None = None
) -> list[float | dict[str, float] | SampleFailure]:
    """``await fn(ctx, group)`` (one score per sample, in order), cut at ``timeout_s``, each entry validated.

    :return: one entry per sample of ``group``: its reward, or the :class:`SampleFailure` that excludes it (an
        invalid entry fails only its own sample).
    :raises SampleFailure: ``reward_timeout``; ``reward_error`` when the result is not a list/tuple of
        ``len(group)`` entries.
    :raises Exception: whatever ``fn`` raises (every sample of the group fails with ``reward_error``).
    """
    values = await _with_timeout(fn(ctx, group), timeout_s, "the group reward function")
    if not isinstance(values, (list, tuple)) or len(values) != len(group):
        got = f"{len(values)} entries" if isinstance(values, (list, tuple)) else type(values).__name__
        raise SampleFailure(
            FailureCause.REWARD_ERROR, f"a group reward must return one score per sample ({len(group)}), got {got}"
        )
    out: list[float | dict[str, float] | SampleFailure] = []
    for i, v in enumerate(values):
        try:
            out.append(validate_reward(v, f"group reward entry {i}"))
        except SampleFailure as e:
            out.append(e)
    return out

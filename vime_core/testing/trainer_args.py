"""The argument namespace a trainer backend reads, for tests and benchmarks that build a backend without
``vime run``: every flag at its command-line default, with test-friendly training settings, overridable by keyword."""

from __future__ import annotations

import argparse
from typing import Any

from vime_core.cli.arguments import default_args
from vime_core.config import RunConfig


def trainer_config(**overrides: Any) -> RunConfig:
    """:func:`trainer_args` as the :class:`~vime_core.config.RunConfig` a trainer backend is built with."""
    return RunConfig.from_args(trainer_args(**overrides))


def trainer_args(**overrides: Any) -> argparse.Namespace:
    """A trainer backend's arguments: every flag at its default (:func:`vime_core.cli.arguments.default_args`: plain
    GRPO loss, no KL, no critic, Megatron at one GPU), then torch on CPU in float32 with seed 0, 8-sample micro-batches
    and a large learning rate (1e-2, so one step visibly moves a tiny model) — then ``overrides`` (flag names with
    underscores, e.g. ``lr=1e-4, advantage_estimator="ppo"``)."""
    base: dict[str, Any] = dict(
        seed=0,
        train_device="cpu",
        train_dtype="float32",
        lr=1e-2,
        micro_batch_size=8,
    )
    return default_args(**(base | overrides))

"""Plugins for the fully-async end-to-end test of ``test_loop_modes.py``, loaded by ``vime run`` through dotted paths.

* :func:`reward`: ``digit_fraction``, raising for every sample whose label is ``FAIL_FROM_LABEL`` or more (the prompt
  file's rows ``i`` have label ``i + 2``: rows 6 and later), like a reward service that stopped answering.
* :func:`slow_grpo`: GRPO, ``SLOW_S`` seconds slower per group: a slow trainer, which the producer must not run
  ahead of beyond ``--rollout-inflight-groups``.
"""

from __future__ import annotations

import argparse
import time

from vime_core.builtins.advantages import grpo
from vime_core.plugins.manager import get_plugins
from vime_core.types import Sample

FAIL_FROM_LABEL = 8
SLOW_S = 1.0


async def reward(args: argparse.Namespace, sample: Sample) -> float:
    """``digit_fraction``; raises ``ValueError`` for labels ``FAIL_FROM_LABEL`` and above."""
    if int(sample.label) >= FAIL_FROM_LABEL:
        raise ValueError(f"reward service refused label {sample.label}")
    return await get_plugins().resolve("reward", "digit_fraction")(args, sample)


def slow_grpo(args: argparse.Namespace, group: list[Sample]) -> list[list[float]]:
    """GRPO's advantages after ``SLOW_S`` seconds."""
    time.sleep(SLOW_S)
    return grpo(args, group)

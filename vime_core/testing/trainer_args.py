"""The argument namespace a trainer backend reads, for tests and benchmarks that build a backend without
``vime run``: every training, algorithm and Megatron flag at a test-friendly default, overridable by keyword."""

from __future__ import annotations

import argparse
from typing import Any

from vime_core.algorithms.options import DEFAULTS


def trainer_args(**overrides: Any) -> argparse.Namespace:
    """A trainer backend's arguments: the algorithm defaults of :data:`vime_core.algorithms.options.DEFAULTS`
    (plain GRPO loss, no KL, no critic), torch on CPU in float32 with 8-sample micro-batches and a large learning
    rate (1e-2, so one step visibly moves a tiny model), Megatron at one GPU with SDPA attention — then
    ``overrides`` (flag names with underscores, e.g. ``lr=1e-4, advantage_estimator="ppo"``)."""
    base: dict[str, Any] = dict(
        DEFAULTS,
        seed=0,
        train_num_threads=None,
        train_device="cpu",
        train_dtype="float32",
        gradient_checkpointing=False,
        lr=1e-2,
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_eps=1e-8,
        weight_decay=0.0,
        clip_grad=1.0,
        global_batch_size=None,
        micro_batch_size=8,
        use_rollout_logprobs=False,
        calculate_per_token_loss=False,
        eps_clip=0.2,
        eps_clip_high=None,
        tensor_model_parallel_size=1,
        megatron_attention=None,
    )
    base.update(overrides)
    return argparse.Namespace(**base)

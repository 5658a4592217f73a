"""Learning-rate schedules under Megatron-LM's flag names and formulas, shared by every trainer backend (policy and
critic).

The learning rate of optimizer step ``k`` is :meth:`LRSchedule.lr_at` ``(k)``, Megatron-LM's
``OptimizerParamScheduler.get_lr`` (warm-up, then constant, linear or cosine decay to ``--min-lr``): a function of
the step count alone, which checkpoints save. The formulas: docs/algorithms.md, "Learning-rate schedules". This
module imports no torch (the argument parser imports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vime_core.config import DECAY_STYLES, TrainerConfig


@dataclass(frozen=True)
class LRSchedule:
    """One optimizer's schedule (Megatron-LM's ``OptimizerParamScheduler`` learning-rate part).

    :ivar max_lr: the peak learning rate (``--lr`` / ``--critic-lr``).
    :ivar min_lr: the floor of a decay (``--min-lr``).
    :ivar warmup_iters: optimizer steps of linear warm-up (0: none).
    :ivar decay_iters: the optimizer step at which a decay reaches ``min_lr``.
    :ivar decay_style: ``constant``, ``linear`` or ``cosine``.
    :ivar init_lr: the learning rate at step 0 of a warm-up (``--lr-warmup-init``).
    """

    max_lr: float
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_iters: int = 1
    decay_style: str = "constant"
    init_lr: float = 0.0

    def lr_at(self, num_steps: int) -> float:
        """The learning rate of the optimizer step that follows ``num_steps`` earlier ones (see the module
        docstring).

        :raises ValueError: on an unknown decay style.
        """
        if self.warmup_iters > 0 and num_steps <= self.warmup_iters:
            return self.init_lr + (self.max_lr - self.init_lr) * float(num_steps) / float(self.warmup_iters)
        if self.decay_style == "constant":
            return self.max_lr
        if num_steps > self.decay_iters:
            return self.min_lr
        ratio = float(num_steps - self.warmup_iters) / float(self.decay_iters - self.warmup_iters)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            raise ValueError(f"--lr-decay-style must be one of {', '.join(DECAY_STYLES)}, got {self.decay_style!r}")
        return self.min_lr + coeff * (self.max_lr - self.min_lr)


def total_optimizer_steps(cfg: TrainerConfig) -> int:
    """Optimizer steps of a whole run: ``--num-rollout`` × mini-batches per rollout (``rollout-batch-size ×
    n-samples-per-prompt / --global-batch-size``, 1 without ``--global-batch-size``). A rollout whose excluded
    samples leave fewer mini-batches takes fewer steps, so this is the most the run takes."""
    total = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    gbs = cfg.global_batch_size or total
    return max(1, cfg.num_rollout * math.ceil(total / gbs))


def _schedule(cfg: TrainerConfig, max_lr: float, warmup_iters: int) -> LRSchedule:
    decay = cfg.lr_decay_iters
    return LRSchedule(
        max_lr=float(max_lr),
        min_lr=float(cfg.min_lr),
        warmup_iters=int(warmup_iters),
        decay_iters=int(decay) if decay is not None else total_optimizer_steps(cfg),
        decay_style=cfg.lr_decay_style,
        init_lr=float(cfg.lr_warmup_init),
    )


def policy_lr_schedule(cfg: TrainerConfig) -> LRSchedule:
    """The policy's schedule: peak ``--lr``, warm-up ``--lr-warmup-iters``."""
    return _schedule(cfg, cfg.lr, cfg.lr_warmup_iters)


def critic_lr_schedule(cfg: TrainerConfig) -> LRSchedule:
    """The critic's schedule: peak ``--critic-lr`` (default ``--lr``), warm-up ``--critic-lr-warmup-iters`` (slime's
    flag, default 0); decay style, ``--lr-decay-iters`` and ``--min-lr`` as the policy's."""
    return _schedule(cfg, cfg.critic_lr or cfg.lr, cfg.critic_lr_warmup_iters or 0)


def check_lr_schedule_config(cfg: TrainerConfig) -> None:
    """Check the schedule flags (Megatron's assertions, as errors naming the flags).

    :raises ValueError: negative warm-up or ``--lr-decay-iters < 1``; ``--min-lr`` above ``--lr`` (or
        ``--critic-lr``); ``--lr-warmup-init`` above ``--lr``; a linear/cosine decay whose ``--lr-decay-iters`` is
        not above the warm-up.
    """
    for name in ("lr_warmup_iters", "critic_lr_warmup_iters"):
        if (getattr(cfg, name) or 0) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    decay = cfg.lr_decay_iters
    if decay is not None and decay < 1:
        raise ValueError(f"--lr-decay-iters must be >= 1, got {decay}")
    for label, schedule in (("--lr", policy_lr_schedule(cfg)), ("--critic-lr", critic_lr_schedule(cfg))):
        if not 0.0 <= schedule.min_lr <= schedule.max_lr:
            raise ValueError(f"need 0 <= --min-lr <= {label}, got --min-lr {schedule.min_lr} and {schedule.max_lr}")
        if not 0.0 <= schedule.init_lr <= schedule.max_lr:
            raise ValueError(
                f"need 0 <= --lr-warmup-init <= {label}, got --lr-warmup-init {schedule.init_lr} and {schedule.max_lr}"
            )
        if schedule.decay_style != "constant" and schedule.warmup_iters >= schedule.decay_iters:
            raise ValueError(
                f"--lr-decay-style {schedule.decay_style}: the warm-up ({schedule.warmup_iters} steps) must end "
                f"before --lr-decay-iters ({schedule.decay_iters}; default: every optimizer step of the run)"
            )


def set_lr(optimizer: Any, lr: float) -> None:
    """Write ``lr`` into every parameter group of ``optimizer`` (a torch optimizer, or a Megatron one, whose
    ``param_groups`` are its inner optimizers' groups — what Megatron's own scheduler writes)."""
    for group in optimizer.param_groups:
        group["lr"] = lr

"""Learning-rate schedules (Megatron-LM's ``OptimizerParamScheduler.get_lr`` formulas under its flag names) for the
policy and the critic, with exact values per optimizer step, restored exactly by a resume through the trainer's own
checkpoint save/load."""

from __future__ import annotations

import math

import pytest

from vime_core.cli.arguments import ArgumentError, parse_run_args
from vime_core.config import TrainerConfig
from vime_core.config.context import PluginContext
from vime_core.testing.trainer_args import trainer_config
from vime_core.trainer.lr_schedule import (
    LRSchedule,
    critic_lr_schedule,
    policy_lr_schedule,
    total_optimizer_steps,
)

pytestmark = pytest.mark.unit

BASE = ["--model", "m", "--prompt-data", "d.jsonl"]


def test_constant_with_warmup():
    s = LRSchedule(max_lr=1e-2, warmup_iters=4, decay_iters=100, decay_style="constant")
    assert [s.lr_at(k) for k in range(7)] == [0.0, 0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01]
    s = LRSchedule(max_lr=1e-2, warmup_iters=4, decay_iters=100, init_lr=2e-3)
    assert [s.lr_at(k) for k in (0, 2, 4, 9)] == pytest.approx([2e-3, 6e-3, 1e-2, 1e-2], abs=1e-15)
    assert LRSchedule(max_lr=3e-6).lr_at(0) == 3e-6 and LRSchedule(max_lr=3e-6).lr_at(10**6) == 3e-6


def test_linear_decay_hand_computed():
    # warm-up 2 steps to 1.0, then linear from 1.0 at step 2 to 0.1 at step 8, then 0.1
    s = LRSchedule(max_lr=1.0, min_lr=0.1, warmup_iters=2, decay_iters=8, decay_style="linear")
    got = [s.lr_at(k) for k in range(11)]
    want = [0.0, 0.5, 1.0, 0.85, 0.7, 0.55, 0.4, 0.25, 0.1, 0.1, 0.1]
    assert got == pytest.approx(want, abs=1e-12)


def test_cosine_decay_hand_computed():
    # no warm-up: 0.5·(cos(π·k/4) + 1) between 1.0 and 0.0 over 4 steps
    s = LRSchedule(max_lr=1.0, min_lr=0.0, decay_iters=4, decay_style="cosine")
    got = [s.lr_at(k) for k in range(6)]
    c = math.sqrt(0.5)
    assert got == pytest.approx([1.0, (1 + c) / 2, 0.5, (1 - c) / 2, 0.0, 0.0], abs=1e-12)


def test_flags_defaults_and_schedules_from_args():
    args = parse_run_args(BASE)
    assert (args.lr_warmup_iters, args.lr_warmup_init, args.lr_decay_style, args.lr_decay_iters, args.min_lr) == (
        0,
        0.0,
        "constant",
        None,
        0.0,
    )
    assert policy_lr_schedule(TrainerConfig.from_args(args)) == LRSchedule(
        max_lr=1e-6, decay_iters=10
    )  # 10 rollouts × 1 step
    args = parse_run_args(
        BASE
        + ["--lr", "2e-6", "--lr-warmup-iters", "3", "--lr-decay-style", "cosine", "--min-lr", "1e-7"]
        + [
            "--num-rollout",
            "5",
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "2",
            "--global-batch-size",
            "2",
        ]
        + ["--advantage-estimator", "ppo", "--critic-lr", "1e-5", "--critic-lr-warmup-iters", "7"]
    )
    assert total_optimizer_steps(TrainerConfig.from_args(args)) == 20  # 5 rollouts × 8 samples / 2 per step
    assert policy_lr_schedule(TrainerConfig.from_args(args)) == LRSchedule(2e-6, 1e-7, 3, 20, "cosine", 0.0)
    assert critic_lr_schedule(TrainerConfig.from_args(args)) == LRSchedule(1e-5, 1e-7, 7, 20, "cosine", 0.0)


def test_bad_schedule_flags_are_named():
    with pytest.raises(ArgumentError, match=r"need 0 <= --min-lr <= --lr, got --min-lr 0.01 and 1e-06"):
        parse_run_args(BASE + ["--min-lr", "0.01"])
    with pytest.raises(ArgumentError, match=r"--lr-decay-style linear: the warm-up \(10 steps\) must end before"):
        parse_run_args(BASE + ["--lr-decay-style", "linear", "--lr-warmup-iters", "10"])
    with pytest.raises(ArgumentError, match="--lr-decay-iters must be >= 1, got 0"):
        parse_run_args(BASE + ["--lr-decay-iters", "0"])
    with pytest.raises(ArgumentError, match="--lr-warmup-iters must be >= 0, got -1"):
        parse_run_args(BASE + ["--lr-warmup-iters", "-1"])
    with pytest.raises(
        ArgumentError, match="--critic-lr-warmup-iters has no effect without --advantage-estimator ppo"
    ):
        parse_run_args(BASE + ["--critic-lr-warmup-iters", "2"])
    with pytest.raises(ArgumentError) as e:
        parse_run_args(BASE + ["--lr-decay-style", "step"])
    assert str(e.value) == (
        "argument --lr-decay-style: invalid choice: 'step' (choose from 'constant', 'linear', 'cosine') "
        "(`vime run --help` lists the flags)"
    )
    # the constant style needs no decay horizon: a warm-up longer than the run is allowed
    assert parse_run_args(BASE + ["--lr-warmup-iters", "50"]).lr_warmup_iters == 50


def _ppo_config():
    return trainer_config(
        advantage_estimator="ppo",
        lr=1e-2,
        lr_warmup_iters=2,
        lr_decay_style="cosine",
        lr_decay_iters=6,
        min_lr=1e-3,
        critic_lr=5e-3,
        critic_lr_warmup_iters=3,
        num_critic_only_steps=1,
        num_rollout=5,
        rollout_batch_size=1,
        n_samples_per_prompt=4,
    )


def _train(trainer, steps):
    from tests.support.samples import random_samples
    from vime_core.algorithms.batch import build_batch
    from vime_core.builtins import advantages as est

    out = []
    for step in steps:
        m = trainer.train_step(build_batch(PluginContext(trainer.run_config), [random_samples()], est.ppo, step))
        assert trainer.optimizer.param_groups[0]["lr"] == m["train/lr"] or step == 0
        assert trainer.critic.optimizer.param_groups[0]["lr"] == m["train/critic_lr"]
        out.append((m["train/lr"], m["train/critic_lr"]))
    return out


def test_policy_and_critic_lr_per_step_and_exact_resume(tiny_model_dir, tmp_path):
    from vime_core.trainer.torch_backend import TorchTrainer

    cfg = _ppo_config()
    uninterrupted = _train(TorchTrainer(cfg, tiny_model_dir), range(5))

    def cosine(k, w, d, hi, lo=1e-3):
        return lo + 0.5 * (math.cos(math.pi * (k - w) / (d - w)) + 1.0) * (hi - lo)

    # step 0 trains the critic only (--num-critic-only-steps 1): the policy's first optimizer step is at step 1
    policy = [0.0, 0.0, 5e-3, 1e-2, cosine(3, 2, 6, 1e-2)]  # policy optimizer steps -, 0, 1, 2, 3
    critic = [0.0, 5e-3 / 3, 5e-3 * 2 / 3, 5e-3, cosine(4, 3, 6, 5e-3)]  # critic optimizer steps 0..4
    assert [p for p, _ in uninterrupted] == pytest.approx(policy, abs=1e-15)
    assert [c for _, c in uninterrupted] == pytest.approx(critic, abs=1e-15)
    assert critic[4] == pytest.approx(4e-3, abs=1e-15)  # 1e-3 + 0.5·(cos(π/3) + 1)·4e-3

    first = TorchTrainer(cfg, tiny_model_dir)
    before = _train(first, range(2))
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = TorchTrainer(cfg, tiny_model_dir)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert (resumed.steps_done, resumed.critic.steps_done) == (1, 2)
    after = _train(resumed, range(2, 5))
    assert before + after == uninterrupted  # exactly, step by step

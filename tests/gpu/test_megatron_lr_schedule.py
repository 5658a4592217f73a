"""The learning-rate schedules on the ``megatron`` backend (policy and critic): each optimizer step's learning rate is
the shared schedule's (Megatron's formulas, :mod:`vime_core.trainer.lr_schedule`), written into every parameter
group of Megatron's distributed optimizer, and a resume through the trainer's checkpoint gives exactly the learning
rates of the uninterrupted run.

Marked ``gpu``; run on the lent H200 with megatron-core carried as a wheel (see bench/megatron_step.py).
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("megatron.core")

from tests.gpu.test_megatron_algorithms import _config, _samples  # noqa: E402
from tests.gpu.test_megatron_backend import build_hf  # noqa: E402
from vime_core.algorithms.batch import build_batch  # noqa: E402
from vime_core.builtins import advantages as est  # noqa: E402
from vime_core.config.context import PluginContext  # noqa: E402


def _train(trainer, steps):
    out = []
    for step in steps:
        m = trainer.train_step(build_batch(PluginContext(trainer.run_config), [_samples()], est.ppo, step))
        assert trainer.optimizer.param_groups and all(g["lr"] == m["train/lr"] for g in trainer.optimizer.param_groups)
        assert all(g["lr"] == m["train/critic_lr"] for g in trainer.critic.optimizer.param_groups)
        out.append((m["train/lr"], m["train/critic_lr"]))
    return out


def test_megatron_lr_schedules_and_exact_resume(tmp_path):
    from vime_core.trainer.megatron_backend import MegatronTrainer

    policy = build_hf(tmp_path / "policy", "llama", seed=0)
    config = _config(
        advantage_estimator="ppo",
        lr_warmup_iters=1,
        lr_decay_style="linear",
        lr_decay_iters=5,
        min_lr=1e-5,
        critic_lr=2e-4,
        critic_lr_warmup_iters=2,
    )
    trainer = MegatronTrainer(config, policy)
    uninterrupted = _train(trainer, range(4))
    # policy: warm-up 0 → 1e-4 over 1 step, then linear to 1e-5 at step 5; critic: warm-up over 2 steps to 2e-4
    policy_lr = [0.0, 1e-4, 1e-5 + 0.75 * 9e-5, 1e-5 + 0.5 * 9e-5]
    critic_lr = [0.0, 1e-4, 2e-4, 1e-5 + (1 - 1 / 3) * 1.9e-4]
    assert [p for p, _ in uninterrupted] == pytest.approx(policy_lr, abs=1e-15)
    assert [c for _, c in uninterrupted] == pytest.approx(critic_lr, abs=1e-15)
    assert all(math.isfinite(p) for p, _ in uninterrupted)

    first = MegatronTrainer(config, policy)
    before = _train(first, range(2))
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = MegatronTrainer(config, policy)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert (resumed.steps_done, resumed.critic.steps_done) == (2, 2)
    assert before + _train(resumed, range(2, 4)) == uninterrupted

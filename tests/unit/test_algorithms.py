"""Exact values for the GRPO advantage, the PPO-clip policy loss and batch building."""

import math

import pytest
import torch

from vime_core.algorithms.advantages import grpo_advantages
from vime_core.algorithms.batch import build_batch
from vime_core.algorithms.policy_loss import policy_loss
from vime_core.builtins.advantages import grpo
from vime_core.cli.arguments import default_args
from vime_core.config import RunConfig
from vime_core.config.context import PluginContext
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit


def test_grpo_advantages_hand_computed():
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6)]
    assert grpo_advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx(expected, rel=1e-12)


def test_grpo_all_equal_rewards_give_exact_zeros():
    assert grpo_advantages([0.7, 0.7, 0.7, 0.7]) == [0.0, 0.0, 0.0, 0.0]
    assert grpo_advantages([0.0, 0.0]) == [0.0, 0.0]


def test_grpo_group_of_one_is_zero_not_nan():
    assert grpo_advantages([1.0]) == [0.0]


def test_dr_grpo_no_std_normalisation():
    assert grpo_advantages([1.0, 0.0, 0.0, 0.0], normalize_std=False) == [0.75, -0.25, -0.25, -0.25]


def test_grpo_rejects_nan_and_empty():
    with pytest.raises(ValueError, match="non-finite"):
        grpo_advantages([1.0, float("nan")])
    with pytest.raises(ValueError, match="at least one"):
        grpo_advantages([])


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_policy_loss_hand_computed_per_sample_and_per_token():
    # sample A: ratio 1, A=1 → loss -1 on its single token.
    # sample B: token 1 ratio 1.5, A=2: max(-3.0, -2.4) = -2.4 (clipped); token 2 ratio 0.5, A=-1: max(0.5, 0.8) = 0.8.
    # sample C: fully masked → not counted.
    lp_a = _t([-1.0]).requires_grad_()
    old_b = _t([-1.0, -2.0])
    lp_b = (old_b + _t([math.log(1.5), math.log(0.5)])).requires_grad_()
    lp_c = _t([-0.3]).requires_grad_()
    args = dict(
        log_probs=[lp_a, lp_b, lp_c],
        old_log_probs=[_t([-1.0]), old_b, _t([-0.3])],
        advantages=[_t([1.0]), _t([2.0, -1.0]), _t([5.0])],
        loss_masks=[_t([1]), _t([1, 1]), _t([0])],
    )
    out = policy_loss(**args, eps_clip=0.2)
    assert float(out.loss.detach()) == pytest.approx((-1.0 + (-2.4 + 0.8) / 2) / 2, abs=1e-6)  # -0.9
    assert out.metrics["pg_clipfrac"] == pytest.approx(2 / 3)
    out.loss.backward()
    # d/dlogp of -A·ρ at ρ=1 is -A; sample A's token has weight 1/2 (two counted samples, one token)
    assert float(lp_a.grad[0]) == pytest.approx(-0.5, abs=1e-6)
    # clipped tokens carry no gradient; the masked sample none either
    assert lp_b.grad.tolist() == [0.0, 0.0]
    assert lp_c.grad.tolist() == [0.0]
    out_tok = policy_loss(**{k: [t.detach() for t in v] for k, v in args.items()}, eps_clip=0.2, per_token=True)
    assert float(out_tok.loss) == pytest.approx((-1.0 - 2.4 + 0.8) / 3, abs=1e-6)


def test_policy_loss_asymmetric_clip_high():
    # ratio 1.25, A=1: with eps_clip_high=0.28 the ratio is inside the band → loss -1.25, not clipped
    out = policy_loss([_t([math.log(1.25)])], [_t([0.0])], [_t([1.0])], [_t([1])], eps_clip=0.2, eps_clip_high=0.28)
    assert float(out.loss.detach()) == pytest.approx(-1.25, abs=1e-6)
    assert out.metrics["pg_clipfrac"] == 0.0


def test_policy_loss_reports_train_rollout_logprob_diff():
    out = policy_loss(
        [_t([-1.0, -2.0])], [_t([-1.0, -2.0])], [_t([0.0, 0.0])], [_t([1, 0])], rollout_log_probs=[_t([-1.5, -9.0])]
    )
    assert out.metrics["train_rollout_logprob_abs_diff"] == pytest.approx(0.5)  # masked token ignored


def _sample(group, index, reward, status=Status.COMPLETED, n_resp=3, mask=None):
    s = Sample(group_index=group, index=index, tokens=[1, 2], status=status, reward=reward)
    s.append_response_tokens([5] * n_resp, trainable=True, log_probs=[-0.1] * n_resp, weight_version=0)
    if mask is not None:
        s.loss_mask = mask
    return s


def test_build_batch_excludes_failed_and_masked_and_computes_grpo_over_the_rest():
    ns = default_args(disable_grpo_std_normalization=True)
    g0 = [_sample(0, 0, 1.0), _sample(0, 1, 0.0), _sample(0, 2, None, status=Status.FAILED)]
    g1 = [_sample(1, 0, 1.0, mask=[0, 0, 0]), _sample(1, 1, 0.0, status=Status.ABORTED)]
    batch = build_batch(PluginContext(RunConfig.from_args(ns)), [g0, g1], grpo)
    assert [(s.group_index, s.index) for s in batch.samples] == [(0, 0), (0, 1)]
    assert batch.advantages == [[0.5, 0.5, 0.5], [-0.5, -0.5, -0.5]]
    assert batch.metrics == {"rollout/num_trained_samples": 2.0, "rollout/num_excluded_samples": 3.0}

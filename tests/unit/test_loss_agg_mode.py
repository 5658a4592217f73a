"""``--loss-agg-mode`` (verl's names): token-mean, seq-mean-token-mean and Dr.GRPO's seq-mean-token-sum-norm, each
with exact values, and the flag semantics (the default from ``--calculate-per-token-loss``, the divisor from
``--loss-scale-factor`` or ``--rollout-max-response-len``, contradictions refused naming the flags)."""

from __future__ import annotations

import pytest
import torch

from tests.support.data_parallel import run_dp
from vime_core.algorithms.policy_loss import policy_loss, policy_loss_kwargs
from vime_core.cli.arguments import ArgumentError, parse_run_args
from vime_core.config import AlgorithmConfig
from vime_core.testing.trainer_args import trainer_config

pytestmark = pytest.mark.unit


def _t(v):
    return torch.tensor(v, dtype=torch.float32)


# ratio 1 everywhere: each token's loss is -A. sample 1: three tokens of A = 1; sample 2: two trained tokens of A = 2
# (its third token masked); sample 3: nothing trained (counts in no mode)
BATCH = dict(
    log_probs=[_t([-1.0] * 3), _t([-1.0] * 3), _t([-1.0] * 2)],
    old_log_probs=[_t([-1.0] * 3), _t([-1.0] * 3), _t([-1.0] * 2)],
    advantages=[_t([1.0] * 3), _t([2.0, 2.0, 9.0]), _t([5.0, 5.0])],
    loss_masks=[_t([1, 1, 1]), _t([1, 1, 0]), _t([0, 0])],
)


def test_the_three_modes_exact_values():
    # token-mean: -(1+1+1+2+2) / 5 trained tokens
    assert float(policy_loss(**BATCH, per_token=True).loss) == pytest.approx(-7.0 / 5)
    # seq-mean-token-mean: -(mean 1 + mean 2) / 2 samples with a trained token
    assert float(policy_loss(**BATCH).loss) == pytest.approx(-3.0 / 2)
    # seq-mean-token-sum-norm, L = 4: -(3/4 + 4/4) / 2 — the sum, not the mean, of each sample, over a constant
    assert float(policy_loss(**BATCH, token_sum_norm=4.0).loss) == pytest.approx(-0.875)
    # the constant does not depend on the lengths: the same samples with L = 128
    assert float(policy_loss(**BATCH, token_sum_norm=128.0).loss) == pytest.approx(-7.0 / 256)


def test_dr_grpo_gradient_weighs_every_token_alike():
    lp = [_t([-1.0] * 3).requires_grad_(), _t([-1.0]).requires_grad_()]
    out = policy_loss(
        lp, [_t([-1.0] * 3), _t([-1.0])], [_t([1.0] * 3), _t([1.0])], [_t([1, 1, 1]), _t([1])], token_sum_norm=4.0
    )
    out.loss.backward()
    # d/dlogp of -A·ratio at ratio 1 is -A; each token: -1 / (L · 2 samples), in the long and the short sample alike
    assert lp[0].grad.tolist() == pytest.approx([-0.125] * 3)
    assert lp[1].grad.tolist() == pytest.approx([-0.125])


def _algo(argv: list[str], tmp_path) -> AlgorithmConfig:
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p", "label": "1"}\n')
    return AlgorithmConfig.from_args(parse_run_args(["--model", "m", "--prompt-data", str(data), *argv]))


@pytest.mark.parametrize(
    ("argv", "per_token", "norm"),
    [
        ([], False, None),
        (["--calculate-per-token-loss"], True, None),
        (["--loss-agg-mode", "token-mean"], True, None),
        (["--loss-agg-mode", "seq-mean-token-mean"], False, None),
        (["--loss-agg-mode", "seq-mean-token-sum-norm"], False, 128.0),  # --rollout-max-response-len's default
        (["--loss-agg-mode", "seq-mean-token-sum-norm", "--rollout-max-response-len", "300"], False, 300.0),
        (["--loss-agg-mode", "seq-mean-token-sum-norm", "--loss-scale-factor", "4096"], False, 4096.0),
    ],
)
def test_flags_select_the_mode(argv, per_token, norm, tmp_path):
    kw = policy_loss_kwargs(_algo(argv, tmp_path))
    assert (kw["per_token"], kw["token_sum_norm"]) == (per_token, norm)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--calculate-per-token-loss", "--loss-agg-mode", "seq-mean-token-sum-norm"],
            "--calculate-per-token-loss is --loss-agg-mode token-mean; it contradicts seq-mean-token-sum-norm",
        ),
        (
            ["--loss-scale-factor", "512"],
            "--loss-scale-factor is the divisor of --loss-agg-mode seq-mean-token-sum-norm only",
        ),
        (
            ["--loss-agg-mode", "seq-mean-token-sum-norm", "--loss-scale-factor", "0"],
            "--loss-scale-factor must be a finite number > 0, got 0.0",
        ),
    ],
)
def test_contradictions_are_refused_naming_the_flags(argv, message, tmp_path):
    with pytest.raises(ArgumentError) as e:
        _algo(argv, tmp_path)
    assert str(e.value) == message


def test_dr_grpo_micro_batches_and_two_dp_ranks_give_the_one_rank_gradient():
    """The step's accumulation weighs micro-batches by trained samples: the same gradient however it is split."""
    cfg = trainer_config(lr=0.5, micro_batch_size=1, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=16.0)
    (m1,), (one,) = run_dp(cfg, 1)
    _, two = run_dp(cfg, 2)
    whole = trainer_config(lr=0.5, micro_batch_size=8, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=16.0)
    _, (big,) = run_dp(whole, 1)
    torch.testing.assert_close(big.grads[0], one.grads[0], rtol=1e-12, atol=1e-12)
    for r in two:
        torch.testing.assert_close(r.grads[0], one.grads[0], rtol=1e-12, atol=1e-12)
    other = trainer_config(lr=0.5, micro_batch_size=1)
    _, (mean_mode,) = run_dp(other, 1)
    assert not torch.allclose(mean_mode.grads[0], one.grads[0])  # a different loss than seq-mean-token-mean

"""Data parallelism in the shared RL step (:mod:`vime_core.trainer.rl_step`): which samples each DP rank trains on
(exact indices), and that the DP ranks' averaged gradients equal the one-rank gradient of every optimizer step, for
per-sample and per-token loss normalisation, one and two mini-batches.

The DP ranks here are threads of one process around a small next-token table (``logits = table[previous token]``),
exchanging objects through a barrier (the role ``torch.distributed.all_gather_object`` plays on Megatron's DP group)
and averaging their gradients before the optimizer step, as Megatron's DDP does (``sum / dp_size``).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.data_parallel import run_dp
from vime_core.testing.trainer_args import trainer_config
from vime_core.trainer.rl_step import dp_shard

pytestmark = pytest.mark.unit


def test_dp_shard_indices_are_slimes_strided_split():
    items = list(range(8))
    assert [dp_shard(items, r, 2) for r in range(2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [dp_shard(items, r, 4) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dp_shard(items, 0, 1) == items
    # a mini-batch not divisible by the DP size: the first ranks get one more
    assert [dp_shard(list(range(5)), r, 2) for r in range(2)] == [[0, 2, 4], [1, 3]]
    assert [dp_shard([7], r, 2) for r in range(2)] == [[7], []]
    with pytest.raises(ValueError, match="data-parallel rank 2 is not in 0 … 1"):
        dp_shard(items, 2, 2)


def test_each_rank_trains_its_shard_of_every_minibatch():
    """Global batch 4 of 8 samples at DP=2: mini-batch 0 = samples 0-3, rank 0 trains 0 and 2, rank 1 trains 1 and 3;
    mini-batch 1 = samples 4-7: rank 0 gets 4 and 6, rank 1 gets 5 and 7 (each rank global_batch / dp = 2)."""
    samples = list(range(8))
    gbs, dp = 4, 2
    per_rank = [[dp_shard(samples[i : i + gbs], r, dp) for i in range(0, 8, gbs)] for r in range(dp)]
    assert per_rank == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
@pytest.mark.parametrize("gbs", [None, 4], ids=["one-minibatch", "two-minibatches"])
def test_dp2_gradients_and_metrics_equal_one_rank(per_token, gbs):
    cfg = trainer_config(lr=0.5, global_batch_size=gbs, micro_batch_size=1, calculate_per_token_loss=per_token)
    (m1,), (one,) = run_dp(cfg, 1)
    m2, two = run_dp(cfg, 2)
    steps = 1 if gbs is None else 2
    assert len(one.grads) == steps and all(len(r.grads) == steps for r in two)
    for k in range(steps):
        for r in two:
            torch.testing.assert_close(r.grads[k], one.grads[k], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(two[0].table.data, one.table.data, rtol=1e-12, atol=1e-12)
    # rank 0 trained samples 0, 2 (and 4, 6), rank 1 samples 1, 3 (5, 7), each in length order within its shard
    if gbs is None:
        assert sorted(two[0].trained) == [0, 2, 4, 6] and sorted(two[1].trained) == [1, 3, 5, 7]
    else:
        assert [sorted(two[0].trained[:2]), sorted(two[0].trained[2:])] == [[0, 2], [4, 6]]
        assert [sorted(two[1].trained[:2]), sorted(two[1].trained[2:])] == [[1, 3], [5, 7]]
    assert sorted(one.trained) == list(range(8))
    for key in ("train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/entropy_loss", "train/grad_norm"):
        assert m2[0][key] == pytest.approx(m1[key], rel=1e-12, abs=1e-15), key
        assert m2[1][key] == pytest.approx(m1[key], rel=1e-12, abs=1e-15), key
    key = "train/train_rollout_logprob_abs_diff"
    assert m2[0][key] == pytest.approx(m1[key], rel=1e-12)


def test_dp2_per_token_and_per_sample_gradients_differ():
    """The two normalisations are not the same gradient here (unequal response lengths), so the test above checks
    each one's global denominator, not a shared value."""
    grads = []
    for per_token in (False, True):
        cfg = trainer_config(lr=0.5, micro_batch_size=1, calculate_per_token_loss=per_token)
        grads.append(run_dp(cfg, 2)[1][0].grads[0])
    assert not torch.allclose(grads[0], grads[1])

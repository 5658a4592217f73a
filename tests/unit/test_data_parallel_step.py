"""Data parallelism in the shared RL step (:mod:`vime_core.trainer.rl_step`): which samples each DP rank trains on
(exact indices), and that the DP ranks' averaged gradients equal the one-rank gradient of every optimizer step, for
per-sample and per-token loss normalisation, one and two mini-batches.

The DP ranks here are threads of one process around a small next-token table (``logits = table[previous token]``),
exchanging objects through a barrier (the role ``torch.distributed.all_gather_object`` plays on Megatron's DP group)
and averaging their gradients before the optimizer step, as Megatron's DDP does (``sum / dp_size``).
"""

from __future__ import annotations

import threading

import pytest
import torch

from vime_core.config import AlgorithmConfig, TrainerConfig
from vime_core.testing.trainer_args import trainer_args
from vime_core.trainer.rl_step import dp_shard, rl_train_step
from vime_core.types import RolloutBatch, Sample, Status

pytestmark = pytest.mark.unit

VOCAB = 11


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


class ThreadGroup:
    """``all_gather`` of Python objects between ``n`` threads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n)
        self.slots: list = [None] * n

    def all_gather(self, rank: int, obj):
        self.barrier.wait()
        self.slots[rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class TablePolicy:
    """A :class:`~vime_core.trainer.rl_step.PolicyOps` on CPU: next-token logits ``table[previous token]``
    (``[VOCAB, VOCAB]`` float64), SGD; ``optimizer_step`` averages the gradient over the DP ranks first (Megatron DDP)
    and records it."""

    def __init__(self, args, dp_rank: int = 0, dp_size: int = 1, group: ThreadGroup | None = None) -> None:
        g = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64))
        self.trainer_config = TrainerConfig.from_args(args)
        self.algorithm_config = AlgorithmConfig.from_args(args)
        self.optimizer = torch.optim.SGD([self.table], lr=self.trainer_config.lr)
        self.steps_done = 0
        self.ref_model = None
        self.critic = None
        self.loss_device = torch.device("cpu")
        self.dp_rank, self.dp_size, self.group = dp_rank, dp_size, group
        self.grads: list[torch.Tensor] = []
        self.trained: list[int] = []  # sample indices of every training forward pass, in order

    def dp_all_gather(self, obj):
        return [obj] if self.group is None else self.group.all_gather(self.dp_rank, obj)

    def policy_log_probs(self, samples, with_entropy):
        lps, ents = [], []
        if torch.is_grad_enabled():
            self.trained += [s.index for s in samples]
        for s in samples:
            ids = torch.tensor(s.tokens)
            logp = torch.log_softmax(self.table[ids[:-1]], dim=-1)
            sl = slice(s.prompt_length - 1, None)
            lps.append(logp.gather(-1, ids[1:, None])[:, 0][sl])
            ents.append(-(logp.exp() * logp).sum(-1)[sl])
        return lps, ents if with_entropy else None

    def zero_grad(self) -> None:
        self.table.grad = None

    def optimizer_step(self) -> float:
        grad = torch.zeros_like(self.table) if self.table.grad is None else self.table.grad
        grad = sum(self.dp_all_gather(grad.clone())) / self.dp_size  # Megatron DDP: the mean over DP ranks
        self.table.grad = grad
        self.grads.append(grad.clone())
        self.optimizer.step()
        return float(grad.norm())


def batch() -> RolloutBatch:
    """8 samples: prompts of 3 tokens, responses of 2-6 tokens, some tokens masked out, sample 5 fully masked."""
    g = torch.Generator().manual_seed(3)
    samples, advs = [], []
    for i in range(8):
        s = Sample(
            group_index=i // 4,
            index=i,
            tokens=torch.randint(0, VOCAB, (3,), generator=g).tolist(),
            status=Status.COMPLETED,
        )
        n = 2 + i % 5
        resp = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        s.append_response_tokens(resp, trainable=i != 5, log_probs=[-2.0] * n, weight_version=0)
        if i == 2:
            s.loss_mask[0] = 0
        samples.append(s)
        advs.append([(-1.0) ** i * (1 + i / 10)] * n)
    return RolloutBatch(samples=samples, advantages=advs)


def run_dp(args, dp: int) -> tuple[list[dict], list[TablePolicy]]:
    group = ThreadGroup(dp) if dp > 1 else None
    ranks = [TablePolicy(args, r, dp, group) for r in range(dp)]
    out: list = [None] * dp

    def work(r: int) -> None:
        try:
            out[r] = rl_train_step(ranks[r], batch())  # every rank its own copy of the whole batch, as over Ray
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            out[r] = e
            group.barrier.abort() if group else None

    threads = [threading.Thread(target=work, args=(r,)) for r in range(dp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out, ranks


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
@pytest.mark.parametrize("gbs", [None, 4], ids=["one-minibatch", "two-minibatches"])
def test_dp2_gradients_and_metrics_equal_one_rank(per_token, gbs):
    args = trainer_args(lr=0.5, global_batch_size=gbs, micro_batch_size=1, calculate_per_token_loss=per_token)
    (m1,), (one,) = run_dp(args, 1)
    m2, two = run_dp(args, 2)
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
        args = trainer_args(lr=0.5, micro_batch_size=1, calculate_per_token_loss=per_token)
        grads.append(run_dp(args, 2)[1][0].grads[0])
    assert not torch.allclose(grads[0], grads[1])

"""Data parallelism without processes: DP ranks as threads of one process around a small next-token table
(``logits = table[previous token]``), exchanging objects through a barrier (the role
``torch.distributed.all_gather_object`` plays on Megatron's DP group) and averaging their gradients before the
optimizer step, as Megatron's DDP does (``sum / dp_size``)."""

from __future__ import annotations

import threading

import torch

from vime_core.config import RunConfig
from vime_core.trainer.rl_step import rl_train_step
from vime_core.types import RolloutBatch, Sample, Status

VOCAB = 11


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

    def __init__(
        self, config: RunConfig, dp_rank: int = 0, dp_size: int = 1, group: ThreadGroup | None = None
    ) -> None:
        g = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64))
        self.trainer_config = config.trainer
        self.algorithm_config = config.algorithm
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


def run_dp(config: RunConfig, dp: int) -> tuple[list[dict], list[TablePolicy]]:
    """One RL step of :func:`batch` on ``dp`` thread ranks of :class:`TablePolicy`: each rank's metrics and policy."""
    group = ThreadGroup(dp) if dp > 1 else None
    ranks = [TablePolicy(config, r, dp, group) for r in range(dp)]
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

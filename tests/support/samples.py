"""Fixed random samples for trainer-side tests (critic, LR schedule, the train step's split, garbage collection)."""

from __future__ import annotations

import torch

from vime_core.types import RolloutBatch, Sample, Status


def random_samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(((3, 5), (6, 2), (4, 4), (5, 3))):
        s = Sample(
            index=i,
            tokens=torch.randint(0, 4096, (p,), generator=g).tolist(),
            status=Status.COMPLETED,
            reward=float(i % 2),
        )
        s.append_response_tokens(
            torch.randint(0, 4096, (r,), generator=g).tolist(), trainable=True, log_probs=[-1.0] * r, weight_version=0
        )
        out.append(s)
    out[2].loss_mask[1] = 0  # a context token inside a response
    return out


def small_rl_batch(step: int = 0) -> RolloutBatch:
    """Four completed samples (prompt/response lengths 5/6, 3/9, 8/2, 4/4; token ids from seed 7, below 4096),
    rollout log-probs -2.0, advantages -1/+1 alternating: a train step's input on the tiny model (step split, GC)."""
    g = torch.Generator().manual_seed(7)
    samples, advs = [], []
    for i, (p, r) in enumerate(((5, 6), (3, 9), (8, 2), (4, 4))):
        s = Sample(tokens=torch.randint(0, 4096, (p,), generator=g).tolist(), status=Status.COMPLETED)
        resp = torch.randint(0, 4096, (r,), generator=g).tolist()
        s.append_response_tokens(resp, trainable=True, log_probs=[-2.0] * r, weight_version=0)
        samples.append(s)
        advs.append([1.0 if i % 2 else -1.0] * r)
    return RolloutBatch(samples=samples, advantages=advs, step=step)

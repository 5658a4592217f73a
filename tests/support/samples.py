"""Fixed random samples for trainer-side tests (critic, LR schedule)."""

from __future__ import annotations

import torch

from vime_core.types import Sample, Status


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

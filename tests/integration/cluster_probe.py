"""A trainer backend for the trainer-group test: it trains nothing and reports what ``torch.distributed`` says.

Loaded by name (``--trainer tests.integration.cluster_probe:GroupProbeTrainer``) inside the real trainer-group Ray
actors, so the group's rendezvous, torchrun environment and Gloo initialisation are the ones under test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from vime_core.trainer.base import TrainerBackend


class GroupProbeTrainer(TrainerBackend):
    """``train_step`` all-reduces ``rank + 1`` over the group and returns the sum with this rank's view."""

    NAME = "group-probe"
    DISTRIBUTED = True

    def train_step(self, batch) -> dict[str, float]:
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return {
            "rank": float(dist.get_rank()),
            "world": float(dist.get_world_size()),
            "sum": float(t.item()),
            "gloo": float(dist.get_backend() == "gloo"),
        }

    def named_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ()

    def save_checkpoint(self, path: Path) -> None:
        pass

    def load_checkpoint(self, path: Path) -> None:
        pass

    def save_hf(self, path: Path) -> None:
        pass

"""Debug replay of a run's rollouts (slime's ``--save-debug-rollout-data`` / ``--load-debug-rollout-data``): each
step's groups written with ``torch.save`` and read back instead of generating."""

from __future__ import annotations

from pathlib import Path

import torch

from vime_core.types import Sample


def save_debug_rollout(pattern: str, step: int, groups: list[list[Sample]]) -> Path:
    """``torch.save`` the step's groups to ``pattern.format(rollout_id=step)``."""
    path = Path(pattern.format(rollout_id=step))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"rollout_id": step, "groups": [[s.to_dict() for s in g] for g in groups]}, path)
    return path


def load_debug_rollout(pattern: str, step: int) -> list[list[Sample]]:
    """Inverse of :func:`save_debug_rollout`.

    :raises FileNotFoundError: naming the expected file.
    """
    path = Path(pattern.format(rollout_id=step))
    if not path.exists():
        raise FileNotFoundError(f"--load-debug-rollout-data: {path} not found (rollout_id={step})")
    data = torch.load(path, weights_only=False)
    return [[Sample.from_dict(d) for d in g] for g in data["groups"]]

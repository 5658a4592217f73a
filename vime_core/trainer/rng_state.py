"""A trainer checkpoint's ``trainer_state.pt``, written and read the same way by both trainer backends: the
optimizer-step counts (which place the learning-rate schedules) and the random-number generators' state, so a resumed
run draws what the uninterrupted run would have drawn: Python's :mod:`random`, numpy's global generator, torch's CPU
generator and, once CUDA is initialised, the current CUDA device's generator.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch


def get_rng_state() -> dict[str, Any]:
    """Every generator's state, picklable (``torch.save``).

    :return: ``{"python": random.getstate(), "numpy": numpy.random.get_state(), "torch": CPU ByteTensor}`` and
        ``"cuda"`` (the current device's ByteTensor) when CUDA is initialised in this process.
    """
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any] | torch.Tensor, cuda_state: torch.Tensor | None = None) -> None:
    """Restore what :func:`get_rng_state` returned.

    Checkpoints written before this module saved torch's CPU state alone (a ByteTensor, and the Megatron backend's
    CUDA state as ``cuda_state``); those restore what they hold and leave the other generators as they are. A
    ``"cuda"`` state is restored only where CUDA is available.

    :raises TypeError: ``state`` is neither a dict nor a tensor.
    """
    if isinstance(state, torch.Tensor):
        state = {"torch": state} if cuda_state is None else {"torch": state, "cuda": cuda_state}
    if not isinstance(state, dict):
        raise TypeError(f"RNG state: expected a dict from get_rng_state(), got {type(state).__name__}")
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


TRAINER_STATE_FILE = "trainer_state.pt"


def save_trainer_state(path: Path, trainer: Any) -> None:
    """Write ``path/trainer_state.pt``: ``{"steps_done", "rng"}`` (:func:`get_rng_state`) and, when the trainer has a
    critic, ``"critic_steps_done"`` (its learning-rate schedule's position).

    :param trainer: a trainer backend (``steps_done``, ``critic``: ``None`` or an object with ``steps_done``).
    """
    state = {"steps_done": trainer.steps_done, "rng": get_rng_state()}
    if trainer.critic is not None:
        state["critic_steps_done"] = trainer.critic.steps_done
    torch.save(state, Path(path) / TRAINER_STATE_FILE)


def load_trainer_state(path: Path, trainer: Any) -> None:
    """Restore what :func:`save_trainer_state` wrote into ``trainer`` (its and its critic's ``steps_done``) and the
    generators. Older checkpoints: without ``"critic_steps_done"`` the critic takes the policy's count; a
    ``"cuda_rng"`` entry is torch's CUDA state kept apart (:func:`set_rng_state`).

    :raises FileNotFoundError: ``path`` has no ``trainer_state.pt``.
    """
    ts = torch.load(Path(path) / TRAINER_STATE_FILE, weights_only=False)
    trainer.steps_done = ts["steps_done"]
    if trainer.critic is not None:
        trainer.critic.steps_done = ts.get("critic_steps_done", trainer.steps_done)
    set_rng_state(ts["rng"], ts.get("cuda_rng"))

"""The random-number generators' state a trainer checkpoint saves, so a resumed run draws what the uninterrupted
run would have drawn: Python's :mod:`random`, numpy's global generator, torch's CPU generator and, once CUDA is
initialised, the current CUDA device's generator. Both trainer backends use it (``trainer_state.pt``'s ``"rng"``).
"""

from __future__ import annotations

import random
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

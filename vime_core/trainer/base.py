"""The trainer-backend interface every backend implements (built-in or plugin)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from vime_core.config import RunConfig
from vime_core.types import RolloutBatch


class TrainerBackend(ABC):
    """A policy trainer: consumes :class:`RolloutBatch` es, steps its optimizer, exposes HF-layout weights.

    Members:

    * ``run_config`` — the run's :class:`~vime_core.config.RunConfig` (a plugin backend's own flags:
      ``run_config.plugin(ItsPluginConfig)``); ``trainer_config`` (:class:`~vime_core.config.TrainerConfig`) and
      ``algorithm_config`` (:class:`~vime_core.config.AlgorithmConfig`) are its two sections every backend reads.
    * ``NAME`` — the registered name (``--trainer``).
    * :meth:`train_step` — one RL step on a batch; returns float metrics (``train/*``).
    * :meth:`named_hf_tensors` — the current weights in Hugging Face names/shapes (what vLLM loads).
    * :meth:`save_checkpoint` / :meth:`load_checkpoint` — full state (weights + optimizer) for resume.
    * :meth:`save_hf` — an HF directory loadable by transformers and vLLM.
    * ``dp_rank`` / ``dp_size`` / :meth:`dp_all_gather` — data parallelism as the shared RL step sees it
      (:mod:`vime_core.trainer.rl_step`); a one-rank backend keeps the defaults (rank 0 of 1).
    * ``SUPPORTS_LORA`` — whether the backend trains a LoRA adapter with ``--lora-rank`` > 0 (docs/lora.md); such a
      backend also has ``lora_adapter()`` (the adapter's tensors in PEFT's names and its ``adapter_config.json``
      content, what the weight sync sends) and ``save_adapter(path)`` (``final_adapter/``).
    * ``DISTRIBUTED`` — whether the backend runs as several ranks of one ``torch.distributed`` group (the trainer
      group of :mod:`vime_core.trainer.group` sets torchrun's environment for each rank); ``False``: one rank only.
    """

    NAME: str = ""
    SUPPORTS_LORA: bool = False
    DISTRIBUTED: bool = False
    dp_rank: int = 0
    dp_size: int = 1

    def __init__(self, config: RunConfig, model_path: Path) -> None:
        self.run_config = config
        self.trainer_config = config.trainer
        self.algorithm_config = config.algorithm
        self.model_path = Path(model_path)

    def dp_all_gather(self, obj: Any) -> list[Any]:
        """Every data-parallel rank's ``obj``, in DP-rank order (one rank: ``[obj]``)."""
        return [obj]

    @abstractmethod
    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """Compute the policy loss on ``batch``, backpropagate and step the optimizer once per mini-batch."""

    @abstractmethod
    def named_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` for every weight vLLM needs (tied weights once), on CPU.

        A backend whose weights live on a GPU may take a ``device`` keyword (``None``: where they are); the trainer
        rank passes the weight-sync strategy's ``TENSOR_DEVICE`` (``ipc``/``nccl``: ``None``, no copy to the host).
        """

    @abstractmethod
    def save_checkpoint(self, path: Path) -> None:
        """Save weights and optimizer state under ``path`` (a directory)."""

    @abstractmethod
    def load_checkpoint(self, path: Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""

    @abstractmethod
    def save_hf(self, path: Path) -> None:
        """Write an HF model directory (config, weights, tokenizer) to ``path``."""


def lora_adapter_of(lora: Any) -> tuple[dict[str, torch.Tensor], dict]:
    """What a LoRA backend's ``lora_adapter()`` returns: ``lora.adapter_state()`` (PEFT's adapter tensor names) and
    ``lora.adapter_config()`` (the ``adapter_config.json`` content).

    :raises RuntimeError: ``lora`` is ``None`` (the run trains every weight, ``--lora-rank 0``).
    """
    if lora is None:
        raise RuntimeError("lora_adapter: this run trains every weight (--lora-rank 0)")
    return lora.adapter_state(), lora.adapter_config()

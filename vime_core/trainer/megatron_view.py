"""What the megatron backend's reference model, critic and LoRA ask of the policy trainer: a small protocol, so that
:mod:`~vime_core.trainer.megatron_reference`, :mod:`~vime_core.trainer.megatron_critic` and
:mod:`~vime_core.trainer.megatron_lora` depend on it instead of on
:class:`~vime_core.trainer.megatron_backend.MegatronTrainer` (no import runs back from them to the backend).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from vime_core.trainer.megatron_convert import ArchConfig
from vime_core.types import Sample

if TYPE_CHECKING:
    from vime_core.config import AlgorithmConfig, MegatronConfig, TrainerConfig


class AdapterSwitch(Protocol):
    """The policy's LoRA adapter as the adapter-disabled KL reference sees it
    (:class:`~vime_core.trainer.megatron_lora.MegatronLora` is one)."""

    def set_enabled(self, on: bool) -> None:
        """Switch every adapter on or off (off: the base model)."""


class MegatronPolicy(Protocol):
    """The megatron policy trainer as its reference model, critic and LoRA see it
    (:class:`~vime_core.trainer.megatron_backend.MegatronTrainer` is one): its flags, architecture and model, how it
    builds, loads, gathers and wraps a ``GPTModel``, its parallel layout, and its forward helpers."""

    @property
    def trainer_config(self) -> TrainerConfig:
        """The trainer's flags."""

    @property
    def algorithm_config(self) -> AlgorithmConfig:
        """The algorithm's flags."""

    @property
    def megatron_config(self) -> MegatronConfig:
        """The megatron backend's flags (``--qkv-format``, ``--fp32-lm-head``, ...)."""

    @property
    def model_path(self) -> Path:
        """The policy's HF checkpoint directory."""

    @property
    def rank(self) -> int:
        """This process's global rank."""

    @property
    def tp(self) -> int:
        """The tensor-parallel size."""

    @property
    def tp_rank(self) -> int:
        """This rank's index in its tensor-parallel group."""

    @property
    def tp_group(self) -> Any:
        """The tensor-parallel process group."""

    @property
    def arch(self) -> ArchConfig:
        """The policy's architecture."""

    @property
    def config(self) -> Any:
        """megatron-core's ``TransformerConfig`` of the policy."""

    @property
    def attention(self) -> str:
        """The layer spec's attention: ``te``, ``sdpa`` or ``local``."""

    @property
    def gpt(self) -> Any:
        """The policy ``GPTModel``."""

    @property
    def lora(self) -> AdapterSwitch | None:
        """The policy's LoRA adapter (``None`` without ``--lora-rank``)."""

    def new_gpt(self, *, tied: bool | None = None) -> Any:
        """A new ``GPTModel`` of the policy's architecture on the current GPU (random weights)."""

    def wrap_for_training(self, module: Any, lr: float) -> tuple[Any, Any]:
        """Megatron DDP and optimizer for a ``Float16Module``: ``(ddp, optimizer)``."""

    def read_hf(self, path: Path) -> dict[str, torch.Tensor]:
        """Every tensor of an HF checkpoint directory, ``{HF name: CPU tensor}``."""

    def load_hf_tensors(
        self, hf: dict[str, torch.Tensor], gpt: Any = None, arch: ArchConfig | None = None, skip: tuple = ()
    ) -> None:
        """Copy HF tensors into this rank's Megatron parameters of ``gpt`` (default: the policy)."""

    def megatron_tensors(self, gpt: Any = None, skip: tuple = ()) -> dict[str, torch.Tensor]:
        """Full (TP-gathered, unpadded) Megatron tensors of ``gpt`` (default: the policy), ``skip`` left out."""

    def token_batch(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ``[b, s]`` token ids of ``samples`` and their positions, on the current GPU."""

    def token_log_probs(
        self, ids: torch.Tensor, pos: torch.Tensor, module: Any = None, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[b, s - 1]`` log-probs of each next token under ``module`` (default: the policy), and entropies."""

    def response_slices(self, samples: list[Sample], x: torch.Tensor) -> list[torch.Tensor]:
        """Per sample the ``[response_length]`` slice of a ``[b, s - 1]`` next-token tensor."""

    def sample_log_probs(
        self, samples: list[Sample], module: Any = None, with_entropy: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per sample ``[response_length]`` log-probs under ``module`` (default: the policy), padded or packed as
        ``--qkv-format`` says, and entropies."""

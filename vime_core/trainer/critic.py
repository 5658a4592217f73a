"""The PPO critic of the ``torch`` backend: a value head on a copy of the policy's transformer, with its own optimizer.

``V_t`` is the value of the state *before* response token ``t`` (the prompt plus response tokens ``< t``), read
from the final hidden state at the position that predicts token ``t`` — the same positions whose logits give the
token's log-prob, so values, log-probs and advantages line up token by token. The loss is
:func:`vime_core.algorithms.gae.value_loss` (clipped, shared by every backend); the targets come from
:func:`vime_core.algorithms.batch.gae_advantages`.

On disk a critic is a directory: the transformer in Hugging Face layout (``config.json``, ``model.safetensors``,
loadable with ``AutoModel``) plus ``value_head.safetensors`` (``weight [1, hidden]``, ``bias [1]``).
``--critic-load`` accepts such a directory, or any HF causal-LM directory / known model name (a new value head).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from vime_core.algorithms.gae import value_loss
from vime_core.config import AlgorithmConfig, TrainerConfig
from vime_core.models import resolve_model
from vime_core.trainer.lr_schedule import critic_lr_schedule, set_lr
from vime_core.trainer.packing import enable_packed_attention, packed_batch, packed_hidden_states
from vime_core.trainer.padding import left_padded_batch, response_slices
from vime_core.types import Sample

logger = logging.getLogger("vime.trainer")

VALUE_HEAD_FILE = "value_head.safetensors"

# devices whose AdamW step runs torch's fused kernel (one pass over each parameter instead of ~10 foreach passes:
# on 2 CPU cores and 135M fp32 parameters ~1 s instead of ~5 s per step; equal to the foreach step within float32
# rounding)
FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def resolve_critic_path(path: str | Path) -> Path:
    """``--critic-load`` (or the policy's directory) as a directory: an HF/critic directory as is, else a known
    model name prepared by :func:`vime_core.models.resolve_model`.

    :raises FileNotFoundError: naming ``--critic-load`` if ``path`` is neither a directory nor a known model.
    """
    path = Path(path)
    if (path / "config.json").is_file():
        return path

    try:
        return resolve_model(str(path))
    except Exception as e:  # noqa: BLE001 - re-raised with the flag named
        raise FileNotFoundError(f"--critic-load {path}: not an HF model directory nor a known model ({e})") from e


def adamw_with_checkpointing(
    model: Any,
    params: Iterable[torch.nn.Parameter],
    cfg: TrainerConfig,
    lr: float,
    device: torch.device,
    *,
    input_require_grads: bool = False,
) -> torch.optim.AdamW:
    """Gradient checkpointing on ``model`` with ``--gradient-checkpointing`` (and, with ``input_require_grads``,
    inputs that require grad: frozen embeddings under LoRA), then AdamW over ``params`` at ``lr`` with the optimizer
    flags of ``cfg`` (fused on :data:`FUSED_ADAMW_DEVICES`). The policy's and the critic's optimizers."""
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if input_require_grads:
            model.enable_input_require_grads()
    return torch.optim.AdamW(
        params,
        lr=lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        fused=device.type in FUSED_ADAMW_DEVICES,
    )


def clip_and_step(
    params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer, max_norm: float, label: str
) -> float:
    """Clip the gradients to ``max_norm`` (``--clip-grad``) and step ``optimizer``; the norm before clipping.

    :param label: names the norm in the error, e.g. ``"grad norm"`` or ``"critic grad norm"``.
    :raises FloatingPointError: ``non-finite <label> <norm>`` on a non-finite gradient norm (no update is made).
    """
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"non-finite {label} {grad_norm}")
    optimizer.step()
    return grad_norm


class ValueModel(torch.nn.Module):
    """A transformer backbone (``AutoModel``, no LM head) and a linear value head ``hidden → 1``.

    :param backbone: an HF base model whose output has ``last_hidden_state [B, S, hidden]``.
    :param head: ``Linear(hidden, 1)``; default: a new head with weight ``N(0, 1/(hidden+1))``, bias 0 (OpenRLHF's
        initialisation), drawn from torch's global RNG.
    """

    def __init__(self, backbone: torch.nn.Module, head: torch.nn.Linear | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = int(backbone.config.hidden_size)
        if head is None:
            head = torch.nn.Linear(hidden, 1)
            torch.nn.init.normal_(head.weight, std=1.0 / (hidden + 1))
            torch.nn.init.zeros_(head.bias)
        self.value_head = head.to(dtype=next(backbone.parameters()).dtype)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> ValueModel:
        """Load a critic directory (backbone + ``value_head.safetensors``), or an HF model directory or known model
        name (backbone only; a new value head).

        :raises FileNotFoundError: naming ``--critic-load`` if ``path`` is neither a directory nor a known model.
        """
        from transformers import AutoModel

        path = resolve_critic_path(path)
        backbone = AutoModel.from_pretrained(str(path), dtype=dtype)
        head = None
        if (path / VALUE_HEAD_FILE).is_file():
            state = load_file(str(path / VALUE_HEAD_FILE))
            head = torch.nn.Linear(state["weight"].shape[1], 1)
            head.load_state_dict(state)
        else:
            logger.info("critic: %s has no %s; starting from a new value head", path, VALUE_HEAD_FILE)
        return cls(backbone, head)

    def save_pretrained(self, path: str | Path) -> None:
        """Write the backbone (HF layout, safetensors) and ``value_head.safetensors`` to ``path``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(str(path), safe_serialization=True)
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in self.value_head.state_dict().items()},
            str(path / VALUE_HEAD_FILE),
        )

    def response_values(self, samples: list[Sample], device: torch.device, packing: bool = True) -> list[torch.Tensor]:
        """One batched forward pass; the value ``V_t`` of every response token of each sample.

        The value of response token ``t`` is the head applied to the hidden state one position before it. With
        ``packing`` (the default) the samples are packed into one row without padding and the head runs only on
        those positions (:mod:`vime_core.trainer.packing`, as the policy's log-probs are; the backbone is switched
        to its per-sample attention); else they are left-padded with explicit ``position_ids``
        (:mod:`vime_core.trainer.padding`).

        :param samples: samples with ``tokens`` = prompt + response (a prompt of at least one token).
        :param device: where the model lives.
        :param packing: packed rows (default) or the left-padded batch (equal within float32 rounding).
        :return: one ``[response_length]`` float32 tensor per sample (graph attached when grad is enabled).
        """
        if packing:
            packed = packed_batch(samples, device)
            enable_packed_attention(self.backbone)
            hidden = packed_hidden_states(self.backbone, packed)  # [total, H]
            values = self.value_head(hidden.index_select(0, packed.predict_index)).squeeze(-1).float()  # [M]
            return packed.split(values)
        batch = left_padded_batch(samples, device)
        hidden = self.backbone(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).last_hidden_state  # [B, S, H]
        # [B, keep-1, H]: the states before the last keep-1 tokens
        states = hidden[:, batch.seq_len - batch.keep : batch.seq_len - 1]
        values = self.value_head(states).squeeze(-1).float()  # [B, keep-1]
        return response_slices(values, samples)


class CriticBase:
    """What every backend's critic shares: the no-grad value pass and one optimizer step of the clipped value loss
    (:func:`vime_core.algorithms.gae.value_loss`). A backend supplies :meth:`response_values`, :meth:`zero_grad` and
    :meth:`optimizer_step` (the torch backend: :class:`Critic`; megatron: ``vime_core.trainer.megatron_critic``).

    Attributes: ``trainer_config`` and ``algorithm_config`` (the flags it reads: ``--clip-grad``, the critic's
    learning-rate schedule, ``--value-clip``), ``optimizer`` (torch or Megatron; its learning rate is set before
    every step from :func:`~vime_core.trainer.lr_schedule.critic_lr_schedule`), ``steps_done`` (optimizer steps
    taken; saved with the trainer's checkpoint), ``lr`` (the learning rate of the last step, or of the next one
    before any step).
    """

    trainer_config: TrainerConfig
    algorithm_config: AlgorithmConfig
    optimizer: Any
    lr: float
    steps_done: int = 0

    def response_values(self, samples: list[Sample]) -> list[torch.Tensor]:
        """One micro-batch forward: per sample the ``[response_length]`` float32 values ``V_t`` (graph attached)."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def optimizer_step(self) -> float:
        """Clip to ``--clip-grad``, step; the gradient norm before clipping.

        :raises FloatingPointError: on a non-finite gradient norm (no update is made).
        """
        raise NotImplementedError

    @torch.no_grad()
    def values(self, samples: list[Sample], micro_batch_size: int) -> dict[int, torch.Tensor]:
        """Values of every sample's response before any update, keyed by ``id(sample)`` (float32, CPU, no grad)."""
        out: dict[int, torch.Tensor] = {}
        for i in range(0, len(samples), micro_batch_size):
            mb = samples[i : i + micro_batch_size]
            for s, v in zip(mb, self.response_values(mb), strict=True):
                out[id(s)] = v.float().cpu()
        return out

    def train_minibatch(
        self,
        micro_batches: list[list[Sample]],
        old_values: dict[int, torch.Tensor],
        returns: dict[int, torch.Tensor],
        per_token: bool,
    ) -> dict[str, float]:
        """One optimizer step of the clipped value loss over a mini-batch given as micro-batches.

        The loss is aggregated like the policy loss (per-sample means, or token mean with ``per_token``), weighted
        across micro-batches so that the gradient equals that of one pass over the mini-batch.

        :param old_values: ``id(sample) → [T]`` values before the step's first update (the clip anchor).
        :param returns: ``id(sample) → [T]`` value targets.
        :return: metrics ``value_loss``, ``value_clipfrac`` (weighted means over the mini-batch) and
            ``critic_grad_norm``.
        :raises FloatingPointError: on a non-finite gradient norm.
        """

        def weight(group: list[Sample]) -> int:
            return sum(sum(s.loss_mask) for s in group) if per_token else sum(1 for s in group if any(s.loss_mask))

        total = sum(weight(mb) for mb in micro_batches)
        self.zero_grad()
        sums: dict[str, float] = {}
        counted = 0
        for mb in micro_batches:
            count = weight(mb)
            if count == 0:
                continue
            values = self.response_values(mb)
            dev = values[0].device
            out = value_loss(
                [v.float() for v in values],
                [old_values[id(s)].to(dev) for s in mb],
                [returns[id(s)].to(dev) for s in mb],
                [torch.tensor(s.loss_mask, dtype=torch.float32, device=dev) for s in mb],
                value_clip=self.algorithm_config.value_clip,
                per_token=per_token,
            )
            (out.loss * (count / total)).backward()
            for k, v in out.metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * count
            counted += count
        self.lr = critic_lr_schedule(self.trainer_config).lr_at(self.steps_done)
        set_lr(self.optimizer, self.lr)
        grad_norm = self.optimizer_step()
        self.steps_done += 1
        metrics = {k: v / max(counted, 1) for k, v in sums.items()}
        metrics["critic_grad_norm"] = grad_norm
        return metrics


class Critic(CriticBase):
    """The torch backend's value model (:class:`ValueModel`) with its AdamW optimizer (``--critic-lr``, default
    ``--lr``, on :func:`~vime_core.trainer.lr_schedule.critic_lr_schedule`; the other optimizer flags are the
    policy's), on the trainer's device and dtype.

    :param trainer_config: the optimizer flags and the critic's learning-rate schedule (``--critic-lr``).
    :param algorithm_config: ``--critic-load``, ``--value-clip``.
    :param model_path: the policy's initial HF directory (the backbone when ``--critic-load`` is not given).
    """

    def __init__(
        self,
        trainer_config: TrainerConfig,
        algorithm_config: AlgorithmConfig,
        model_path: Path,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        cfg = self.trainer_config = trainer_config
        self.algorithm_config = algorithm_config
        self.device = device
        self.path = Path(algorithm_config.critic_load or model_path)
        self.model = ValueModel.from_pretrained(self.path, dtype=dtype).to(device)
        # packed rows (ValueModel.response_values) where the backbone can switch its attention; else left-padded
        self.packing = enable_packed_attention(self.model.backbone)
        self.model.train()
        self.lr = critic_lr_schedule(cfg).lr_at(0)
        self.optimizer = adamw_with_checkpointing(self.model.backbone, self.model.parameters(), cfg, self.lr, device)

    def response_values(self, samples: list[Sample]) -> list[torch.Tensor]:
        return self.model.response_values(samples, self.device, packing=self.packing)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        return clip_and_step(
            self.model.parameters(), self.optimizer, self.trainer_config.clip_grad, "critic grad norm"
        )

    def save(self, path: Path) -> None:
        """The critic directory (:meth:`ValueModel.save_pretrained`) plus ``optimizer.pt``."""
        path = Path(path)
        self.model.save_pretrained(path)
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")

    def load(self, path: Path) -> None:
        """Restore what :meth:`save` wrote (weights and optimizer state).

        :raises FileNotFoundError: if the checkpoint has no critic (it was written by a run without ``ppo``).
        :raises ValueError: if its tensors do not match this critic.
        """
        path = Path(path)
        if not (path / VALUE_HEAD_FILE).is_file():
            raise FileNotFoundError(
                f"{path}: no critic in this checkpoint (written without --advantage-estimator ppo?)"
            )
        missing, unexpected = self.model.backbone.load_state_dict(
            load_file(str(path / "model.safetensors")), strict=False
        )
        if missing or unexpected:
            raise ValueError(f"critic checkpoint {path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.model.value_head.load_state_dict(load_file(str(path / VALUE_HEAD_FILE)))
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))

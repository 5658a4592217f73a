"""The PPO critic of the ``megatron`` backend: a megatron-core ``GPTModel`` of the policy's architecture whose
output layer is a value head ``hidden → 1`` (slime's approach), with its own Megatron DDP and distributed optimizer.

:class:`MegatronCritic` shares everything else with the torch backend's critic
(:class:`vime_core.trainer.critic.CriticBase`: the value pass, the clipped value loss, the positions ``V_t`` is read
at) and its directory format, so a critic saved by one backend loads in the other; the value head is replicated
on the tensor-parallel ranks. Details: docs/algorithms.md, "PPO with a critic".
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from vime_core.trainer.critic import VALUE_HEAD_FILE, CriticBase, resolve_critic_path
from vime_core.trainer.lr_schedule import critic_lr_schedule
from vime_core.trainer.megatron_convert import megatron_to_hf
from vime_core.trainer.megatron_experts import float16_module
from vime_core.trainer.megatron_optim import inner_optimizers, load_optimizer, megatron_step, save_optimizer
from vime_core.trainer.megatron_view import MegatronPolicy
from vime_core.types import Sample
from vime_core.weight_sync.tensor_io import safetensors_files

HEAD = ("output_layer.weight", "output_layer.bias")


class ValueHead(torch.nn.Linear):
    """``Linear(hidden, 1)`` with the output-layer call signature ``GPTModel`` uses (``weight=``,
    ``runtime_gather_output=``; returns ``(output, None)``). Under sequence parallelism the sequence shards are
    gathered first.

    :param sequence_parallel: whether the hidden states arrive split along the sequence over TP ranks.
    """

    def __init__(self, hidden_size: int, sequence_parallel: bool = False) -> None:
        super().__init__(hidden_size, 1)
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None) -> tuple:
        """``hidden [s, b, h]`` → ``([s, b, 1], None)``."""
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
        return super().forward(hidden), None


def _backbone_hf(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """HF causal-LM names of a critic directory's backbone (or of an HF causal LM's, ``lm_head`` dropped) and the
    value head tensors (None for a plain HF model)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        if f.name != VALUE_HEAD_FILE:
            tensors.update(load_file(str(f)))
    if (path / VALUE_HEAD_FILE).is_file():  # a critic directory: AutoModel names (no "model." prefix)
        backbone = {k if k.startswith("model.") else f"model.{k}": v for k, v in tensors.items()}
        return backbone, load_file(str(path / VALUE_HEAD_FILE))
    return {k: v for k, v in tensors.items() if k != "lm_head.weight"}, None


class MegatronCritic(CriticBase):
    """The value model of ``--advantage-estimator ppo`` on the megatron backend.

    :param trainer: the policy trainer (architecture, parallel layout, HF loading, DDP/optimizer construction).
    :raises FileNotFoundError: naming ``--critic-load`` if it is neither a directory nor a known model.
    """

    def __init__(self, trainer: MegatronPolicy) -> None:

        self.trainer = trainer
        self.trainer_config = trainer.trainer_config
        self.algorithm_config = trainer.algorithm_config
        self.path = path = resolve_critic_path(self.algorithm_config.critic_load or trainer.model_path)
        self.arch = dataclasses.replace(trainer.arch, tie_word_embeddings=True)  # no LM head to map
        gpt = trainer.new_gpt(tied=False)
        gpt.output_layer = ValueHead(trainer.arch.hidden_size, trainer.config.sequence_parallel).cuda()
        self.gpt = gpt
        self._load_weights(path, fresh_head=True)
        self.module = float16_module(trainer.config, gpt)
        schedule = critic_lr_schedule(self.trainer_config)
        self.lr = schedule.lr_at(0)
        self.ddp, self.optimizer = trainer.wrap_for_training(self.module, schedule.max_lr)

    @torch.no_grad()
    def _load_weights(self, path: Path, fresh_head: bool) -> None:
        backbone, head = _backbone_hf(path)
        self.trainer.load_hf_tensors(backbone, gpt=self.gpt, arch=self.arch, skip=HEAD)
        layer = self.gpt.output_layer
        if head is None:
            if not fresh_head:
                raise FileNotFoundError(f"{path}: no {VALUE_HEAD_FILE}")
            # OpenRLHF's initialisation, as the torch critic: weight N(0, 1/(hidden+1)), bias 0; the same on every
            # rank (a generator seeded with --seed), so the replicated head starts identical under TP
            g = torch.Generator().manual_seed(int(self.trainer_config.seed))
            hidden = layer.weight.shape[1]
            w = torch.randn(layer.weight.shape, generator=g) * (1.0 / (hidden + 1))
            layer.weight.copy_(w.to(layer.weight))
            layer.bias.zero_()
        else:
            layer.weight.copy_(head["weight"].to(layer.weight))
            layer.bias.copy_(head["bias"].to(layer.bias))

    # -- CriticBase ------------------------------------------------------------------------------------------------
    def response_values(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Per sample ``[response_length]`` float32 values (graph attached), on the GPU."""
        ids, pos = self.trainer.token_batch(samples)
        out = self.ddp(ids, pos, None)  # [b, s, 1]
        values = out[:, :-1, 0].float()  # [b, s - 1]: the value before each next token
        return self.trainer.response_slices(samples, values)

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> float:
        return megatron_step(self.ddp, self.optimizer, "critic grad norm")

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """The critic directory (backbone in ``AutoModel`` layout, ``config.json``, ``value_head.safetensors``) plus
        the Megatron optimizer state. Collective: every rank calls it, rank 0 writes the weights."""
        import torch.distributed as dist

        t = self.trainer
        path = Path(path)
        if t.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        mc = t.megatron_tensors(gpt=self.gpt, skip=HEAD)
        hf = megatron_to_hf(mc, self.arch, te=t.attention == "te")
        if t.rank == 0:
            backbone = {k.removeprefix("model."): v.contiguous().cpu() for k, v in hf.items() if k != "lm_head.weight"}
            save_file(backbone, str(path / "model.safetensors"), metadata={"format": "pt"})
            layer = self.gpt.output_layer
            save_file(
                {"weight": layer.weight.detach().cpu().contiguous(), "bias": layer.bias.detach().cpu().contiguous()},
                str(path / VALUE_HEAD_FILE),
            )
            shutil.copy2(t.model_path / "config.json", path / "config.json")
        if self._stepped():  # the critic steps whenever the policy does (and alone in critic-only steps)
            save_optimizer(self.optimizer, path, t.rank)
        dist.barrier()

    def _stepped(self) -> bool:
        return any(o.state for o in inner_optimizers(self.optimizer))

    def load(self, path: Path) -> None:
        """Restore what :meth:`save` wrote (weights and optimizer state).

        :raises FileNotFoundError: if the checkpoint has no critic (it was written without ``ppo``).
        """
        path = Path(path)
        if not (path / VALUE_HEAD_FILE).is_file():
            raise FileNotFoundError(
                f"{path}: no critic in this checkpoint (written without --advantage-estimator ppo?)"
            )
        self._load_weights(path, fresh_head=False)
        load_optimizer(self.optimizer, path)

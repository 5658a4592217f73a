"""The torch backend's LoRA (``--lora-rank`` > 0): the Hugging Face model wrapped by PEFT.

PEFT injects its LoRA layers into the model in place, so the backend keeps running the HF model itself (its packed
forward, :mod:`vime_core.trainer.packing`) while :class:`LoraModel` holds the ``PeftModel`` for what PEFT owns: the
trainable parameters, the adapter's state dict and config (PEFT's file format, which vLLM's LoRA loader reads),
``disable_adapter`` for the reference policy, and the merged weights. Only adapter parameters require gradients, so
only they get optimizer state. docs/lora.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from vime_core.config import LoraConfig
from vime_core.config.lora import module_names, peft_target_modules
from vime_core.types import Sample

ADAPTER = "default"  # PEFT's adapter name inside the model (one adapter per run)


class LoraModel:
    """A causal LM with a PEFT LoRA adapter: fresh (``--lora-rank``, ``--lora-alpha``, ``--lora-dropout``,
    ``--target-modules``, ``--exclude-modules``) or loaded trainable from ``--lora-adapter-path``.

    :param model: the HF causal LM (its layers get the adapter in place).
    :param cfg: the run's LoRA flags.
    :ivar peft_model: the ``peft.PeftModel``.
    :ivar model: the HF model (with the LoRA layers injected): what forward passes run.
    """

    def __init__(self, model: torch.nn.Module, cfg: LoraConfig) -> None:
        import peft

        if cfg.lora_adapter_path is not None:
            self.peft_model = peft.PeftModel.from_pretrained(model, str(cfg.lora_adapter_path), is_trainable=True)
        else:
            config = peft.LoraConfig(
                r=cfg.lora_rank,
                lora_alpha=cfg.lora_alpha,
                lora_dropout=cfg.lora_dropout,
                target_modules=peft_target_modules(cfg),
                exclude_modules=module_names(cfg.exclude_modules) or None,
                bias="none",
            )
            self.peft_model = peft.get_peft_model(model, config)
        self.model = self.peft_model.get_base_model()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The adapter's parameters (the only ones with ``requires_grad``), in a fixed order."""
        return [p for p in self.peft_model.parameters() if p.requires_grad]

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter tensors under the names PEFT saves (``base_model.model.<module>.lora_A.weight``), detached
        CPU copies."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.peft_model, adapter_name=ADAPTER)
        return {name: t.detach().to("cpu").contiguous() for name, t in state.items()}

    def adapter_config(self) -> dict[str, Any]:
        """``adapter_config.json``'s content, as ``PeftModel.save_pretrained`` writes it (inference mode: what an
        engine serves)."""
        config = self.peft_model.peft_config[ADAPTER]
        out = config.to_dict()
        out = {k: sorted(v) if isinstance(v, set) else v for k, v in out.items()}
        out["inference_mode"] = True
        return json.loads(json.dumps(out, default=str))

    def load_adapter_state(self, state: dict[str, torch.Tensor], where: str) -> None:
        """Set the adapter tensors from :meth:`adapter_state`'s names.

        :raises ValueError: naming ``where`` if a tensor is unknown or one of the adapter's is missing.
        """
        from peft import set_peft_model_state_dict

        expected = set(self.adapter_state())
        if set(state) != expected:
            missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(f"{where}: adapter tensors missing {missing[:5]}, unexpected {unexpected[:5]}")
        set_peft_model_state_dict(self.peft_model, state, adapter_name=ADAPTER)

    def merged_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's weights with the adapter merged in, under the plain HF names (``W + scale · B A`` per adapted
        layer, PEFT's ``get_delta_weight``), without changing the model (merging in place and back would round
        the base weights)."""
        from peft.tuners.lora import LoraLayer

        layers = {name: m for name, m in self.model.named_modules() if isinstance(m, LoraLayer)}
        for name, tensor in self.model.state_dict().items():
            if ".lora_" in name:
                continue
            t = tensor.detach()
            if ".base_layer." in name:
                owner, _, leaf = name.partition(".base_layer.")
                name = f"{owner}.{leaf}"
                if leaf == "weight":
                    with torch.no_grad():
                        t = t + layers[owner].get_delta_weight(ADAPTER).to(t.dtype)
            yield name, t

    def save_adapter(self, path: Path) -> None:
        """``PeftModel.save_pretrained`` (safetensors): a directory ``peft`` and ``vllm serve --lora-modules``
        load."""
        self.peft_model.save_pretrained(str(path), safe_serialization=True)


class AdapterDisabledReference:
    """The reference policy for KL with LoRA: the base model, i.e. the policy with its adapter disabled
    (``PeftModel.disable_adapter``), evaluated without gradients — no second copy of the model.

    :param lora: the policy's :class:`LoraModel`.
    :param forward: ``forward(samples, packing)`` → per-sample response log-probs of the policy's HF model (the
        backend's :func:`~vime_core.trainer.torch_backend.response_log_probs`).
    :param packing: packed rows or left-padded batches (the backend sets it with its own).
    """

    def __init__(
        self, lora: LoraModel, forward: Callable[[list[Sample], bool], list[torch.Tensor]], packing: bool
    ) -> None:
        self.lora = lora
        self.forward = forward
        self.packing = packing

    @torch.no_grad()
    def log_probs(self, samples: list[Sample], micro_batch_size: int) -> dict[int, torch.Tensor]:
        """Base-model log-probs of every sample's response, keyed by ``id(sample)`` (float32, CPU)."""
        model = self.lora.peft_model
        was_training = model.training
        model.eval()  # no dropout (as the frozen reference model of full fine-tuning)
        out: dict[int, torch.Tensor] = {}
        try:
            with model.disable_adapter():
                for i in range(0, len(samples), micro_batch_size):
                    mb = samples[i : i + micro_batch_size]
                    for s, lp in zip(mb, self.forward(mb, self.packing), strict=True):
                        out[id(s)] = lp.float().cpu()
        finally:
            model.train(was_training)
        return out

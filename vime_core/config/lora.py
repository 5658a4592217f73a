"""The LoRA flags (upstream vime's names), their checks, and how the engines' adapters are sized and kept.

``--lora-rank`` 0 (the default) is full fine-tuning; above 0 the trainer trains a PEFT LoRA adapter and the engines
serve it through vLLM's runtime LoRA API. The checks here run at startup and refuse a combination that cannot run
with one line naming the flag (:class:`LoraFlagError`). This module imports no torch at import time (the argument
parser imports it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from vime_core.config import ALL_LINEAR, LoraConfig
from vime_core.config.passthrough import passthrough_value

#: the ``--max-lora-rank`` values vLLM accepts (``MaxLoRARanks`` of vLLM 0.24 and 0.32 alike)
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraFlagError(ValueError):
    """A LoRA flag combination that cannot run (the message names the flag)."""


def module_names(values: Sequence[str] | None) -> list[str]:
    """``--target-modules`` / ``--exclude-modules`` values as names (commas split, blanks dropped)."""
    return [n.strip() for v in values or () for n in str(v).split(",") if n.strip()]


def peft_target_modules(cfg: LoraConfig) -> str | list[str]:
    """What PEFT's ``LoraConfig(target_modules=...)`` gets: ``"all-linear"`` or the names."""
    names = module_names(cfg.target_modules)
    return ALL_LINEAR if names == [ALL_LINEAR] else names


def adapters_to_keep(cfg: LoraConfig) -> int:
    """How many weight versions' adapters each engine keeps loaded: the versions a request may still name. With
    ``--loop fully-async`` requests keep generating across an update (pause mode ``keep``), and groups up to
    ``--max-staleness`` versions old are trained, so ``--max-staleness + 1``; the other loops finish every request
    before an update, so the current one alone."""
    return cfg.max_staleness + 1 if cfg.loop == "fully-async" else 1


def engine_max_lora_rank(cfg: LoraConfig) -> int:
    """The engines' ``--max-lora-rank``: ``--vllm-max-lora-rank`` when given, else the smallest value vLLM accepts
    that holds ``--lora-rank``.

    :raises LoraFlagError: ``--lora-rank`` above that (or above vLLM's largest, 512).
    """
    given = passthrough_value(cfg.vllm_args, "max-lora-rank")
    if given is not None:
        engine = int(given)
        if cfg.lora_rank > engine:
            raise LoraFlagError(
                f"--lora-rank {cfg.lora_rank} exceeds the engines' --vllm-max-lora-rank {engine}: vLLM refuses an "
                "adapter above its max LoRA rank; raise --vllm-max-lora-rank or lower --lora-rank"
            )
        return engine
    for rank in VLLM_MAX_LORA_RANKS:
        if rank >= cfg.lora_rank:
            return rank
    raise LoraFlagError(
        f"--lora-rank {cfg.lora_rank} exceeds vLLM's largest --max-lora-rank {VLLM_MAX_LORA_RANKS[-1]}"
    )


def check_lora_config(cfg: LoraConfig, strategy_cls: type | None, trainer_cls: type | None) -> None:
    """The checks that need no model: values, the weight-sync strategy and the trainer backend.

    :param strategy_cls: the ``--weight-sync`` class (``None``: unknown name, reported elsewhere); it must have
        ``CARRIES_LORA``.
    :param trainer_cls: the ``--trainer`` class (``None``: unknown); it must have ``SUPPORTS_LORA``.
    :raises LoraFlagError: naming the flag.
    """
    if cfg.lora_rank < 0:
        raise LoraFlagError(f"--lora-rank must be >= 0 (0: full fine-tuning), got {cfg.lora_rank}")
    if not cfg.enabled:
        if cfg.lora_adapter_path is not None:
            raise LoraFlagError("--lora-adapter-path needs --lora-rank > 0 (the adapter's rank)")
        return
    if not cfg.lora_alpha > 0:
        raise LoraFlagError(f"--lora-alpha must be > 0, got {cfg.lora_alpha:g}")
    if not 0 <= cfg.lora_dropout < 1:
        raise LoraFlagError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout:g}")
    targets = module_names(cfg.target_modules)
    if not targets:
        raise LoraFlagError("--target-modules names no module")
    if ALL_LINEAR in targets and len(targets) > 1:
        raise LoraFlagError(f"--target-modules: {ALL_LINEAR} stands alone, got {' '.join(targets)}")
    engine_max_lora_rank(cfg)
    if strategy_cls is not None and not getattr(strategy_cls, "CARRIES_LORA", False):
        raise LoraFlagError(
            f"--weight-sync {cfg.weight_sync} cannot carry a LoRA adapter (--lora-rank {cfg.lora_rank}): use "
            "--weight-sync disk (PEFT adapter files loaded through vLLM's runtime LoRA API), ipc or nccl (the "
            "adapter handed over in memory)"
        )
    if trainer_cls is not None and not getattr(trainer_cls, "SUPPORTS_LORA", False):
        raise LoraFlagError(f"--trainer {cfg.trainer} has no LoRA support (--lora-rank {cfg.lora_rank})")


def adapter_config(path: Path) -> dict:
    """``adapter_config.json`` of the PEFT adapter directory ``path``.

    :raises LoraFlagError: naming ``--lora-adapter-path`` if it is not a LoRA adapter directory.
    """
    file = Path(path) / "adapter_config.json"
    if not file.is_file() or not (Path(path) / "adapter_model.safetensors").is_file():
        raise LoraFlagError(
            f"--lora-adapter-path {path}: not a PEFT adapter directory (adapter_config.json and "
            "adapter_model.safetensors)"
        )
    config = json.loads(file.read_text())
    if config.get("peft_type") != "LORA":
        raise LoraFlagError(f"--lora-adapter-path {path}: peft_type {config.get('peft_type')!r}, not 'LORA'")
    return config


def linear_modules(model_path: Path) -> tuple[set[str], str | None]:
    """The names (last component) of the model's ``nn.Linear`` modules, and the output layer's, from its config
    alone (built on the meta device: no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out = model.get_output_embeddings()
    names, head = set(), None
    for name, module in model.named_modules():
        if module is out:
            head = name.rsplit(".", 1)[-1]
        elif isinstance(module, torch.nn.Linear):
            names.add(name.rsplit(".", 1)[-1])
    return names, head


def check_lora_model(cfg: LoraConfig, model_path: Path) -> None:
    """The checks that need the model: every ``--target-modules`` / ``--exclude-modules`` name is a linear layer
    of it that vLLM can adapt (not the output layer), and a ``--lora-adapter-path`` adapter has ``--lora-rank``.

    :raises LoraFlagError: naming the flag and the model's linear layers.
    """
    if not cfg.enabled:
        return
    linear, head = linear_modules(model_path)
    known = ", ".join(sorted(linear))
    for flag, values in (("--target-modules", cfg.target_modules), ("--exclude-modules", cfg.exclude_modules)):
        for name in module_names(values):
            if name == ALL_LINEAR and flag == "--target-modules":
                continue
            if name == head:
                raise LoraFlagError(
                    f"{flag} {name}: the output layer; vLLM serves LoRA on the decoder's linear layers ({known})"
                )
            if name not in linear:
                raise LoraFlagError(f"{flag} {name}: the model {model_path} has no such linear layer ({known})")
    if cfg.lora_adapter_path is not None:
        rank = adapter_config(cfg.lora_adapter_path).get("r")
        if rank != cfg.lora_rank:
            raise LoraFlagError(
                f"--lora-rank {cfg.lora_rank} differs from the rank of --lora-adapter-path {cfg.lora_adapter_path} "
                f"(r={rank})"
            )

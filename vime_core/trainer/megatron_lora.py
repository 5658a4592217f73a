"""The megatron backend's LoRA (``--lora-rank`` > 0; GPU, written for and not yet run on one): PEFT's LoRA on
megatron-core's tensor-parallel linear layers.

:class:`MegatronLora` wraps megatron-core's parallel linear layers in PEFT's ``LoraParallelLinear`` (local layer spec,
no ``--sequence-parallel``); :func:`megatron_lora_to_peft` / :func:`peft_to_megatron_lora` convert the fused
``linear_qkv`` / ``linear_fc1`` adapters to and from Hugging Face's layout, exact both ways. Details: docs/lora.md,
"Megatron (GPU)".
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from vime_core.config import LoraConfig
from vime_core.config.lora import ALL_LINEAR, LoraFlagError, module_names
from vime_core.trainer.megatron_convert import ArchConfig, shard
from vime_core.trainer.megatron_model import tp_full
from vime_core.trainer.megatron_view import MegatronPolicy
from vime_core.types import Sample

ADAPTER = "default"
#: HF projection → the Megatron layer it is part of
MEGATRON_LAYER = {
    "q_proj": "self_attention.linear_qkv",
    "k_proj": "self_attention.linear_qkv",
    "v_proj": "self_attention.linear_qkv",
    "o_proj": "self_attention.linear_proj",
    "gate_proj": "mlp.linear_fc1",
    "up_proj": "mlp.linear_fc1",
    "down_proj": "mlp.linear_fc2",
}
HF_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
FUSED = {"self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"), "mlp.linear_fc1": ("gate_proj", "up_proj")}
ROW_PARALLEL = ("self_attention.linear_proj", "mlp.linear_fc2")  # A is sharded (dim 1), B full


def register_megatron_layers(config: Any) -> None:
    """Adapt megatron-core's parallel linear layers with PEFT's :class:`LoraParallelLinear`, past two faults of its
    Megatron path in PEFT 0.21: its dispatcher reads a ``fan_in_fan_out`` keyword PEFT no longer passes
    (``KeyError: 'fan_in_fan_out'``; a Megatron linear layer is never fan-in-fan-out), and the layer never records
    its ``lora_bias`` before ``reset_lora_parameters`` reads it (``KeyError: 'default'``; huggingface/peft PR #2621,
    not merged; LoRA on a parallel layer has no bias). Goes through PEFT's custom-module registry
    (``LoraConfig._register_custom_module``, asked before the built-in dispatchers); nothing of PEFT is patched."""
    from megatron.core import tensor_parallel
    from peft.tuners.lora.tp_layer import LoraParallelLinear

    class MegatronLoraLinear(LoraParallelLinear):
        def update_layer(self, adapter_name: str, *args: Any, **kwargs: Any) -> None:
            self.lora_bias[adapter_name] = False
            super().update_layer(adapter_name, *args, **kwargs)

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
            """The base layer's ``(output, bias)`` plus ``B(A(x)) * scaling`` of each active adapter; the parallel
            one of ``A``/``B`` returns ``(output, bias)`` too, which PEFT 0.21's forward multiplies as is."""
            self._check_forward_args(x, *args, **kwargs)
            if kwargs.pop("adapter_names", None) is not None:
                raise ValueError("MegatronLoraLinear does not support mixed-batch adapter_names")
            if self.disable_adapters and self.merged:
                self.unmerge()
            result, bias = self.base_layer(x, *args, **kwargs)
            if self.disable_adapters or self.merged:
                return result, bias
            dtype = result.dtype
            for name in self.active_adapters:
                if name not in self.lora_A:
                    continue
                a = self.lora_A[name]
                h = a(self.lora_dropout[name](self._cast_input_dtype(x, a.weight.dtype)))
                h = self.lora_B[name](h[0] if isinstance(h, tuple) else h)
                result = result + (h[0] if isinstance(h, tuple) else h) * self.scaling[name]
            return result.to(dtype), bias

    def megatron_layer(target: Any, adapter_name: str, config: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("fan_in_fan_out", False)
        kwargs["megatron_config"] = config.megatron_config
        return MegatronLoraLinear(target, adapter_name, config=config, backend=tensor_parallel, **kwargs)

    layers = {tensor_parallel.ColumnParallelLinear: megatron_layer, tensor_parallel.RowParallelLinear: megatron_layer}
    config._register_custom_module(layers)


def hf_targets(cfg: LoraConfig) -> list[str]:
    """The HF projections ``--target-modules`` / ``--exclude-modules`` adapt (all-linear: all seven).

    :raises LoraFlagError: a name Megatron has no layer for, or part of a fused layer without the rest.
    """
    names = module_names(cfg.target_modules)
    chosen = list(MEGATRON_LAYER) if names == [ALL_LINEAR] else names
    chosen = [n for n in chosen if n not in set(module_names(cfg.exclude_modules))]
    for name in chosen:
        if name not in MEGATRON_LAYER:
            raise LoraFlagError(f"--target-modules {name}: the megatron backend adapts {', '.join(MEGATRON_LAYER)}")
    for layer, parts in FUSED.items():
        if any(p in chosen for p in parts) and not all(p in chosen for p in parts):
            raise LoraFlagError(
                f"--target-modules: Megatron fuses {'/'.join(parts)} into {layer.split('.')[-1]}, which gets one "
                f"adapter: adapt all of {' '.join(parts)} or none (--trainer megatron)"
            )
    return [n for n in MEGATRON_LAYER if n in chosen]


def _hf_name(layer: int, proj: str, part: str) -> str:
    return f"base_model.model.model.layers.{layer}.{HF_PARENT.get(proj, 'mlp')}.{proj}.{part}.weight"


def megatron_lora_to_peft(mc: dict[str, torch.Tensor], arch: ArchConfig) -> dict[str, torch.Tensor]:
    """Full (TP-gathered) Megatron adapter tensors → PEFT's HF names.

    :param mc: ``{"decoder.layers.{i}.<layer>.lora_A.weight": [r, in], ".lora_B.weight": [out, r]}`` for every
        adapted Megatron layer (``linear_qkv``'s ``B`` rows in Megatron's per-query-group order, ``linear_fc1``'s
        ``[gate; up]``).
    :return: ``{"base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight": ..., ...}``; a fused layer's
        projections share its ``A`` (a copy each).
    """
    nh, ng, d, f = arch.num_attention_heads, arch.num_query_groups, arch.head_dim, arch.ffn_hidden_size
    per = nh // ng
    out: dict[str, torch.Tensor] = {}
    for name, a in mc.items():
        if not name.endswith(".lora_A.weight"):
            continue
        prefix = name[: -len(".lora_A.weight")]
        layer = int(prefix.split(".")[2])
        kind = prefix.split(".", 3)[3]
        b = mc[prefix + ".lora_B.weight"]
        r = a.shape[0]
        if kind == "self_attention.linear_qkv":
            q, k, v = torch.split(b.reshape(ng, (per + 2) * d, r), [per * d, d, d], dim=1)
            parts = {"q_proj": q.reshape(nh * d, r), "k_proj": k.reshape(ng * d, r), "v_proj": v.reshape(ng * d, r)}
        elif kind == "mlp.linear_fc1":
            gate, up = torch.split(b, [f, f], dim=0)
            parts = {"gate_proj": gate, "up_proj": up}
        else:
            parts = {"o_proj" if kind == "self_attention.linear_proj" else "down_proj": b}
        for proj, bp in parts.items():
            out[_hf_name(layer, proj, "lora_A")] = a.clone()
            out[_hf_name(layer, proj, "lora_B")] = bp.contiguous()
    return out


def peft_to_megatron_lora(hf: dict[str, torch.Tensor], arch: ArchConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`megatron_lora_to_peft`.

    :raises ValueError: projections of one fused layer with different ``A`` (not a Megatron-trained adapter).
    """
    nh, ng, d = arch.num_attention_heads, arch.num_query_groups, arch.head_dim
    per = nh // ng
    out: dict[str, torch.Tensor] = {}
    for layer in range(arch.num_layers):
        for kind in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            projs = FUSED.get(kind) or (("o_proj",) if kind == "self_attention.linear_proj" else ("down_proj",))
            names = [_hf_name(layer, p, "lora_A") for p in projs]
            if names[0] not in hf:
                continue
            a = hf[names[0]]
            if any(not torch.equal(hf[n], a) for n in names[1:]):
                raise ValueError(f"layer {layer}: {'/'.join(projs)} have different lora_A; Megatron fuses them")
            bs = [hf[_hf_name(layer, p, "lora_B")] for p in projs]
            r = a.shape[0]
            if kind == "self_attention.linear_qkv":
                q, k, v = (bs[0].reshape(ng, per * d, r), bs[1].reshape(ng, d, r), bs[2].reshape(ng, d, r))
                b = torch.cat([q, k, v], dim=1).reshape((nh + 2 * ng) * d, r)
            else:
                b = torch.cat(bs, dim=0)
            prefix = f"decoder.layers.{layer}.{kind}"
            out[prefix + ".lora_A.weight"], out[prefix + ".lora_B.weight"] = a, b
    return out


def _layout_name(prefix: str) -> str:
    """The base weight's name, whose tensor-parallel layout :func:`shard` / :func:`unshard` know."""
    return prefix + ".weight"


class MegatronLora:
    """The policy ``GPTModel``'s PEFT adapter (call before ``Float16Module`` wraps the model).

    :param trainer: the megatron trainer (its ``gpt``, ``config``, ``arch``, TP layout).
    :param cfg: the LoRA flags.
    :raises LoraFlagError: Transformer Engine's layer spec, ``--sequence-parallel``, or targets Megatron cannot
        adapt.
    """

    def __init__(self, trainer: MegatronPolicy, cfg: LoraConfig) -> None:
        import peft

        if trainer.attention == "te":
            raise LoraFlagError(
                "--lora-rank with --trainer megatron needs the local layer spec (--megatron-attention sdpa or local): "
                "PEFT adapts megatron-core's ColumnParallelLinear/RowParallelLinear, not Transformer Engine's layers"
            )
        if trainer.config.sequence_parallel:
            raise LoraFlagError("--lora-rank with --trainer megatron does not work with --sequence-parallel")
        self.trainer, self.cfg = trainer, cfg
        self.projections = hf_targets(cfg)
        layers = sorted({MEGATRON_LAYER[p].split(".")[-1] for p in self.projections})
        config = peft.LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=layers,
            megatron_config=copy.copy(trainer.config),  # PEFT sets its params_dtype to fp32: not the model's
            megatron_core="megatron.core",
        )
        register_megatron_layers(config)
        peft.inject_adapter_in_model(config, trainer.gpt, adapter_name=ADAPTER)
        for name, p in trainer.gpt.named_parameters():
            p.requires_grad_(".lora_" in name)
        self.scaling = cfg.lora_alpha / cfg.lora_rank
        if cfg.lora_adapter_path is not None:
            from safetensors.torch import load_file

            self.load_peft_state(load_file(str(Path(cfg.lora_adapter_path) / "adapter_model.safetensors")))

    def _tuner_layers(self) -> list[Any]:
        from peft.tuners.tuners_utils import BaseTunerLayer

        return [m for m in self.trainer.gpt.modules() if isinstance(m, BaseTunerLayer)]

    def set_enabled(self, on: bool) -> None:
        """Switch every adapter on or off (off: the base model, the KL reference)."""
        for m in self._tuner_layers():
            m.enable_adapters(on)

    @torch.no_grad()
    def full_adapter(self) -> dict[str, torch.Tensor]:
        """The adapter's full tensors (TP-gathered), ``decoder.layers.{i}.<layer>.lora_{A,B}.weight``. Collective
        under TP."""
        t = self.trainer
        out: dict[str, torch.Tensor] = {}
        for name, p in t.gpt.named_parameters():
            if ".lora_" not in name:
                continue
            prefix, _, rest = name.partition(".lora_")
            part, key = rest.split(".", 1)[0], f"{prefix}.lora_{rest.split('.', 1)[0]}.weight"
            kind = prefix.split(".", 3)[3]
            sharded = (part == "A") == (kind in ROW_PARALLEL)  # row layers shard A, column layers shard B
            # each rank's rows (B) / columns (A) are its base layer's: same layout
            out[key] = tp_full(p, _layout_name(prefix), t.tp, t.tp_group) if sharded else p.data
        return out

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """PEFT's HF-named adapter tensors (fp32, CPU). Collective under TP."""
        mc = {k: v.float().cpu() for k, v in self.full_adapter().items()}
        return megatron_lora_to_peft(mc, self.trainer.arch)

    def adapter_config(self) -> dict[str, Any]:
        """``adapter_config.json`` of the HF-layout adapter (what vLLM and PEFT load)."""
        import peft

        config = peft.LoraConfig(
            r=self.cfg.lora_rank,
            lora_alpha=self.cfg.lora_alpha,
            lora_dropout=self.cfg.lora_dropout,
            target_modules=self.projections,
            base_model_name_or_path=str(self.trainer.model_path),
            inference_mode=True,
        ).to_dict()
        return json.loads(json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}))

    @torch.no_grad()
    def load_peft_state(self, hf: dict[str, torch.Tensor]) -> None:
        """Set the adapter from PEFT's HF-named tensors (this rank's shards).

        :raises KeyError: a Megatron adapter tensor the state lacks.
        """
        t = self.trainer
        mc = peft_to_megatron_lora(hf, t.arch)
        for name, p in t.gpt.named_parameters():
            if ".lora_" not in name:
                continue
            prefix, _, rest = name.partition(".lora_")
            part = rest.split(".", 1)[0]
            full = mc[f"{prefix}.lora_{part}.weight"]
            kind = prefix.split(".", 3)[3]
            if t.tp > 1 and (part == "A") == (kind in ROW_PARALLEL):
                full = shard(_layout_name(prefix), full, t.tp_rank, t.tp)
            p.copy_(full.to(device=p.device, dtype=p.dtype))

    def merged(self, mc: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full Megatron tensors with the adapter merged in (``W + alpha/r · B A`` per adapted layer) and the plain
        Megatron names (``.base_layer`` dropped, no ``lora_`` tensors).

        :param mc: full tensors of the model (:meth:`full_tensors`).
        """
        out: dict[str, torch.Tensor] = {}
        for name, t in mc.items():
            if ".lora_" in name:
                continue
            if ".base_layer." in name:
                prefix, _, leaf = name.partition(".base_layer.")
                name = f"{prefix}.{leaf}"
                if leaf == "weight":
                    a, b = mc[f"{prefix}.lora_A.weight"], mc[f"{prefix}.lora_B.weight"]
                    t = (t.float() + self.scaling * (b.float() @ a.float())).to(t.dtype)
            out[name] = t
        return out

    def full_tensors(self) -> dict[str, torch.Tensor]:
        """Every full Megatron tensor of the policy, the base weights under their plain layout names' sharding and
        the adapter's from :meth:`full_adapter`. Collective under TP."""
        t = self.trainer
        out = dict(self.full_adapter())
        for name, p in t.gpt.named_parameters():
            if ".lora_" not in name:
                out[name] = tp_full(p, name.replace(".base_layer", ""), t.tp, t.tp_group)
        return out


class MegatronAdapterReference:
    """The KL reference with LoRA on the megatron backend: the policy with its adapter disabled (no second
    ``GPTModel``).

    :param trainer: the policy trainer (``lora``, ``sample_log_probs``).
    """

    def __init__(self, trainer: MegatronPolicy) -> None:
        self.trainer = trainer

    @torch.no_grad()
    def log_probs(self, samples: list[Sample], micro_batch_size: int) -> dict[int, torch.Tensor]:
        """Base-model log-probs of every sample's response, keyed by ``id(sample)`` (float32, CPU)."""
        t = self.trainer
        out: dict[int, torch.Tensor] = {}
        t.lora.set_enabled(False)
        try:
            for i in range(0, len(samples), micro_batch_size):
                mb = samples[i : i + micro_batch_size]
                for s, x in zip(mb, t.sample_log_probs(mb)[0], strict=True):
                    out[id(s)] = x.float().cpu()
        finally:
            t.lora.set_enabled(True)
        return out

"""The model families each trainer takes, keyed by a checkpoint's ``config.json`` ``model_type``.

Torch-free on purpose: ``vime run`` checks ``--model`` against ``--trainer`` with :func:`check_trainer_model` before
Ray, engines or torch are imported, and ``vime models`` prints :func:`families_table` — the same registry the
``megatron`` trainer builds its model from (:meth:`ArchConfig.from_hf`). A :class:`ModelFamily` reads an HF config
into an :class:`ArchConfig` (refusing what the Megatron trainer does not build, with the feature named) and says
which features (TP, EP, routing replay, LoRA) each trainer has for it. The per-layer tensor mappings live in
:mod:`vime_core.trainer.megatron_convert`, the layer specs and ``TransformerConfig`` fields in
:mod:`vime_core.trainer.megatron_model`. Adding a family: docs/models.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConversionError(ValueError):
    """A checkpoint does not fit the architecture (missing/unexpected tensor, bad shape, unsupported feature)."""


class UnsupportedFeature(ConversionError):
    """A family's config uses a feature the Megatron trainer does not build.

    :ivar feature: what the config has, e.g. ``rope_type 'dynamic'``.
    :ivar supported: what is built instead, e.g. ``rope_type default, linear or llama3``.
    """

    def __init__(self, feature: str, supported: str) -> None:
        super().__init__(f"{feature} is not supported ({supported})")
        self.feature, self.supported = feature, supported


class UnsupportedModelError(ValueError):
    """``--model`` is not a model ``--trainer`` can train (the message is one line, for ``vime: error:``)."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling of the HF config (``rope_parameters`` / ``rope_scaling``), as transformers computes it.

    :ivar rope_type: ``linear`` (positions / factor) or ``llama3`` (Llama 3.1+ frequency-dependent scaling).
    :ivar factor: the scaling factor. :ivar low_freq_factor: llama3 only. :ivar high_freq_factor: llama3 only.
    :ivar original_max_position_embeddings: llama3 only: the pre-training context.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ArchConfig:
    """What the Megatron mapping, layer spec and ``TransformerConfig`` need to know about a model (from an HF config
    via :meth:`from_hf`).

    :ivar num_layers: decoder layers. :ivar hidden_size: model width ``H``.
    :ivar num_attention_heads: query heads ``nh``. :ivar num_query_groups: key/value heads ``ng`` (divides ``nh``).
    :ivar head_dim: per-head width ``d`` (Megatron's ``kv_channels``; need not be ``H / nh``).
    :ivar ffn_hidden_size: MLP width ``F``. :ivar vocab_size: ``V``.
    :ivar tie_word_embeddings: ``lm_head`` shares ``embed_tokens``. :ivar qkv_bias: q/k/v projections have biases.
    :ivar rms_norm_eps: RMSNorm epsilon. :ivar rope_theta: RoPE base. :ivar max_position_embeddings: context.
    :ivar model_type: the HF ``model_type``. :ivar qk_layernorm: per-head RMSNorm of q and k before RoPE (Qwen3).
    :ivar rope_scaling: ``None`` for plain RoPE.
    :ivar attention: the attention part's mapping, a key of ``megatron_convert.ATTENTION`` (``gqa``; MLA families
        add their own).
    :ivar moe: ``None`` for dense models. Extension point for MoE families: an object of theirs with
        ``mlp_kind(layer) -> str`` (a key of ``megatron_convert.MLP``; DeepSeek-V3's first dense layers say
        ``dense``) and the router/expert sizes their mapping, spec and ``TransformerConfig`` fields read
        (:class:`vime_core.models.moe_families.MoEConfig`).
    :ivar mla: ``None`` unless ``attention == "mla"``: the multi-latent attention sizes
        (:class:`vime_core.models.moe_families.MLAConfig`).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    model_type: str = "llama"
    qk_layernorm: bool = False
    rope_scaling: RopeScaling | None = None
    attention: str = "gqa"
    moe: Any = None
    mla: Any = None

    def mlp_kind(self, layer: int) -> str:
        """The MLP part's mapping of decoder layer ``layer`` (0-based): ``dense`` unless an MoE family says else."""
        return "dense" if self.moe is None else self.moe.mlp_kind(layer)

    @classmethod
    def from_hf(cls, config: Any) -> ArchConfig:
        """From a transformers config (``LlamaConfig``, ``Qwen3Config``, ...) or a ``config.json`` dict, by its
        ``model_type`` (default ``llama``) through the family registry (:func:`family_of`).

        :raises UnsupportedFeature: for a feature the family's reader refuses (RoPE type, sliding window, ...).
        :raises ConversionError: for a model type no family has, or a missing/inconsistent field.
        """
        view = HFConfig(config)
        model_type = str(view.get("model_type", "llama"))
        family = family_of(model_type)
        if family is None or family.read_arch is None:
            supported = ", ".join(megatron_model_types())
            raise ConversionError(f"model_type {model_type!r} is not supported ({supported})")
        return family.read_arch(view)


class HFConfig:
    """Read-only view of an HF config: a transformers ``PretrainedConfig`` or ``config.json``'s dict."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def get(self, name: str, default: Any = None) -> Any:
        """The field ``name``; ``default`` when absent or ``null``."""
        c = self.config
        value = c.get(name) if isinstance(c, Mapping) else getattr(c, name, None)
        return default if value is None else value

    def require(self, name: str) -> Any:
        """The field ``name``.

        :raises ConversionError: naming the field when it is absent or ``null``.
        """
        value = self.get(name)
        if value is None:
            raise ConversionError(f"the model's config has no {name}")
        return value

    def rope(self) -> tuple[str, dict, float]:
        """``(rope_type, parameters, rope_theta)`` from transformers 5's ``rope_parameters`` or the older
        ``rope_scaling`` + ``rope_theta`` (``default`` and 10000.0 when neither says)."""
        rope = self.get("rope_parameters") or self.get("rope_scaling") or {}
        if not isinstance(rope, Mapping):
            rope = {}
        rope_type = rope.get("rope_type", rope.get("type")) or "default"
        theta = self.get("rope_theta", rope.get("rope_theta"))
        return str(rope_type), dict(rope), float(theta or 10000.0)


# ---------------------------------------------------------------------------------------------------- features
@dataclass(frozen=True)
class Features:
    """What a trainer does with a family: tensor parallelism, expert parallelism, rollout routing replay
    (``--use-rollout-routing-replay``), LoRA (``--lora-rank``)."""

    tp: bool = False
    ep: bool = False
    routing_replay: bool = False
    lora: bool = False


@dataclass(frozen=True)
class ModelFamily:
    """One model family: the ``model_type`` values of its checkpoints, how the Megatron trainer reads its config,
    and what each trainer offers for it.

    :ivar name: display name, e.g. ``Qwen3``. :ivar model_types: ``config.json`` ``model_type`` values.
    :ivar examples: checkpoints of the family, for ``vime models``.
    :ivar read_arch: HF config view → :class:`ArchConfig`, raising :class:`UnsupportedFeature` for what the Megatron
        trainer does not build (``None``: the family has no Megatron support).
    :ivar features: trainer name → :class:`Features` (a trainer absent here does not take the family; the
        ``torch`` trainer takes every causal LM, see :data:`TRAINERS`).
    :ivar notes: the features of the config the Megatron trainer builds, e.g. ``RoPE default, linear, llama3``.
    """

    name: str
    model_types: tuple[str, ...]
    examples: str
    read_arch: Callable[[HFConfig], ArchConfig] | None
    features: Mapping[str, Features]
    notes: str = ""


@dataclass(frozen=True)
class TrainerModels:
    """Which models a trainer takes. :ivar any_causal_lm: every HF causal LM (``AutoModelForCausalLM``), with
    :attr:`default_features` for families it has no entry for. :ivar description: one line for ``vime models``."""

    any_causal_lm: bool
    description: str
    default_features: Features = field(default_factory=Features)


#: the trainers whose models are known; a trainer plugin not listed here is not checked up front
TRAINERS: dict[str, TrainerModels] = {
    "torch": TrainerModels(
        any_causal_lm=True,
        description="transformers' AutoModelForCausalLM: any Hugging Face causal LM (CPU or one GPU)",
        default_features=Features(lora=True),
    ),
    "megatron": TrainerModels(
        any_causal_lm=False,
        description="megatron-core GPTModel (GPU): the families below, mapped HF <-> Megatron by vime",
    ),
}

#: model_type → family; :func:`register_family` adds to it
FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add ``family`` under each of its model types.

    :raises ValueError: if a model type is registered already.
    """
    for model_type in family.model_types:
        if model_type in FAMILIES:
            raise ValueError(f"model_type {model_type!r} is registered already ({FAMILIES[model_type].name})")
        FAMILIES[model_type] = family
    return family


def family_of(model_type: str) -> ModelFamily | None:
    """The family of ``model_type``, or ``None``."""
    return FAMILIES.get(model_type)


def megatron_model_types() -> list[str]:
    """The model types the Megatron trainer builds, sorted."""
    return sorted(t for t, f in FAMILIES.items() if f.read_arch is not None and "megatron" in f.features)


def features_of(trainer: str, model_type: str) -> Features | None:
    """What ``trainer`` offers for ``model_type`` (``None``: it does not take it, or the trainer is unknown)."""
    family, spec = FAMILIES.get(model_type), TRAINERS.get(trainer)
    if family is not None and trainer in family.features:
        return family.features[trainer]
    if spec is not None and spec.any_causal_lm:
        return spec.default_features
    return None


# ---------------------------------------------------------------------------------------------- the up-front check
TORCH_HINT = "--trainer torch takes any Hugging Face causal LM"


def read_model_config(model_dir: Path) -> dict:
    """``model_dir/config.json`` as a dict.

    :raises UnsupportedModelError: naming the file if it is missing or not a JSON object.
    """
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(f"--model {model_dir}: cannot read {path} ({e})") from None
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"--model {model_dir}: {path} is not a JSON object")
    return config


def check_trainer_model(trainer: str, config: Mapping, where: str) -> None:
    """Refuse a model ``trainer`` cannot train, from its ``config.json`` alone (no torch, no transformers).

    The ``torch`` trainer (and a trainer plugin :data:`TRAINERS` does not list) takes any model. For the others the
    model type must have a family with the trainer in its features, and the family's reader must accept the config.

    :param config: the model's ``config.json``. :param where: the ``--model`` value, named in the message.
    :raises UnsupportedModelError: one line naming the model type, what ``trainer`` supports and that
        ``--trainer torch`` takes any Hugging Face causal LM.
    """
    spec = TRAINERS.get(trainer)
    if spec is None or spec.any_causal_lm:
        return
    model_type = config.get("model_type")
    if not model_type:
        raise UnsupportedModelError(
            f"--model {where}: config.json has no model_type, so --trainer {trainer} cannot tell its family; "
            f"{TORCH_HINT}"
        )
    family = FAMILIES.get(str(model_type))
    if family is None or trainer not in family.features or family.read_arch is None:
        takes = ", ".join(t for t, f in sorted(FAMILIES.items()) if trainer in f.features and f.read_arch)
        raise UnsupportedModelError(
            f"--model {where}: model_type {model_type!r} is not supported by --trainer {trainer} (it takes "
            f"{takes}; `vime models` lists them); {TORCH_HINT}"
        )
    try:
        family.read_arch(HFConfig(config))
    except UnsupportedFeature as e:
        raise UnsupportedModelError(
            f"--model {where}: {family.name} (model_type {model_type!r}) with {e.feature} is not supported by "
            f"--trainer {trainer} (it supports {e.supported}); {TORCH_HINT}"
        ) from None
    except ConversionError as e:
        raise UnsupportedModelError(f"--model {where}: {e} (model_type {model_type!r}); {TORCH_HINT}") from None


def families_table() -> list[dict]:
    """One row per (trainer, family) for ``vime models``: ``trainer``, ``family``, ``model_types``, ``examples``,
    ``tp``, ``ep``, ``routing_replay``, ``lora``, ``notes``. A trainer taking any causal LM gets a first row with
    family ``any causal LM``, then rows only for the families it offers more for (an entry in their ``features``)."""
    rows = []
    families = sorted({id(f): f for f in FAMILIES.values()}.values(), key=lambda f: f.name)
    for trainer, spec in TRAINERS.items():
        if spec.any_causal_lm:
            rows.append(_row(trainer, "any causal LM", ("*",), "AutoModelForCausalLM", spec.default_features, ""))
        for f in families:
            feats = f.features.get(trainer)
            if feats is None or (trainer == "megatron" and f.read_arch is None):
                continue
            notes = f.notes if trainer == "megatron" else ""
            rows.append(_row(trainer, f.name, f.model_types, f.examples, feats, notes))
    return rows


def _row(trainer: str, name: str, types: tuple, examples: str, f: Features, notes: str) -> dict:
    return {
        "trainer": trainer,
        "family": name,
        "model_types": list(types),
        "examples": examples,
        "tp": f.tp,
        "ep": f.ep,
        "routing_replay": f.routing_replay,
        "lora": f.lora,
        "notes": notes,
    }


# ------------------------------------------------------------------------------------------------- dense families
#: HF config fields that make a layer a mixture of experts (a dense family with one of them set is refused)
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def dense_arch(
    cfg: HFConfig, *, qkv_bias: bool, qk_layernorm: bool = False, rope_types: tuple[str, ...] = ("default",)
) -> ArchConfig:
    """The :class:`ArchConfig` of a dense decoder with gated SiLU MLP, RMSNorm and RoPE (Llama layout).

    :param qkv_bias: q/k/v projections have biases (Qwen2 always; Llama/Mistral/Qwen3 with ``attention_bias``).
    :param qk_layernorm: per-head q/k RMSNorm (Qwen3).
    :param rope_types: the RoPE types the family builds (``default``, ``linear``, ``llama3``).
    :raises UnsupportedFeature: an activation other than SiLU, ``mlp_bias``, partial rotary embeddings, a RoPE type
        not in ``rope_types``, MoE fields, multi-latent attention fields.
    :raises ConversionError: heads not a multiple of key/value heads, or a missing size.
    """
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedFeature(f"hidden_act {cfg.get('hidden_act')!r}", "hidden_act silu")
    if cfg.get("mlp_bias", False):
        raise UnsupportedFeature("mlp_bias", "MLP without biases")
    for name in MOE_FIELDS:
        if cfg.get(name, 0):
            raise UnsupportedFeature(f"MoE layers ({name} {cfg.get(name)})", "dense MLP layers")
    if cfg.get("kv_lora_rank") or cfg.get("q_lora_rank"):
        raise UnsupportedFeature("multi-latent attention (kv_lora_rank)", "grouped-query attention")
    rope_type, rope, theta = cfg.rope()
    if rope_type not in rope_types:
        raise UnsupportedFeature(f"rope_type {rope_type!r}", "rope_type " + _alternatives(rope_types))
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise UnsupportedFeature("partial_rotary_factor < 1", "rotary embeddings over the whole head")
    heads = int(cfg.require("num_attention_heads"))
    groups = int(cfg.get("num_key_value_heads", heads))
    if heads % groups:
        raise ConversionError(f"{heads} attention heads are not a multiple of {groups} key/value heads")
    hidden = int(cfg.require("hidden_size"))
    return ArchConfig(
        num_layers=int(cfg.require("num_hidden_layers")),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=int(cfg.get("head_dim", hidden // heads)),
        ffn_hidden_size=int(cfg.require("intermediate_size")),
        vocab_size=int(cfg.require("vocab_size")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        model_type=str(cfg.get("model_type", "llama")),
        qk_layernorm=qk_layernorm,
        rope_scaling=_rope_scaling(rope_type, rope),
    )


def _alternatives(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _rope_scaling(rope_type: str, rope: dict) -> RopeScaling | None:
    """The :class:`RopeScaling` of a ``linear`` / ``llama3`` config (``None`` for ``default``).

    :raises ConversionError: naming a missing parameter (transformers needs them too).
    """
    if rope_type == "default":
        return None
    need = (
        ("factor",)
        if rope_type == "linear"
        else ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    )
    missing = [k for k in need if rope.get(k) is None]
    if missing:
        raise ConversionError(f"rope_type {rope_type!r} needs {', '.join(missing)} in rope_parameters/rope_scaling")
    if rope_type == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    return RopeScaling(
        "llama3",
        float(rope["factor"]),
        float(rope["low_freq_factor"]),
        float(rope["high_freq_factor"]),
        int(rope["original_max_position_embeddings"]),
    )


def _full_attention(cfg: HFConfig, *, use_flag: bool) -> None:
    """Refuse sliding-window attention: the Megatron trainer computes full causal attention.

    :param use_flag: the family switches it on with ``use_sliding_window`` (Qwen2/Qwen3); else (Mistral) a
        ``sliding_window`` shorter than the context is in use.
    """
    window = cfg.get("sliding_window")
    if use_flag:
        used = bool(cfg.get("use_sliding_window", False)) and window is not None
    else:
        used = window is not None and int(window) < int(cfg.get("max_position_embeddings", 0) or 0)
    layer_types = cfg.get("layer_types") or []
    if used or any(t != "full_attention" for t in layer_types):
        raise UnsupportedFeature(f"sliding-window attention (sliding_window {window})", "full attention")


def _read_llama(cfg: HFConfig) -> ArchConfig:
    return dense_arch(cfg, qkv_bias=bool(cfg.get("attention_bias", False)), rope_types=("default", "linear", "llama3"))


def _read_mistral(cfg: HFConfig) -> ArchConfig:
    _full_attention(cfg, use_flag=False)
    return dense_arch(cfg, qkv_bias=bool(cfg.get("attention_bias", False)))


def _read_qwen2(cfg: HFConfig) -> ArchConfig:
    _full_attention(cfg, use_flag=True)
    return dense_arch(cfg, qkv_bias=True)


def _read_qwen3(cfg: HFConfig) -> ArchConfig:
    _full_attention(cfg, use_flag=True)
    return dense_arch(cfg, qkv_bias=bool(cfg.get("attention_bias", False)), qk_layernorm=True)


#: the dense families on the Megatron trainer (the torch trainer takes them as any causal LM)
DENSE_MEGATRON = Features(tp=True, lora=True)

LLAMA = register_family(
    ModelFamily(
        name="Llama",
        model_types=("llama",),
        examples="Llama-3/3.1/3.2/3.3, SmolLM2",
        read_arch=_read_llama,
        features={"megatron": DENSE_MEGATRON},
        notes="RoPE default, linear or llama3 (Llama 3.1+); attention_bias",
    )
)
MISTRAL = register_family(
    ModelFamily(
        name="Mistral",
        model_types=("mistral",),
        examples="Mistral-7B-v0.2/v0.3 (dense)",
        read_arch=_read_mistral,
        features={"megatron": DENSE_MEGATRON},
        notes="RoPE default; full attention (no sliding window)",
    )
)
QWEN2 = register_family(
    ModelFamily(
        name="Qwen2",
        model_types=("qwen2",),
        examples="Qwen2/Qwen2.5 0.5B-72B, Qwen2.5-Coder",
        read_arch=_read_qwen2,
        features={"megatron": DENSE_MEGATRON},
        notes="q/k/v biases; RoPE default; full attention",
    )
)
QWEN3 = register_family(
    ModelFamily(
        name="Qwen3",
        model_types=("qwen3",),
        examples="Qwen3-0.6B-32B (dense), tied or untied",
        read_arch=_read_qwen3,
        features={"megatron": DENSE_MEGATRON},
        notes="q/k RMSNorm; head_dim of its own; RoPE default; full attention",
    )
)

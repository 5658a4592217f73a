"""Models vime can fetch by name and the resolution of ``--model`` / ``--hf-checkpoint`` arguments; importing it
registers the MoE families (:mod:`vime_core.models.moe_families`) in the family registry."""

import vime_core.models.moe_families  # noqa: F401 - registers Qwen3-MoE and DeepSeek-V3 in the family registry
from vime_core.models.prepare import (
    KNOWN_MODELS,
    KnownModel,
    ModelPrepareError,
    default_cache_dir,
    is_prepared,
    prepare_model,
    resolve_model,
)

__all__ = [
    "KNOWN_MODELS",
    "KnownModel",
    "ModelPrepareError",
    "default_cache_dir",
    "is_prepared",
    "prepare_model",
    "resolve_model",
]

"""Models vime can fetch by name and the resolution of ``--model`` / ``--hf-checkpoint`` arguments."""

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

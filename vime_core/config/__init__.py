"""Typed, frozen configuration of a run: the one declaration of every ``vime run`` flag.

Each component's section (:class:`RolloutConfig`, :class:`TrainerConfig`, ...; :class:`RunConfig` composes them)
declares its own flags once (:func:`flag`); the ``vime run`` parser, the YAML loader and ``vime args`` are generated
from the tree (:func:`vime_core.cli.arguments.build_parser`). Plugins declare theirs as a :class:`PluginConfig`.
How to read and extend it: docs/plugins.md and docs/architecture.md ("Flags").
"""

from vime_core.config.flags import (
    ALL_LINEAR,
    DECAY_STYLES,
    FLAG,
    LOSS_AGG_MODES,
    PASSTHROUGH,
    PASSTHROUGH_DESTS,
    REF,
    ConfigError,
    PluginConfig,
    Section,
    add_flags,
    check_plugin_config,
    declared_flags,
    flag,
    flag_name,
    json_object,
    passthrough,
    ref,
)
from vime_core.config.rollout import (
    CodingAgentConfig,
    DataConfig,
    EngineConfig,
    EvalConfig,
    MultiTurnConfig,
    RewardConfig,
    RolloutConfig,
    SandboxConfig,
)
from vime_core.config.run import SECTIONS, ClusterConfig, LoggingConfig, ModelConfig, RunConfig, check_tree
from vime_core.config.training import AlgorithmConfig, LoraConfig, MegatronConfig, TrainerConfig, WeightSyncConfig

__all__ = [
    "ALL_LINEAR",
    "DECAY_STYLES",
    "FLAG",
    "LOSS_AGG_MODES",
    "PASSTHROUGH",
    "PASSTHROUGH_DESTS",
    "REF",
    "SECTIONS",
    "AlgorithmConfig",
    "ClusterConfig",
    "CodingAgentConfig",
    "ConfigError",
    "DataConfig",
    "EngineConfig",
    "EvalConfig",
    "LoggingConfig",
    "LoraConfig",
    "MegatronConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "PluginConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SandboxConfig",
    "Section",
    "TrainerConfig",
    "WeightSyncConfig",
    "add_flags",
    "check_plugin_config",
    "check_tree",
    "declared_flags",
    "flag",
    "flag_name",
    "json_object",
    "passthrough",
    "ref",
]

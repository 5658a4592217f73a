"""The run-wide config sections (model and output, cluster, checkpoint and logging) and :class:`RunConfig`, the
tree of every section; its import-time check that each flag is declared once.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from vime_core.config.flags import (
    FLAG,
    PASSTHROUGH,
    REF,
    ConfigError,
    P,
    PluginConfig,
    Section,
    declared_flags,
    flag,
    flag_name,
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
from vime_core.config.training import AlgorithmConfig, LoraConfig, MegatronConfig, TrainerConfig, WeightSyncConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig(Section):
    """The model, the run's output directory and the seed."""

    TITLE = "model and output"

    model: str = flag(required=True, help="a known model name (see `vime model list`) or a local HF directory")
    output_dir: Path = flag(
        type=Path,
        default=Path("outputs/run"),
        help="directory of the run: metrics.jsonl, report.html, tensorboard/, checkpoints/ (a re-run resumes from "
        "them, see --resume), final_hf/, logs/, summary.json",
    )
    seed: int = flag(type=int, default=1234, help="seed of data shuffling, the trainer and the engines (vLLM --seed)")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig(Section):
    """Ray placement: the cluster, the trainer and engine GPUs, colocation, CPU pinning."""

    TITLE = "cluster (Ray placement; see docs/cluster.md)"

    ray_address: str | None = flag(
        default=None,
        help="join this running Ray cluster (e.g. 10.0.0.1:6379, or 'auto' to read RAY_ADDRESS) instead of "
        "starting a single-node Ray on 127.0.0.1 (default); the GPU flags below are placed on its nodes",
    )
    ray_worker_niceness: int = flag(
        type=int,
        default=0,
        help="niceness of the Ray workers vime starts (trainer, engines, rollout manager) in the single-node Ray it "
        "starts (default 0, the driver's: Ray's own default 15 lets any other process on the machine preempt the "
        "trainer and the engines); a joined cluster (--ray-address) keeps what `ray start` was given "
        "(RAY_worker_niceness)",
    )
    actor_num_nodes: int = flag(
        type=int,
        default=1,
        help="nodes the trainer ranks spread over (default 1); needs --actor-num-gpus-per-node >= 1 when above 1",
    )
    actor_num_gpus_per_node: int = flag(
        type=int,
        default=0,
        help="GPUs (= trainer ranks) per trainer node (default 0: one trainer rank without a GPU, today's CPU "
        "layout); world size = --actor-num-nodes × this",
    )
    rollout_num_gpus: int = flag(
        type=int,
        default=0,
        help="GPUs of all vLLM engines together (default 0: engines without GPUs, --rollout-num-engines of them); "
        "engines = this / --rollout-num-gpus-per-engine; with --colocate it defaults to the trainer's GPUs",
    )
    colocate: bool = flag(
        action="store_true",
        help="engines share the trainer's GPUs (each bundle half trainer rank, half engine) instead of GPUs of "
        "their own (default: disaggregated); needs --actor-num-gpus-per-node",
    )
    offload_rollout: bool = flag(
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --colocate: the engines sleep while the trainer trains and the trainer returns its cached GPU "
        "memory after each step (slime's flag); --no-offload-rollout keeps both resident, for GPUs that hold the "
        "engine (size it with --vllm-gpu-memory-utilization) and the trainer's peak together: no sleep, no wake",
    )
    rollout_num_engines: int = ref()
    rollout_num_gpus_per_engine: int = ref()
    rollout_external: bool = ref()
    debug_rollout_only: bool = ref()
    debug_train_only: bool = ref()
    trainer: str = ref()
    weight_sync: str = ref()
    train_cpus: str | None = ref()
    tensor_model_parallel_size: int = ref()  # the trainer's model-parallel groups must fit its GPUs
    expert_model_parallel_size: int = ref()


@dataclass(frozen=True, slots=True, kw_only=True)
class LoggingConfig(Section):
    """Checkpoints, metrics sinks (TensorBoard, W&B), the HTML report and the debug modes."""

    TITLE = "checkpoint and logging"
    DESCRIPTION = (
        "checkpoints, TensorBoard, W&B (needs the wandb extra: pip install 'vime[wandb]'), the report, debug modes"
    )

    failure_exit_timeout: float = flag(
        type=float,
        default=60.0,
        help="seconds within which a run ends after a systemic failure (every sample of a step failed, every engine "
        "lost, the fully-async producer died): it stops what it started and exits 1 with the error and "
        "summary.json status 'failed' (docs/loop_modes.md). Default 60",
    )
    save_interval: int | None = flag(
        type=int,
        default=None,
        help="steps between checkpoints under OUTPUT_DIR/checkpoints (default: none; a checkpoint is always written "
        "after the last step); combines with --save-interval-minutes (whichever comes first)",
    )
    save_interval_minutes: float | None = flag(
        type=float,
        default=None,
        help="minutes of wall time after which the next finished step is checkpointed (default: off); counted from "
        "the start and from each checkpoint, so combined with --save-interval a step-count checkpoint restarts it",
    )
    keep_checkpoints: int = flag(
        type=int,
        default=1,
        aliases=("--max-checkpoints",),
        metavar="N",
        help="keep the newest N complete checkpoints (default: 1, the one a resume needs; 0: keep all); older ones "
        "are deleted after a new one is complete, so a crash never leaves fewer than one; applies to "
        "--save-interval and --save-interval-minutes checkpoints alike (slime/verl: max_actor_ckpt_to_keep). A "
        "checkpoint holds the optimizer state too: about 3× the model's fp32 weights (1.6 GB for the quickstart)",
    )
    resume: bool = flag(
        action=argparse.BooleanOptionalAction,
        default=True,
        help="resume from OUTPUT_DIR/checkpoints/latest when it exists",
    )
    save_hf: bool = flag(
        action=argparse.BooleanOptionalAction, default=True, help="write OUTPUT_DIR/final_hf at the end"
    )
    use_tensorboard: bool = flag(
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write TensorBoard scalars to OUTPUT_DIR/tensorboard (same metric names as metrics.jsonl and W&B)",
    )
    report: bool = flag(
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write OUTPUT_DIR/report.html (plots of metrics.jsonl, as `vime report OUTPUT_DIR`) when the run ends",
    )
    use_wandb: bool = flag(
        action="store_true",
        help="also log every step's metrics (the names of metrics.jsonl / TensorBoard) to a W&B run whose config "
        "is the resolved arguments; see --wandb-mode",
    )
    wandb_project: str = flag(default="vime", help="W&B project (with --use-wandb)")
    wandb_group: str | None = flag(default=None, help="W&B group that gathers related runs (default: none)")
    wandb_run_name: str | None = flag(default=None, help="W&B run name (default: the last component of --output-dir)")
    wandb_team: str | None = flag(default=None, help="W&B entity (team or user; default: your W&B default)")
    wandb_mode: str = flag(
        choices=["online", "offline", "disabled"],
        default="online",
        help="online: upload as it runs (needs `wandb login` or WANDB_API_KEY); offline: only write the run "
        "files (upload later with `wandb sync DIR`); disabled: no W&B at all",
    )
    wandb_dir: Path | None = flag(
        type=Path, default=None, help="the W&B run files go to WANDB_DIR/wandb/ (default: --output-dir)"
    )
    wandb_run_id: str | None = flag(
        default=None, help="resume this W&B run id instead of starting a new run (default: new)"
    )
    debug_rollout_only: bool = flag(action="store_true", help="no trainer: generate and score only")
    debug_train_only: bool = flag(action="store_true", help="no engines: train on --load-debug-rollout-data")
    save_debug_rollout_data: str | None = flag(
        default=None, help="path pattern with {rollout_id}, e.g. d/p_{rollout_id}.pt"
    )
    load_debug_rollout_data: str | None = flag(default=None, help="path pattern with {rollout_id}; implies train-only")
    model: str = ref()
    output_dir: Path = ref()
    num_rollout: int = ref()


@dataclass(frozen=True, slots=True)
class RunConfig:
    """Every section of a run, built once from the parsed flags (:meth:`from_args`), plus one
    :class:`PluginConfig` per installed plugin that declares flags."""

    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    engine: EngineConfig
    reward: RewardConfig
    eval: EvalConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    megatron: MegatronConfig
    weight_sync: WeightSyncConfig
    lora: LoraConfig
    sandbox: SandboxConfig
    cluster: ClusterConfig
    logging: LoggingConfig
    multi_turn: MultiTurnConfig
    coding_agent: CodingAgentConfig
    plugins: tuple[PluginConfig, ...] = ()

    @classmethod
    def from_args(cls, args: argparse.Namespace, plugin_configs: tuple[type[PluginConfig], ...] = ()) -> RunConfig:
        """Every section read from parsed ``vime run`` arguments, and each of ``plugin_configs`` (the classes the
        installed plugins register: :func:`vime_core.cli.arguments.build_run_config` passes them).

        :raises ConfigError: when ``args`` lacks flags (see :meth:`Section.from_args`).
        """
        sections = {f.name: SECTIONS[f.name].from_args(args) for f in fields(cls) if f.name in SECTIONS}
        return cls(**sections, plugins=tuple(c.from_args(args) for c in plugin_configs))

    def __getattr__(self, name: str) -> Any:
        """Deprecated flat access, for class plugins (trainer backends, weight-sync strategies) written against the
        ``args`` Namespace: ``config.lr`` is the flag of that dest in the section that holds it (or in a plugin's
        flags), with a ``DeprecationWarning`` naming the typed path. Called only when normal lookup fails.

        :raises AttributeError: ``name`` is no flag.
        """
        if name.startswith("_") or name in SECTIONS or name == "plugins":
            raise AttributeError(name)
        for section_name in SECTIONS:
            try:
                section = object.__getattribute__(self, section_name)
            except AttributeError:  # not set yet (unpickling): nothing to look up
                raise AttributeError(name) from None
            if name in section.__dataclass_fields__:
                return _deprecated_flat(name, f"config.{section_name}.{name}", getattr(section, name))
        for plugin_config in object.__getattribute__(self, "plugins"):
            if name in plugin_config.__dataclass_fields__:
                where = f"config.plugin({type(plugin_config).__name__}).{name}"
                return _deprecated_flat(name, where, getattr(plugin_config, name))
        raise AttributeError(f"RunConfig has no section or flag {name!r}")

    def plugin(self, cls: type[P]) -> P:
        """The flags of the plugin whose flag class is ``cls``.

        :raises ConfigError: when this config was built without ``cls`` (not registered by an installed plugin, or
            built by ``from_args`` without ``plugin_configs``).
        """
        for p in self.plugins:
            if type(p) is cls:
                return p
        raise ConfigError(
            f"this run's config holds no {cls.__qualname__} flags: the plugin that declares them is not installed "
            "or not loaded, or the config was built without plugin_configs (use "
            "vime_core.cli.arguments.build_run_config)"
        )


def _deprecated_flat(name: str, where: str, value: Any) -> Any:
    warnings.warn(
        f"reading the flag {name!r} as an attribute of the run's config (the old args.{name}) is deprecated and "
        f"stops working in vime 0.2; read {where}",
        DeprecationWarning,
        stacklevel=3,
    )
    return value


# RunConfig field → its section class.
SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "engine": EngineConfig,
    "reward": RewardConfig,
    "eval": EvalConfig,
    "algorithm": AlgorithmConfig,
    "trainer": TrainerConfig,
    "megatron": MegatronConfig,
    "weight_sync": WeightSyncConfig,
    "lora": LoraConfig,
    "sandbox": SandboxConfig,
    "cluster": ClusterConfig,
    "logging": LoggingConfig,
    "multi_turn": MultiTurnConfig,
    "coding_agent": CodingAgentConfig,
}


def check_tree(sections: Iterable[type[Section]]) -> None:
    """Each flag declared by exactly one of ``sections``; each :func:`ref` names a flag one of them declares, under
    the same type; every field is a flag, a ref or a pass-through. Runs on :data:`SECTIONS` at import: a drifted
    tree fails at once, naming the field.

    :raises ConfigError: naming the section, the field and what is wrong.
    """
    sections = list(sections)
    declared: dict[str, tuple[str, Any]] = {}
    for cls in sections:
        for f in declared_flags(cls):
            if f.name in declared:
                raise ConfigError(f"flag {flag_name(f)} declared twice: {declared[f.name][0]} and {cls.__name__}")
            declared[f.name] = (cls.__name__, f.type)
    for cls in sections:
        for f in fields(cls):
            if REF in f.metadata:
                if f.name not in declared:
                    raise ConfigError(f"{cls.__name__}.{f.name} is a ref() but no section declares {flag_name(f)}")
                if declared[f.name][1] != f.type:
                    raise ConfigError(
                        f"{cls.__name__}.{f.name}: type {f.type} differs from the declaring "
                        f"{declared[f.name][0]}'s {declared[f.name][1]}"
                    )
            elif FLAG not in f.metadata and PASSTHROUGH not in f.metadata:
                raise ConfigError(f"{cls.__name__}.{f.name}: declare it with flag(), ref() or passthrough()")


check_tree(SECTIONS.values())

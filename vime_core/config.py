"""Typed, frozen configuration of a run: one object per component, built from the parsed ``vime run`` flags.

Each component receives only its own section (:class:`RolloutConfig`, :class:`TrainerConfig`,
:class:`AlgorithmConfig`, :class:`WeightSyncConfig`, ...; :class:`RunConfig` composes them), each built by
``from_args`` from the Namespace. Fields are named like the flags' ``dest`` and have no defaults: defaults live only
in the flag definitions (:func:`vime_core.arguments.default_args` fills a Namespace without a command line).
``tests/unit/test_config.py`` checks both directions. For plugins: docs/plugins.md.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Self

# Namespace attributes that are not parser flags but set by parse_run_args: the --vllm-* / --router-* pass-through.
PASSTHROUGH_DESTS = ("vllm_args", "router_args")


class ConfigError(ValueError):
    """A Namespace that lacks flags a config section needs (built by hand instead of by the parser)."""


class _Section:
    """Base of the config sections: :meth:`from_args` reads each field from the Namespace attribute of its name."""

    __slots__ = ()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Self:
        """This section's flags read from parsed ``vime run`` arguments.

        :raises ConfigError: naming the missing flags when ``args`` lacks some (a hand-built Namespace; build it
            with :func:`vime_core.arguments.default_args` instead).
        """
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        missing = [n for n in names if not hasattr(args, n)]
        if missing:
            flags = ", ".join(n if n in PASSTHROUGH_DESTS else "--" + n.replace("_", "-") for n in missing)
            raise ConfigError(
                f"{cls.__name__} needs the flags {flags}, which the arguments lack; build the Namespace with "
                "vime_core.arguments.default_args(**overrides) (every flag at its default) or parse_run_args(argv)"
            )
        return cls(**{n: getattr(args, n) for n in names})


@dataclass(frozen=True, slots=True)
class DataConfig(_Section):
    """Prompt data (group 'data'): where the prompts are and how a row is read."""

    prompt_data: Path | None
    input_key: str
    label_key: str
    metadata_key: str
    apply_chat_template: bool
    rollout_shuffle: bool
    seed: int
    generate: str  # the default generate function applies the chat template: the prompt checks need to know
    rollout_max_prompt_len: int | None
    filter_overlong_prompts: bool


@dataclass(frozen=True, slots=True)
class RolloutConfig(_Section):
    """Training rollouts: batch sizes, the loop and staleness, sampling, the generate/reward plugins, dynamic sampling,
    over-sampling, overlong shaping and partial rollouts."""

    model: str
    output_dir: Path
    seed: int
    num_rollout: int
    rollout_batch_size: int
    n_samples_per_prompt: int
    loop: str
    max_staleness: int
    stale_policy: str
    rollout_inflight_groups: int | None
    rollout_temperature: float
    rollout_top_p: float
    rollout_top_k: int
    rollout_min_p: float | None
    rollout_repetition_penalty: float | None
    rollout_sampling_params: dict[str, Any] | None
    rollout_max_response_len: int
    rollout_max_context_len: int | None
    rollout_stop: list[str] | None
    rollout_stop_token_ids: list[int] | None
    rollout_concurrency: int
    generate: str
    reward: str
    reward_key: str | None
    group_reward: str | None
    reward_timeout: float | None
    apply_chat_template: bool
    dynamic_sampling_filter: str | None
    over_sampling_batch_size: int | None
    dynamic_sampling_max_rounds: int
    overlong_filter: bool
    overlong_buffer_len: int | None
    overlong_penalty_factor: float
    partial_rollout: bool
    mask_offpolicy_in_partial_rollout: bool
    save_debug_rollout_data: str | None
    load_debug_rollout_data: str | None


@dataclass(frozen=True, slots=True)
class EngineConfig(_Section):
    """The vLLM engines and the router vime starts (or joins), and the teacher engines of on-policy distillation."""

    model: str
    output_dir: Path
    generate: str
    seed: int
    train_dtype: str
    rollout_num_engines: int
    rollout_num_gpus_per_engine: int
    rollout_enforce_eager: bool | None  # None: eager on a CPU, CUDA graphs on a GPU
    rollout_cpu_bind: list[str] | None
    rollout_kv_cache_gib: int
    rollout_engine_startup_timeout: float
    rollout_max_engine_restarts: int
    rollout_engine_restart_backoff: float
    rollout_health_check_interval: float
    rollout_engine_hang_timeout: float
    rollout_max_request_retries: int
    rollout_engine_access_log: bool
    update_weight_disk_dir: Path | None  # a replacement engine's full load is written there (rollout/health.py)
    vllm_router_ip: str | None
    vllm_router_port: int | None
    vllm_args: list[str]
    router_args: list[str]
    weight_sync: str
    weight_sync_timeout: float
    distill_teacher: str | None
    distill_num_engines: int


@dataclass(frozen=True, slots=True)
class RewardConfig(_Section):
    """The reward function and the built-in rewards' own flags."""

    reward: str
    reward_key: str | None
    group_reward: str | None
    reward_timeout: float | None
    rm_url: str | None
    rm_concurrency: int
    rm_timeout: float
    rm_max_retries: int
    math_verify_timeout: float
    math_verify_workers: int
    math_last_number_fallback: bool


@dataclass(frozen=True, slots=True)
class EvalConfig(_Section):
    """Held-out evaluation (group 'evaluation') and the rollout sampling it falls back to."""

    eval_prompt_data: list[str] | None
    eval_interval: int | None
    skip_eval_before_train: bool
    n_samples_per_eval_prompt: int
    eval_temperature: float | None
    eval_top_p: float | None
    eval_top_k: int | None
    eval_min_p: float | None
    eval_repetition_penalty: float | None
    eval_sampling_params: dict[str, Any] | None
    eval_set_sampling_params: dict[str, dict[str, Any]] | None
    eval_max_response_len: int | None
    eval_reward: str | None
    eval_pass_threshold: float
    save_eval_samples: bool
    output_dir: Path
    reward: str
    reward_key: str | None
    input_key: str
    label_key: str
    metadata_key: str
    rollout_temperature: float
    rollout_top_p: float
    rollout_top_k: int
    rollout_min_p: float | None
    rollout_repetition_penalty: float | None
    rollout_sampling_params: dict[str, Any] | None
    rollout_max_response_len: int
    rollout_stop: list[str] | None
    rollout_stop_token_ids: list[int] | None


@dataclass(frozen=True, slots=True)
class AlgorithmConfig(_Section):
    """Advantage estimators, loss terms, KL, critic, distillation and train/inference-mismatch correction."""

    advantage_estimator: str
    disable_grpo_std_normalization: bool
    reward_key: str | None
    normalize_advantages: bool
    gamma: float
    lambd: float
    value_clip: float
    critic_load: str | None
    critic_lr: float | None
    critic_lr_warmup_iters: int
    num_critic_only_steps: int
    distill_teacher: str | None
    distill_coef: float
    distill_num_engines: int
    eps_clip: float
    eps_clip_high: float | None
    eps_clip_c: float | None
    calculate_per_token_loss: bool
    loss_agg_mode: str | None
    loss_scale_factor: float | None
    rollout_max_response_len: int
    entropy_coef: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    kl_coef: float
    ref_load: str | None
    use_rollout_logprobs: bool
    use_tis: bool
    use_mis: bool
    tis_clip_low: float
    tis_clip: float
    max_train_rollout_logprob_diff: float | None
    dynamic_sampling_filter: str | None


@dataclass(frozen=True, slots=True)
class TrainerConfig(_Section):
    """The trainer backend: optimizer, learning-rate schedule, batch split, device and precision."""

    trainer: str
    seed: int
    lr: float
    critic_lr: float | None
    critic_lr_warmup_iters: int
    lr_warmup_iters: int
    lr_warmup_init: float
    lr_decay_style: str
    lr_decay_iters: int | None
    min_lr: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    weight_decay: float
    clip_grad: float
    train_device: str
    train_dtype: str
    train_num_threads: int | None
    gradient_checkpointing: bool
    train_cpus: str | None
    num_rollout: int
    rollout_batch_size: int
    n_samples_per_prompt: int
    global_batch_size: int | None
    micro_batch_size: int


@dataclass(frozen=True, slots=True)
class MegatronConfig(_Section):
    """The megatron trainer backend's flags (Megatron-LM's names)."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    sequence_parallel: bool
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None
    use_distributed_optimizer: bool
    megatron_attention: str | None


@dataclass(frozen=True, slots=True)
class WeightSyncConfig(_Section):
    """Weight sync from the trainer to the engines: the strategy and its flags."""

    model: str
    weight_sync: str
    update_weight_disk_dir: Path | None
    keep_weight_updates: bool
    weight_sync_timeout: float
    update_weight_delta_encoding: str
    update_weight_delta_zstd_level: int
    update_weight_delta_base: str | None
    update_weight_buffer_size: int
    update_weight_checksums: bool
    rollout_num_engines: int
    rollout_num_gpus_per_engine: int


@dataclass(frozen=True, slots=True)
class LoraConfig(_Section):
    """LoRA (``--lora-rank`` > 0): the adapter the trainer trains and the engines serve (docs/lora.md)."""

    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    target_modules: list[str]
    exclude_modules: list[str] | None
    lora_adapter_path: Path | None
    model: str
    trainer: str
    weight_sync: str
    loop: str
    max_staleness: int
    keep_weight_updates: bool
    vllm_args: list[str]

    @property
    def enabled(self) -> bool:
        """Whether the run trains a LoRA adapter instead of every weight."""
        return self.lora_rank > 0


@dataclass(frozen=True, slots=True)
class SandboxConfig(_Section):
    """The sandbox backend and the limits every backend applies (0 = none)."""

    sandbox: str
    sandbox_network: bool
    sandbox_cpus: float
    sandbox_memory_mb: int
    sandbox_disk_mb: int
    sandbox_pids: int
    sandbox_wall_time: float
    sandbox_max_output_bytes: int
    sandbox_exec_timeout: float


@dataclass(frozen=True, slots=True)
class ClusterConfig(_Section):
    """Ray placement: the cluster, the trainer and engine GPUs, colocation, CPU pinning."""

    ray_address: str | None
    ray_worker_niceness: int
    actor_num_nodes: int
    actor_num_gpus_per_node: int
    rollout_num_gpus: int
    colocate: bool
    rollout_num_engines: int
    rollout_num_gpus_per_engine: int
    debug_rollout_only: bool
    debug_train_only: bool
    trainer: str
    weight_sync: str
    train_cpus: str | None


@dataclass(frozen=True, slots=True)
class LoggingConfig(_Section):
    """Checkpoints, metrics sinks (TensorBoard, W&B), the HTML report and the debug modes."""

    model: str
    output_dir: Path
    num_rollout: int
    save_interval: int | None
    save_interval_minutes: float | None
    max_checkpoints: int | None
    resume: bool
    save_hf: bool
    use_tensorboard: bool
    report: bool
    use_wandb: bool
    wandb_project: str
    wandb_group: str | None
    wandb_run_name: str | None
    wandb_team: str | None
    wandb_mode: str
    wandb_dir: Path | None
    wandb_run_id: str | None
    debug_rollout_only: bool
    debug_train_only: bool
    save_debug_rollout_data: str | None
    load_debug_rollout_data: str | None
    failure_exit_timeout: float


@dataclass(frozen=True, slots=True)
class MultiTurnConfig(_Section):
    """The multi_turn generate function (--generate multi_turn)."""

    multi_turn_tools: list[str] | None
    multi_turn_tool_parser: str
    multi_turn_max_turns: int
    multi_turn_max_tokens_per_turn: int | None
    multi_turn_tool_timeout: float
    multi_turn_max_tool_output_tokens: int
    multi_turn_tool_prompt: str
    multi_turn_chat_template: Path | None
    multi_turn_sandbox_tool: str | None
    apply_chat_template: bool
    rollout_max_context_len: int | None
    rollout_max_response_len: int
    sandbox: str


@dataclass(frozen=True, slots=True)
class CodingAgentConfig(_Section):
    """The coding_agent generate function (--generate coding_agent)."""

    agent: str | None
    agent_max_turns: int
    agent_wall_time: float
    agent_max_tokens: int | None
    agent_tool_parser: str
    agent_chat_template: Path | None
    agent_history: str
    agent_max_file_bytes: int
    agent_record_turns: bool
    rollout_max_context_len: int | None
    rollout_max_response_len: int
    sandbox: str


@dataclass(frozen=True, slots=True)
class RunConfig:
    """Every section of a run, built once from the parsed flags (:meth:`from_args`)."""

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

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunConfig:
        """Every section read from parsed ``vime run`` arguments.

        :raises ConfigError: when ``args`` lacks flags (see :meth:`_Section.from_args`).
        """
        return cls(**{f.name: SECTIONS[f.name].from_args(args) for f in fields(cls)})


# RunConfig field → its section class.
SECTIONS: dict[str, type[_Section]] = {
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

"""The training side's config sections: algorithm, trainer, Megatron, weight sync, LoRA. Each declares its own
flags once (:func:`vime_core.config.flags.flag`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from vime_core.config.flags import ALL_LINEAR, DECAY_STYLES, LOSS_AGG_MODES, Section, flag, passthrough, ref


@dataclass(frozen=True, slots=True, kw_only=True)
class AlgorithmConfig(Section):
    """Advantage estimators, loss terms, KL, critic, distillation and train/inference-mismatch correction."""

    TITLE = "algorithm"
    DESCRIPTION = "estimators, loss terms, KL, critic, distillation, train/inference mismatch"

    allow_off_policy_without_correction: bool = flag(
        action="store_true",
        help="let --loop one-step-off / fully-async train without --use-tis, --use-mis or --use-rollout-logprobs "
        "(refused by default: the PPO ratio is then anchored to the trainer's current policy instead of the policy "
        "that generated the tokens); a warning is logged at startup. Default: off",
    )
    advantage_estimator: str = flag(
        default="grpo",
        help="advantage estimator: grpo, gspo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, ppo, "
        "on_policy_distill, or a plugin's name (`vime plugins`)",
    )
    disable_grpo_std_normalization: bool = flag(action="store_true", help="Dr.GRPO: A = r - mean(r)")
    eps_clip: float = flag(type=float, default=0.2, help="PPO clip range: ratio clipped to [1-eps, 1+eps-high]")
    eps_clip_high: float | None = flag(
        type=float, default=None, help="upper clip range (DAPO clip-higher; default: --eps-clip)"
    )
    calculate_per_token_loss: bool = flag(
        action="store_true",
        help="average the loss over all tokens of the batch (default: per-sample mean, then over samples); "
        "the same as --loss-agg-mode token-mean",
    )
    loss_agg_mode: str | None = flag(
        choices=LOSS_AGG_MODES,
        default=None,
        help="how token losses become one loss (verl's names; docs/algorithms.md): token-mean (mean over the "
        "batch's tokens), seq-mean-token-mean (mean over samples of each sample's token mean), "
        "seq-mean-token-sum-norm (Dr.GRPO: mean over samples of each sample's token sum / --loss-scale-factor) "
        "(default: token-mean with --calculate-per-token-loss, else seq-mean-token-mean)",
    )
    loss_scale_factor: float | None = flag(
        type=float,
        default=None,
        help="the constant divisor of --loss-agg-mode seq-mean-token-sum-norm (default: --rollout-max-response-len)",
    )
    use_rollout_logprobs: bool = flag(
        action="store_true",
        help="bypass mode: the engine's log-probs are the PPO ratio's old policy (no recomputation by the trainer)",
    )
    normalize_advantages: bool = flag(action="store_true", help="whiten advantages over the batch's tokens")
    gamma: float = flag(type=float, default=1.0, help="discount (REINFORCE++ returns, GAE)")
    lambd: float = flag(type=float, default=1.0, help="GAE lambda (ppo)")
    value_clip: float = flag(type=float, default=0.2, help="critic value clip (ppo)")
    critic_load: str | None = flag(
        default=None,
        help="ppo critic: HF dir or known name, or a saved critic dir (default: --model + a new value head)",
    )
    critic_lr: float | None = flag(type=float, default=None, help="ppo critic learning rate (default: --lr)")
    critic_lr_warmup_iters: int = flag(
        type=int,
        default=0,
        help="ppo critic: optimizer steps of linear learning-rate warm-up from --lr-warmup-init to --critic-lr "
        "(slime's flag); --lr-decay-style, --lr-decay-iters and --min-lr apply to the critic too. Default: 0 (none)",
    )
    num_critic_only_steps: int = flag(type=int, default=0, help="ppo: train only the critic first N steps")
    distill_teacher: str | None = flag(
        default=None, help="on-policy distillation teacher (HF dir or known name), served by its own vLLM engines"
    )
    distill_coef: float = flag(
        type=float, default=1.0, help="λ of the distill advantage λ·(logp_teacher - logp_student)"
    )
    distill_num_engines: int = flag(type=int, default=1, help="vLLM servers of the teacher engine group")
    eps_clip_c: float | None = flag(
        type=float, default=None, help="dual-clip PPO constant c > 1 (loss of A<0 <= -c·A)"
    )
    entropy_coef: float = flag(type=float, default=0.0, help="entropy bonus weight")
    use_kl_loss: bool = flag(action="store_true", help="KL to the reference model as a loss term")
    kl_loss_coef: float = flag(type=float, default=0.0, help="weight of the KL loss (0: logged only)")
    kl_loss_type: str = flag(
        default="k1",
        choices=["k1", "k2", "k3", "low_var_kl"],
        help="KL estimator of --use-kl-loss (Schulman's k1/k2/k3; low_var_kl = k3 clamped to [-10, 10])",
    )
    kl_coef: float = flag(type=float, default=0.0, help="KL as reward shaping (reinforce_plus_plus*)")
    ref_load: str | None = flag(default=None, help="reference model: HF dir or known name (default: --model)")
    use_rollout_routing_replay: bool = flag(
        action="store_true",
        help="rollout routing replay (R3, upstream vime's flag), MoE models: the engines return the experts each "
        "token was routed to (vLLM's --enable-return-routed-experts), every sample carries them, and every trainer "
        "forward pass routes each token to the engine's experts with the gate weights from the trainer's own scores "
        "(docs/routing_replay.md). Default: off",
    )
    use_rollout_correction: bool = flag(
        action="store_true",
        help="decoupled three-policy PPO (upstream's flag): the PPO ratio against the trainer's recomputed old "
        "policy, each token's loss × the IS weight old/rollout (--use-tis) and/or rejection (--use-rs, "
        "--rs-veto-threshold); needs one of those, refused with --use-rollout-logprobs (bypass). --use-tis, --use-mis "
        "and --use-rs alone run the same loss. Default: off",
    )
    use_tis: bool = flag(
        action="store_true",
        help="importance sampling: each token's pg loss × the weight w = exp(logp_old - logp_rollout) at --tis-level, "
        "bounded by --tis-mode (default truncate: min(w, --tis-clip))",
    )
    use_mis: bool = flag(
        action="store_true",
        help="masked IS (IcePop) at token level: weight 0 for tokens whose w is outside [--tis-clip-low, --tis-clip], "
        "the token kept in the loss's denominators (--use-tis --tis-mode mask instead drops it from them)",
    )
    tis_mode: str | None = flag(
        choices=["truncate", "clip", "mask"],
        default=None,
        help="with --use-tis: truncate (min(w, --tis-clip)), clip (clamp(w, --tis-clip-low, --tis-clip)) or mask "
        "(w kept, tokens outside [--tis-clip-low, --tis-clip] rejected). Default: truncate",
    )
    tis_level: str | None = flag(
        choices=["token", "sequence", "geometric"],
        default=None,
        help="with --use-tis: the weight of each token (token), the product of the sequence's token ratios (sequence) "
        "or their geometric mean (geometric) on every token of the sequence. Default: token",
    )
    tis_clip_low: float = flag(
        type=float, default=0.0, help="IS band lower bound (--tis-mode clip and mask, --use-mis). Default: 0"
    )
    tis_clip: float = flag(
        type=float, default=2.0, help="IS band upper bound (every --tis-mode, --use-mis). Default: 2"
    )
    tis_batch_normalize: bool = flag(
        action="store_true",
        help="with --use-tis: divide the weights by their mean over the step's batch (per token at token level, per "
        "sequence at sequence/geometric level), so that they average 1. Default: off",
    )
    use_rs: bool = flag(
        action="store_true",
        help="rejection sampling: drop the tokens (or, at sequence/geometric level, whole sequences) whose ratio "
        "old/rollout at --rs-level is outside [--rs-lower-bound, --rs-upper-bound]; needs --rs-upper-bound",
    )
    rs_level: str | None = flag(
        choices=["token", "sequence", "geometric"],
        default=None,
        help="with --use-rs: the ratio's level. Default: token",
    )
    rs_lower_bound: float | None = flag(
        type=float, default=None, help="with --use-rs: accepted band's lower bound. Default: 1 / --rs-upper-bound"
    )
    rs_upper_bound: float | None = flag(type=float, default=None, help="with --use-rs: accepted band's upper bound")
    rs_veto_threshold: float | None = flag(
        type=float,
        default=None,
        help="veto: reject a whole sequence that has a token with ratio old/rollout below this (typical 1e-4 .. 1e-6)",
    )
    get_mismatch_metrics: bool = flag(
        action="store_true",
        help="log train/mismatch/* every step (trainer and engine log-ppl and ppl, KL, k3 KL, log-ppl difference, "
        "ppl ratio, |Δlogp|) without changing the loss. Default: off",
    )
    max_train_rollout_logprob_diff: float | None = flag(
        type=float,
        default=None,
        help="stop the run when mean |logp_trainer - logp_engine| exceeds this (nats per token)",
    )
    dynamic_sampling_filter: str | None = flag(default=None, help="DAPO group filter, e.g. check_reward_nonzero_std")
    reward_key: str | None = ref()
    rollout_max_response_len: int = ref()


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerConfig(Section):
    """The trainer backend: optimizer, learning-rate schedule, batch split, device and precision."""

    TITLE = "training"
    DESCRIPTION = "the trainer backend, optimizer, learning-rate schedule, batch split, device"

    global_batch_size: int | None = flag(type=int, default=None, help="samples per optimizer step (default: all)")
    micro_batch_size: int = flag(type=int, default=8, help="samples per forward/backward pass")
    trainer: str = flag(default="torch", help="trainer backend")
    lr: float = flag(type=float, default=1e-6, help="peak policy learning rate (AdamW); see --lr-decay-style")
    lr_warmup_iters: int = flag(
        type=int,
        default=0,
        help="optimizer steps (one per --global-batch-size samples) of linear warm-up from --lr-warmup-init to "
        "--lr (Megatron's flag and formula; the critic has --critic-lr-warmup-iters). Default: 0 (none)",
    )
    lr_warmup_init: float = flag(
        type=float,
        default=0.0,
        help="learning rate of the first step of a --lr-warmup-iters warm-up (Megatron's flag). Default: 0.0",
    )
    lr_decay_style: str = flag(
        choices=DECAY_STYLES,
        default="constant",
        help="after the warm-up: constant --lr, or a linear / cosine decay to --min-lr at --lr-decay-iters, for the "
        "policy and the critic (Megatron's formulas). Default: constant",
    )
    lr_decay_iters: int | None = flag(
        type=int,
        default=None,
        help="the optimizer step at which a linear/cosine decay reaches --min-lr. Default: every optimizer step of "
        "the run, --num-rollout × rollout-batch-size × n-samples-per-prompt / --global-batch-size",
    )
    min_lr: float = flag(
        type=float,
        default=0.0,
        help="the learning rate a linear/cosine --lr-decay-style ends at (policy and critic). Default: 0.0",
    )
    adam_beta1: float = flag(type=float, default=0.9, help="Adam beta1")
    adam_beta2: float = flag(type=float, default=0.98, help="Adam beta2")
    adam_eps: float = flag(type=float, default=1e-8, help="Adam epsilon")
    weight_decay: float = flag(type=float, default=0.0, help="decoupled weight decay (AdamW)")
    clip_grad: float = flag(type=float, default=1.0, help="clip the global gradient L2 norm to this value")
    train_device: str = flag(default="cpu", help="torch device of the torch trainer (cpu, cuda, cuda:1)")
    train_dtype: str = flag(
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="parameter dtype of the trainer (the engines get the weights in their own dtype)",
    )
    train_num_threads: int | None = flag(
        type=int, default=None, help="torch intra-op threads of the trainer (default: every core the trainer may use)"
    )
    gradient_checkpointing: bool = flag(action="store_true", help="recompute activations in backward (less memory)")
    freeze_vision_tower: bool = flag(
        action=argparse.BooleanOptionalAction,
        default=False,
        help="vision-language models: keep the vision tower (encoder and merger) at its loaded weights and sync only "
        "the language model to the engines. Default: off (the tower trains, as upstream vime's Megatron-Bridge "
        "models do: freeze_vision_model=False)",
    )
    train_cpus: str | None = flag(
        default=None, help="CPU cores the trainer runs on, e.g. '1' or '2-3,6' (os.sched_setaffinity; default: all)"
    )
    manual_gc: bool = flag(
        action="store_true",
        help="Python's automatic garbage collection off in the trainer ranks; a full collection after every "
        "--manual-gc-interval train steps instead (Megatron-LM's flag). Default: automatic, with the start-up heap "
        "frozen out of it (perf/train_gc_time says what collections cost a step)",
    )
    manual_gc_interval: int = flag(
        type=int,
        default=0,
        help="with --manual-gc: train steps between full collections; 0 collects only at start-up (Megatron-LM's "
        "flag). Default: 0",
    )
    seed: int = ref()
    critic_lr: float | None = ref()
    critic_lr_warmup_iters: int = ref()
    num_rollout: int = ref()
    rollout_batch_size: int = ref()
    n_samples_per_prompt: int = ref()
    fp32_lm_head: bool = ref()


@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronConfig(Section):
    """The megatron trainer backend's flags (Megatron-LM's names)."""

    TITLE = "megatron (--trainer megatron; Megatron-LM's flag names)"

    tensor_model_parallel_size: int = flag(
        type=int,
        default=1,
        help="Megatron tensor parallel size (ranks that split each layer); needs that many GPUs per trainer",
    )
    pipeline_model_parallel_size: int = flag(type=int, default=1, help="Megatron pipeline parallel size (only 1 yet)")
    context_parallel_size: int = flag(type=int, default=1, help="Megatron context parallel size (only 1 yet)")
    sequence_parallel: bool = flag(
        action="store_true", help="Megatron sequence parallelism (with --tensor-model-parallel-size > 1)"
    )
    recompute_granularity: str | None = flag(
        choices=["full", "selective"],
        default=None,
        help="Megatron activation recomputation: full layers or selective (attention core); default: none",
    )
    recompute_method: str | None = flag(
        choices=["uniform", "block"],
        default=None,
        help="with --recompute-granularity full: uniform (every N layers) or block (the first N layers per stage)",
    )
    recompute_num_layers: int | None = flag(
        type=int, default=None, help="N of --recompute-method (layers; default: Megatron's)"
    )
    use_distributed_optimizer: bool = flag(
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shard the optimizer state over data-parallel ranks (Megatron's distributed optimizer)",
    )
    expert_model_parallel_size: int = flag(
        type=int,
        default=1,
        help="Megatron expert parallel size (MoE models): the routed experts are split over this many ranks, tokens "
        "exchanged by all-to-all; must divide the experts and, times --tensor-model-parallel-size, the trainer's GPUs",
    )
    moe_aux_loss_coeff: float = flag(
        type=float,
        default=0.0,
        help="MoE models on the megatron trainer: weight of megatron-core's load-balancing (aux) loss, added to every "
        "micro-batch's loss (Megatron's flag). Default: 0.0 (none)",
    )
    megatron_attention: str | None = flag(
        choices=["te", "sdpa", "local"],
        default=None,
        help="core attention: Transformer Engine spec (default when TE imports), torch SDPA in the local "
        "spec (default otherwise), or Megatron's unfused local attention",
    )
    qkv_format: str = flag(
        choices=["bshd", "thd"],
        default="bshd",
        help="micro-batch layout: bshd right-pads every sample to the longest; thd packs a micro-batch into one row "
        "without padding (megatron-core's packed format: RoPE and attention per sample; needs "
        "--megatron-attention sdpa or te). slime's flag",
    )
    bias_swiglu_fusion: bool = flag(
        action=argparse.BooleanOptionalAction,
        default=True,
        help="SiLU(gate)·up in one fused kernel (Megatron-LM's flag; torch.compile): one bf16 rounding, as vLLM's "
        "kernel does, and less memory traffic; off where it does not compile (the trainer logs it)",
    )
    deterministic_mode: bool = flag(
        action="store_true",
        help="deterministic kernels in the trainer (Megatron-LM's flag): torch's deterministic algorithms, and "
        "vLLM's batch-invariant matmul/softmax/mean where vLLM is installed; with "
        "--vllm-enable-deterministic-inference the true-on-policy mode (docs/gpu.md)",
    )
    fp32_lm_head: bool = ref()


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightSyncConfig(Section):
    """Weight sync from the trainer to the engines: the strategy and its flags."""

    TITLE = "weight sync"
    DESCRIPTION = "the strategy and its flags (disk-delta, nccl)"

    weight_sync: str = flag(default="disk", help="weight-sync strategy")
    update_weight_disk_dir: Path | None = flag(type=Path, default=None, help="default: OUTPUT_DIR/weights")
    keep_weight_updates: bool = flag(
        action="store_true",
        help="keep each weight update under --update-weight-disk-dir (default: deleted after the sync)",
    )
    weight_sync_timeout: float = flag(type=float, default=300.0, help="seconds per engine")
    update_weight_delta_encoding: str = flag(
        choices=["xor", "sub", "overwrite"],
        default="sub",
        help="disk-delta: xor of old and new bytes, integer difference of each element's bits (both "
        "applied once), or changed byte positions + new bytes",
    )
    update_weight_delta_zstd_level: int = flag(type=int, default=1, help="disk-delta: zstandard level")
    update_weight_delta_base: str | None = flag(
        default=None, help="disk-delta: HF directory the engines start from (the first delta's base); default --model"
    )
    update_weight_buffer_size: int = flag(
        type=int,
        default=512 * 2**20,
        help="nccl, ipc: bucket size in bytes (tensors are broadcast in buckets of at most this size; slime's flag)",
    )
    update_weight_checksums: bool = flag(
        action="store_true", help="nccl: attach an xxh3-128 digest per tensor; receivers verify before loading"
    )
    model: str = ref()
    rollout_num_engines: int = ref()
    rollout_num_gpus_per_engine: int = ref()


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraConfig(Section):
    """LoRA (``--lora-rank`` > 0): the adapter the trainer trains and the engines serve (docs/lora.md)."""

    TITLE = "LoRA (docs/lora.md; upstream vime's flag names)"

    lora_rank: int = flag(
        type=int,
        default=0,
        help="LoRA rank r: train a PEFT LoRA adapter (only its parameters get gradients and optimizer state) and "
        "sync only the adapter to the engines; 0: full fine-tuning (default)",
    )
    lora_alpha: float = flag(type=float, default=16.0, help="LoRA alpha (the update is scaled alpha / r)")
    lora_dropout: float = flag(type=float, default=0.0, help="dropout on the LoRA branch's input, in [0, 1)")
    target_modules: list[str] = flag(
        nargs="+",
        default=[ALL_LINEAR],
        help="modules that get an adapter: all-linear (every linear layer but the output layer) or module names "
        "(q_proj v_proj, or comma-separated)",
    )
    exclude_modules: list[str] | None = flag(
        nargs="+", default=None, help="module names left without an adapter (e.g. down_proj; default: none)"
    )
    lora_adapter_path: Path | None = flag(
        type=Path,
        default=None,
        help="start from this PEFT adapter directory (adapter_config.json + adapter_model.safetensors) instead of "
        "a fresh one; its rank must equal --lora-rank",
    )
    model: str = ref()
    trainer: str = ref()
    weight_sync: str = ref()
    loop: str = ref()
    max_staleness: int = ref()
    keep_weight_updates: bool = ref()
    vllm_args: list[str] = passthrough()

    @property
    def enabled(self) -> bool:
        """Whether the run trains a LoRA adapter instead of every weight."""
        return self.lora_rank > 0

"""Algorithm options: what the flags of an :class:`~vime_core.config.AlgorithmConfig` imply, and the checks of
their combination.

The flags and their defaults are defined in :mod:`vime_core.cli.arguments` (group "algorithm"). This module imports no
torch (the argument parser imports it).
"""

from __future__ import annotations

import math

from vime_core.config import LOSS_AGG_MODES, AlgorithmConfig

# the estimators of vime_core.algorithms.kl.approx_kl, named here so that this module needs no torch
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")

# Estimators whose advantages are returns of per-token rewards, so that --kl-coef can shape those rewards.
KL_SHAPING_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
# Estimators whose advantages are whitened over the whole batch (REINFORCE++, Hu et al. 2025, arXiv:2501.03262).
BATCH_WHITENED_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
# Estimators trained with a critic (value model) by the trainer backend.
CRITIC_ESTIMATORS = ("ppo",)
DISTILL_ESTIMATOR = "on_policy_distill"
# --loss-agg-mode: verl's names (docs/algorithms.md, "Loss aggregation")


def loss_aggregation(cfg: AlgorithmConfig) -> tuple[str, float | None]:
    """``(mode, constant)``: the run's loss aggregation mode (``--loss-agg-mode``, else ``token-mean`` with
    ``--calculate-per-token-loss`` and ``seq-mean-token-mean`` without) and, for ``seq-mean-token-sum-norm``, its
    constant divisor (``--loss-scale-factor``, else ``--rollout-max-response-len``); ``None`` for the others."""
    mode = cfg.loss_agg_mode or ("token-mean" if cfg.calculate_per_token_loss else "seq-mean-token-mean")
    if mode != "seq-mean-token-sum-norm":
        return mode, None
    return mode, float(cfg.loss_scale_factor or cfg.rollout_max_response_len)


def kl_enabled(cfg: AlgorithmConfig) -> bool:
    """Whether the run needs reference-model log-probs (``--use-kl-loss``, even at coefficient 0 for the metric,
    or a non-zero ``--kl-coef``)."""
    return bool(cfg.use_kl_loss) or cfg.kl_coef != 0.0


def uses_critic(cfg: AlgorithmConfig) -> bool:
    """Whether the trainer must train a value model next to the policy (``--advantage-estimator ppo``)."""
    return cfg.advantage_estimator in CRITIC_ESTIMATORS


def distill_enabled(cfg: AlgorithmConfig) -> bool:
    """Whether a teacher engine group scores every response (``--distill-teacher``)."""
    return cfg.distill_teacher is not None


def check_algorithm_config(cfg: AlgorithmConfig) -> None:
    """Check the algorithm flags and their combination.

    :raises ValueError: naming the flag(s) and the accepted values, for: KL both as a loss term and as reward
        shaping; ``--kl-loss-coef`` without ``--use-kl-loss``; ``--kl-coef`` with an estimator that has no per-token
        rewards to shape; the rollout-correction flags (:func:`check_rollout_correction`); bounds out of range;
        critic flags without
        ``--advantage-estimator ppo``; ``--advantage-estimator on_policy_distill`` without ``--distill-teacher``.
    """
    kl_loss_coef, kl_coef = cfg.kl_loss_coef, cfg.kl_coef
    estimator = cfg.advantage_estimator
    if cfg.use_kl_loss and kl_loss_coef != 0.0 and kl_coef != 0.0:
        raise ValueError(
            f"--kl-coef {kl_coef} (KL as reward shaping) and --use-kl-loss --kl-loss-coef {kl_loss_coef} (KL as a "
            "loss term) are both non-zero; use only one of the two"
        )
    if kl_loss_coef != 0.0 and not cfg.use_kl_loss:
        raise ValueError(f"--kl-loss-coef {kl_loss_coef} has no effect without --use-kl-loss")
    if cfg.kl_loss_type not in KL_TYPES:
        raise ValueError(f"--kl-loss-type must be one of {', '.join(KL_TYPES)}, got {cfg.kl_loss_type!r}")
    if kl_coef != 0.0 and estimator not in KL_SHAPING_ESTIMATORS:
        raise ValueError(
            f"--kl-coef shapes per-token rewards, which --advantage-estimator {estimator} does not have (supported: "
            f"{', '.join(KL_SHAPING_ESTIMATORS)}); use --use-kl-loss --kl-loss-coef instead"
        )
    if estimator not in CRITIC_ESTIMATORS:
        for name in ("critic_load", "critic_lr"):
            if getattr(cfg, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} has no effect without --advantage-estimator ppo")
        for name in ("num_critic_only_steps", "critic_lr_warmup_iters"):
            if getattr(cfg, name):
                raise ValueError(f"--{name.replace('_', '-')} has no effect without --advantage-estimator ppo")
    if cfg.num_critic_only_steps < 0:
        raise ValueError(f"--num-critic-only-steps must be >= 0, got {cfg.num_critic_only_steps}")
    critic_lr = cfg.critic_lr
    if critic_lr is not None and not (critic_lr > 0.0 and math.isfinite(critic_lr)):
        raise ValueError(f"--critic-lr must be a finite number > 0, got {critic_lr}")
    if estimator == DISTILL_ESTIMATOR and not distill_enabled(cfg):
        raise ValueError(
            "--advantage-estimator on_policy_distill needs --distill-teacher PATH (an HF model directory or a known "
            "model name sharing the policy's tokenizer)"
        )
    if not math.isfinite(cfg.distill_coef):
        raise ValueError(f"--distill-coef must be finite, got {cfg.distill_coef}")
    if cfg.distill_num_engines < 1:
        raise ValueError(f"--distill-num-engines must be >= 1, got {cfg.distill_num_engines}")
    mode = cfg.loss_agg_mode
    if mode is not None and mode not in LOSS_AGG_MODES:
        raise ValueError(f"--loss-agg-mode must be one of {', '.join(LOSS_AGG_MODES)}, got {mode!r}")
    if cfg.calculate_per_token_loss and mode not in (None, "token-mean"):
        raise ValueError(f"--calculate-per-token-loss is --loss-agg-mode token-mean; it contradicts {mode}")
    scale = cfg.loss_scale_factor
    if scale is not None and loss_aggregation(cfg)[0] != "seq-mean-token-sum-norm":
        raise ValueError("--loss-scale-factor is the divisor of --loss-agg-mode seq-mean-token-sum-norm only")
    if scale is not None and not (scale > 0.0 and math.isfinite(scale)):
        raise ValueError(f"--loss-scale-factor must be a finite number > 0, got {scale}")
    check_rollout_correction(cfg)
    c = cfg.eps_clip_c
    if c is not None and not c > 1.0:
        raise ValueError(f"--eps-clip-c must be > 1 (dual-clip PPO caps the loss of A < 0 at -c·A), got {c}")
    for name in ("gamma", "lambd"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise ValueError(f"--{name} must be in [0, 1], got {getattr(cfg, name)}")
    if not cfg.value_clip > 0.0:
        raise ValueError(f"--value-clip must be > 0, got {cfg.value_clip}")
    bound = cfg.max_train_rollout_logprob_diff
    if bound is not None and not (bound >= 0.0 and math.isfinite(bound)):
        raise ValueError(f"--max-train-rollout-logprob-diff must be a finite number >= 0, got {bound}")
    for name in ("entropy_coef", "kl_loss_coef", "kl_coef"):
        if not math.isfinite(getattr(cfg, name)):
            raise ValueError(f"--{name.replace('_', '-')} must be finite, got {getattr(cfg, name)}")


def check_rollout_correction(cfg: AlgorithmConfig) -> None:
    """Check the rollout-correction flags (docs/algorithms.md, "Rollout correction").

    :raises ValueError: for ``--use-tis`` with ``--use-mis``; ``--tis-mode`` / ``--tis-level`` /
        ``--tis-batch-normalize`` without ``--use-tis``; ``--tis-clip-low`` with ``--tis-mode truncate``; bounds not
        ``0 <= low < high``; ``--use-rs`` without ``--rs-upper-bound``; ``--rs-*`` without ``--use-rs``; a veto
        threshold outside ``(0, 1]``; ``--use-rollout-correction`` without a correction or with
        ``--use-rollout-logprobs``.
    """
    if cfg.use_tis and cfg.use_mis:
        raise ValueError(
            "--use-tis (IS weights) and --use-mis (token-level IcePop masking) exclude each other; "
            "--use-tis --tis-mode mask is the masked variant of --use-tis"
        )
    if not cfg.use_tis:
        for name in ("tis_mode", "tis_level"):
            if getattr(cfg, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} has no effect without --use-tis")
        if cfg.tis_batch_normalize:
            raise ValueError("--tis-batch-normalize has no effect without --use-tis")
    low, high = cfg.tis_clip_low, cfg.tis_clip
    if not 0.0 <= low < high:
        raise ValueError(f"need 0 <= --tis-clip-low < --tis-clip, got {low} and {high}")
    if cfg.use_tis and (cfg.tis_mode or "truncate") == "truncate" and low != 0.0:
        raise ValueError(
            f"--tis-clip-low {low} has no effect with --tis-mode truncate (the default: min(w, --tis-clip)); "
            "use --tis-mode clip to clamp w to [--tis-clip-low, --tis-clip]"
        )
    if cfg.use_rs:
        if cfg.rs_upper_bound is None:
            raise ValueError(
                "--use-rs needs --rs-upper-bound (and optionally --rs-lower-bound, default 1 / upper): the band of "
                "the ratio old/rollout whose tokens are kept"
            )
        rs_low = cfg.rs_lower_bound if cfg.rs_lower_bound is not None else 1.0 / cfg.rs_upper_bound
        if not 0.0 <= rs_low < cfg.rs_upper_bound:
            raise ValueError(f"need 0 <= --rs-lower-bound < --rs-upper-bound, got {rs_low} and {cfg.rs_upper_bound}")
    else:
        for name in ("rs_level", "rs_lower_bound", "rs_upper_bound"):
            if getattr(cfg, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} has no effect without --use-rs")
    veto = cfg.rs_veto_threshold
    if veto is not None and not 0.0 < veto <= 1.0:
        raise ValueError(f"--rs-veto-threshold must be in (0, 1] (a ratio old/rollout), got {veto}")
    if cfg.use_rollout_correction:
        if not (cfg.use_tis or cfg.use_mis or cfg.use_rs or veto is not None):
            raise ValueError(
                "--use-rollout-correction selects no correction: add --use-tis, --use-rs or --rs-veto-threshold"
            )
        if cfg.use_rollout_logprobs:
            raise ValueError(
                "--use-rollout-correction (decoupled PPO: the ratio against the trainer's recomputed old policy) "
                "contradicts --use-rollout-logprobs (bypass: the ratio against the engine's log-probs); use one"
            )

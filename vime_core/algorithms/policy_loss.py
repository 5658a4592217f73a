"""The policy loss shared by every trainer backend (one implementation; backends only supply log-probs).

:func:`policy_loss` combines the PPO clipped surrogate (asymmetric and dual clip), GSPO's sequence-level ratio,
rollout correction (IS weights, rejection, veto), the entropy bonus and the KL loss, each off by default,
aggregated per sample, per token or Dr.GRPO's constant; masked tokens never reach the loss (NaN/inf included) and
an empty mask gives 0. The terms, their sources and the aggregation: docs/algorithms.md, "Loss terms", "Loss
aggregation" and "Rollout correction".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from vime_core.algorithms.kl import approx_kl
from vime_core.algorithms.mismatch import importance_weights
from vime_core.algorithms.options import loss_aggregation
from vime_core.algorithms.rollout_correction import CorrectionSettings, pad_batch, rollout_correction
from vime_core.config import AlgorithmConfig

# |log ratio| is clamped before exp (as verl's compute_policy_loss does) so that a wild token gives a large finite
# loss instead of inf; inside the clamp the value and gradient are exact.
LOG_RATIO_CLAMP = 20.0
RATIO_TYPES = ("token", "sequence")


@dataclass
class PolicyLossOutput:
    """Scalar loss (differentiable) and detached metrics (floats)."""

    loss: torch.Tensor
    metrics: dict[str, float]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask == 1``; 0 (not NaN) when the mask is empty. Shapes must match.

    Masked entries are selected out (``torch.where``), not multiplied by 0, so a NaN/inf there cannot leak in.
    """
    keep = mask.bool()
    picked = torch.where(keep, values, torch.zeros_like(values))
    return picked.sum() / keep.sum().clamp(min=1)


def zero_masked(tensors: list[torch.Tensor] | None, masks: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Each tensor with its masked entries replaced by 0 (a differentiable ``torch.where``; None stays None).

    Applied to every input of a loss before any arithmetic, so that a NaN/inf on a masked token can reach neither the
    loss nor, through ``0·NaN`` in the backward pass, the gradient.
    """
    if tensors is None:
        return None
    return [torch.where(m.bool(), t, torch.zeros_like(t)) for t, m in zip(tensors, masks, strict=True)]


def aggregate(
    token_values: list[torch.Tensor],
    masks: list[torch.Tensor],
    per_token: bool,
    token_sum_norm: float | None = None,
    accepted: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Reduce per-token values of a batch to one scalar (slime's ``sum_of_sample_mean``).

    :param token_values: one ``[T_i]`` float tensor per sample.
    :param masks: one ``[T_i]`` 0/1 tensor per sample.
    :param per_token: True: masked mean over all tokens; False: mean over samples of each sample's masked mean,
        counting only samples with a trained token.
    :param token_sum_norm: with ``per_token`` False, each sample's masked token *sum* divided by this constant
        replaces its masked mean (Dr.GRPO; ``--loss-agg-mode seq-mean-token-sum-norm``).
    :param accepted: the masks after rejection (rollout correction; default ``masks``): only accepted tokens enter
        the sums and each sample's token mean, while the token-mean denominator and the count of samples stay those
        of ``masks`` (slime's reducer rebuilt with ``modified_response_masks``).
    :return: a 0-dim tensor (0 when nothing is trained; keeps the autograd graph).
    """
    kept = masks if accepted is None else accepted
    if per_token:
        values = torch.where(torch.cat(kept).bool(), torch.cat(token_values), 0.0)
        return values.sum() / torch.cat(masks).bool().sum().clamp(min=1)
    if token_sum_norm is not None:
        zero = [torch.where(m.bool(), v, torch.zeros_like(v)) for v, m in zip(token_values, kept, strict=True)]
        per_sample = [z.sum() / token_sum_norm for z in zero]
    else:
        per_sample = [masked_mean(v, m) for v, m in zip(token_values, kept, strict=True)]
    counted = sum(1 for m in masks if m.sum() > 0)
    return torch.stack(per_sample).sum() / max(counted, 1)


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO loss ``max(-A·ρ, -A·clip(ρ, 1-ε, 1+ε_high))``, with dual clip ``min(·, -c·A)`` for ``A < 0``.

    :param ratio: ``[T]`` importance ratio ``π_θ / π_old`` (requires grad).
    :param advantages: ``[T]`` advantages.
    :param eps_clip: ``ε`` (lower clip).
    :param eps_clip_high: ``ε_high`` (upper clip; default ``ε``).
    :param eps_clip_c: dual-clip constant ``c > 1`` (Ye et al. 2020, arXiv:1912.09729), or None.
    :return: ``(losses [T], clipped [T], dual_clipped [T])``; the flags are float 0/1: ``clipped`` where the clipped
        term is taken, ``dual_clipped`` where the ``-c·A`` cap is taken.
    :raises ValueError: if ``eps_clip_c <= 1``.
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + high)
    losses = torch.maximum(unclipped, clipped)
    clip_flags = (clipped > unclipped).float()
    dual_flags = torch.zeros_like(clip_flags)
    if eps_clip_c is not None:
        if not eps_clip_c > 1.0:
            raise ValueError(f"--eps-clip-c must be > 1 (dual-clip PPO lower bound), got {eps_clip_c}")
        cap = -eps_clip_c * advantages
        negative = advantages < 0
        dual_flags = (negative & (cap < losses)).float()
        losses = torch.where(negative, torch.minimum(losses, cap), losses)
    return losses, clip_flags, dual_flags


def ppo_clip_token_losses(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate ``max(-A·ρ, -A·clip(ρ, 1-ε, 1+ε_high))`` with ``ρ = exp(logp - old_logp)``.

    :param log_probs: ``[T]`` float32 current-policy log-probs (requires grad).
    :param old_log_probs: ``[T]`` behaviour-policy log-probs (no grad).
    :param advantages: ``[T]`` per-token advantages.
    :return: ``(losses [T], clipped [T] as float 0/1)``.
    """
    ratio = torch.exp((log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    losses, clipped, _ = clipped_surrogate(ratio, advantages, eps_clip=eps_clip, eps_clip_high=eps_clip_high)
    return losses, clipped


def log_ratios(
    log_probs: list[torch.Tensor], old_log_probs: list[torch.Tensor], masks: list[torch.Tensor], ratio_type: str
) -> list[torch.Tensor]:
    """Per-token ``log(π_θ / π_old)`` of each sample, clamped to ``[-20, 20]``.

    ``token``: ``logp_t - old_t``. ``sequence`` (GSPO, Zheng et al. 2025, arXiv:2507.18071): every token of sample
    ``i`` carries ``mean_t(logp_t - old_t)`` over its trained tokens, so ``exp`` of it is the length-normalised
    sequence ratio ``s_i = (π_θ(y_i) / π_old(y_i))^(1/|y_i|)``; the gradient flows through the mean.

    :raises ValueError: on an unknown ``ratio_type``.
    """
    if ratio_type not in RATIO_TYPES:
        raise ValueError(f"unknown ratio type {ratio_type!r}; known: {', '.join(RATIO_TYPES)}")
    out = []
    for lp, old, m in zip(log_probs, old_log_probs, masks, strict=True):
        diff = lp - old
        if ratio_type == "sequence":
            diff = masked_mean(diff, m).expand_as(lp)
        out.append(diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return out


@dataclass(frozen=True)
class PolicyLossOptions:
    """The options of :func:`policy_loss` that the run's flags select (:meth:`from_config`; every backend's).

    :ivar eps_clip: lower clip ``ε``; ``eps_clip_high``: upper clip (default ``ε``); ``eps_clip_c``: dual clip
        (Ye et al. 2020, arXiv:1912.09729), or None.
    :ivar per_token: aggregation (see the module docstring): a masked mean over all tokens, else a mean of the
        samples' masked means.
    :ivar token_sum_norm: Dr.GRPO's constant normalizer (see :func:`aggregate`), or None.
    :ivar ratio_type: ``"token"`` (PPO) or ``"sequence"`` (GSPO).
    :ivar importance_sampling: None, ``"tis"`` (``--use-tis``: each token's pg loss × the IS weight of
        ``exp(train_old - rollout)`` at ``tis_level``, bounded by ``tis_mode`` with ``[is_low, is_high]``) or
        ``"mis"`` (``--use-mis``: token level, weight 0 outside ``[is_low, is_high]``, the token kept in the
        denominators; :func:`~vime_core.algorithms.mismatch.importance_weights`).
    :ivar tis_mode, tis_level, tis_batch_normalize: see
        :class:`~vime_core.algorithms.rollout_correction.CorrectionSettings`.
    :ivar rs_level: rejection sampling's level (None: off), band ``[rs_low, rs_high]``; ``rs_veto_threshold``: the
        veto (None: off). Rejected tokens leave the loss's sums (docs/algorithms.md, "Rollout correction").
    :ivar entropy_coef: weight of the entropy bonus (subtracted from the loss).
    :ivar kl_loss_coef: weight of the KL term (0: metric only, no gradient).
    :ivar kl_loss_type: ``k1``, ``k2``, ``k3`` or ``low_var_kl``.
    """

    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    per_token: bool = False
    token_sum_norm: float | None = None
    ratio_type: str = "token"
    importance_sampling: str | None = None
    is_low: float = 0.0
    is_high: float = 2.0
    tis_mode: str = "truncate"
    tis_level: str = "token"
    tis_batch_normalize: bool = False
    rs_level: str | None = None
    rs_low: float = 0.5
    rs_high: float = 2.0
    rs_veto_threshold: float | None = None
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"

    @classmethod
    def from_config(cls, cfg: AlgorithmConfig) -> PolicyLossOptions:
        """The options selected by the run's algorithm flags (clip ranges, importance sampling, entropy and KL)."""
        agg, norm = loss_aggregation(cfg)
        rs_high = cfg.rs_upper_bound if cfg.rs_upper_bound is not None else cls.rs_high
        rs_low = cfg.rs_lower_bound if cfg.rs_lower_bound is not None else 1.0 / rs_high
        return cls(
            eps_clip=cfg.eps_clip,
            eps_clip_high=cfg.eps_clip_high,
            eps_clip_c=cfg.eps_clip_c,
            per_token=agg == "token-mean",
            token_sum_norm=norm,
            ratio_type="sequence" if cfg.advantage_estimator == "gspo" else "token",
            importance_sampling="tis" if cfg.use_tis else "mis" if cfg.use_mis else None,
            is_low=cfg.tis_clip_low,
            is_high=cfg.tis_clip,
            tis_mode=cfg.tis_mode or "truncate",
            tis_level=cfg.tis_level or "token",
            tis_batch_normalize=cfg.tis_batch_normalize,
            rs_level=(cfg.rs_level or "token") if cfg.use_rs else None,
            rs_low=rs_low,
            rs_high=rs_high,
            rs_veto_threshold=cfg.rs_veto_threshold,
            entropy_coef=cfg.entropy_coef,
            kl_loss_coef=cfg.kl_loss_coef if cfg.use_kl_loss else 0.0,
            kl_loss_type=cfg.kl_loss_type,
        )


def policy_loss(
    log_probs: list[torch.Tensor],
    old_log_probs: list[torch.Tensor],
    advantages: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    options: PolicyLossOptions | None = None,
    *,
    rollout_log_probs: list[torch.Tensor] | None = None,
    train_old_log_probs: list[torch.Tensor] | None = None,
    entropies: list[torch.Tensor] | None = None,
    ref_log_probs: list[torch.Tensor] | None = None,
    is_normalizer: float | None = None,
    **overrides: Any,
) -> PolicyLossOutput:
    """Policy loss over a batch of samples: PPO/GSPO surrogate [× IS weight] [- entropy bonus] [+ KL loss].

    Each list has one ``[response_length]`` float32 tensor per sample (masks 0/1; log-probs in nats).

    :param log_probs: current-policy log-probs (require grad).
    :param old_log_probs: behaviour-policy log-probs, the PPO ratio's denominator (no grad).
    :param advantages: per-token advantages.
    :param loss_masks: 1 = trained token.
    :param options: the loss's options (default :class:`PolicyLossOptions`'); ``overrides`` replace fields of it
        by name (``policy_loss(..., per_token=True)``).
    :param rollout_log_probs: the engine's log-probs; needed for importance sampling and the drift metric.
    :param train_old_log_probs: the trainer's log-probs of the behaviour policy, the IS ratio's numerator
        (default: ``log_probs`` detached, which is exact when the old policy is the current one).
    :param entropies: per-token policy entropies (nats; require grad when ``entropy_coef != 0``).
    :param ref_log_probs: reference-model log-probs (no grad); enables the ``kl_loss`` metric.
    :param is_normalizer: with ``tis_batch_normalize``, the mean weight of the whole step's batch to divide by
        (default: that of this call's samples).
    :return: loss and metrics: ``loss``, ``pg_loss``, ``pg_clipfrac``, ``ppo_kl`` (mean ``-log ratio``), and when
        enabled ``pg_dual_clipfrac``, ``entropy_loss`` (aggregated entropy), ``kl_loss``, ``tis`` (mean raw IS
        ratio), ``tis_clipfrac`` (fraction of tokens whose weight differs from the ratio: truncated, clipped or
        masked), the rollout-correction metrics of
        :func:`~vime_core.algorithms.rollout_correction.rollout_correction`, ``train_rollout_logprob_abs_diff``
        (mean ``|train_old - rollout|``). Clip fractions and ratio metrics are token means over trained tokens
        (``pg_clipfrac`` and ``ppo_kl`` over the accepted ones).
    :raises ValueError: on an unknown ``ratio_type``, ``importance_sampling`` or ``kl_loss_type``, on
        ``eps_clip_c <= 1``, or on a rollout correction without ``rollout_log_probs``.
    :raises TypeError: an override that is not an option.
    """
    opts = replace(options or PolicyLossOptions(), **overrides)
    masks = loss_masks
    log_probs, old_log_probs = zero_masked(log_probs, masks), zero_masked(old_log_probs, masks)
    advantages, entropies = zero_masked(advantages, masks), zero_masked(entropies, masks)
    rollout_log_probs, ref_log_probs = zero_masked(rollout_log_probs, masks), zero_masked(ref_log_probs, masks)
    train_old_log_probs = zero_masked(train_old_log_probs, masks)
    log_ratio = log_ratios(log_probs, old_log_probs, masks, opts.ratio_type)
    token_losses, clip_flags, dual_flags = [], [], []
    for lr, adv in zip(log_ratio, advantages, strict=True):
        tl, cf, df = clipped_surrogate(
            torch.exp(lr), adv, eps_clip=opts.eps_clip, eps_clip_high=opts.eps_clip_high, eps_clip_c=opts.eps_clip_c
        )
        token_losses.append(tl)
        clip_flags.append(cf)
        dual_flags.append(df)

    train_old = train_old_log_probs if train_old_log_probs is not None else [lp.detach() for lp in log_probs]
    token_losses, accepted, is_metrics = _rollout_corrected(
        token_losses, train_old, rollout_log_probs, masks, opts, is_normalizer
    )

    pg_loss = aggregate(token_losses, masks, opts.per_token, opts.token_sum_norm, accepted)
    loss, extra = _regularized(pg_loss, log_probs, entropies, ref_log_probs, masks, opts, accepted)

    all_mask = torch.cat(masks if accepted is None else accepted)
    with torch.no_grad():
        metrics = {
            "loss": float(loss.detach()),
            "pg_loss": float(pg_loss.detach()),
            "pg_clipfrac": float(masked_mean(torch.cat(clip_flags), all_mask)),
            "ppo_kl": float(masked_mean(-torch.cat(log_ratio).detach(), all_mask)),
        }
        if opts.eps_clip_c is not None:
            metrics["pg_dual_clipfrac"] = float(masked_mean(torch.cat(dual_flags), all_mask))
        metrics.update(extra)
        metrics.update(is_metrics)
        if rollout_log_probs is not None:
            diff = (torch.cat(train_old).detach() - torch.cat(rollout_log_probs)).abs()
            metrics["train_rollout_logprob_abs_diff"] = float(masked_mean(diff, torch.cat(masks)))
    return PolicyLossOutput(loss=loss, metrics=metrics)


def correction_settings(opts: PolicyLossOptions) -> CorrectionSettings | None:
    """The :class:`CorrectionSettings` of ``opts`` (None when neither ``tis`` nor rejection nor the veto is on;
    ``mis`` is applied by :func:`_mis_weighted`).

    :raises ValueError: on an unknown ``importance_sampling``.
    """
    if opts.importance_sampling not in (None, "tis", "mis"):
        raise ValueError(f"unknown importance_sampling {opts.importance_sampling!r}; known: tis, mis")
    tis = opts.importance_sampling == "tis"
    if not tis and opts.rs_level is None and opts.rs_veto_threshold is None:
        return None
    return CorrectionSettings(
        tis_mode=opts.tis_mode if tis else None,
        tis_level=opts.tis_level,
        tis_low=opts.is_low,
        tis_high=opts.is_high,
        batch_normalize=opts.tis_batch_normalize,
        rs_level=opts.rs_level,
        rs_low=opts.rs_low,
        rs_high=opts.rs_high,
        veto_threshold=opts.rs_veto_threshold,
    )


def _rollout_corrected(
    token_losses: list[torch.Tensor],
    train_old: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor] | None,
    masks: list[torch.Tensor],
    opts: PolicyLossOptions,
    normalizer: float | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, dict[str, float]]:
    """Each token's loss × its IS weight, and the masks after rejection (None when nothing can be rejected), with
    the correction's metrics.

    :raises ValueError: on a correction without ``rollout_log_probs``.
    """
    settings = correction_settings(opts)
    if settings is None and opts.importance_sampling is None:
        return token_losses, None, {}
    if rollout_log_probs is None:
        raise ValueError(
            f"importance_sampling={opts.importance_sampling!r} / rejection sampling needs rollout_log_probs"
        )
    accepted, metrics = None, {}
    if settings is not None:
        out = rollout_correction(
            pad_batch(train_old), pad_batch(rollout_log_probs), pad_batch(masks), settings, normalizer
        )
        metrics = out.metrics
        rows = range(len(masks))
        if settings.tis_mode is not None:
            token_losses = [tl * out.weights[i, : len(tl)] for i, tl in zip(rows, token_losses, strict=True)]
            metrics["tis_clipfrac"] = sum(v for k, v in metrics.items() if k.startswith("tis_") and "fraction" in k)
        if settings.tis_mode == "mask" or settings.rs_level is not None or settings.veto_threshold is not None:
            accepted = [out.mask[i, : len(m)] for i, m in zip(rows, masks, strict=True)]
    if opts.importance_sampling == "mis":
        token_losses, mis_metrics = _mis_weighted(token_losses, train_old, rollout_log_probs, masks, opts)
        metrics |= mis_metrics
    return token_losses, accepted, metrics


def _mis_weighted(
    token_losses: list[torch.Tensor],
    train_old: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    masks: list[torch.Tensor],
    opts: PolicyLossOptions,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """``--use-mis``: each token's loss × its MIS weight of ``exp(train_old - rollout)``; with the ``tis`` and
    ``tis_clipfrac`` metrics."""
    raw, weights = [], []
    for old, ro in zip(train_old, rollout_log_probs, strict=True):
        w = torch.exp((old.detach() - ro).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        raw.append(w)
        weights.append(importance_weights(w, opts.importance_sampling, opts.is_low, opts.is_high))
    token_losses = [tl * w for tl, w in zip(token_losses, weights, strict=True)]
    all_mask = torch.cat(masks)
    return token_losses, {
        "tis": float(masked_mean(torch.cat(raw), all_mask)),
        "tis_clipfrac": float(masked_mean((torch.cat(weights) != torch.cat(raw)).float(), all_mask)),
    }


def _regularized(
    pg_loss: torch.Tensor,
    log_probs: list[torch.Tensor],
    entropies: list[torch.Tensor] | None,
    ref_log_probs: list[torch.Tensor] | None,
    masks: list[torch.Tensor],
    opts: PolicyLossOptions,
    accepted: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``pg_loss`` minus the entropy bonus plus the KL loss (each where its coefficient is set, over the accepted
    tokens), and the ``entropy_loss`` / ``kl_loss`` metrics (where entropies / reference log-probs are given)."""
    loss = pg_loss
    extra: dict[str, float] = {}
    if entropies is not None:
        ents = entropies if opts.entropy_coef else [e.detach() for e in entropies]
        entropy = aggregate(ents, masks, opts.per_token, opts.token_sum_norm, accepted)
        if opts.entropy_coef:
            loss = loss - opts.entropy_coef * entropy
        extra["entropy_loss"] = float(entropy.detach())
    if ref_log_probs is not None:
        lps = log_probs if opts.kl_loss_coef else [lp.detach() for lp in log_probs]
        token_kl = [approx_kl(lp, ref, opts.kl_loss_type) for lp, ref in zip(lps, ref_log_probs, strict=True)]
        kl = aggregate(token_kl, masks, opts.per_token, opts.token_sum_norm, accepted)
        if opts.kl_loss_coef:
            loss = loss + opts.kl_loss_coef * kl
        extra["kl_loss"] = float(kl.detach())
    return loss, extra


def policy_loss_kwargs(cfg: AlgorithmConfig) -> dict[str, Any]:
    """:meth:`PolicyLossOptions.from_config` as keywords of :func:`policy_loss`.

    :param cfg: the algorithm flags (clip ranges, importance sampling, entropy and KL terms).
    """
    return asdict(PolicyLossOptions.from_config(cfg))

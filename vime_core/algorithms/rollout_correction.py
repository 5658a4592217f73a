"""Rollout correction: importance-sampling weights, rejection masks and the veto between the trainer's old policy
and the engine's (behaviour) policy, at token, sequence or geometric level; and the mismatch metrics.

Pure functions on padded ``[B, T]`` float32 tensors with a 0/1 response mask. Sources:
``THUDM/slime/examples/train_infer_mismatch_helper/mis.py`` (``compute_mis_weights``, ``add_ppl_metrics``) and
``volcengine/verl/verl/trainer/ppo/rollout_corr_helper.py`` (``compute_rollout_correction_weights``,
``compute_rollout_rejection_mask``). Formulas and flags: docs/algorithms.md, "Rollout correction".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LEVELS = ("token", "sequence", "geometric")
TIS_MODES = ("truncate", "clip", "mask")
# |log ratio| is clamped before exp (slime's SAFETY_BOUND), so a wild sequence gives a large finite weight
SAFETY_BOUND = 20.0
# a batch mean of the weights at or below this leaves them unnormalised (slime's guard against dividing by ~0)
MIN_NORMALIZER = 1e-8


@dataclass(frozen=True)
class CorrectionSettings:
    """What to correct (the run's flags, docs/algorithms.md "Rollout correction").

    :ivar tis_mode: None (no IS weight), ``truncate`` (``min(w, tis_high)``), ``clip`` (``clamp(w, tis_low,
        tis_high)``) or ``mask`` (``w`` kept, tokens with ``w`` outside ``[tis_low, tis_high]`` rejected).
    :ivar tis_level: ``token``, ``sequence`` or ``geometric`` (see :func:`level_log_ratio`).
    :ivar batch_normalize: divide the weights by their mean over the batch (``--tis-batch-normalize``).
    :ivar rs_level: None (no rejection sampling) or the level of the rejection ratio.
    :ivar rs_low, rs_high: the accepted band of the rejection ratio.
    :ivar veto_threshold: reject a whole sequence with a token ratio below this (``--rs-veto-threshold``), or None.
    """

    tis_mode: str | None = None
    tis_level: str = "token"
    tis_low: float = 0.0
    tis_high: float = 2.0
    batch_normalize: bool = False
    rs_level: str | None = None
    rs_low: float = 0.5
    rs_high: float = 2.0
    veto_threshold: float | None = None


@dataclass
class CorrectionOutput:
    """``weights`` ``[B, T]`` float32 (0 on untrained tokens, no grad), ``mask`` ``[B, T]`` float32 0/1 (the
    response mask minus the rejected tokens), ``metrics`` (floats, see :func:`rollout_correction`)."""

    weights: torch.Tensor
    mask: torch.Tensor
    metrics: dict[str, float]


def pad_batch(rows: list[torch.Tensor]) -> torch.Tensor:
    """One ``[B, T]`` float32 tensor (``T`` the longest row) from ``B`` ``[T_i]`` rows, right-padded with 0."""
    return torch.nn.utils.rnn.pad_sequence([r.float() for r in rows], batch_first=True)


def _token_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    keep = mask.bool()
    return float(torch.where(keep, values, torch.zeros_like(values)).sum() / keep.sum().clamp(min=1))


def _row_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), values, torch.zeros_like(values)).sum(dim=1)


def level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The log importance ratio of each token at ``level``, clamped to ``±SAFETY_BOUND``.

    With ``r_t = logp_old_t - logp_rollout_t`` and ``m_t`` the mask of row ``i``: ``token`` gives ``r_t``;
    ``sequence`` gives ``Σ_t m_t r_t`` (the log of the product of token ratios) on every token of the row;
    ``geometric`` gives ``Σ_t m_t r_t / Σ_t m_t`` (log of the geometric mean; 0 for an empty row).

    :param log_ratio: ``[B, T]`` float32. :param mask: ``[B, T]`` 0/1.
    :return: ``[B, T]`` float32; 0 where ``mask`` is 0.
    :raises ValueError: on an unknown level.
    """
    keep = mask.bool()
    r = torch.where(keep, log_ratio, torch.zeros_like(log_ratio))
    if level == "token":
        out = r
    elif level == "sequence":
        out = r.sum(dim=1, keepdim=True).expand_as(r)
    elif level == "geometric":
        out = (r.sum(dim=1, keepdim=True) / keep.sum(dim=1, keepdim=True).clamp(min=1)).expand_as(r)
    else:
        raise ValueError(f"unknown rollout-correction level {level!r}; known: {', '.join(LEVELS)}")
    return torch.where(keep, out.clamp(-SAFETY_BOUND, SAFETY_BOUND), torch.zeros_like(r))


def is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, mode: str, level: str, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Importance-sampling weights ``w = exp(level_log_ratio)`` bounded by ``mode``.

    ``truncate``: ``min(w, high)`` (TIS; ``low`` unused). ``clip``: ``clamp(w, low, high)``. ``mask``: ``w``
    unchanged, and tokens with ``w < low`` or ``w > high`` leave the mask (they are rejected).

    :param log_ratio: ``[B, T]`` float32 ``logp_old - logp_rollout``. :param mask: ``[B, T]`` 0/1.
    :return: ``(weights [B, T] float32, 0 off the mask; mask [B, T] float32; metrics)``: ``tis`` (mean raw weight),
        ``tis_truncate_fraction`` / ``tis_clip_fraction_low`` / ``tis_clip_fraction_high`` /
        ``tis_mask_fraction_low`` / ``tis_mask_fraction_high`` (the mode's, token fractions of the mask).
    :raises ValueError: on an unknown mode or level.
    """
    if mode not in TIS_MODES:
        raise ValueError(f"unknown --tis-mode {mode!r}; known: {', '.join(TIS_MODES)}")
    keep = mask.bool()
    raw = torch.exp(level_log_ratio(log_ratio, mask, level))
    metrics = {"tis": _token_mean(raw, mask)}
    below, above = (raw < low).float(), (raw > high).float()
    out_mask = mask.float()
    if mode == "truncate":
        weights = raw.clamp(max=high)
        metrics["tis_truncate_fraction"] = _token_mean(above, mask)
    elif mode == "clip":
        weights = raw.clamp(low, high)
        metrics["tis_clip_fraction_low"] = _token_mean(below, mask)
        metrics["tis_clip_fraction_high"] = _token_mean(above, mask)
    else:
        weights = raw
        out_mask = out_mask * (1.0 - below) * (1.0 - above)
        metrics["tis_mask_fraction_low"] = _token_mean(below, mask)
        metrics["tis_mask_fraction_high"] = _token_mean(above, mask)
    return torch.where(keep, weights, torch.zeros_like(weights)), out_mask, metrics


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: str, low: float, high: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rejection sampling: keep a token where its ratio at ``level`` is in ``[low, high]``.

    At ``sequence`` / ``geometric`` level a row is kept or rejected whole.

    :return: ``(mask [B, T] float32, metrics)``: ``rs_mask_fraction_low``, ``rs_mask_fraction_high`` (token fractions
        of ``mask`` rejected below / above the band).
    """
    ratio = torch.exp(level_log_ratio(log_ratio, mask, level))
    below, above = ratio < low, ratio > high
    accepted = mask.float() * (~below & ~above).float()
    return accepted, {
        "rs_mask_fraction_low": _token_mean(below.float(), mask),
        "rs_mask_fraction_high": _token_mean(above.float(), mask),
    }


def veto_mask(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The veto: reject every token of a row that has a trained token with ratio ``exp(r_t) < threshold``.

    :param threshold: ``> 0`` (typical: 1e-4 to 1e-6).
    :return: ``(mask [B, T] float32, metrics)``: ``rs_catastrophic_token_fraction`` (token fraction of ``mask``
        under the threshold), ``rs_catastrophic_seq_fraction`` (fraction of the rows with a trained token that are
        vetoed).
    """
    keep = mask.bool()
    catastrophic = (log_ratio < math.log(threshold)) & keep
    vetoed = catastrophic.any(dim=1, keepdim=True)
    rows = keep.any(dim=1)
    return mask.float() * (~vetoed).float(), {
        "rs_catastrophic_token_fraction": _token_mean(catastrophic.float(), mask),
        "rs_catastrophic_seq_fraction": float(vetoed.squeeze(1)[rows].float().sum() / rows.sum().clamp(min=1)),
    }


def batch_normalizer(weights: torch.Tensor, mask: torch.Tensor, level: str) -> float:
    """The mean weight that ``--tis-batch-normalize`` divides by: at ``token`` level the mean over the batch's
    trained tokens, at ``sequence`` / ``geometric`` level the mean over the rows with a trained token of the row's
    weight (the weight of a sequence counts once, whatever its length). 0 for an empty batch."""
    if level == "token":
        return _token_mean(weights, mask)
    keep = mask.bool()
    rows = keep.any(dim=1)
    per_row = _row_sum(weights, mask) / keep.sum(dim=1).clamp(min=1)
    return float(per_row[rows].sum() / rows.sum().clamp(min=1))


def rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    settings: CorrectionSettings,
    normalizer: float | None = None,
) -> CorrectionOutput:
    """IS weights, rejection and veto of a batch (slime ``compute_mis_weights``; verl ``rollout_corr_helper``).

    With ``r_t = old_t - rollout_t``: the weights are :func:`is_weights` (all 1 without ``tis_mode``), divided by
    their batch mean with ``batch_normalize``; the mask is the response mask minus the tokens rejected by
    ``tis_mode`` ``mask``, by :func:`rejection_mask` and by :func:`veto_mask`.

    :param old_log_probs: ``[B, T]`` float32 trainer log-probs of the old (proximal) policy (no grad).
    :param rollout_log_probs: ``[B, T]`` float32 engine log-probs of the behaviour policy.
    :param mask: ``[B, T]`` 0/1 response (loss) mask.
    :param normalizer: the batch mean to divide by with ``batch_normalize`` (the whole step's, computed once);
        None: :func:`batch_normalizer` of this batch. A normalizer ``<= 1e-8`` leaves the weights as they are.
    :return: :class:`CorrectionOutput`; metrics: those of :func:`is_weights`, :func:`rejection_mask` and
        :func:`veto_mask` that apply, ``tis_weight_mean`` (mean applied weight over the accepted tokens),
        ``tis_batch_norm_factor`` with ``batch_normalize``, ``rejected_fraction`` (token fraction of ``mask``
        rejected by any rule).
    :raises ValueError: on shapes that differ, an unknown mode or level.
    """
    if not old_log_probs.shape == rollout_log_probs.shape == mask.shape:
        raise ValueError(
            f"rollout correction needs [B, T] tensors of one shape; got old {tuple(old_log_probs.shape)}, "
            f"rollout {tuple(rollout_log_probs.shape)}, mask {tuple(mask.shape)}"
        )
    keep = mask.bool()
    diff = old_log_probs.detach().float() - rollout_log_probs.float()
    log_ratio = torch.where(keep, diff, torch.zeros_like(diff))
    metrics: dict[str, float] = {}
    accepted = mask.float()
    if settings.tis_mode is None:
        weights = mask.float()
    else:
        s = settings
        weights, accepted, metrics = is_weights(log_ratio, mask, s.tis_mode, s.tis_level, s.tis_low, s.tis_high)
        if s.batch_normalize:
            norm = batch_normalizer(weights, mask, s.tis_level) if normalizer is None else normalizer
            if norm > MIN_NORMALIZER:
                weights = weights / norm
            metrics["tis_batch_norm_factor"] = norm if norm > MIN_NORMALIZER else 1.0
    if settings.rs_level is not None:
        rs, rs_metrics = rejection_mask(log_ratio, mask, settings.rs_level, settings.rs_low, settings.rs_high)
        accepted, metrics = accepted * rs, metrics | rs_metrics
    if settings.veto_threshold is not None:
        veto, veto_metrics = veto_mask(log_ratio, mask, settings.veto_threshold)
        accepted, metrics = accepted * veto, metrics | veto_metrics
    if settings.tis_mode is not None:
        metrics["tis_weight_mean"] = _token_mean(weights, accepted)
    metrics["rejected_fraction"] = _token_mean(1.0 - accepted, mask)
    return CorrectionOutput(weights=weights.detach(), mask=accepted.detach(), metrics=metrics)


MISMATCH_METRICS = (
    "training_log_ppl",
    "training_ppl",
    "rollout_log_ppl",
    "rollout_ppl",
    "kl",
    "k3_kl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "ppl_ratio",
    "logprob_abs_diff",
)


def mismatch_metrics(
    train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Train/inference mismatch metrics of a batch (slime ``add_ppl_metrics``); they do not touch the loss.

    Per row ``i`` with trained tokens: ``training_log_ppl_i = -mean_t logp_train``, ``training_ppl_i =
    exp(training_log_ppl_i)``, likewise ``rollout_*``; ``log_ppl_diff_i = mean_t logp_rollout - mean_t
    logp_train`` (= ``log(training_ppl_i / rollout_ppl_i)``), ``log_ppl_abs_diff_i = |log_ppl_diff_i|``,
    ``ppl_ratio_i = exp(log_ppl_diff_i)``; these are averaged over the rows. Per token, averaged over every trained
    token of the batch: ``kl = logp_rollout - logp_train`` (k1 estimate of KL(π_rollout‖π_train)), ``k3_kl =
    exp(r) - r - 1`` with ``r = logp_train - logp_rollout`` (``r`` clamped to ±20), ``logprob_abs_diff = |r|``.

    :param train_log_probs: ``[B, T]`` float32 trainer log-probs (nats). :param rollout_log_probs: ``[B, T]``
        engine log-probs. :param mask: ``[B, T]`` 0/1.
    :return: ``{name: value}`` for :data:`MISMATCH_METRICS`; all 0 without trained tokens.
    """
    keep = mask.bool()
    zero = torch.zeros_like(mask, dtype=torch.float64)
    train = torch.where(keep, train_log_probs.detach().double(), zero)
    rollout = torch.where(keep, rollout_log_probs.double(), zero)
    rows = keep.any(dim=1)
    if not bool(rows.any()):
        return dict.fromkeys(MISMATCH_METRICS, 0.0)
    n = keep.sum(dim=1).clamp(min=1)
    mean_train, mean_rollout = (train.sum(dim=1) / n)[rows], (rollout.sum(dim=1) / n)[rows]
    log_ppl_diff = mean_rollout - mean_train
    r = train - rollout
    r_safe = r.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_row = {
        "training_log_ppl": -mean_train,
        "training_ppl": torch.exp(-mean_train),
        "rollout_log_ppl": -mean_rollout,
        "rollout_ppl": torch.exp(-mean_rollout),
        "log_ppl_diff": log_ppl_diff,
        "log_ppl_abs_diff": log_ppl_diff.abs(),
        "ppl_ratio": torch.exp(log_ppl_diff),
    }
    out = {k: float(v.mean()) for k, v in per_row.items()}
    out["kl"] = _token_mean(-r, mask)
    out["k3_kl"] = _token_mean(torch.exp(r_safe) - r_safe - 1.0, mask)
    out["logprob_abs_diff"] = _token_mean(r.abs(), mask)
    return {k: out[k] for k in MISMATCH_METRICS}

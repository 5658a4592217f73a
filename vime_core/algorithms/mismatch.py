"""Train/inference mismatch: importance weights between trainer and engine, and the drift budget.

The engine samples with its own kernels and dtype, so the trainer's log-probs of the same tokens differ from the
rollout's. :func:`importance_weights` weighs each token by ``w = exp(logp_train_old - logp_rollout)``, truncated
(TIS) or masked outside the bounds (MIS, IcePop); :func:`check_logprob_drift` turns the mean ``|Δlogp|`` into a stop
condition (:class:`LogprobDriftError`). Flags and sources: docs/algorithms.md, "Train/inference mismatch".
"""

from __future__ import annotations

import torch

IS_MODES = ("tis", "mis")


def importance_weights(ratio: torch.Tensor, mode: str, low: float, high: float) -> torch.Tensor:
    """Per-token importance weights from raw ratios ``w = exp(train - rollout)``.

    :param ratio: ``[T]`` float ratios (no grad).
    :param mode: ``"tis"`` clamps to ``[low, high]``; ``"mis"`` keeps ``w`` inside ``[low, high]`` and gives ``0``
        outside (NaN ratios are masked too).
    :param low: lower bound (``>= 0``).
    :param high: upper bound (``> low``).
    :return: ``[T]`` float weights.
    :raises ValueError: on an unknown mode.
    """
    if mode == "tis":
        return ratio.clamp(low, high)
    if mode == "mis":
        inside = (ratio >= low) & (ratio <= high)
        return torch.where(inside, ratio, torch.zeros_like(ratio))
    raise ValueError(f"unknown importance-sampling mode {mode!r}; known: {', '.join(IS_MODES)}")


class LogprobDriftError(RuntimeError):
    """Trainer and engine log-probs of the same tokens differ by more than ``--max-train-rollout-logprob-diff``.

    Attributes: ``value`` (mean ``|Δlogp|``, nats per token), ``bound``, ``num_tokens``, ``step``.
    """

    def __init__(self, value: float, bound: float, num_tokens: int, step: int | None = None) -> None:
        self.value, self.bound, self.num_tokens, self.step = value, bound, num_tokens, step
        where = "" if step is None else f" at train step {step}"
        super().__init__(
            f"train/rollout log-prob drift{where}: mean |logp_trainer - logp_engine| = {value:.6g} nats per token "
            f"over {num_tokens} trained tokens exceeds the bound --max-train-rollout-logprob-diff {bound:g}. "
            "The trainer and the engines disagree about the same policy. Likely causes: stale weights on the "
            "engines (a weight sync that did not apply, or samples from an older weight version); a dtype mismatch "
            "between trainer and engine (e.g. --train-dtype float32 against a bfloat16 engine; bf16 alone drifts by "
            "~0.01); a different model or tokenizer on the two sides; engine log-probs that are not the raw "
            "distribution (temperature/top-p processed). Raise the bound, or correct for the drift with --use-tis "
            "or --use-mis.",
        )


def logprob_drift(
    train_log_probs: list[torch.Tensor], rollout_log_probs: list[torch.Tensor], loss_masks: list[torch.Tensor]
) -> tuple[float, int]:
    """Mean ``|train - rollout|`` log-prob over every trained token of a batch.

    :param train_log_probs: one ``[T_i]`` float tensor per sample (trainer, before any update).
    :param rollout_log_probs: one ``[T_i]`` float tensor per sample (engine).
    :param loss_masks: one ``[T_i]`` 0/1 tensor per sample.
    :return: ``(mean |Δlogp| in nats, number of trained tokens)``; ``(0.0, 0)`` without trained tokens. NaN
        log-probs on trained tokens give NaN (which exceeds any bound).
    """
    if not train_log_probs:
        return 0.0, 0
    keep = torch.cat([m.bool() for m in loss_masks])
    diff = (torch.cat([t.detach().double() for t in train_log_probs]) - torch.cat(rollout_log_probs).double()).abs()
    n = int(keep.sum())
    return (float(diff[keep].sum() / n) if n else 0.0), n


def check_logprob_drift(
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    bound: float | None,
    step: int | None = None,
) -> float:
    """Enforce the drift budget: call before the first optimizer step of a train step.

    :param bound: ``--max-train-rollout-logprob-diff`` (nats per token); ``None`` disables the check.
    :return: the drift (see :func:`logprob_drift`).
    :raises LogprobDriftError: if the drift exceeds ``bound`` or is NaN.
    """
    value, n = logprob_drift(train_log_probs, rollout_log_probs, loss_masks)
    if bound is not None and not value <= bound:
        raise LogprobDriftError(value, bound, n, step)
    return value

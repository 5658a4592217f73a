"""DAPO's two remedies for responses cut by the token budget (arXiv:2503.14476, §3.4), applied by the rollout manager
to every scored sample of any generate function.

:func:`apply_overlong` does overlong filtering (``--overlong-filter``: a length-truncated response gets loss mask 0)
and the soft overlong punishment (``--overlong-buffer-len``, ``--overlong-penalty-factor``:
:func:`overlong_penalty`); :func:`overlong_metrics` reports both. The formulas: docs/algorithms.md, "Truncated
responses". This module imports no torch (the argument parser imports it).
"""

from __future__ import annotations

import math

from vime_core.config import RolloutConfig
from vime_core.types import Sample, Status

# multi_turn's stop reasons for a truncation that is not the token budget's (the turn cap)
NOT_LENGTH_STOP_REASONS = frozenset({"max_turns"})


def check_overlong_config(cfg: RolloutConfig) -> None:
    """Check the overlong flags.

    :raises ValueError: ``--overlong-buffer-len`` outside ``(0, --rollout-max-response-len]``, or a negative or
        non-finite ``--overlong-penalty-factor``.
    """
    buffer_len = cfg.overlong_buffer_len
    max_len = cfg.rollout_max_response_len
    if buffer_len is not None and not (0 < buffer_len and (max_len is None or buffer_len <= max_len)):
        raise ValueError(
            f"--overlong-buffer-len must be in (0, --rollout-max-response-len {max_len}], got {buffer_len}"
        )
    factor = cfg.overlong_penalty_factor
    if not (factor >= 0.0 and math.isfinite(factor)):
        raise ValueError(f"--overlong-penalty-factor must be a finite number >= 0, got {factor}")


def is_length_truncated(sample: Sample) -> bool:
    """Whether the response was cut by a token budget: status ``truncated``, except multi_turn's turn cap
    (``metadata["stop_reason"] == "max_turns"``: the last turn ended, the episode was not cut by length)."""
    return sample.status == Status.TRUNCATED and sample.metadata.get("stop_reason") not in NOT_LENGTH_STOP_REASONS


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment ``min(-(length - (max_len - buffer_len)) / buffer_len · factor, 0)``.

    :param length: response tokens.
    :param max_len: ``L_max`` (``--rollout-max-response-len``).
    :param buffer_len: ``L_cache`` (``--overlong-buffer-len``, > 0).
    :param factor: the penalty at ``length == max_len`` is ``-factor``.
    :return: a reward term ``<= 0`` (0 for ``length <= max_len - buffer_len``).
    """
    return min(-(length - (max_len - buffer_len)) / buffer_len * factor, 0.0)


def apply_overlong(cfg: RolloutConfig, sample: Sample) -> None:
    """Apply ``--overlong-filter`` and the soft overlong punishment to one scored sample (status completed or
    truncated, reward set), in place; records ``metadata["overlong_filtered"]`` and ``metadata["overlong_penalty"]``.

    :raises ValueError: if the penalty is on and the reward is a dict without ``--reward-key`` (naming the flags).
    """
    if cfg.overlong_filter and is_length_truncated(sample):
        sample.loss_mask = [0] * sample.response_length
        sample.metadata["overlong_filtered"] = True
    buffer_len = cfg.overlong_buffer_len
    if buffer_len is None:
        return
    penalty = overlong_penalty(
        sample.response_length, cfg.rollout_max_response_len, buffer_len, cfg.overlong_penalty_factor
    )
    sample.metadata["overlong_penalty"] = penalty
    if isinstance(sample.reward, dict):
        key = cfg.reward_key
        if key is None or key not in sample.reward:
            raise ValueError(
                f"--overlong-buffer-len adds a penalty to the reward, but the reward is a dict {sorted(sample.reward)}"
                " without --reward-key naming the entry to penalise"
            )
        sample.reward[key] = float(sample.reward[key]) + penalty
    else:
        sample.reward = sample.reward_value() + penalty


def overlong_metrics(cfg: RolloutConfig, samples: list[Sample]) -> dict[str, float]:
    """``rollout/overlong_filtered_frac`` (of all samples, with ``--overlong-filter``) and
    ``rollout/overlong_penalty_mean`` / ``rollout/overlong_penalized_frac`` (over the penalised, i.e. scored,
    samples, with ``--overlong-buffer-len``); empty when neither is on."""
    out: dict[str, float] = {}
    if cfg.overlong_filter:
        out["rollout/overlong_filtered_frac"] = sum(bool(s.metadata.get("overlong_filtered")) for s in samples) / max(
            len(samples), 1
        )
    if cfg.overlong_buffer_len is not None:
        penalties = [float(s.metadata["overlong_penalty"]) for s in samples if "overlong_penalty" in s.metadata]
        n = max(len(penalties), 1)
        out["rollout/overlong_penalty_mean"] = sum(penalties) / n
        out["rollout/overlong_penalized_frac"] = sum(p < 0 for p in penalties) / n
    return out

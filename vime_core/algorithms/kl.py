"""Per-token KL estimators between the policy and a reference model (shared by every trainer backend).

Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html: with tokens sampled from
``π_θ`` and ``r = π_ref / π_θ``, ``k1 = -log r``, ``k2 = (log r)² / 2`` and ``k3 = (r - 1) - log r`` estimate
``KL(π_θ ‖ π_ref)``. ``low_var_kl`` is k3 clamped to ``[-10, 10]``, as verl (``kl_penalty="low_var_kl"``) and slime
(``compute_approx_kl``) define it.
"""

from __future__ import annotations

import torch

from vime_core.algorithms.options import KL_TYPES

LOW_VAR_KL_BOUND = 10.0


def approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str = "k1") -> torch.Tensor:
    """Per-token KL estimate of the policy against the reference.

    :param log_probs: ``[T]`` float policy log-probs of the sampled tokens (may require grad; nats).
    :param ref_log_probs: ``[T]`` float reference-model log-probs of the same tokens (no grad; nats).
    :param kl_type: ``k1`` (``logp - ref``), ``k2`` (``(logp - ref)² / 2``), ``k3``
        (``exp(ref - logp) - 1 - (ref - logp)``, non-negative) or ``low_var_kl`` (k3 clamped to ``[-10, 10]``).
    :return: ``[T]`` float32 per-token KL (nats); k3 may be ``inf`` when ``ref - logp`` exceeds ~88 (use
        ``low_var_kl`` to bound it), never NaN for finite inputs.
    :raises ValueError: on an unknown ``kl_type`` (the message lists the known ones).
    """
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return log_ratio.square() / 2.0
    if kl_type in ("k3", "low_var_kl"):
        neg = -log_ratio
        kl = torch.expm1(neg) - neg
        return kl.clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND) if kl_type == "low_var_kl" else kl
    raise ValueError(f"unknown KL type {kl_type!r}; known: {', '.join(KL_TYPES)}")

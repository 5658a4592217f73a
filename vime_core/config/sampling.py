"""The engine sampling parameters of a rollout, derived from the config once: training rollouts read the
``--rollout-*`` flags, eval rollouts the ``--eval-*`` ones where set (:func:`sampling_params`)."""

from __future__ import annotations

from typing import Any

from vime_core.config.rollout import EvalConfig, RolloutConfig

#: engine parameter → the flag suffix it comes from (``--rollout-<suffix>``, or ``--eval-<suffix>`` for evaluation)
_FLAGS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_tokens": "max_response_len"}
#: engine parameters sent only when their flag is set
_OPTIONAL = ("min_p", "repetition_penalty")


def sampling_params(cfg: RolloutConfig | EvalConfig, eval_set: str | None = None) -> dict[str, Any]:
    """The engine sampling parameters of a training rollout (``cfg`` a :class:`RolloutConfig`) or of an eval rollout
    (``cfg`` an :class:`EvalConfig`: each ``--eval-*`` value where set, else the ``--rollout-*`` one).

    ``temperature``, ``top_p``, ``top_k`` and ``max_tokens`` always; ``min_p`` and ``repetition_penalty`` when set;
    ``stop`` / ``stop_token_ids`` from ``--rollout-stop`` / ``--rollout-stop-token-ids``; then
    ``--rollout-sampling-params`` and, for evaluation, ``--eval-sampling-params`` and ``eval_set``'s
    ``--eval-set-sampling-params`` fields, each over the one before.
    """
    evaluating = isinstance(cfg, EvalConfig)

    def pick(suffix: str) -> Any:
        own = getattr(cfg, f"eval_{suffix}") if evaluating else None
        return getattr(cfg, f"rollout_{suffix}") if own is None else own

    params: dict[str, Any] = {key: pick(suffix) for key, suffix in _FLAGS.items()}
    for key in _OPTIONAL:
        value = pick(key)
        if value is not None:
            params[key] = value
    if cfg.rollout_stop:
        params["stop"] = cfg.rollout_stop
    if cfg.rollout_stop_token_ids:
        params["stop_token_ids"] = cfg.rollout_stop_token_ids
    params.update(cfg.rollout_sampling_params or {})
    if evaluating:
        params.update(cfg.eval_sampling_params or {})
        if eval_set is not None:
            params.update((cfg.eval_set_sampling_params or {}).get(eval_set, {}))
    return params

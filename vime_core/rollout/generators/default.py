"""The default single-turn generate function (``--generate default``)."""

from __future__ import annotations

from typing import Any

from vime_core.agent.responders import engine_versions
from vime_core.config.context import PluginContext, rollout_engines, takes_context
from vime_core.data.prompt_checks import encode_prompt, encode_sample_prompt  # noqa: F401 - encode_prompt: old home
from vime_core.types import Sample, Status

FINISH_TO_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@takes_context
async def generate(ctx: PluginContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """One engine call through the router: prompt ids in, response ids + log-probs out (a vision-language
    sample's images go with its prompt: :func:`encode_sample_prompt`).

    Every response token is trainable (mask 1), carries the engine's log-prob and the weight version the engine
    tagged it with (``/inference/v1/generate``'s per-token ``weight_versions``); with ``--use-rollout-routing-replay``
    the sample carries the experts the engine routed its tokens to (``routed_experts``, prompt and response).
    ``finish_reason`` stop/length/abort → status completed/truncated/aborted. A sample whose prompt leaves no
    token budget (``--rollout-max-context-len``) is marked truncated without an engine call.

    Partial rollout: a sample that already has response tokens (an aborted sample being resumed) continues from
    ``tokens`` = prompt + partial response; ``max_tokens`` counts the whole response, so the engine is asked for
    ``max_tokens - response_length`` more (none left: truncated without an engine call).
    """
    cfg = ctx.rollout
    engines = rollout_engines(ctx)
    if not sample.tokens:
        sample.tokens = encode_sample_prompt(engines.tokenizer, sample.prompt, sample.images, cfg.apply_chat_template)
    params = dict(sampling_params)
    if sample.response_length and params.get("max_tokens") is not None:
        params["max_tokens"] -= sample.response_length
        if params["max_tokens"] <= 0:
            sample.status = Status.TRUNCATED
            return sample
    max_ctx = cfg.rollout_max_context_len
    if max_ctx:
        budget = max_ctx - len(sample.tokens)
        if budget <= 0:
            sample.status = Status.TRUNCATED
            return sample
        params["max_tokens"] = min(params.get("max_tokens", budget), budget)
    images = {"images": list(sample.images)} if sample.images else {}  # with the prompt, to the engine (docs/vlm.md)
    out = await engines.client.generate(sample.tokens, params, session_id=sample.metadata.get("session_id"), **images)
    # per-token versions: the engine's tags, or the client's where the release tags none (a missing one raises)
    versions = engine_versions(out)
    sample.append_response_tokens(
        out.token_ids, trainable=True, log_probs=out.log_probs, weight_version=versions, text=out.text
    )
    sample.routed_experts = out.routed_experts  # --use-rollout-routing-replay: the whole sequence's, else None
    sample.status = FINISH_TO_STATUS[out.finish_reason]
    return sample

"""The default single-turn generate function (``--generate default``)."""

from __future__ import annotations

from typing import Any

from vime_core.agent.responders import engine_versions
from vime_core.context import PluginContext, takes_context
from vime_core.data.vision_prompt import encode_with_images, processor_for
from vime_core.rollout.context import get_rollout_context
from vime_core.types import Sample, Status

FINISH_TO_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], apply_chat_template: bool) -> list[int]:
    """Prompt token ids: chat messages go through the tokenizer's chat template (with the generation prompt);
    a string is tokenised as is, or wrapped as one user message when ``apply_chat_template``.

    :raises ValueError: if messages are given but the tokenizer has no chat template.
    """
    if isinstance(prompt, str) and not apply_chat_template:
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("prompt is a list of chat messages but the tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def encode_sample_prompt(
    tokenizer: Any, prompt: str | list[dict[str, Any]], images: list[str] | None, apply_chat_template: bool
) -> list[int]:
    """:func:`encode_prompt`, or for a prompt with images the model's processor: its chat template, every image
    placeholder expanded (:func:`vime_core.data.vision_prompt.encode_with_images`; the processor of the directory
    ``tokenizer`` came from).

    :raises ValueError: images with ``--no-apply-chat-template`` or with a string prompt (the data buffer turns a
        string prompt with images into chat messages), or a different number of images and image parts.
    """
    if not images:
        return encode_prompt(tokenizer, prompt, apply_chat_template)
    if not apply_chat_template:
        raise ValueError("a prompt with images needs the chat template (--no-apply-chat-template is set)")
    if isinstance(prompt, str):
        raise ValueError("a prompt with images must be chat messages with an image part per image")
    return encode_with_images(processor_for(tokenizer), prompt, images)


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
    engines = get_rollout_context()
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

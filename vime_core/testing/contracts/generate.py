"""Contract of generate functions."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

from vime_core.config.context import PluginContext, adapt_legacy, is_legacy
from vime_core.testing.contracts.base import _Contract, adapted
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample, Status

VALID_STATUSES = {Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED}


class GenerateFunctionContract(_Contract):
    """Contract of ``vime_register_generate_functions`` providers (needs running engines).

    Fixtures to supply: ``generate_fn`` (``async def generate(ctx, sample, sampling_params)``),
    ``rollout_context`` (the :class:`~vime_core.config.context.Engines` it generates with, e.g. a real router client +
    tokenizer), ``generate_ctx`` (the :class:`~vime_core.config.context.PluginContext` it is called with; default every
    flag at its default with ``rollout_context`` as ``ctx.engines``,
    :func:`vime_core.testing.plugin_context.plugin_context`) and ``prompt_sample`` (a fresh :class:`Sample`; a
    vision-language prompt carries its ``images``, and the samples returned must then hold them first, in order,
    each with one placeholder run of the processor's length).
    """

    @pytest.fixture
    def generate_ctx(self, rollout_context) -> PluginContext:
        return plugin_context(engines=rollout_context)

    def _run(self, generate_fn, generate_ctx, sample, params) -> list[Sample]:
        out = asyncio.run(adapted(generate_fn, "generate")(generate_ctx, sample, params))
        return out if isinstance(out, list) else [out]

    def test_signature(self, generate_fn: Any) -> None:
        assert inspect.iscoroutinefunction(generate_fn)
        generate_fn = getattr(
            generate_fn, "__vime_legacy__", generate_fn
        )  # the registry's wrapper of an (args, ...) one
        params = list(inspect.signature(generate_fn).parameters)
        if is_legacy(generate_fn):  # the deprecated (args, sample, sampling_params) form still works, with a warning
            with pytest.warns(DeprecationWarning, match=r"async def generate\(ctx: PluginContext"):
                adapt_legacy(generate_fn, "generate", "contract")
            params[0] = "ctx"
        assert params[:3] == ["ctx", "sample", "sampling_params"]

    def test_sample_bookkeeping(self, generate_fn, generate_ctx, prompt_sample, rollout_context) -> None:
        params = {"temperature": 1.0, "max_tokens": 8}
        for s in self._run(generate_fn, generate_ctx, prompt_sample, params):
            s.validate()
            assert s.status in VALID_STATUSES
            assert len(s.loss_mask) == s.response_length == len(s.rollout_log_probs) == len(s.weight_versions)
            assert 1 <= s.response_length <= 8 or s.status in (Status.ABORTED, Status.FAILED)
            assert all(lp <= 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask, strict=True) if m)
            assert all(
                v == rollout_context.weight_version for v, m in zip(s.weight_versions, s.loss_mask, strict=True) if m
            )
            if prompt_sample.images or s.images:  # a vision-language sample: every image, in order, one run each
                from vime_core.data.vision_prompt import check_image_tokens, processor_for

                assert s.images[: len(prompt_sample.images)] == prompt_sample.images
                check_image_tokens(processor_for(rollout_context.tokenizer), s.tokens, s.images, "the sample")

    def test_tokens_are_prompt_plus_response(self, generate_fn, generate_ctx, prompt_sample, rollout_context):
        from vime_core.data.prompt_checks import encode_sample_prompt

        apply_chat_template = generate_ctx.rollout.apply_chat_template
        prompt_ids = encode_sample_prompt(
            rollout_context.tokenizer, prompt_sample.prompt, prompt_sample.images, apply_chat_template
        )
        for s in self._run(generate_fn, generate_ctx, prompt_sample, {"temperature": 1.0, "max_tokens": 4}):
            assert s.tokens[: s.prompt_length] == prompt_ids

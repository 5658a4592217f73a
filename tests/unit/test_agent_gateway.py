"""The agent gateway with a scripted responder, driven by the real ``openai`` and ``anthropic`` SDKs.

Exact token bookkeeping for a tool-using conversation under three chat templates (the tiny model's ChatML, SmolLM2's
and Qwen2.5's, both shipped in tests/data), identical samples from the three APIs, drift (whitespace, dropped
thinking, parallel tool calls), streaming formats, errors and concurrent sessions. The scripted backend plays the
engine: "what the engine saw" is its recorded calls. The same SDKs against the real vLLM server:
tests/integration/test_agent_gateway_vllm.py.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import anthropic
import openai
import pytest

from vime_core.agent.gateway import AgentGateway
from vime_core.agent.responders import ScriptedResponder, ScriptedTurn
from vime_core.agent.tool_parsers import HermesToolParser, tool_schema
from vime_core.agent.trajectory import Drift, TurnRecord, check_token_exact
from vime_core.testing.samples import chain_mask
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit

DATA = Path(__file__).parents[1] / "data"
TEMPLATES = {
    "chatml": None,  # the tiny model's own template (no tool support: the Hermes format is written for it)
    "smollm2": (DATA / "smollm2_chat_template.jinja").read_text(),
    "qwen25": (DATA / "qwen25_chat_template.jinja").read_text(),
}
SYSTEM, USER, RESULT = "You are a weather bot.", "Weather in Paris?", "sunny, 21 C"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
FINAL = "It is sunny in Paris, 21 C."


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def oa(gw, sid):
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=sid, max_retries=0, timeout=60)


def an(gw, sid):
    return anthropic.Anthropic(base_url=gw.url, api_key=sid, max_retries=0, timeout=60)


def chat_episode(gw, sid):
    c = oa(gw, sid)
    tools = [{"type": "function", "function": WEATHER}]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    r1 = c.chat.completions.create(model="policy", messages=msgs, tools=tools)
    m = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls" and m.content is None
    (tc,) = m.tool_calls
    assert (tc.function.name, json.loads(tc.function.arguments)) == ("get_weather", {"city": "Paris"})
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
        {"role": "tool", "tool_call_id": tc.id, "content": RESULT},
    ]
    r2 = c.chat.completions.create(model="policy", messages=msgs, tools=tools)
    assert (r2.choices[0].finish_reason, r2.choices[0].message.content) == ("stop", FINAL)
    return r1, r2


def anthropic_episode(gw, sid):
    a = an(gw, sid)
    tools = [{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}]
    msgs = [{"role": "user", "content": USER}]
    r1 = a.messages.create(model="policy", max_tokens=256, system=SYSTEM, messages=msgs, tools=tools)
    assert r1.stop_reason == "tool_use" and [b.type for b in r1.content] == ["tool_use"]
    use = r1.content[0]
    assert (use.name, use.input, use.id.startswith("toolu_")) == ("get_weather", {"city": "Paris"}, True)
    msgs += [
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]},
    ]
    r2 = a.messages.create(model="policy", max_tokens=256, system=SYSTEM, messages=msgs, tools=tools)
    assert (r2.stop_reason, r2.content[0].text) == ("end_turn", FINAL)
    return r1, r2


def responses_episode(gw, sid):
    c = oa(gw, sid)
    tools = [{"type": "function", **WEATHER}]
    inp = [{"role": "user", "content": USER}]
    r1 = c.responses.create(model="policy", instructions=SYSTEM, input=inp, tools=tools)
    (fc,) = r1.output
    assert (fc.type, fc.name, json.loads(fc.arguments), r1.status) == (
        "function_call",
        "get_weather",
        {"city": "Paris"},
        "completed",
    )
    inp += [
        {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
        {"type": "function_call_output", "call_id": fc.call_id, "output": RESULT},
    ]
    r2 = c.responses.create(model="policy", instructions=SYSTEM, input=inp, tools=tools)
    assert r2.output_text == FINAL
    return r1, r2


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_tool_conversation_is_token_exact(gateway, tok, template):
    """[system, user, assistant(tool call), tool result, assistant]: the sample is exactly what the engine saw and
    is trained exactly on the two assistant outputs, end-of-turn tokens included."""
    gw, backend = gateway([CALL, FINAL], TEMPLATES[template])
    gw.open_session("sk-a")
    chat_episode(gw, "sk-a")
    tokenized = gw._sessions["sk-a"].trajectory.tokenized_chars
    (s,) = gw.close_session("sk-a", Sample(group_index=2, index=3, prompt=USER), reward=1.0)
    c1, c2 = backend.calls
    p1, o1, p2, o2 = c1.prompt_ids, c1.output.token_ids, c2.prompt_ids, c2.output.token_ids
    # incremental: the first prompt and then only the new text were tokenised, never the re-sent history
    assert tokenized == len(tok.decode(p1)) + len(tok.decode(p2[len(p1) + len(o1) :]))
    assert p2[: len(p1) + len(o1)] == p1 + o1  # the second prompt extends the first turn exactly
    assert s.tokens == p2 + o2 and s.prompt_length == len(p1)
    assert s.loss_mask == [1] * len(o1) + [0] * (len(p2) - len(p1) - len(o1)) + [1] * len(o2)
    assert o1[-1] == o2[-1] == tok.eos_token_id
    assert tok.decode(o1) == CALL + "<|im_end|>" and tok.decode(o2) == FINAL + "<|im_end|>"
    assert s.rollout_log_probs == [-0.5] * len(o1) + [0.0] * (len(p2) - len(p1) - len(o1)) + [-0.5] * len(o2)
    assert (s.reward, s.status, s.group_index, s.index) == (1.0, Status.COMPLETED, 2, 3)
    assert s.metadata["trajectory"]["drift"] == {"new": 1, "clean": 1, "realign": 0, "fork": 0}
    tools_prompt = HermesToolParser().tools_prompt([tool_schema(WEATHER)])
    if template == "qwen25":  # a template with tool support renders exactly as transformers does
        ref = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
        text = tok.apply_chat_template(
            ref,
            tools=[{"type": "function", "function": WEATHER}],
            tokenize=False,
            chat_template=TEMPLATES[template],
            add_generation_prompt=True,
        )
        assert tok.decode(p1) == text
    else:  # the Hermes tool list is appended to the system prompt
        assert tok.decode(p1) == (
            f"<|im_start|>system\n{SYSTEM}\n\n{tools_prompt}<|im_end|>\n"
            f"<|im_start|>user\n{USER}<|im_end|>\n<|im_start|>assistant\n"
        )
    # all three: the tool result comes back as a user turn in <tool_response> tags
    assert tok.decode(p2[len(p1) + len(o1) :]) == (
        "\n<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    check_token_exact([s], [_turn(c) for c in backend.calls])


def _turn(call):
    o = call.output
    return TurnRecord(call.prompt_ids, o.token_ids, o.log_probs, [int(v) for v in o.weight_versions], o.finish_reason)


def test_the_three_apis_give_identical_samples(gateway):
    script = {sid: [CALL, FINAL] for sid in ("sk-chat", "sk-anthropic", "sk-responses")}
    gw, backend = gateway(script, TEMPLATES["qwen25"])
    samples = {}
    for sid, episode in (
        ("sk-chat", chat_episode),
        ("sk-anthropic", anthropic_episode),
        ("sk-responses", responses_episode),
    ):
        gw.open_session(sid)
        episode(gw, sid)
        (samples[sid],) = gw.close_session(sid, Sample(prompt=USER), reward=0.0)
    ref = samples["sk-chat"]
    for s in samples.values():
        assert (s.tokens, s.loss_mask, s.prompt_length) == (ref.tokens, ref.loss_mask, ref.prompt_length)
    assert len({s.episode_id for s in samples.values()}) == 3
    assert ref.tokens == backend.calls[1].prompt_ids + backend.calls[1].output.token_ids


def test_streaming_responses_match_non_streaming(gateway, tok):
    script = {"*": [CALL, FINAL]}
    gw, _ = gateway(script, TEMPLATES["qwen25"])
    tools = [{"name": "get_weather", "description": "w", "input_schema": WEATHER["parameters"]}]
    for sid in ("s1", "s2", "s3"):
        gw.open_session(sid)
        backend_script = gw.responder.script
        backend_script[sid] = [CALL, FINAL]
    a = an(gw, "s1")
    with a.messages.stream(
        model="policy", max_tokens=64, messages=[{"role": "user", "content": USER}], tools=tools
    ) as stream:
        events = [e.type for e in stream]
        msg = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert msg.stop_reason == "tool_use" and msg.content[0].input == {"city": "Paris"}
    assert msg.usage.output_tokens == len(tok(CALL, add_special_tokens=False)["input_ids"]) + 1
    c = oa(gw, "s2")
    chunks = list(
        c.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": USER}],
            tools=[{"type": "function", "function": WEATHER}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert chunks[-2].choices[0].finish_reason == "tool_calls" and chunks[-1].usage.completion_tokens > 0
    c = oa(gw, "s3")
    with c.responses.stream(model="policy", input=USER, tools=[{"type": "function", **WEATHER}]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [o.type for o in final.output] == ["function_call"] and final.output[0].name == "get_weather"
    r2 = c.responses.create(
        model="policy",
        previous_response_id=final.id,
        tools=[{"type": "function", **WEATHER}],
        input=[{"type": "function_call_output", "call_id": final.output[0].call_id, "output": RESULT}],
    )
    assert r2.output_text == FINAL
    for sid in ("s1", "s2"):
        gw.drop_session(sid)
    (s,) = gw.close_session("s3", Sample())
    assert s.metadata["trajectory"]["drift"]["clean"] == 1  # previous_response_id rebuilt the same history


# -- drift ----------------------------------------------------------------------------------------------------------
def _two_turns(gw, sid, first_reply_as_resent: str, *, second_user="And tomorrow?"):
    c = oa(gw, sid)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    c.chat.completions.create(model="policy", messages=msgs)
    msgs += [{"role": "assistant", "content": first_reply_as_resent}, {"role": "user", "content": second_user}]
    c.chat.completions.create(model="policy", messages=msgs)
    msgs += [{"role": "assistant", "content": "Rain."}, {"role": "user", "content": "Thanks."}]
    c.chat.completions.create(model="policy", messages=msgs)


def test_drift_changed_whitespace_realigns_at_the_divergence(gateway, tok):
    gw, backend = gateway({"w": ["Sunny today.  \n\n", "Rain.", "Bye."]})
    gw.open_session("w")
    _two_turns(gw, "w", "Sunny today.")  # the client trims the reply it re-sends
    placements = [p.kind for p in gw._sessions["w"].placements]
    samples = gw.close_session("w", Sample())
    assert placements == [Drift.NEW, Drift.REALIGN, Drift.CLEAN]
    (s,) = samples
    c1, c2, c3 = backend.calls
    o1 = c1.output.token_ids
    kept = len(tok("Sunny today.", add_special_tokens=False)["input_ids"])
    assert tok.decode(o1[:kept]) == "Sunny today." and c2.prompt_ids[: len(c1.prompt_ids) + kept] == (
        c1.prompt_ids + o1[:kept]
    )
    assert s.metadata["trajectory"]["realign_dropped_tokens"] == len(o1) - kept  # whitespace + <|im_end|>
    assert s.tokens == c3.prompt_ids + c3.output.token_ids
    assert s.loss_mask == ([1] * kept + [0] * (len(c2.prompt_ids) - len(c1.prompt_ids) - kept) + chain_mask([c2, c3]))
    check_token_exact([s], [_turn(c) for c in backend.calls])


def test_drift_dropped_thinking_forks(gateway):
    think = "<think>\n" + "Paris is in France; weather is sunny there today. " * 4 + "\n</think>\n\n"
    gw, backend = gateway({"t": [think + "Sunny today.", "Rain.", "Bye."]})
    gw.open_session("t")
    _two_turns(gw, "t", "Sunny today.")  # history re-sent without the thinking (as Qwen3 templates do)
    s0, s1 = gw.close_session("t", Sample(), reward=1.0)
    c1, c2, c3 = backend.calls
    assert s0.tokens == c1.prompt_ids + c1.output.token_ids and s0.loss_mask == [1] * len(c1.output.token_ids)
    assert s1.tokens == c3.prompt_ids + c3.output.token_ids and s1.prompt_length == len(c2.prompt_ids)
    assert s1.loss_mask == chain_mask([c2, c3])
    assert s0.episode_id == s1.episode_id and s0.reward == s1.reward == 1.0
    assert [s.metadata["trajectory"]["turns"] for s in (s0, s1)] == [[0], [1, 2]]
    check_token_exact([s0, s1], [_turn(c) for c in backend.calls])


def test_drift_short_dropped_thinking_within_the_bound_realigns(gateway):
    gw, backend = gateway({"t": ["<think>ok</think>Sunny.", "Rain.", "Bye."]}, max_realign_tokens=64)
    gw.open_session("t")
    _two_turns(gw, "t", "Sunny.")
    (s,) = gw.close_session("t", Sample())
    c1, c2, c3 = backend.calls
    assert s.metadata["trajectory"]["drift"]["realign"] == 1
    assert s.metadata["trajectory"]["realign_dropped_tokens"] == len(c1.output.token_ids)  # all of turn 1 (bounded)
    assert s.tokens == c3.prompt_ids + c3.output.token_ids and s.prompt_length == len(c1.prompt_ids)
    check_token_exact([s], [_turn(c) for c in backend.calls])


@pytest.mark.parametrize(
    "separator,bound,kind", [("\n", 16, Drift.CLEAN), ("\n\n", 16, Drift.FORK), ("\n\n", 64, Drift.REALIGN)]
)
def test_drift_parallel_tool_calls(gateway, tok, separator, bound, kind):
    """Two calls in one turn, two results in one user turn. The template joins calls with one newline: a model that
    wrote a blank line between them drifts after the first call."""
    paris, tokyo = CALL, CALL.replace("Paris", "Tokyo")
    gw, backend = gateway(
        {"p": [paris + separator + tokyo, "Sunny in Paris, rain in Tokyo."]},
        TEMPLATES["qwen25"],
        max_realign_tokens=bound,
    )
    gw.open_session("p")
    c = oa(gw, "p")
    tools = [{"type": "function", "function": WEATHER}]
    msgs = [{"role": "user", "content": "Weather in Paris and Tokyo?"}]
    r1 = c.chat.completions.create(model="policy", messages=msgs, tools=tools)
    calls = r1.choices[0].message.tool_calls
    assert [json.loads(x.function.arguments)["city"] for x in calls] == ["Paris", "Tokyo"]
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [x.model_dump() for x in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
        {"role": "tool", "tool_call_id": calls[1].id, "content": "rain"},
    ]
    c.chat.completions.create(model="policy", messages=msgs, tools=tools)
    assert gw._sessions["p"].placements[1].kind is kind
    samples = gw.close_session("p", Sample())
    c1, c2 = backend.calls
    assert tok.decode(c2.prompt_ids).endswith(
        "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert samples[-1].tokens == c2.prompt_ids + c2.output.token_ids
    assert len(samples) == (2 if kind is Drift.FORK else 1)
    if kind is Drift.REALIGN:
        kept = len(tok(paris + "\n", add_special_tokens=False)["input_ids"])
        assert samples[0].metadata["trajectory"]["realign_dropped_tokens"] == len(c1.output.token_ids) - kept
    check_token_exact(samples, [_turn(c) for c in backend.calls])


# -- limits, errors, sessions ---------------------------------------------------------------------------------------
def test_max_tokens_truncation_is_recorded_but_not_trained(gateway):
    gw, backend = gateway({"m": ["A long answer that will not fit."]})
    gw.open_session("m", sampling_params={"temperature": 0.7, "max_tokens": 4})
    a = an(gw, "m")
    r = a.messages.create(
        model="policy", max_tokens=100, messages=[{"role": "user", "content": "Hi"}], extra_body={"temperature": 0.1}
    )
    assert (r.stop_reason, r.usage.output_tokens) == ("max_tokens", 4)
    assert backend.calls[0].sampling_params == {"temperature": 0.7, "max_tokens": 4}  # the session's wins
    (s,) = gw.close_session("m", Sample())
    assert (s.status, s.remove_sample, s.loss_mask) == (Status.TRUNCATED, True, [0, 0, 0, 0])
    assert s.metadata["trajectory"]["truncated_turns"] == [0]


def test_ill_formed_tool_call_is_returned_as_text_and_not_trained(gateway):
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    gw, _ = gateway({"i": [bad]})
    gw.open_session("i")
    r = oa(gw, "i").chat.completions.create(
        model="policy", messages=[{"role": "user", "content": USER}], tools=[{"type": "function", "function": WEATHER}]
    )
    assert (r.choices[0].finish_reason, r.choices[0].message.content) == ("stop", bad)
    (s,) = gw.close_session("i", Sample())
    assert s.remove_sample and s.metadata["trajectory"]["ill_formed_turns"] == [0]


def test_errors_unknown_session_abort_and_count_tokens(gateway):
    gw, backend = gateway({"e": [ScriptedTurn("partial", finish_reason="abort"), "Fine."]})
    with pytest.raises(openai.AuthenticationError):
        oa(gw, "nobody").chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.AuthenticationError):
        an(gw, "nobody").messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    gw.open_session("e")
    a = an(gw, "e")
    with pytest.raises(anthropic.InternalServerError) as err:  # 529 overloaded: agents retry
        a.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 529
    r = a.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert r.content[0].text == "Fine."
    n = a.messages.count_tokens(model="policy", messages=[{"role": "user", "content": "hi"}])
    assert n.input_tokens == len(backend.calls[1].prompt_ids)
    (s,) = gw.close_session("e", Sample())
    assert s.metadata["session_turns"] == 1 and s.metadata["gateway_errors"] == 1  # the abort was not recorded
    with pytest.raises(anthropic.AuthenticationError):  # closed
        a.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="already open"):
        gw.open_session("x")
        gw.open_session("x")
    assert oa(gw, "x").models.list().data[0].id == "vime-policy"


def test_session_turn_budget_refuses_later_calls_and_aborts_do_not_count(gateway):
    from vime_core.agent.gateway import TURN_BUDGET_MESSAGE

    gw, backend = gateway({"b": [ScriptedTurn("x", finish_reason="abort"), "One.", "Two.", "Three."]})
    gw.open_session("b", max_turns=2)
    a = an(gw, "b")
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.InternalServerError):  # aborted: retried by the agent, not counted
        a.messages.create(model="policy", max_tokens=8, messages=msgs)
    assert a.messages.create(model="policy", max_tokens=8, messages=msgs).content[0].text == "One."
    assert a.messages.create(model="policy", max_tokens=8, messages=msgs).content[0].text == "Two."
    with pytest.raises(anthropic.BadRequestError, match=TURN_BUDGET_MESSAGE):
        a.messages.create(model="policy", max_tokens=8, messages=msgs)
    with pytest.raises(openai.BadRequestError, match=TURN_BUDGET_MESSAGE):
        oa(gw, "b").chat.completions.create(model="policy", messages=msgs)
    assert len(backend.calls) == 3  # the refused requests never reached the engine
    samples = gw.close_session("b", Sample())
    assert {s.metadata["refused_turns"] for s in samples} == {2}
    assert {s.metadata["session_turns"] for s in samples} == {2}


def test_concurrent_sessions_stay_separate(gateway, tok):
    sids = [f"agent-{i}" for i in range(6)]
    gw, backend = gateway({sid: [f"{sid} turn 1", f"{sid} turn 2"] for sid in sids})
    for sid in sids:
        gw.open_session(sid)
    errors: list[BaseException] = []

    def run(sid: str) -> None:
        try:
            c = oa(gw, sid)
            msgs = [{"role": "user", "content": f"I am {sid}"}]
            r = c.chat.completions.create(model="policy", messages=msgs)
            msgs += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "again"},
            ]
            c.chat.completions.create(model="policy", messages=msgs, stream=True).close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(sid,)) for sid in sids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for sid in sids:
        (s,) = gw.close_session(sid, Sample())
        assert tok.decode(s.tokens) == (
            f"<|im_start|>user\nI am {sid}<|im_end|>\n<|im_start|>assistant\n"
            f"{sid} turn 1<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
            f"<|im_start|>assistant\n{sid} turn 2<|im_end|>"
        )
        assert s.metadata["trajectory"]["drift"]["clean"] == 1


# -- history="model": the model's own tokens for the assistant turns it generated -------------------------------
# Like Qwen3's template: earlier assistant turns are rendered without their <think> section.
DROPS_THINKING = (
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
THINK = "<think>\n" + "Paris is in France; weather is sunny there today. " * 4 + "\n</think>\n\nSunny today."


@pytest.mark.parametrize(
    "history,kinds",
    [("client", [Drift.NEW, Drift.FORK, Drift.CLEAN]), ("model", [Drift.NEW, Drift.CLEAN, Drift.CLEAN])],
)
def test_template_dropping_thinking_forks_unless_history_is_the_models(gateway, history, kinds):
    gw, backend = gateway({"h": [THINK, "Rain.", "Bye."]}, DROPS_THINKING, history=history)
    gw.open_session("h")
    _two_turns(gw, "h", THINK)  # the client re-sends the reply verbatim; the template drops the thinking
    assert [p.kind for p in gw._sessions["h"].placements] == kinds
    samples = gw.close_session("h", Sample())
    check_token_exact(samples, [_turn(c) for c in backend.calls])
    last = backend.calls[-1]
    assert samples[-1].tokens == last.prompt_ids + last.output.token_ids
    if history == "model":  # one sample, every sampled token trained, the thinking kept in context
        (s,) = samples
        assert s.loss_mask == chain_mask(backend.calls) and "</think>" in gw.renderer.decode(last.prompt_ids)


@pytest.mark.parametrize(
    "first,resent", [("Sunny today.  \n\n", "Sunny today."), (CALL + "\n\n" + CALL.replace("Paris", "Tokyo"), None)]
)
def test_model_history_absorbs_client_reformatting(gateway, first, resent):
    """Trimmed whitespace and re-joined parallel calls would realign or fork; with history="model" they are clean."""
    gw, backend = gateway({"r": [first, "Rain.", "Bye."]}, TEMPLATES["qwen25"], history="model")
    gw.open_session("r")
    c = oa(gw, "r")
    tools = [{"type": "function", "function": WEATHER}]
    msgs = [{"role": "user", "content": USER}]
    r1 = c.chat.completions.create(model="policy", messages=msgs, tools=tools)
    m = r1.choices[0].message
    msgs.append(
        {"role": "assistant", "content": resent, "tool_calls": [x.model_dump() for x in m.tool_calls]}
        if m.tool_calls
        else {"role": "assistant", "content": resent}
    )
    msgs += [{"role": "tool", "tool_call_id": x.id, "content": "ok"} for x in m.tool_calls or []]
    msgs += [] if m.tool_calls else [{"role": "user", "content": "More?"}]
    c.chat.completions.create(model="policy", messages=msgs, tools=tools)
    assert [p.kind for p in gw._sessions["r"].placements] == [Drift.NEW, Drift.CLEAN]
    (s,) = gw.close_session("r", Sample())
    assert s.loss_mask == chain_mask(backend.calls[:2])
    check_token_exact([s], [_turn(x) for x in backend.calls])


# -- a prompt that fills the context window ---------------------------------------------------------------------
LONG = "Tell me about the weather. " * 20
# Claude Code 2.1.197 (its bundled JS): `e.message.toLowerCase().includes("prompt is too long")`, then
# /prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)/i for the token gap it compacts by
CLAUDE_CODE_PROMPT_TOO_LONG = r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)"


def _prompt_len(gw, messages, tools=None):
    from vime_core.agent.chat import ChatMessage

    text = gw.renderer.render([ChatMessage(m["role"], m["content"]) for m in messages], tools)
    return len(gw.renderer.encode(text))


def test_context_overflow_errors_are_the_ones_each_client_recognises(gateway):
    import re

    gw, backend = gateway({"*": ["Short answer."]})
    msgs = [{"role": "user", "content": LONG}]
    n = _prompt_len(gw, msgs)
    gw.open_session("cc", max_context_len=n, max_turns=1)  # room for the prompt, none for the output
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as err:
            a = an(gw, "cc")
            if stream:
                with a.messages.stream(model="policy", max_tokens=64, messages=msgs) as s:
                    list(s)
            else:
                a.messages.create(model="policy", max_tokens=64, messages=msgs)
        assert err.value.body == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": f"prompt is too long: {n} tokens > {n - 1} maximum"},
        }
        m = re.search(CLAUDE_CODE_PROMPT_TOO_LONG, str(err.value).lower())
        assert (int(m.group(1)), int(m.group(2))) == (n, n - 1)  # Claude Code's token gap: 1 > 0, it compacts
    # the refused requests did not use up the turn budget: the compacted conversation is served
    r = an(gw, "cc").messages.create(model="policy", max_tokens=64, messages=[{"role": "user", "content": "Hi"}])
    assert r.content[0].text == "Short answer."
    (s,) = gw.close_session("cc", Sample())
    assert (s.metadata["context_exhausted"], s.metadata["context_overflows"], s.metadata["session_turns"]) == (
        True,
        2,
        1,
    )
    expected = {"type": "invalid_request_error", "code": "context_length_exceeded"}
    gw.open_session("oa", max_context_len=n)
    with pytest.raises(openai.BadRequestError) as err:
        oa(gw, "oa").chat.completions.create(model="policy", messages=msgs)
    assert err.value.body == {
        **expected,
        "param": "messages",
        "message": f"This model's maximum context length is {n} tokens. However, your messages resulted in {n} "
        "tokens, leaving no room for the output. Please reduce the length of the messages.",
    }
    n_resp = _prompt_len(gw, msgs)
    with pytest.raises(openai.BadRequestError) as err:
        oa(gw, "oa").responses.create(model="policy", input=LONG)
    assert err.value.body == {
        **expected,
        "param": "input",
        "message": f"This model's maximum context length is {n} tokens. However, your input resulted in {n_resp} "
        "tokens, leaving no room for the output. Please reduce the length of the input.",
    }
    # streamed Responses (how Codex calls): response.created then response.failed carrying the code Codex reads
    events = list(oa(gw, "oa").responses.create(model="policy", input=LONG, stream=True))
    assert [e.type for e in events] == ["response.created", "response.failed"]
    assert (events[1].response.status, events[1].response.error.code) == ("failed", "context_length_exceeded")
    assert gw.session_turns("oa") == [] and gw._sessions["oa"].context_overflows == 3
    assert gw.close_session("oa", Sample()) == []  # nothing was generated: no sample
    assert len(backend.calls) == 1  # no refused request reached the engine


class _EngineRefusingLongPrompts(ScriptedResponder):
    """Answers like vLLM behind the router for a prompt over its max_model_len (RouterClient's error text)."""

    async def generate(self, prompt_token_ids, sampling_params, session_id=None):
        from vime_core.engines.client import RouterClientError

        if len(prompt_token_ids) > 32:
            raise RouterClientError(
                'POST http://127.0.0.1:30000/v1/completions returned 400: {"error": {"message": "This model\'s '
                f"maximum context length is 32 tokens. However, your request has {len(prompt_token_ids)} input "
                'tokens. Please reduce the length of the input messages.", "type": "BadRequestError", "code": 400}}'
            )
        return await super().generate(prompt_token_ids, sampling_params, session_id)


def test_engine_context_limit_is_reported_as_context_overflow(tok):
    with AgentGateway(tok, _EngineRefusingLongPrompts(tok, ["ok"])) as gw:
        gw.open_session("e")
        msgs = [{"role": "user", "content": LONG}]
        n = _prompt_len(gw, msgs)
        with pytest.raises(anthropic.BadRequestError) as err:
            an(gw, "e").messages.create(model="policy", max_tokens=8, messages=msgs)
        assert err.value.body["error"]["message"] == f"prompt is too long: {n} tokens > 31 maximum"
        with pytest.raises(openai.BadRequestError) as err:
            oa(gw, "e").chat.completions.create(model="policy", messages=msgs)
        assert err.value.body["code"] == "context_length_exceeded"
        assert gw._sessions["e"].context_overflows == 2 and gw._sessions["e"].errors == 0
        assert gw.close_session("e", Sample()) == []

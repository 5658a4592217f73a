"""Tool calls parsed by JSON structure (Hermes/Qwen format), its streaming variant under every chunking, turns cut by
the token budget, and tool results paired to their calls by id — through the parser, the ``multi_turn`` generate
function and the agent gateway (driven by the real ``anthropic``/``openai`` SDKs)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from pathlib import Path

import anthropic
import openai
import pytest

from vime_core.agent.responders import ScriptedResponder
from vime_core.agent.tool_parsers import HermesToolParser, OpenAIJsonToolParser, ParseResult, get_tool_parser
from vime_core.plugins.manager import get_plugins
from vime_core.rollout.context import RolloutContext, set_rollout_context
from vime_core.rollout.generators.tools import register_tool
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit

QWEN = (Path(__file__).parents[1] / "data" / "qwen25_chat_template.jinja").read_text()
# issue 15 §7: a closing tag inside a JSON string argument
ARGS = {"path": "notes.md", "content": "close it with </tool_call> then stop"}
CALL = '<tool_call>\n{"name": "write_file", "arguments": ' + json.dumps(ARGS) + "}\n</tool_call>"
WRITE_FILE = {
    "name": "write_file",
    "description": "Write a file.",
    "parameters": {
        "type": "object",
        "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"],
    },
}
WRITTEN: list[tuple[str, str]] = []


def write_file(path: str, content: str) -> str:
    """Write a file."""
    WRITTEN.append((path, content))
    return f"wrote {len(content)} characters to {path}"


register_tool(write_file)


def calls_of(r: ParseResult) -> list[tuple[str, dict]]:
    return [(c.name, c.arguments) for c in r.tool_calls]


# -- the parser ---------------------------------------------------------------------------------------------------
def test_closing_tag_inside_a_string_argument_is_part_of_the_argument():
    r = HermesToolParser().parse(CALL)
    assert (r.content, calls_of(r), r.ill_formed, r.errors) == ("", [("write_file", ARGS)], False, [])


def test_two_calls_back_to_back():
    r = HermesToolParser().parse(CALL + CALL)
    assert (r.content, calls_of(r), r.ill_formed) == ("", [("write_file", ARGS)] * 2, False)
    r = HermesToolParser().parse("Writing twice.\n" + CALL + "\n" + CALL + "\n")
    assert (r.content, calls_of(r), r.ill_formed) == ("Writing twice.", [("write_file", ARGS)] * 2, False)


@pytest.mark.parametrize(
    "cut", [len("<tool_call>"), len("<tool_call>\n{"), CALL.index("</tool_call>") + 5, len(CALL) - 3]
)
def test_cut_inside_a_call_gives_no_call_and_keeps_the_text(cut):
    text = "Let me write it.\n" + CALL[:cut]
    r = HermesToolParser().parse(text)
    assert (r.content, r.tool_calls, r.ill_formed, r.errors) == (text, [], True, ["unclosed <tool_call>"])
    r = HermesToolParser().parse("Let me write it.\n<tool_c")  # cut inside the tag: not a call at all
    assert (r.content, r.tool_calls, r.ill_formed) == ("Let me write it.\n<tool_c", [], False)


def test_ill_formed_blocks_stay_text():
    p = HermesToolParser()
    bad = '<tool_call>\n{"name": "f", "arguments": {oops}}\n</tool_call>'
    r = p.parse(bad + CALL)
    assert (r.content, calls_of(r), r.ill_formed) == (bad, [("write_file", ARGS)], True)
    assert r.errors[0].startswith("JSONDecodeError: ")
    r = p.parse("<tool_call>not json</tool_call> then text")
    assert (r.content, r.tool_calls, r.errors) == (
        "<tool_call>not json</tool_call> then text",
        [],
        ["<tool_call> is not followed by a JSON object"],
    )
    r = p.parse('<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>')
    assert (r.content, r.tool_calls, r.errors) == (
        '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
        [],
        ["text after the JSON object before </tool_call>"],
    )
    r = p.parse('<tool_call>{"arguments": {}}</tool_call>')
    assert (r.tool_calls, r.errors) == ([], ['ValueError: tool call without a name: {"arguments": {}}'])


STREAM_CASES = [
    CALL,
    "Two calls: " + CALL + CALL + " done",
    'x <tool_c <tool_call> {"name": "a", "arguments": {"s": "\\"}{[</tool_call>"}} </tool_call>y</tool_call',
    '<tool_call>\n{"name": "f", "arguments": {oops}}\n</tool_call>' + CALL + "<tool_call>not json</tool_call>tail",
    "Let me write it.\n" + CALL[:70],
    "plain text with </tool_call> and < signs",
]


def stream_parse(parser, chunks: list[str]) -> tuple[ParseResult, str, list]:
    s = parser.stream()
    events = [e for c in chunks for e in s.feed(c)] + s.close()
    text = "".join(e.text for e in events if e.kind == "text")
    called = [(e.call.name, e.call.arguments) for e in events if e.kind == "call"]
    return s.result(), text, called


def _same(a: ParseResult, b: ParseResult) -> bool:
    return (a.content, calls_of(a), a.ill_formed, a.errors) == (b.content, calls_of(b), b.ill_formed, b.errors)


@pytest.mark.parametrize("case", range(len(STREAM_CASES)))
def test_streaming_gives_the_same_result_for_every_chunking(case):
    """Every split into 2 and 3 chunks, one character at a time, and 300 random chunkings."""
    text = STREAM_CASES[case]
    p = HermesToolParser()
    whole = p.parse(text)
    n = len(text)
    splits = [(i,) for i in range(n + 1)] + list(itertools.combinations(range(1, n), 2))
    splits.append(tuple(range(1, n)))
    rng = random.Random(case)
    splits += [tuple(sorted(rng.sample(range(1, n), rng.randint(1, min(n - 1, 12))))) for _ in range(300)]
    for cuts in splits:
        bounds = [0, *cuts, n]
        chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
        r, streamed_text, called = stream_parse(p, chunks)
        assert _same(r, whole), cuts
        assert (streamed_text.strip() if r.tool_calls else streamed_text) == whole.content, cuts
        assert called == calls_of(whole), cuts


def test_streaming_default_for_other_formats_buffers():
    p = OpenAIJsonToolParser()
    text = '{"name": "f", "arguments": {"x": "}"}}'
    for i in range(len(text) + 1):
        r, _, called = stream_parse(p, [text[:i], text[i:]])
        assert (calls_of(r), called) == ([("f", {"x": "}"})], [("f", {"x": "}"})])
    assert get_tool_parser("qwen").parse(CALL).tool_calls[0].arguments == ARGS


# -- multi_turn ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def run_multi_turn(tok, script, max_tokens):
    backend = ScriptedResponder(tok, script)
    set_rollout_context(RolloutContext(client=backend, tokenizer=tok, weight_version=0))
    try:
        ctx = plugin_context(apply_chat_template=True, multi_turn_tools=["write_file"])
        s = asyncio.run(
            get_plugins().resolve("generate", "multi_turn")(
                ctx, Sample(prompt="Write notes.md."), {"max_tokens": max_tokens}
            )
        )
    finally:
        set_rollout_context(None)
    s.validate()
    return s, backend.calls


def test_multi_turn_runs_the_call_with_its_argument_intact(tok):
    WRITTEN.clear()
    s, calls = run_multi_turn(tok, [CALL, "Done."], 400)
    assert WRITTEN == [("notes.md", "close it with </tool_call> then stop")]
    assert s.metadata["tool_calls"] == [
        {"turn": 0, "name": "write_file", "arguments": ARGS, "result": "wrote 36 characters to notes.md"}
    ]
    assert (s.status, s.metadata["ill_formed_turns"]) == (Status.COMPLETED, [])
    assert s.tokens == calls[1].prompt_ids + calls[1].output.token_ids


def test_multi_turn_cut_mid_call_runs_nothing_and_is_truncated(tok):
    WRITTEN.clear()
    n = len(tok(CALL, add_special_tokens=False)["input_ids"]) - 4  # cut 4 tokens before the closing tag ends
    s, calls = run_multi_turn(tok, [CALL, "Done."], n)
    (c,) = calls
    assert WRITTEN == [] and s.metadata["tool_calls"] == []
    assert (s.status, s.metadata["stop_reason"]) == (Status.TRUNCATED, "length")
    assert s.tokens == c.prompt_ids + c.output.token_ids and c.output.token_ids == tok(CALL)["input_ids"][:n]
    assert s.response == tok.decode(tok(CALL)["input_ids"][:n]) and s.loss_mask == [1] * n


# -- the gateway --------------------------------------------------------------------------------------------------
def an(gw, sid):
    return anthropic.Anthropic(base_url=gw.url, api_key=sid, max_retries=0, timeout=60)


def oa(gw, sid):
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=sid, max_retries=0, timeout=60)


ANTHROPIC_TOOLS = [
    {"name": "write_file", "description": "Write a file.", "input_schema": WRITE_FILE["parameters"]},
    {"name": "read_file", "description": "Read a file.", "input_schema": {"type": "object", "properties": {}}},
]


def test_gateway_two_calls_with_closing_tags_in_arguments(gateway):
    gw, backend = gateway({"g": [CALL + "\n" + CALL]}, QWEN)
    gw.open_session("g")
    r = an(gw, "g").messages.create(
        model="p", max_tokens=300, messages=[{"role": "user", "content": "Write."}], tools=ANTHROPIC_TOOLS
    )
    assert r.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in r.content] == [("tool_use", "write_file", ARGS)] * 2
    (turn,) = gw.session_turns("g")
    assert turn.output_ids == backend.calls[0].output.token_ids and not turn.ill_formed
    gw.drop_session("g")


def test_gateway_turn_cut_mid_call_is_text_and_truncated(gateway, tok):
    n = len(tok(CALL, add_special_tokens=False)["input_ids"]) - 4
    gw, backend = gateway({"a": [CALL], "o": [CALL]}, QWEN)
    gw.open_session("a", sampling_params={"max_tokens": n})
    r = an(gw, "a").messages.create(
        model="p", max_tokens=300, messages=[{"role": "user", "content": "Write."}], tools=ANTHROPIC_TOOLS
    )
    cut = tok.decode(tok(CALL)["input_ids"][:n])
    assert (r.stop_reason, [(b.type, b.text) for b in r.content]) == ("max_tokens", [("text", cut)])
    (turn,) = gw.session_turns("a")
    assert (turn.output_ids, turn.finish_reason, turn.ill_formed) == (
        backend.calls[0].output.token_ids,
        "length",
        False,
    )
    (s,) = gw.close_session("a", Sample())
    assert (s.status, s.remove_sample, s.loss_mask, s.metadata["trajectory"]["truncated_turns"]) == (
        Status.TRUNCATED,
        True,
        [0] * n,
        [0],
    )
    assert s.tokens == backend.calls[0].prompt_ids + backend.calls[0].output.token_ids
    gw.open_session("o", sampling_params={"max_tokens": n})
    c = oa(gw, "o").chat.completions.create(
        model="p",
        messages=[{"role": "user", "content": "Write."}],
        tools=[{"type": "function", "function": WRITE_FILE}],
    )
    assert (c.choices[0].finish_reason, c.choices[0].message.content, c.choices[0].message.tool_calls) == (
        "length",
        cut,
        None,
    )
    gw.drop_session("o")


# -- tool results paired to their calls -------------------------------------------------------------------------
TWO_CALLS = CALL + "\n" + CALL.replace("notes.md", "todo.md")
RESULTS_IN_CALL_ORDER = (
    "<|im_start|>user\n<tool_response>\nwrote notes\n</tool_response>\n<tool_response>\nwrote todo\n"
    "</tool_response><|im_end|>\n<|im_start|>assistant\n"
)


def test_anthropic_tool_results_are_paired_and_ordered_by_call(gateway, tok):
    gw, backend = gateway({"*": [TWO_CALLS, "Both written."]}, QWEN)
    gw.open_session("r")
    a = an(gw, "r")
    msgs = [{"role": "user", "content": "Write."}]
    r = a.messages.create(model="p", max_tokens=300, messages=msgs, tools=ANTHROPIC_TOOLS)
    u1, u2 = r.content
    msgs.append({"role": "assistant", "content": [u1.model_dump(), u2.model_dump()]})

    def results(*pairs):
        return {"role": "user", "content": [{"type": "tool_result", **p} for p in pairs]}

    reversed_results = results(
        {"tool_use_id": u2.id, "content": "wrote todo"}, {"tool_use_id": u1.id, "content": "wrote notes"}
    )
    assert a.messages.create(model="p", max_tokens=300, messages=[*msgs, reversed_results], tools=ANTHROPIC_TOOLS)
    assert tok.decode(backend.calls[1].prompt_ids).endswith(RESULTS_IN_CALL_ORDER)  # call order, not arrival order
    for bad, message in [
        (
            results({"tool_use_id": u1.id, "content": "a"}, {"tool_use_id": "toolu_nope", "content": "b"}),
            "unexpected `tool_use_id` found in `tool_result` blocks: toolu_nope. Each `tool_result` block must have "
            f"a corresponding `tool_use` block in the previous assistant message (its ids: {u1.id}, {u2.id})",
        ),
        (
            results({"content": "a"}),
            "a `tool_result` block has no `tool_use_id`; each result must name the call it answers "
            f"(calls of the previous assistant message: {u1.id}, {u2.id})",
        ),
        (
            results({"tool_use_id": u1.id, "content": "a"}, {"tool_use_id": u1.id, "content": "b"}),
            f"`tool_use_id` {u1.id} is answered twice",
        ),
    ]:
        with pytest.raises(anthropic.BadRequestError) as err:
            a.messages.create(model="p", max_tokens=300, messages=[*msgs, bad], tools=ANTHROPIC_TOOLS)
        assert err.value.status_code == 400
        assert err.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    with pytest.raises(anthropic.BadRequestError, match="must answer a `tool_use` block of the assistant message"):
        a.messages.create(
            model="p",
            max_tokens=300,
            messages=[results({"tool_use_id": u1.id, "content": "a"})],
            tools=ANTHROPIC_TOOLS,
        )
    assert len(backend.calls) == 2  # refused requests never reach the engine
    gw.drop_session("r")


def test_openai_tool_call_ids_are_paired_and_ordered_by_call(gateway, tok):
    gw, backend = gateway({"*": [TWO_CALLS, "Both written."]}, QWEN)
    gw.open_session("c")
    c = oa(gw, "c")
    tools = [{"type": "function", "function": WRITE_FILE}]
    msgs = [{"role": "user", "content": "Write."}]
    m = c.chat.completions.create(model="p", messages=msgs, tools=tools).choices[0].message
    t1, t2 = m.tool_calls
    msgs.append({"role": "assistant", "content": None, "tool_calls": [t1.model_dump(), t2.model_dump()]})
    c.chat.completions.create(
        model="p",
        messages=[
            *msgs,
            {"role": "tool", "tool_call_id": t2.id, "content": "wrote todo"},
            {"role": "tool", "tool_call_id": t1.id, "content": "wrote notes"},
        ],
        tools=tools,
    )
    assert tok.decode(backend.calls[1].prompt_ids).endswith(RESULTS_IN_CALL_ORDER)
    for bad, message in [
        (
            [{"role": "tool", "tool_call_id": "call_nope", "content": "x"}],
            "unexpected 'tool_call_id' found in messages with role 'tool': call_nope. Each message with role 'tool' "
            f"must have a corresponding 'tool_calls' entry in the previous assistant message (its ids: {t1.id}, "
            f"{t2.id})",
        ),
        (
            [{"role": "tool", "content": "x"}],
            "a message with role 'tool' has no 'tool_call_id'; each result must name the call it answers "
            f"(calls of the previous assistant message: {t1.id}, {t2.id})",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="p", messages=[*msgs, *bad], tools=tools)
        assert err.value.status_code == 400 and err.value.body["message"] == message
    gw.drop_session("c")


def test_responses_call_ids_are_paired_and_ordered_by_call(gateway, tok):
    gw, backend = gateway({"*": [TWO_CALLS, "Both written."]}, QWEN)
    gw.open_session("s")
    c = oa(gw, "s")
    tools = [{"type": "function", **WRITE_FILE}]
    r = c.responses.create(model="p", input="Write.", tools=tools)
    f1, f2 = r.output
    out = [
        {"type": "function_call_output", "call_id": f2.call_id, "output": "wrote todo"},
        {"type": "function_call_output", "call_id": f1.call_id, "output": "wrote notes"},
    ]
    c.responses.create(model="p", previous_response_id=r.id, input=out, tools=tools)
    assert tok.decode(backend.calls[1].prompt_ids).endswith(RESULTS_IN_CALL_ORDER)
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(
            model="p",
            previous_response_id=r.id,
            input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}],
            tools=tools,
        )
    assert err.value.body["message"] == (
        "unexpected 'call_id' found in 'function_call_output' items: call_nope. Each 'function_call_output' item "
        f"must have a corresponding 'function_call' item in the previous assistant message (its ids: {f1.call_id}, "
        f"{f2.call_id})"
    )
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(
            model="p", previous_response_id=r.id, input=[{"type": "function_call_output", "output": "x"}], tools=tools
        )
    assert err.value.body["message"] == (
        "a 'function_call_output' item has no 'call_id'; each result must name the call it answers "
        f"(calls of the previous assistant message: {f1.call_id}, {f2.call_id})"
    )
    gw.drop_session("s")

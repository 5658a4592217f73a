"""Qwen3-Coder's XML tool calls through the agent gateway and ``multi_turn`` (issue 27): the ``qwen3_coder`` parser
selected by its flag, typed values, the finish reason, the recorded completion ids untouched by parsing, and every
parse failure counted by reason from the turn to the samples to ``metrics.jsonl``
(``agent/tool_parse_failures/<reason>``). The engine is a :class:`ScriptedResponder`; the parser alone, streamed in
chunks: tests/unit/test_qwen3_xml_parser.py."""

from __future__ import annotations

import json
from dataclasses import replace

import anthropic
import openai
import pytest

from tests.support.qwen3_xml_calls import BAD_OFFSET, READ, REGISTER, TOOLS
from tests.support.rollout import manager_with_hooks
from vime_core.agent.qwen3_xml import Qwen3XMLToolParser
from vime_core.agent.tool_parse_failures import ToolParseFailure
from vime_core.cli.arguments import default_args
from vime_core.config import CodingAgentConfig
from vime_core.config.context import PluginContext
from vime_core.plugins.manager import get_plugins
from vime_core.rollout.context import RolloutContext, set_rollout_context
from vime_core.rollout.generators import coding_agent
from vime_core.run.metrics import MetricsSink
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample

pytestmark = pytest.mark.unit

#: a call cut before its end tag, the turn ended by the model (EOS): ill-formed, reason ``unclosed``
CUT = READ[: READ.index("</function>")]
ANSWER = "The file has 140 lines."
ZERO = {f"agent/tool_parse_failures/{r.value}": 0.0 for r in ToolParseFailure}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _chat(gw, sid, stream: bool):
    """One chat request with the two tools: ``(finish_reason, content, [(name, arguments)])``."""
    c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=sid, max_retries=0, timeout=60)
    tools = [TOOLS[0], {"type": "function", "function": TOOLS[1]}]  # TOOLS[1] is in the flat shape
    kw = dict(model="policy", messages=[{"role": "user", "content": "Read src/a.py."}], tools=tools)
    if not stream:
        ch = c.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls or []]
        return ch.finish_reason, ch.message.content, calls
    chunks = list(c.chat.completions.create(**kw, stream=True))
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) or None
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1
    return finish[0], content, [(d.function.name, json.loads(d.function.arguments)) for d in deltas]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_gateway_types_values_keeps_ids_and_counts_failures_per_segment(gateway, tok, stream):
    script = [READ, REGISTER, BAD_OFFSET, ANSWER, CUT]
    gw, backend = gateway({"q": script}, tool_parser="qwen3_coder")
    assert isinstance(gw.renderer.parser, Qwen3XMLToolParser)
    gw.open_session("q")
    got = [_chat(gw, "q", stream) for _ in script]
    assert got == [
        ("tool_calls", None, [("read_file", {"path": "src/a.py", "offset": 230, "limit": 140})]),
        ("tool_calls", None, [("register", {"zip_code": "03106", "age": 32})]),
        ("tool_calls", None, [("read_file", {"path": "src/a.py", "offset": "2026-01-15", "limit": 140})]),
        ("stop", ANSWER, []),
        ("stop", CUT, []),
    ]
    turns = gw.session_turns("q")
    eos = tok.eos_token_id
    for turn, call, text in zip(turns, backend.calls, script, strict=True):  # what the engine produced, unchanged
        assert turn.output_ids == call.output.token_ids == tok(text, add_special_tokens=False)["input_ids"] + [eos]
    assert [t.metadata["tool_parse_failures"] for t in turns] == [{}, {}, {"value_type": 1}, {}, {"unclosed": 1}]
    assert [t.metadata["tool_value_errors"] for t in turns][2] == [
        "read_file.offset: '2026-01-15' is not an integer; kept as the string '2026-01-15'"
    ]
    assert [t.ill_formed for t in turns] == [False, False, False, False, True]
    samples = gw.close_session("q", Sample())
    per_turn = {2: {"value_type": 1}, 4: {"unclosed": 1}}
    for s in samples:  # each segment counts the turns it holds; together they count each turn once
        want: dict[str, int] = {}
        for i in s.metadata["trajectory"]["turns"]:
            for reason, n in per_turn.get(i, {}).items():
                want[reason] = want.get(reason, 0) + n
        assert s.metadata["tool_parse_failures"] == want
    assert sorted(i for s in samples for i in s.metadata["trajectory"]["turns"]) == [0, 1, 2, 3, 4]
    m = coding_agent.rollout_metrics(samples)
    assert {k: v for k, v in m.items() if k.startswith("agent/")} == {
        **ZERO,
        "agent/tool_parse_failures/value_type": 1.0,
        "agent/tool_parse_failures/unclosed": 1.0,
    }


def test_gateway_anthropic_tool_use_is_typed(gateway):
    gw, _ = gateway({"a": [READ, ANSWER]}, tool_parser="qwen3xml")
    gw.open_session("a")
    a = anthropic.Anthropic(base_url=gw.url, api_key="a", max_retries=0, timeout=60)
    tools = [{"name": t["name"], "input_schema": t["parameters"]} for t in (TOOLS[0]["function"], TOOLS[1])]
    msgs = [{"role": "user", "content": "Read src/a.py."}]
    r = a.messages.create(model="policy", max_tokens=256, messages=msgs, tools=tools)
    assert (r.stop_reason, [(b.type, b.name, b.input) for b in r.content]) == (
        "tool_use",
        [("tool_use", "read_file", {"path": "src/a.py", "offset": 230, "limit": 140})],
    )
    r = a.messages.create(model="policy", max_tokens=256, messages=msgs, tools=tools)
    assert (r.stop_reason, [b.text for b in r.content]) == ("end_turn", [ANSWER])


def test_hermes_gateway_reads_the_xml_as_an_ill_formed_non_call(gateway):
    """The default parser on Qwen3-Coder output: no call, the turn ill-formed, counted as ``not_a_call``."""
    gw, _ = gateway({"h": [READ]})
    gw.open_session("h")
    assert _chat(gw, "h", False) == ("stop", READ, [])
    (s,) = gw.close_session("h", Sample())
    assert (s.metadata["trajectory"]["ill_formed_turns"], s.metadata["tool_parse_failures"]) == (
        [0],
        {"not_a_call": 1},
    )


def test_agent_tool_parser_flag_selects_the_gateway_parser(tok):
    from vime_core.agent.responders import ScriptedResponder

    args = default_args(generate="coding_agent", agent_tool_parser="qwen3_coder", rollout_max_response_len=64)
    ctx = RolloutContext(client=ScriptedResponder(tok, []), tokenizer=tok)
    gw = coding_agent.gateway_for(ctx, CodingAgentConfig.from_args(args))
    try:
        assert isinstance(gw.renderer.parser, Qwen3XMLToolParser)
    finally:
        gw.stop()


def test_coding_agent_failure_counts_reach_metrics_jsonl(tmp_path):
    """The built-in ``vime_on_rollout_end`` (what the rollout manager calls each step) adds the counts; the sink
    writes them to metrics.jsonl."""
    samples = [
        Sample(metadata={"tool_parse_failures": {"value_type": 2, "unclosed": 1}}, episode_id="e1"),
        Sample(metadata={"tool_parse_failures": {"not_a_call": 1}}, episode_id="e1"),
        Sample(metadata={"tool_parse_failures": {}}, episode_id="e2"),
    ]
    metrics: dict[str, float] = {"rollout/num_samples": 3.0}
    get_plugins().pm.hook.vime_on_rollout_end(
        ctx=plugin_context(generate="coding_agent"), step=0, samples=samples, metrics=metrics, args=None
    )
    sink = MetricsSink(tmp_path, use_tensorboard=False)
    sink.log(0, metrics)
    sink.close()
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    got = {k: v for k, v in json.loads(line).items() if k.startswith("agent/")}
    assert got == {
        **ZERO,
        "agent/tool_parse_failures/value_type": 2.0,
        "agent/tool_parse_failures/unclosed": 1.0,
        "agent/tool_parse_failures/not_a_call": 1.0,
    }


# -- multi_turn: the rollout manager's step, through the built-in hook, to metrics.jsonl ---------------------------
def read_file(path: str, offset: int, limit: int) -> str:
    """Read lines of a file."""
    return f"{path}: lines {offset!r}..{limit!r}"


def register(zip_code: str, age: int) -> str:
    """Register a person."""
    return f"registered {zip_code!r} {age!r}"


MT_TOOLS = [read_file, register]


def test_multi_turn_step_types_values_and_writes_failure_counts_to_metrics_jsonl(tiny_model_dir, tmp_path, tok):
    from vime_core.agent.responders import ScriptedResponder
    from vime_core.rollout.generators import multi_turn

    script = [READ, REGISTER, BAD_OFFSET, CUT]
    m = manager_with_hooks(
        tiny_model_dir,
        tmp_path,
        num_prompts=1,
        generate=multi_turn.generate,
        n_samples_per_prompt=1,
        rollout_batch_size=1,
        rollout_max_response_len=2048,
        multi_turn_tool_parser="qwen3_coder",
        multi_turn_tools=[f"{__name__}:MT_TOOLS"],
        multi_turn_max_turns=6,
    )
    # the helper registers the function as "echo"; the step's hooks see multi_turn
    cfg = m.ctx.config
    m.ctx = m.runner.ctx = m.groups.ctx = PluginContext(
        replace(cfg, rollout=replace(cfg.rollout, generate="multi_turn"))
    )
    backend = ScriptedResponder(tok, script)
    set_rollout_context(RolloutContext(client=backend, tokenizer=m.tokenizer))
    try:
        groups, metrics = m.generate(0)
    finally:
        set_rollout_context(None)
    ((s,),) = groups
    assert [(c["name"], c["arguments"], c["result"]) for c in s.metadata["tool_calls"]] == [
        ("read_file", {"path": "src/a.py", "offset": 230, "limit": 140}, "src/a.py: lines 230..140"),
        ("register", {"zip_code": "03106", "age": 32}, "registered '03106' 32"),
        ("read_file", {"path": "src/a.py", "offset": "2026-01-15", "limit": 140}, "src/a.py: lines '2026-01-15'..140"),
    ]
    assert s.metadata["ill_formed_turns"] == [3]
    assert s.metadata["tool_parse_failures"] == {"value_type": 1, "unclosed": 1}
    assert len(backend.calls) == 4
    sink = MetricsSink(tmp_path / "run", use_tensorboard=False)
    sink.log(0, metrics)
    sink.close()
    (line,) = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    got = {k: v for k, v in json.loads(line).items() if k.startswith("agent/")}
    assert got == {**ZERO, "agent/tool_parse_failures/value_type": 1.0, "agent/tool_parse_failures/unclosed": 1.0}

"""The ``multi_turn`` generate function with a scripted engine (exact tokens and masks), the tool registry, the
calculator and the tool-call parsers. Against the real vLLM server: tests/integration/test_multi_turn_vllm.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from vime_core.agent.responders import ScriptedResponder, ScriptedTurn
from vime_core.agent.tool_parsers import (
    HermesToolParser,
    OpenAIJsonToolParser,
    ToolCall,
    get_tool_parser,
    register_tool_parser,
)
from vime_core.plugins.manager import get_plugins
from vime_core.rollout.context import RolloutContext, set_rollout_context
from vime_core.rollout.generators.tools import (
    calculator,
    load_tools,
    register_tool,
    registered_tools,
    tool_from_callable,
)
from vime_core.testing.plugin_context import plugin_context
from vime_core.testing.samples import mask_runs
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit

QWEN = Path(__file__).parents[1] / "data" / "qwen25_chat_template.jinja"
CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
BRIDGE = "\n<|im_start|>user\n<tool_response>\n%s\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def run(tok, script, *, prompt="What is 6 * 7?", max_tokens=200, **flags):
    backend = ScriptedResponder(tok, script, weight_version=5)
    set_rollout_context(RolloutContext(client=backend, tokenizer=tok, weight_version=5))
    try:
        flags.setdefault("multi_turn_tools", ["vime_core.rollout.generators.tools:calculator"])
        ctx = plugin_context(apply_chat_template=True, **flags)
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        s = asyncio.run(
            get_plugins().resolve("generate", "multi_turn")(
                ctx, Sample(prompt=msgs), {"temperature": 1.0, "max_tokens": max_tokens}
            )
        )
    finally:
        set_rollout_context(None)
    s.validate()
    return s, backend.calls


def test_tool_loop_tokens_masks_and_metadata(tok):
    s, calls = run(tok, [CALC % "6 * 7", "The answer is 42."])
    c1, c2 = calls
    assert s.tokens == c2.prompt_ids + c2.output.token_ids  # exactly the last engine prompt + its output
    assert c2.prompt_ids[: len(c1.prompt_ids) + len(c1.output.token_ids)] == c1.prompt_ids + c1.output.token_ids
    assert mask_runs(tok, s) == [
        (1, CALC % "6 * 7" + "<|im_end|>"),
        (0, BRIDGE % "42"),
        (1, "The answer is 42.<|im_end|>"),
    ]
    n1, nb = len(c1.output.token_ids), len(c2.prompt_ids) - len(c1.prompt_ids) - len(c1.output.token_ids)
    assert s.rollout_log_probs == [-0.5] * n1 + [0.0] * nb + [-0.5] * len(c2.output.token_ids)
    assert s.weight_versions == [5] * s.response_length
    assert (s.status, s.metadata["stop_reason"], s.metadata["num_turns"]) == (Status.COMPLETED, "no_tool_call", 2)
    assert s.metadata["tool_calls"] == [
        {"turn": 0, "name": "calculator", "arguments": {"expression": "6 * 7"}, "result": "42"}
    ]
    assert s.response == CALC % "6 * 7" + BRIDGE % "42" + "The answer is 42."
    assert c1.sampling_params["max_tokens"] == 200 and c2.sampling_params["max_tokens"] == 200 - n1 - nb
    # the tools were described in the system prompt in the Hermes format (the tiny ChatML template has none)
    tools_prompt = HermesToolParser().tools_prompt([tool_from_callable(calculator).schema()])
    assert tok.decode(s.tokens[: s.prompt_length]) == (
        f"<|im_start|>system\n{tools_prompt}<|im_end|>\n"
        "<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_native_tool_template_and_parallel_calls(tok):
    both = CALC % "1 + 2" + "\n" + CALC % "2 ** 10"
    s, calls = run(tok, [both, "3 and 1024."], multi_turn_chat_template=QWEN)
    tools = [{"type": "function", "function": tool_from_callable(calculator).schema()}]
    ref = tok.apply_chat_template(
        [{"role": "user", "content": "What is 6 * 7?"}],
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
        chat_template=QWEN.read_text(),
    )
    assert tok.decode(s.tokens[: s.prompt_length]) == ref
    assert mask_runs(tok, s)[1] == (
        0,
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n1024"
        "\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    )
    assert s.tokens == calls[-1].prompt_ids + calls[-1].output.token_ids


def test_prompt_with_earlier_tool_turns(tok):
    """Few-shot turns in OpenAI chat format (tool calls and results) are rendered like the live ones."""
    prompt = [
        {"role": "user", "content": "What is 2 + 2?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2 + 2"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
        {"role": "assistant", "content": "Answer: 4"},
        {"role": "user", "content": "What is 6 * 7?"},
    ]
    s, _ = run(tok, ["Answer: 42"], prompt=prompt)
    text = tok.decode(s.tokens[: s.prompt_length])
    assert (CALC % "2 + 2" + "<|im_end|>" + BRIDGE % "4" + "Answer: 4<|im_end|>") in text


def test_stops_at_max_turns(tok):
    s, calls = run(tok, [CALC % "1"] * 3, multi_turn_max_turns=3)
    assert (s.status, s.metadata["stop_reason"], s.metadata["num_turns"], len(calls)) == (
        Status.TRUNCATED,
        "max_turns",
        3,
        3,
    )
    assert [m for m, _ in mask_runs(tok, s)] == [1, 0, 1, 0, 1]  # the last call's tool is not run
    assert s.tokens == calls[-1].prompt_ids + calls[-1].output.token_ids


def test_budget_counts_model_and_tool_tokens(tok):
    n_call = len(tok(CALC % "6 * 7", add_special_tokens=False)["input_ids"]) + 1
    s, calls = run(tok, [CALC % "6 * 7", "The answer is 42."], max_tokens=n_call + 5)
    # the tool answer does not fit: the episode stops before it, truncated, with only the first turn
    assert (s.status, s.metadata["stop_reason"], s.response_length, len(calls)) == (
        Status.TRUNCATED,
        "budget",
        n_call,
        1,
    )
    s, calls = run(tok, ["A long answer that does not fit in the budget at all."], max_tokens=6)
    assert (s.status, s.metadata["stop_reason"], s.response_length, s.loss_mask) == (
        Status.TRUNCATED,
        "length",
        6,
        [1] * 6,
    )  # like `default`: a budget-truncated turn is trained, flagged


def test_tool_errors_are_returned_to_the_model(tok):
    unknown = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
    s, _ = run(tok, [CALC % "1 / 0", unknown, "ok"])
    results = [c["result"] for c in s.metadata["tool_calls"]]
    assert results == ["Error: division by zero", "Error: unknown tool 'search'; available: calculator"]
    assert s.status is Status.COMPLETED


def test_ill_formed_call_ends_the_episode_as_an_answer(tok):
    s, calls = run(tok, ['<tool_call>\n{"name": "calculator", "arguments": {oops}}\n</tool_call>'])
    assert (s.status, s.metadata["ill_formed_turns"], len(calls), s.loss_mask[-1]) == (Status.COMPLETED, [0], 1, 1)


def test_abort_and_no_tools(tok):
    s, _ = run(tok, [ScriptedTurn("part", finish_reason="abort")])
    assert s.status is Status.ABORTED
    s, _ = run(tok, [CALC % "1"], multi_turn_tools=[])  # no tools: a plain single turn, the text is the answer
    assert s.status is Status.COMPLETED and s.metadata["num_turns"] == 1


def test_sandbox_tool_needs_a_sandbox(tok):
    with pytest.raises(ValueError, match="--sandbox"):
        run(tok, ["x"], multi_turn_sandbox_tool="bash", sandbox="")  # --sandbox given empty


# -- tools ------------------------------------------------------------------------------------------------------
def test_calculator():
    assert [
        calculator(e) for e in ("6 * 7", "7 / 2", "2 ** 10", "(1 + 2) * -3", "10 // 3", "1 / 0", "x + 1", "2 ** 100")
    ] == [
        "42",
        "7/2 = 3.5",
        "1024",
        "-9",
        "3",
        "Error: division by zero",
        "Error: unsupported expression: Name(id='x', ctx=Load())",
        "Error: exponent must be an integer with |n| <= 64",
    ]


def test_tool_registry_and_schema():
    def add(a: int, b: float = 1.0, tag: str | None = None) -> float:
        """Add two numbers.

        More text."""
        return a + b

    t = tool_from_callable(add)
    assert t.schema() == {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "number"}, "tag": {"type": "string"}},
            "required": ["a"],
        },
    }
    assert asyncio.run(t.call({"a": 2, "b": 3.5})) == "5.5"
    register_tool(add, name="test_add_tool")
    assert "test_add_tool" in registered_tools()
    assert [x.name for x in load_tools(["test_add_tool", "vime_core.rollout.generators.tools:calculator"])] == [
        "test_add_tool",
        "calculator",
    ]
    with pytest.raises(ValueError, match="duplicate"):
        load_tools(["vime_core.rollout.generators.tools:calculator", "vime_core.rollout.generators.tools:calculator"])
    with pytest.raises(ValueError, match="unknown tool"):
        load_tools(["no_such_tool_anywhere"])


def test_tool_parsers():
    h = get_tool_parser("qwen")
    r = h.parse("Let me check.\n" + CALC % "1+1" + "\n" + CALC % "2")
    assert (r.content, [(c.name, c.arguments) for c in r.tool_calls], r.ill_formed) == (
        "Let me check.",
        [("calculator", {"expression": "1+1"}), ("calculator", {"expression": "2"})],
        False,
    )
    assert h.format_calls([ToolCall("calculator", {"expression": "1+1"})]) == CALC % "1+1"
    r = h.parse("<tool_call>\n{not json}\n</tool_call>")
    assert (r.content, r.tool_calls, r.ill_formed) == ("<tool_call>\n{not json}\n</tool_call>", [], True)
    assert h.parse("done <tool_call>").ill_formed and not h.parse("just text").ill_formed
    o = get_tool_parser("json")
    assert isinstance(o, OpenAIJsonToolParser)
    r = o.parse(
        '[{"type": "function", "function": {"name": "f", "arguments": "{\\"x\\": 1}"}}, {"name": "g", '
        '"parameters": {}}]'
    )
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("f", {"x": 1}), ("g", {})]
    assert o.parse('{"answer": 3}').tool_calls == [] and o.parse("{oops").ill_formed
    with pytest.raises(ValueError, match="available: hermes, json, openai, qwen"):
        get_tool_parser("nope")
    register_tool_parser("test-hermes", HermesToolParser)
    assert isinstance(get_tool_parser("vime_core.agent.tool_parsers:HermesToolParser"), HermesToolParser)


def test_call_grammar_matches_format_calls():
    pytest.importorskip("xgrammar")
    import xgrammar as xg

    schema = tool_from_callable(calculator).schema()
    grammar = HermesToolParser().call_grammar([schema])
    xg.Grammar.from_ebnf(grammar)  # compiles
    assert grammar.count("calculator") == 1 and "<tool_call>" in grammar


def test_rollout_metrics_through_the_hook(tok):
    s1, _ = run(tok, [CALC % "6 * 7", "The answer is 42."])
    s2, _ = run(tok, ["Answer: 42"])
    s3, _ = run(tok, [CALC % "1"] * 2, multi_turn_max_turns=2)
    metrics: dict[str, float] = {}
    get_plugins().pm.hook.vime_on_rollout_end(
        ctx=plugin_context(generate="multi_turn"), step=0, samples=[s1, s2, s3], metrics=metrics, args=None
    )
    expected = {
        "multi_turn/turns_mean": 5 / 3,
        "multi_turn/tool_call_frac": 2 / 3,
        "multi_turn/tool_calls_mean": 2 / 3,
        "multi_turn/ill_formed_frac": 0.0,
        "multi_turn/max_turns_frac": 1 / 3,
    }
    assert {k: metrics[k] for k in expected} == pytest.approx(expected)
    other: dict[str, float] = {}
    get_plugins().pm.hook.vime_on_rollout_end(
        ctx=plugin_context(generate="default"), step=0, samples=[s1], metrics=other, args=None
    )
    assert not any(k.startswith("multi_turn/") for k in other)


def test_context_window_filled_is_recorded(tok):
    s, _ = run(tok, [CALC % "6 * 7", "The answer is 42."])
    assert s.metadata["context_exhausted"] is False
    n_call = len(tok(CALC % "6 * 7", add_special_tokens=False)["input_ids"]) + 1
    ctx = s.prompt_length + n_call + 5  # the tool answer does not fit in the context window
    s, calls = run(tok, [CALC % "6 * 7", "The answer is 42."], rollout_max_context_len=ctx)
    assert (s.status, s.metadata["stop_reason"], s.metadata["context_exhausted"], len(calls)) == (
        Status.TRUNCATED,
        "budget",
        True,
        1,
    )
    s, _ = run(tok, [CALC % "6 * 7", "The answer is 42."], max_tokens=n_call + 5, rollout_max_context_len=10**6)
    assert (s.metadata["stop_reason"], s.metadata["context_exhausted"]) == ("budget", False)  # max_tokens, not ctx

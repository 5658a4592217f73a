"""Multi-turn tool calls under the structural variants of common chat templates, through both paths that build
token-exact samples from a conversation: the ``multi_turn`` generate function (the episode is driven from token ids;
the text between turns comes from the template) and the agent gateway (a client re-sends the conversation as
messages; :class:`~vime_core.agent.trajectory.Trajectory` places each prompt).

Each template below is a minimal one written for this test; it reproduces one structural property of a model
family's real template:

* ``chatml`` — Qwen2.5 (ChatML with tools): ``<|im_end|>`` ends every turn; consecutive tool results are *merged*
  into one user turn of ``<tool_response>`` blocks.
* ``qwen3`` — Qwen3 (ChatML with thinking): an empty ``<think>\\n\\n</think>\\n\\n`` block is rendered on the
  assistant message only when it is the *last* message, not when tool results follow it; so the render with the
  assistant last is not a prefix of the render that continues it.
* ``llama31`` — Llama-3.1 tool format: ``<|eot_id|>`` ends a turn, a call is bare JSON ``{"name", "parameters"}``
  (one per turn; the template refuses parallel calls), results come back in an ``ipython`` turn each, tools are
  listed in the first user message.
* ``glm`` — GLM-4 role-tag endings: no end-of-turn token; an assistant turn is ended by the tag of the next role,
  ``<|observation|>`` before tool results (the model generates it; it is its stop token) and ``<|user|>`` after an
  answer. (The call markup is simplified to the Hermes ``<tool_call>`` format; the property tested is the ending.)

Every case checks, through both paths: every engine prompt equals the template's render of the conversation so far
(generation prompt included), token for token; the final sample equals the render of the full conversation; the loss
mask is 1 exactly on what the model generated (its end-of-turn token included, GLM's ``<|observation|>`` too) and 0
on everything the template put between turns. The tokenizer is the tiny test model's real byte-level BPE tokenizer
with the families' special tokens added.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import openai
import pytest

from vime_core.agent.gateway import AgentGateway
from vime_core.agent.responders import ScriptedResponder, ScriptedTurn
from vime_core.agent.trajectory import Drift
from vime_core.plugins.manager import get_plugins
from vime_core.rollout.context import RolloutContext, set_rollout_context
from vime_core.rollout.generators.tools import register_tool, tool_from_callable
from vime_core.testing.plugin_context import plugin_context
from vime_core.testing.samples import chain_mask, mask_runs
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit

WEATHER = {"Paris": "sunny, 21 C", "Tokyo": "rain, 12 C", "Oslo": "snow, -3 C"}


def get_weather(city: str) -> str:
    """Current weather of a city."""
    return WEATHER[city]


register_tool(get_weather)
SCHEMA = tool_from_callable(get_weather).schema()
TOOLS = [{"type": "function", "function": SCHEMA}]
SYSTEM = "You are a weather bot."

# -- the templates ------------------------------------------------------------------------------------------------
_CHATML_HEAD = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
)
_HERMES_CALLS = (
    "{%- for tc in m.tool_calls %}{%- if m.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' + (tc.function.arguments | tojson)'
    " + '}\\n</tool_call>' }}{%- endfor %}"
)
_CHATML_TOOL = (
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
)
CHATML = (
    _CHATML_HEAD + "{%- for m in messages %}{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + m.content }}"
    + _HERMES_CALLS
    + "{{- '<|im_end|>\\n' }}"
    + _CHATML_TOOL
    + "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN3 = (
    _CHATML_HEAD + "{%- for m in messages %}{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{{- m.content }}"
    + _HERMES_CALLS
    + "{{- '<|im_end|>\\n' }}"
    + _CHATML_TOOL
    + "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA31 = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set sys = '' %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n' + sys + '<|eot_id|>' }}"
    "{%- for m in rest %}"
    "{%- if m.role == 'user' and loop.first and tools %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, respond with a JSON function"
    " call.\\n\\n' }}{%- for t in tools %}{{- (t | tojson(indent=4)) + '\\n\\n' }}{%- endfor %}"
    "{{- m.content + '<|eot_id|>' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}"
    "{%- if m.tool_calls | length != 1 %}{{- raise_exception('This model only supports single tool-calls at once!') }}"
    "{%- endif %}{%- set f = m.tool_calls[0].function %}"
    '{{- \'<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "\' + f.name + \'", "parameters": \''
    " + (f.arguments | tojson) + '}<|eot_id|>' }}"
    "{%- elif m.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content | trim) + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
GLM = (
    "{{- '[gMASK]<sop>' }}"
    "{%- if tools %}{{- '<|system|>\\n# Tools' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|assistant|>' }}{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    + _HERMES_CALLS
    + "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|observation|>' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- else %}{{- '<|' + m.role + '|>\\n' + m.content }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)

SPECIAL = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
]
# Qwen's tokenizers have these as added, *non-special* tokens (they stay in the visible text)
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    t.add_special_tokens({"extra_special_tokens": list(t.extra_special_tokens) + SPECIAL})
    t.add_tokens(ADDED)
    return t


def hermes(city: str) -> str:
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + city + '"}}\n</tool_call>'


def llama(city: str) -> str:
    return '{"name": "get_weather", "parameters": {"city": "' + city + '"}}'


@dataclass
class Style:
    """One template style: its template, tool-call format, and what the model writes each turn."""

    template: str
    parser: str
    turns: list[tuple[str, list[str], str]]  # (text the model writes, cities called, its end-of-turn token)
    after_final: str  # what the full render (no generation prompt) has after the final answer, instead of its eot
    merged_results: bool = True
    extra: dict = field(default_factory=dict)


FINAL = "Paris: sunny. Tokyo: rain. Oslo: snow."
STYLES = {
    "chatml": Style(
        CHATML,
        "hermes",
        [
            (hermes("Paris") + "\n" + hermes("Tokyo"), ["Paris", "Tokyo"], "<|im_end|>"),
            (hermes("Oslo"), ["Oslo"], "<|im_end|>"),
            (FINAL, [], "<|im_end|>"),
        ],
        "<|im_end|>\n",
    ),
    "qwen3": Style(
        QWEN3,
        "hermes",
        [
            (hermes("Paris") + "\n" + hermes("Tokyo"), ["Paris", "Tokyo"], "<|im_end|>"),
            (hermes("Oslo"), ["Oslo"], "<|im_end|>"),
            ("<think>\n\n</think>\n\n" + FINAL, [], "<|im_end|>"),
        ],
        "<|im_end|>\n",
    ),
    "llama31": Style(
        LLAMA31,
        "json",
        [
            (llama("Paris"), ["Paris"], "<|eot_id|>"),
            (llama("Oslo"), ["Oslo"], "<|eot_id|>"),
            (FINAL, [], "<|eot_id|>"),
        ],
        "<|eot_id|>",
        merged_results=False,
    ),
    "glm": Style(
        GLM,
        "hermes",
        [
            (hermes("Paris") + "\n" + hermes("Tokyo"), ["Paris", "Tokyo"], "<|observation|>"),
            (hermes("Oslo"), ["Oslo"], "<|observation|>"),
            ("\n" + FINAL, [], "<|user|>"),
        ],
        "",  # no end-of-turn in the template: the model's <|user|> is the only difference
    ),
}


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def script(tok, style: Style) -> list[ScriptedTurn]:
    return [
        ScriptedTurn(token_ids=encode(tok, text) + [tok.convert_tokens_to_ids(eot)], end_of_turn=False)
        for text, _, eot in style.turns
    ]


def reference_conversations(style: Style) -> list[list[dict]]:
    """The OpenAI-style conversation before each model turn, and (last) the full conversation."""
    msgs: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris, Tokyo?"}]
    out = [list(msgs)]
    for k, (_, cities, _) in enumerate(style.turns):
        if not cities:  # the answer as a client keeps it; the template adds GLM's "\n", Qwen3's empty thinking
            msgs.append({"role": "assistant", "content": FINAL})
            break
        ids = [f"call_{k}_{i}" for i in range(len(cities))]
        calls = [
            {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}
            for i, c in zip(ids, cities, strict=True)
        ]
        msgs.append({"role": "assistant", "content": "", "tool_calls": calls})
        msgs += [{"role": "tool", "tool_call_id": i, "content": WEATHER[c]} for i, c in zip(ids, cities, strict=True)]
        out.append(list(msgs))
    out.append(msgs)
    return out


def render(tok, style: Style, msgs: list[dict], gen: bool) -> str:
    return tok.apply_chat_template(
        msgs, tools=TOOLS, chat_template=style.template, tokenize=False, add_generation_prompt=gen
    )


def check_against_templates(tok, style: Style, calls, sample: Sample) -> None:
    """Every engine prompt == the render of the conversation so far; the sample == the full render; the mask."""
    convs = reference_conversations(style)
    assert len(calls) == len(style.turns)
    for k, call in enumerate(calls):
        assert call.prompt_ids == encode(tok, render(tok, style, convs[k], gen=True)), f"prompt of turn {k}"
    full = render(tok, style, convs[-1], gen=False)
    assert tok.decode(sample.tokens[-1:]) == style.turns[-1][2]
    assert tok.decode(sample.tokens[:-1]) + style.after_final == full
    assert sample.tokens == calls[-1].prompt_ids + calls[-1].output.token_ids
    assert sample.prompt_length == len(calls[0].prompt_ids)
    assert sample.loss_mask == chain_mask(calls)
    # the trained spans are exactly the model's turns, each with its end-of-turn token
    trained = [tok.decode(c.output.token_ids) for c in calls]
    assert trained == [text + eot for text, _, eot in style.turns]


def run_multi_turn(tok, style: Style, tmp_path) -> tuple[Sample, list]:
    path = tmp_path / "template.jinja"
    path.write_text(style.template)
    backend = ScriptedResponder(tok, script(tok, style), weight_version=3)
    set_rollout_context(RolloutContext(client=backend, tokenizer=tok, weight_version=3))
    try:
        ctx = plugin_context(
            apply_chat_template=True,
            multi_turn_tools=["get_weather"],
            multi_turn_chat_template=path,
            multi_turn_tool_parser=style.parser,
        )
        prompt = reference_conversations(style)[0]
        s = asyncio.run(
            get_plugins().resolve("generate", "multi_turn")(
                ctx, Sample(prompt=prompt), {"temperature": 1.0, "max_tokens": 2000}
            )
        )
    finally:
        set_rollout_context(None)
    s.validate()
    return s, backend.calls


def run_gateway(tok, style: Style) -> tuple[Sample, list, list]:
    backend = ScriptedResponder(tok, script(tok, style))
    with AgentGateway(tok, backend, chat_template=style.template, tool_parser=style.parser) as gw:
        gw.open_session("m")
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="m", max_retries=0, timeout=60)
        msgs = reference_conversations(style)[0]
        for text, cities, _ in style.turns:
            r = c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
            m = r.choices[0].message
            if not cities:
                assert (r.choices[0].finish_reason, m.content) == ("stop", text)
                break
            assert [json.loads(x.function.arguments)["city"] for x in m.tool_calls] == cities
            msgs = msgs + [
                {"role": "assistant", "content": None, "tool_calls": [x.model_dump() for x in m.tool_calls]}
            ]
            msgs += [
                {"role": "tool", "tool_call_id": x.id, "content": WEATHER[cc]}
                for x, cc in zip(m.tool_calls, cities, strict=True)
            ]
        placements = [p.kind for p in gw._sessions["m"].placements]
        samples = gw.close_session("m", Sample(), reward=1.0)
    return samples, backend.calls, placements


@pytest.mark.parametrize("name", list(STYLES))
def test_template_matrix_multi_turn(tok, name, tmp_path):
    style = STYLES[name]
    s, calls = run_multi_turn(tok, style, tmp_path)
    assert (s.status, s.metadata["stop_reason"], s.metadata["num_turns"]) == (Status.COMPLETED, "no_tool_call", 3)
    assert [c["result"] for c in s.metadata["tool_calls"]] == [
        WEATHER[c] for _, cities, _ in style.turns for c in cities
    ]
    check_against_templates(tok, style, calls, s)


@pytest.mark.parametrize("name", list(STYLES))
def test_template_matrix_gateway(tok, name, tmp_path):
    style = STYLES[name]
    samples, calls, placements = run_gateway(tok, style)
    assert placements == [Drift.NEW, Drift.CLEAN, Drift.CLEAN]
    (s,) = samples
    check_against_templates(tok, style, calls, s)
    # both paths build the same sample from the same model outputs
    s_mt, _ = run_multi_turn(tok, style, tmp_path)
    assert (s_mt.tokens, s_mt.loss_mask, s_mt.prompt_length) == (s.tokens, s.loss_mask, s.prompt_length)


CASE_A = Style(  # issue 15 §1 case A: system, user, assistant(2 parallel calls), result A, result B, assistant
    QWEN3,
    "hermes",
    [
        (hermes("Paris") + "\n" + hermes("Tokyo"), ["Paris", "Tokyo"], "<|im_end|>"),
        ("<think>\n\n</think>\n\n" + FINAL, [], "<|im_end|>"),
    ],
    "<|im_end|>\n",
)
CASE_B = Style(  # issue 15 §1 case B: GLM-style, the assistant turn is ended by <|observation|>
    GLM,
    "hermes",
    [(hermes("Paris"), ["Paris"], "<|observation|>"), ("\n" + FINAL, [], "<|user|>")],
    "",
)


def run_path(tok, style: Style, path: str, tmp_path) -> tuple[Sample, list]:
    """One episode through ``multi_turn`` or the gateway, checked against the template; the sample and the calls."""
    if path == "multi_turn":
        s, calls = run_multi_turn(tok, style, tmp_path)
    else:
        (s,), calls, _ = run_gateway(tok, style)
    check_against_templates(tok, style, calls, s)
    return s, calls


@pytest.mark.parametrize("path", ["multi_turn", "gateway"])
def test_case_a_qwen3_thinking_template_parallel_calls(tok, path, tmp_path):
    """Before the fix: ``ValueError: cannot locate the assistant's end-of-turn '<|im_end|>'`` at the first call."""
    s, _ = run_path(tok, CASE_A, path, tmp_path)
    assert mask_runs(tok, s) == [
        (1, hermes("Paris") + "\n" + hermes("Tokyo") + "<|im_end|>"),
        (
            0,
            "\n<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n"
            "<tool_response>\nrain, 12 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        ),
        (1, "<think>\n\n</think>\n\n" + FINAL + "<|im_end|>"),
    ]


@pytest.mark.parametrize("path", ["multi_turn", "gateway"])
def test_case_b_glm_role_tag_ending_is_trained(tok, path, tmp_path):
    """The <|observation|> that ends the call turn was generated: mask 1; the tool output: mask 0."""
    s, _ = run_path(tok, CASE_B, path, tmp_path)
    assert mask_runs(tok, s) == [
        (1, hermes("Paris") + "<|observation|>"),
        (0, "\n<tool_response>\nsunny, 21 C\n</tool_response><|assistant|>"),
        (1, "\n" + FINAL + "<|user|>"),
    ]

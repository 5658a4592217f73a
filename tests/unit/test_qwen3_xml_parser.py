"""The ``qwen3_coder`` tool-call parser (issue 27; kinds of mlx-lm #1627 and vLLM's ``qwen3xml``): Qwen3-Coder's XML
calls, values typed by the tools' schemas, non-streamed and streamed in chunks of 1, 3 and 7 characters; every parse
failure (of this parser and the others) has its reason, summed per step by ``tool_parse_metrics``."""

from __future__ import annotations

import pytest

from tests.support.qwen3_xml_calls import BAD_OFFSET, READ, REGISTER, TOOLS
from vime_core.agent.tool_parse_failures import tool_parse_metrics
from vime_core.agent.tool_parsers import ParseResult, get_tool_parser, parse_with_tools
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit


def _parse(text: str, chunk: int | None):
    parser = get_tool_parser("qwen3_coder")
    if chunk is None:
        return parser.parse(text, tools=TOOLS)
    stream = parser.stream(tools=TOOLS)
    for i in range(0, len(text), chunk):
        stream.feed(text[i : i + chunk])
    stream.close()
    return stream.result()


CHUNKS = [None, 1, 3, 7]


@pytest.mark.parametrize("chunk", CHUNKS, ids=["whole", "1", "3", "7"])
def test_the_read_file_call_is_one_call_with_typed_values(chunk):
    r = _parse(READ, chunk)
    assert [(c.name, c.arguments) for c in r.tool_calls] == [
        ("read_file", {"path": "src/a.py", "offset": 230, "limit": 140})
    ]
    assert type(r.tool_calls[0].arguments["offset"]) is int and type(r.tool_calls[0].arguments["limit"]) is int
    assert (r.content, r.ill_formed, r.errors, r.value_errors) == ("", False, [], [])


@pytest.mark.parametrize("chunk", CHUNKS, ids=["whole", "1", "3", "7"])
def test_a_string_parameter_keeps_its_leading_zero(chunk):
    r = _parse("Registering you.\n" + REGISTER, chunk)
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("register", {"zip_code": "03106", "age": 32})]
    assert r.content == "Registering you."


@pytest.mark.parametrize("chunk", CHUNKS, ids=["whole", "1", "3", "7"])
def test_a_value_that_does_not_fit_its_type_keeps_the_call_and_names_the_parameter(chunk):
    r = _parse(BAD_OFFSET, chunk)
    assert [(c.name, c.arguments) for c in r.tool_calls] == [
        ("read_file", {"path": "src/a.py", "offset": "2026-01-15", "limit": 140})
    ]
    assert r.value_errors == ["read_file.offset: '2026-01-15' is not an integer; kept as the string '2026-01-15'"]
    assert not r.ill_formed


def test_hermes_reads_the_same_text_as_no_call_and_qwen3_coder_as_one():
    assert get_tool_parser("hermes").parse(READ).tool_calls == []
    assert len(parse_with_tools(get_tool_parser("qwen3xml"), READ, TOOLS).tool_calls) == 1


def test_without_schemas_values_stay_text_and_an_unclosed_call_is_ill_formed():
    r = get_tool_parser("qwen3_coder").parse(READ)
    assert r.tool_calls[0].arguments == {"path": "src/a.py", "offset": "230.0", "limit": "140"}
    cut = READ[: READ.index("</function>")]
    r = get_tool_parser("qwen3_coder").parse(cut, tools=TOOLS)
    assert r.tool_calls == [] and r.ill_formed and r.content == cut
    assert r.errors == [f"an unclosed <tool_call>: {cut[:200]!r}"]


def test_two_calls_and_the_written_form_round_trips():
    parser = get_tool_parser("qwen3_coder")
    r = parser.parse(READ + "\n" + REGISTER, tools=TOOLS)
    assert [c.name for c in r.tool_calls] == ["read_file", "register"]
    again = parser.parse(parser.format_calls(r.tool_calls), tools=TOOLS)
    assert [(c.name, c.arguments) for c in again.tool_calls] == [(c.name, c.arguments) for c in r.tool_calls]


# -- parse failures by reason (agent/tool_parse_failures/<reason>) -------------------------------------------------
HERMES_OK = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>'
FAILURES = [
    ("qwen3_coder", READ, {}),
    ("qwen3_coder", BAD_OFFSET, {"value_type": 1}),
    ("qwen3_coder", READ.replace("230.0", "x").replace("140", "y"), {"value_type": 2}),
    ("qwen3_coder", READ[: READ.index("</function>")], {"unclosed": 1}),
    ("qwen3_coder", "<tool_call>\nread_file(path)\n</tool_call>\n" + REGISTER, {"not_a_call": 1}),
    ("hermes", READ, {"not_a_call": 1}),
    ("hermes", HERMES_OK, {}),
    ("hermes", HERMES_OK.replace('"a"}', "a}"), {"bad_json": 1}),
    ("hermes", HERMES_OK.replace('"name": "read_file", ', ""), {"bad_call": 1}),
    ("hermes", HERMES_OK.replace("}\n</tool_call>", "} oops\n</tool_call>"), {"trailing_text": 1}),
    ("hermes", HERMES_OK[:-3], {"unclosed": 1}),
    ("hermes", HERMES_OK + "\n" + READ + "\n" + HERMES_OK[:-3], {"not_a_call": 1, "unclosed": 1}),
]


@pytest.mark.parametrize("chunk", CHUNKS, ids=["whole", "1", "3", "7"])
@pytest.mark.parametrize("case", range(len(FAILURES)))
def test_each_parse_failure_has_its_reason(case, chunk):
    name, text, counts = FAILURES[case]
    parser = get_tool_parser(name)
    if chunk is None:
        r = parse_with_tools(parser, text, TOOLS)
    else:
        stream = parser.stream(tools=TOOLS) if name == "qwen3_coder" else parser.stream()
        for i in range(0, len(text), chunk):
            stream.feed(text[i : i + chunk])
        stream.close()
        r = stream.result()
    assert r.failure_counts() == counts
    assert len(r.error_reasons) == len(r.errors) and r.ill_formed == bool(r.errors)


def test_openai_json_failures_have_their_reason():
    parser = get_tool_parser("openai")
    assert parser.parse('{"name": "read_file", "arguments": {').failure_counts() == {"bad_json": 1}
    assert parser.parse('{"name": "read_file", "arguments": [1]}').failure_counts() == {"bad_call": 1}
    assert parser.parse('{"name": "read_file", "arguments": {}}').failure_counts() == {}


def test_a_parse_result_needs_one_reason_per_error():
    with pytest.raises(ValueError, match=r"ParseResult: 1 errors but 0 error_reasons"):
        ParseResult(content="x", ill_formed=True, errors=["broken"])


def test_tool_parse_metrics_sum_by_reason_and_skip_placeholders():
    samples = [
        Sample(metadata={"tool_parse_failures": {"value_type": 1, "unclosed": 2}}),
        Sample(metadata={"tool_parse_failures": {"value_type": 3, "my_reason": 1}}),
        Sample(status=Status.FAILED, metadata={"error": "sandbox died"}),  # a placeholder: no turns
    ]
    assert tool_parse_metrics(samples) == {
        "agent/tool_parse_failures/not_a_call": 0.0,
        "agent/tool_parse_failures/bad_json": 0.0,
        "agent/tool_parse_failures/bad_call": 0.0,
        "agent/tool_parse_failures/trailing_text": 0.0,
        "agent/tool_parse_failures/unclosed": 2.0,
        "agent/tool_parse_failures/value_type": 4.0,
        "agent/tool_parse_failures/my_reason": 1.0,
    }
    with pytest.raises(KeyError, match="tool_parse_failures"):
        tool_parse_metrics([Sample(status=Status.COMPLETED)])

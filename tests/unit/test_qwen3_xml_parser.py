"""The ``qwen3_coder`` tool-call parser (issue 27; kinds of mlx-lm #1627 and vLLM's ``qwen3xml``): Qwen3-Coder's XML
calls, values typed by the tools' schemas, non-streamed and streamed in chunks of 1, 3 and 7 characters."""

from __future__ import annotations

import pytest

from vime_core.agent.tool_parsers import get_tool_parser, parse_with_tools

pytestmark = pytest.mark.unit

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "offset": {"type": "integer"},
                    "limit": {"type": "integer"},
                },
            },
        },
    },
    {
        "name": "register",
        "parameters": {"type": "object", "properties": {"zip_code": {"type": "string"}, "age": {"type": "integer"}}},
    },
]

READ = (
    "<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n<parameter=offset>\n230.0\n"
    "</parameter>\n<parameter=limit>\n140\n</parameter>\n</function>\n</tool_call>"
)
REGISTER = (
    "<tool_call>\n<function=register>\n<parameter=zip_code>\n03106\n</parameter>\n<parameter=age>\n32\n"
    "</parameter>\n</function>\n</tool_call>"
)
BAD_OFFSET = READ.replace("230.0", "2026-01-15")


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

"""The ``qwen3_coder`` tool-call parser (alias ``qwen3xml``): Qwen3-Coder's XML calls, typed by the tools' schemas.

Reads ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`` blocks (Qwen3-Coder's
chat template; vLLM's ``qwen3_coder`` / ``qwen3xml`` parsers); each value's type comes from the tool's JSON schema,
and a value that does not fit is kept as its raw string and reported in :attr:`ParseResult.value_errors`. The
rules: docs/agents.md, "Qwen3-Coder's XML tool calls".
"""

from __future__ import annotations

import json
import re
from typing import Any

from vime_core.agent.tool_parsers import (
    ParseResult,
    ToolCall,
    ToolCallStream,
    ToolParseFailure,
    ToolParser,
    _BufferedStream,
    register_tool_parser,
    tool_schema,
)

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _strip_markup_newlines(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def convert_value(raw: str, schema: dict[str, Any] | None) -> tuple[Any, str | None]:
    """``(value, error)``: ``raw`` typed by its parameter ``schema`` (``None`` or no type: kept as text); ``error``
    says why a value was kept as the raw string instead (``None`` when it converted)."""
    kind = (schema or {}).get("type")
    if isinstance(kind, list):  # ["integer", "null"]
        kind = next((k for k in kind if k != "null"), None)
    if kind in (None, "string"):
        return raw, None
    text = raw.strip()
    if text.lower() == "null":
        return None, None
    if kind == "integer":
        try:
            number = float(text)
        except ValueError:
            return raw, f"{text!r} is not an integer"
        if not number.is_integer():
            return raw, f"{text!r} is not an integer"
        return int(number), None
    if kind == "number":
        try:
            number = float(text)
        except ValueError:
            return raw, f"{text!r} is not a number"
        return (int(number) if re.fullmatch(r"[+-]?\d+", text) else number), None
    if kind == "boolean":
        if text.lower() in ("true", "false"):
            return text.lower() == "true", None
        return raw, f"{text!r} is not a boolean"
    if kind in ("object", "array"):
        try:
            value = json.loads(text)
        except ValueError:
            return raw, f"{text!r} is not a JSON {kind}"
        if not isinstance(value, dict if kind == "object" else list):
            return raw, f"{text!r} is not a JSON {kind}"
        return value, None
    return raw, None


class Qwen3XMLToolParser(ToolParser):
    """Qwen3-Coder's XML tool calls (see the module docstring).

    :param tools: the tools of the turn (any shape :func:`~vime_core.agent.tool_parsers.tool_schema` accepts);
        :meth:`parse` and :meth:`stream` may also be given them per turn.
    """

    name = "qwen3_coder"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = list(tools or [])

    def _schemas(self, tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
        out = {}
        for t in tools if tools is not None else self.tools:
            s = tool_schema(t)
            out[s["name"]] = s["parameters"].get("properties") or {}
        return out

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParseResult:
        """Content and typed calls of one turn; never raises (an unclosed or malformed call is ill-formed text)."""
        schemas = self._schemas(tools)
        calls: list[ToolCall] = []
        errors: list[str] = []
        reasons: list[str] = []
        value_errors: list[str] = []
        content: list[str] = []
        pos = 0
        for m in _CALL.finditer(text):
            content.append(text[pos : m.start()])
            pos = m.end()
            fn = _FUNCTION.match(m.group(1))
            if fn is None:
                errors.append(f"a <tool_call> without one <function=NAME>...</function>: {m.group(1)[:200]!r}")
                reasons.append(ToolParseFailure.NOT_A_CALL.value)
                content.append(m.group(0))
                continue
            name = fn.group(1).strip()
            props = schemas.get(name, {})
            args: dict[str, Any] = {}
            for p in _PARAM.finditer(fn.group(2)):
                key = p.group(1).strip()
                value, problem = convert_value(_strip_markup_newlines(p.group(2)), props.get(key))
                if problem is not None:
                    value_errors.append(f"{name}.{key}: {problem}; kept as the string {value!r}")
                args[key] = value
            calls.append(ToolCall(name=name, arguments=args))
        rest = text[pos:]
        if "<tool_call>" in rest:
            errors.append(f"an unclosed <tool_call>: {rest[rest.index('<tool_call>') :][:200]!r}")
            reasons.append(ToolParseFailure.UNCLOSED.value)
        content.append(rest)
        joined = "".join(content)
        return ParseResult(
            content=joined.strip() if calls else joined,
            tool_calls=calls,
            ill_formed=bool(errors),
            errors=errors,
            error_reasons=reasons,
            value_errors=value_errors,
        )

    def stream(self, tools: list[dict[str, Any]] | None = None) -> ToolCallStream:
        """A stream whose result is :meth:`parse` of the whole turn for any chunking (it parses at close)."""
        return _BufferedStream(Qwen3XMLToolParser(tools if tools is not None else self.tools))

    def format_calls(self, calls: list[ToolCall]) -> str:
        """Calls as Qwen3-Coder writes them (non-string values as JSON)."""
        blocks = []
        for c in calls:
            params = "".join(
                f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
                for k, v in c.arguments.items()
            )
            blocks.append(f"<tool_call>\n<function={c.name}>\n{params}</function>\n</tool_call>")
        return "\n".join(blocks)

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        """The tool list as JSON inside ``<tools></tools>``, with the call format."""
        listed = "\n".join(json.dumps(tool_schema(t), ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou have access to the following functions:\n\n<tools>\n" + listed + "\n</tools>\n\n"
            "To call a function reply with:\n<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n"
            "</function>\n</tool_call>"
        )

    def format_results(self, results: list[str]) -> str:
        """Each result in ``<tool_response></tool_response>``."""
        return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)

    def call_grammar(self, tools: list[dict[str, Any]]) -> str | None:
        """No grammar: the XML values are not JSON (a forced call is not supported with this format)."""
        return None


register_tool_parser("qwen3_coder", Qwen3XMLToolParser)
register_tool_parser("qwen3xml", Qwen3XMLToolParser)

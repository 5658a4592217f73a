"""Tool-call parsers: model text ⇄ structured tool calls, chosen by name and pluggable.

A :class:`ToolParser` knows one tool-call format a model was trained on: it parses a model turn into content + calls
(whole or streamed) and, for chat templates without tool support, writes the format back (tool list, calls,
results). Built in: ``hermes`` (alias ``qwen``), ``qwen3_coder`` (alias ``qwen3xml``), ``openai`` (alias ``json``);
more through :func:`register_tool_parser` or ``pkg.mod:Class``. The formats: docs/agents.md, "Tool-call parsers".
"""

from __future__ import annotations

import importlib
import inspect
import json
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vime_core.agent.tool_parse_failures import ToolParseFailure


@dataclass
class ToolCall:
    """One parsed tool call.

    :ivar name: the function name.
    :ivar arguments: the decoded JSON arguments (always a dict; a JSON string of an object is decoded).
    :ivar id: a call id (generated when the format has none: ``call_<24 hex>``).
    """

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: new_call_id())

    def arguments_json(self) -> str:
        """``arguments`` as the JSON string the OpenAI APIs carry (``json.dumps`` defaults: ``", "``/``": "``)."""
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParseResult:
    """What a parser found in one model turn.

    :ivar content: the text outside tool calls (``""`` if none); for turns with calls it is stripped of surrounding
        whitespace (templates put their own separators around calls).
    :ivar tool_calls: the calls, in order.
    :ivar ill_formed: the turn tried to call a tool but the call could not be parsed (bad JSON, missing name,
        unclosed tag). The broken text stays in ``content``.
    :ivar errors: one message per ill-formed call.
    :ivar error_reasons: the :class:`ToolParseFailure` value of each entry of ``errors``, in order.
    :ivar value_errors: one message per argument kept as its raw text because it does not fit the tool's schema
        (formats whose values are typed by the schema, e.g. ``qwen3_coder``); the call itself is kept.
    :raises ValueError: (on construction) ``error_reasons`` does not give one reason per error.
    """

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    ill_formed: bool = False
    errors: list[str] = field(default_factory=list)
    error_reasons: list[str] = field(default_factory=list)
    value_errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.error_reasons) != len(self.errors):
            n, k = len(self.errors), len(self.error_reasons)
            raise ValueError(f"ParseResult: {n} errors but {k} error_reasons (one ToolParseFailure value per error)")

    def failure_counts(self) -> dict[str, int]:
        """Parse failures of the turn by reason (``{}`` when it parsed cleanly): every ill-formed call under its
        reason, every argument kept as raw text under ``value_type``."""
        counts = Counter(self.error_reasons)
        if self.value_errors:
            counts[ToolParseFailure.VALUE_TYPE.value] += len(self.value_errors)
        return dict(counts)


def _reason_of(error: ValueError) -> ToolParseFailure:
    """``bad_json`` for JSON that does not decode, else ``bad_call`` (a decoded object that is not a call)."""
    return ToolParseFailure.BAD_JSON if isinstance(error, json.JSONDecodeError) else ToolParseFailure.BAD_CALL


def new_call_id() -> str:
    """A fresh tool-call id, ``call_`` + 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def _call_from_obj(obj: Any) -> ToolCall:
    """A :class:`ToolCall` from one decoded JSON object in any of the accepted shapes.

    :raises ValueError: if it has no string ``name`` or its arguments are not an object.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"a tool call must be a JSON object, got {type(obj).__name__}")
    call_id = obj.get("id") if isinstance(obj.get("id"), str) else None
    if isinstance(obj.get("function"), dict):  # OpenAI {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool call without a name: {json.dumps(obj)[:200]}")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ValueError(f"tool call {name!r}: arguments must be a JSON object, got {type(args).__name__}")
    return ToolCall(name=name, arguments=args, id=call_id or new_call_id())


def tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """Normalise a tool definition to ``{"name", "description", "parameters"}``.

    Accepts the OpenAI Chat shape ``{"type": "function", "function": {...}}``, the Responses/flat shape
    ``{"name", "description", "parameters"}`` and the Anthropic shape ``{"name", "description", "input_schema"}``.

    :raises ValueError: if there is no name.
    """
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool without a name: {tool!r:.200}")
    params = fn.get("parameters", fn.get("input_schema")) or {"type": "object", "properties": {}}
    return {"name": name, "description": fn.get("description") or "", "parameters": params}


class ToolParser:
    """Base class of tool-call parsers. Subclasses set :attr:`name` and implement :meth:`parse`,
    :meth:`format_calls`, :meth:`tools_prompt` and :meth:`format_results`."""

    name: ClassVar[str] = ""

    def parse(self, text: str) -> ParseResult:
        """Split a model turn (special tokens already removed) into content and tool calls. Never raises."""
        raise NotImplementedError

    def stream(self) -> ToolCallStream:
        """An incremental parser of one turn: :meth:`ToolCallStream.feed` chunks of text as they arrive, then
        :meth:`ToolCallStream.close`; :meth:`ToolCallStream.result` equals :meth:`parse` of the whole text for any
        chunking. This default buffers the turn and parses it at ``close``; formats with a streaming parser
        override it."""
        return _BufferedStream(self)

    def format_calls(self, calls: list[ToolCall]) -> str:
        """The text a model of this format writes for ``calls`` (used when the chat template has no tool support)."""
        raise NotImplementedError

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        """System-prompt text that describes ``tools`` (normalised by :func:`tool_schema`) in this format."""
        raise NotImplementedError

    def format_results(self, results: list[str]) -> str:
        """The user-turn text carrying consecutive tool results (in call order)."""
        raise NotImplementedError

    def call_prefix(self, name: str) -> str:
        """The text of one call up to its arguments object (as :meth:`format_calls` writes it)."""
        raise NotImplementedError

    def call_suffix(self) -> str:
        """The text of one call after its arguments object."""
        raise NotImplementedError

    def call_grammar(self, tools: list[dict[str, Any]]) -> str | None:
        """A grammar for exactly one call to one of ``tools``, written as :meth:`format_calls` writes it.

        For vLLM's ``structured_outputs={"grammar": ...}`` (xgrammar EBNF): forces a tool call the way an API's
        ``tool_choice`` = required / a named tool does. Arguments follow each tool's JSON schema with ``", "`` and
        ``": "`` separators (``json.dumps``'s, which templates' ``tojson`` also uses), so the re-rendered call
        matches the sampled text exactly.

        :param tools: normalised schemas (:func:`tool_schema`), at least one.
        :return: the grammar text, or ``None`` when ``xgrammar`` is not installed.
        """
        try:
            import xgrammar as xg
        except ImportError:
            return None
        alts = []
        for t in tools:
            try:
                args = xg.Grammar.from_json_schema(json.dumps(t["parameters"]), any_whitespace=False)
            except Exception:  # noqa: BLE001 - a schema xgrammar cannot compile: any JSON object then
                args = xg.Grammar.from_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
            pre = xg.Grammar.from_ebnf("root ::= " + json.dumps(self.call_prefix(t["name"]), ensure_ascii=False))
            post = xg.Grammar.from_ebnf("root ::= " + json.dumps(self.call_suffix(), ensure_ascii=False))
            alts.append(xg.Grammar.concat(pre, args, post))
        return str(alts[0] if len(alts) == 1 else xg.Grammar.union(*alts))


@dataclass
class StreamEvent:
    """What a :class:`ToolCallStream` decided: ``kind`` ``"text"`` (``text`` is content, in order) or ``"call"``
    (``call`` is a complete, valid tool call)."""

    kind: str
    text: str = ""
    call: ToolCall | None = None


class ToolCallStream:
    """Incremental parsing of one model turn (see :meth:`ToolParser.stream`).

    Text is emitted as soon as it cannot be part of a call any more (a possible start tag at the end of a chunk is
    held back), calls as soon as they are complete. The concatenated ``"text"`` events are the content before the
    final whitespace strip of :class:`ParseResult` (turns with calls); the ``"call"`` events are its calls.
    """

    def __init__(self) -> None:
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._errors: list[str] = []
        self._reasons: list[str] = []
        self._value_errors: list[str] = []
        self._closed = False

    def feed(self, chunk: str) -> list[StreamEvent]:
        """Parse ``chunk`` (the next piece of the turn's text); the events it decided.

        :raises RuntimeError: after :meth:`close`.
        """
        if self._closed:
            raise RuntimeError("ToolCallStream.feed after close")
        events: list[StreamEvent] = []
        self._advance(chunk, events)
        return events

    def close(self) -> list[StreamEvent]:
        """End of the turn: flush what was held back (an open call becomes ill-formed text); the last events."""
        if self._closed:
            return []
        self._closed = True
        events: list[StreamEvent] = []
        self._finish(events)
        return events

    def result(self) -> ParseResult:
        """The parse of everything fed (call after :meth:`close`)."""
        content = "".join(self._content)
        return ParseResult(
            content=content.strip() if self._calls else content,
            tool_calls=list(self._calls),
            ill_formed=bool(self._errors),
            errors=list(self._errors),
            error_reasons=list(self._reasons),
            value_errors=list(self._value_errors),
        )

    # -- for subclasses ------------------------------------------------------------------------------------------
    def _fail(self, reason: ToolParseFailure, message: str) -> None:
        self._errors.append(message)
        self._reasons.append(reason.value)

    def _text(self, text: str, events: list[StreamEvent]) -> None:
        if text:
            self._content.append(text)
            events.append(StreamEvent("text", text))

    def _call(self, call: ToolCall, events: list[StreamEvent]) -> None:
        self._calls.append(call)
        events.append(StreamEvent("call", call=call))

    def _advance(self, chunk: str, events: list[StreamEvent]) -> None:
        raise NotImplementedError

    def _finish(self, events: list[StreamEvent]) -> None:
        raise NotImplementedError


class _BufferedStream(ToolCallStream):
    """Buffers the turn; parses it with the parser's :meth:`ToolParser.parse` at close."""

    def __init__(self, parser: ToolParser) -> None:
        super().__init__()
        self._parser, self._buf = parser, []

    def _advance(self, chunk: str, events: list[StreamEvent]) -> None:
        self._buf.append(chunk)

    def _finish(self, events: list[StreamEvent]) -> None:
        r = self._parser.parse("".join(self._buf))
        self._text(r.content, events)
        for c in r.tool_calls:
            self._call(c, events)
        self._errors.extend(r.errors)
        self._reasons.extend(r.error_reasons)
        self._value_errors.extend(r.value_errors)


_WS = " \t\r\n"


def _held_prefix(buf: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``buf`` ends with (text that may still become ``tag``)."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


class _HermesStream(ToolCallStream):
    """The state machine of :class:`HermesToolParser` (see its docstring); every character is decided once, from
    the text seen so far, so the result does not depend on how the text was chunked."""

    def __init__(self, start: str, end: str) -> None:
        super().__init__()
        self._start, self._end = start, end
        self._buf = ""  # undecided text
        self._in_call = False
        self._phase = ""  # in a call: "pre" (whitespace before the object), "json", "post" (after it), "raw"
        self._block: list[str] = []  # the call's text so far, from the start tag
        self._obj: list[str] = []
        self._depth, self._in_str, self._esc = 0, False, False

    def _advance(self, chunk: str, events: list[StreamEvent]) -> None:
        self._buf += chunk
        while self._buf:
            if not self._in_call:
                i = self._buf.find(self._start)
                if i < 0:
                    keep = _held_prefix(self._buf, self._start)
                    self._text(self._buf[: len(self._buf) - keep], events)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                self._text(self._buf[:i], events)
                self._buf = self._buf[i + len(self._start) :]
                self._in_call, self._phase = True, "pre"
                self._block, self._obj = [self._start], []
                self._depth, self._in_str, self._esc = 0, False, False
            elif self._phase == "pre":
                c = self._buf[0]
                if c in _WS:
                    self._block.append(c)
                    self._buf = self._buf[1:]
                elif c == "{":
                    self._phase = "json"
                else:
                    self._phase = "raw"
                    self._fail(ToolParseFailure.NOT_A_CALL, "<tool_call> is not followed by a JSON object")
            elif self._phase == "json":
                self._scan_json()
            elif self._phase == "post":
                if not self._post(events):
                    return
            elif not self._raw(events):
                return

    def _scan_json(self) -> None:
        """Consume the buffer up to the end of the JSON object (or all of it)."""
        buf, i, n = self._buf, 0, len(self._buf)
        depth, in_str, esc = self._depth, self._in_str, self._esc
        while i < n:
            c = buf[i]
            i += 1
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    self._phase = "post"
                    break
        self._depth, self._in_str, self._esc = depth, in_str, esc
        self._obj.append(buf[:i])
        self._block.append(buf[:i])
        self._buf = buf[i:]

    def _post(self, events: list[StreamEvent]) -> bool:
        """After the object: whitespace, then the end tag. False when more text is needed to decide."""
        buf = self._buf
        j = 0
        while j < len(buf) and buf[j] in _WS:
            j += 1
        self._block.append(buf[:j])
        buf = self._buf = buf[j:]
        if not buf:
            return False
        if buf.startswith(self._end):
            self._block.append(self._end)
            self._buf = buf[len(self._end) :]
            self._in_call = False
            obj = "".join(self._obj)
            try:
                call = _call_from_obj(json.loads(obj))
            except (ValueError, json.JSONDecodeError) as e:
                self._fail(_reason_of(e), f"{type(e).__name__}: {e}")
                self._text("".join(self._block), events)  # an unparseable call stays visible as text
            else:
                self._call(call, events)
            return True
        if self._end.startswith(buf):
            return False  # a partial end tag: wait
        self._phase = "raw"
        self._fail(ToolParseFailure.TRAILING_TEXT, f"text after the JSON object before {self._end}")
        return True

    def _raw(self, events: list[StreamEvent]) -> bool:
        """An ill-formed block: everything up to and including the next end tag stays as text."""
        i = self._buf.find(self._end)
        if i < 0:
            keep = _held_prefix(self._buf, self._end)
            self._block.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._block.append(self._buf[: i + len(self._end)])
        self._buf = self._buf[i + len(self._end) :]
        self._in_call = False
        self._text("".join(self._block), events)
        return True

    def _finish(self, events: list[StreamEvent]) -> None:
        if self._in_call:
            self._fail(ToolParseFailure.UNCLOSED, f"unclosed {self._start}")
            self._text("".join(self._block) + self._buf, events)
        else:
            self._text(self._buf, events)
        self._buf, self._in_call = "", False


class HermesToolParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks (Hermes / Qwen2.5 / Qwen3), parsed by JSON structure.

    A call is the JSON object that follows ``<tool_call>`` (whitespace allowed), read to its matching closing brace
    with JSON string rules (quotes, backslash escapes), then whitespace and ``</tool_call>``. A ``</tool_call>``
    *inside* a JSON string argument is therefore part of the argument, not the end of the call (a regex up to the
    first closing tag would cut the call there). A block that is not such an object (bad JSON, missing name, text
    before the closing tag) is ill-formed and stays in ``content`` up to and including its ``</tool_call>``; a block
    still open at the end of the text (unclosed tag, unterminated object, e.g. an output cut by the token budget) is
    ill-formed and stays in ``content`` as written. :meth:`stream` parses the same way incrementally.
    """

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParseResult:
        if self.START not in text:
            return ParseResult(content=text)
        s = self.stream()
        s.feed(text)
        s.close()
        return s.result()

    def stream(self) -> ToolCallStream:
        return _HermesStream(self.START, self.END)

    def format_calls(self, calls: list[ToolCall]) -> str:
        return "\n".join(self.call_prefix(c.name) + c.arguments_json() + self.call_suffix() for c in calls)

    def call_prefix(self, name: str) -> str:
        return f'{self.START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '

    def call_suffix(self) -> str:
        return f"}}\n{self.END}"

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        lines = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def format_results(self, results: list[str]) -> str:
        return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)


class OpenAIJsonToolParser(ToolParser):
    """A turn that is (only) JSON in the OpenAI tools schema is a tool call; anything else is text."""

    name = "openai"

    def parse(self, text: str) -> ParseResult:
        body = text.strip()
        if not body or body[0] not in "{[":
            return ParseResult(content=text)
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            bad = ToolParseFailure.BAD_JSON.value
            return ParseResult(content=text, ill_formed=True, errors=[f"JSONDecodeError: {e}"], error_reasons=[bad])
        if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
            obj = obj["tool_calls"]
        items = obj if isinstance(obj, list) else [obj]
        if isinstance(obj, dict) and "name" not in obj and "function" not in obj:
            return ParseResult(content=text)  # a JSON answer, not a call
        try:
            return ParseResult(content="", tool_calls=[_call_from_obj(o) for o in items])
        except (ValueError, json.JSONDecodeError) as e:
            return ParseResult(
                content=text, ill_formed=True, errors=[f"{type(e).__name__}: {e}"], error_reasons=[_reason_of(e).value]
            )

    def format_calls(self, calls: list[ToolCall]) -> str:
        objs = [{"name": c.name, "arguments": c.arguments} for c in calls]
        return json.dumps(objs[0] if len(objs) == 1 else objs, ensure_ascii=False)

    def call_prefix(self, name: str) -> str:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '

    def call_suffix(self) -> str:
        return "}"

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        lines = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
        return (
            "You have access to the following functions:\n"
            f"{lines}\n\n"
            "To call a function, reply with only a JSON object of the form "
            '{"name": <function-name>, "arguments": <args-json-object>} (a JSON list of them for several calls).'
        )

    def format_results(self, results: list[str]) -> str:
        return "\n".join(results)


_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "openai": OpenAIJsonToolParser,
    "json": OpenAIJsonToolParser,
}


def parse_with_tools(parser: ToolParser, text: str, tools: list[dict[str, Any]] | None) -> ParseResult:
    """``parser.parse(text)``, given the turn's ``tools`` when the parser takes them (its values are typed by the
    tools' schemas, e.g. ``qwen3_coder``)."""
    if tools and "tools" in inspect.signature(parser.parse).parameters:
        return parser.parse(text, tools=tools)
    return parser.parse(text)


def register_tool_parser(name: str, cls: type[ToolParser]) -> None:
    """Make ``cls`` available as ``name``.

    :raises ValueError: if ``name`` is taken by another class.
    """
    old = _PARSERS.get(name)
    if old is not None and old is not cls:
        raise ValueError(f"tool parser {name!r} is already registered as {old.__module__}.{old.__qualname__}")
    _PARSERS[name] = cls


def available_tool_parsers() -> list[str]:
    """Registered parser names, sorted."""
    return sorted(_PARSERS)


def get_tool_parser(name: str | ToolParser) -> ToolParser:
    """A parser instance by registered name or ``pkg.mod:Class`` path (an instance is returned as is).

    :raises ValueError: for an unknown name (the message lists the available ones) or a path that does not name a
        :class:`ToolParser` subclass.
    """
    if isinstance(name, ToolParser):
        return name
    if name in _PARSERS:
        return _PARSERS[name]()
    if ":" in name:
        mod, _, attr = name.partition(":")
        obj = getattr(importlib.import_module(mod), attr)
        if isinstance(obj, type) and issubclass(obj, ToolParser):
            return obj()
        raise ValueError(f"{name} is not a ToolParser subclass")
    raise ValueError(
        f"unknown tool parser {name!r}; available: {', '.join(available_tool_parsers())} (or a 'pkg.mod:Class' path)"
    )

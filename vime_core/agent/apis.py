"""The three chat APIs the gateway speaks, converted to and from one canonical form.

* Anthropic Messages (``POST /v1/messages``, as Claude Code uses it): ``system`` (string or text blocks), ``messages``
  with text / ``tool_use`` / ``tool_result`` blocks (``thinking`` and ``redacted_thinking`` blocks are dropped: the
  model's own text already carries what it thought), ``tools`` (``input_schema``; server tools without a schema are
  ignored), ``tool_choice`` ``auto|any|tool|none``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
  ``stop_sequences``, ``stream``.
* OpenAI Chat Completions (``POST /v1/chat/completions``): ``system``/``developer``/``user``/``assistant``
  (``tool_calls``)/``tool`` messages, ``tools`` (``function``), ``tool_choice``, ``max_tokens`` /
  ``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``, ``n`` = 1, ``stream`` (+ ``stream_options``).
* OpenAI Responses (``POST /v1/responses``, as Codex uses it): ``instructions``, ``input`` (a string or items:
  messages with ``input_text``/``output_text`` parts, ``function_call``, ``function_call_output``; ``reasoning``
  items are dropped), ``previous_response_id`` (the gateway keeps the session's responses), ``tools`` (flat
  ``function`` tools; others ignored), ``tool_choice``, ``max_output_tokens``, ``temperature``, ``top_p``,
  ``stream``.

Sources: the Anthropic Messages API reference (messages, streaming events), OpenAI's Chat Completions and Responses
API references, and the ``anthropic``/``openai`` Python SDKs' stream accumulators, which the tests drive.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from vime_core.agent.chat import ChatMessage, text_of
from vime_core.agent.tool_parsers import ToolCall, tool_schema


class APIError(Exception):
    """A request the gateway refuses or cannot serve; rendered in the API's own error format.

    :param status: HTTP status.
    :param kind: error type (Anthropic ``invalid_request_error``/``authentication_error``/``overloaded_error``/
        ``api_error``; mapped to the OpenAI names by :func:`openai_error`).
    :param message: human-readable message.
    :param code: the OpenAI ``error.code`` (e.g. ``context_length_exceeded``), ``None`` if none.
    :param param: the OpenAI ``error.param`` (the request field at fault), ``None`` if none.
    """

    def __init__(self, status: int, kind: str, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.code, self.param = status, kind, message, code, param


#: OpenAI's ``error.code`` for a prompt that does not fit the model's context window (Codex reads it from a
#: ``response.failed`` event as "context window exceeded" and compacts or stops the thread)
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def context_overflow_error(api: str, prompt_tokens: int, context_len: int) -> APIError:
    """The error each API's clients recognise for a prompt that leaves no room to generate in the context window.

    * Anthropic (Claude Code): 400 ``invalid_request_error`` ``"prompt is too long: N tokens > M maximum"`` — the
      vendor's wording, which Claude Code matches (case-insensitively, ``prompt is too long``) and parses (``N``,
      ``M``) to compact its conversation and retry.
    * OpenAI Chat Completions / Responses (Codex): 400 ``invalid_request_error`` with ``code``
      ``context_length_exceeded`` and the vendor's message (for a streamed Responses request the gateway sends it as
      a ``response.failed`` event, where Codex looks for the code).

    :param prompt_tokens: the prompt's length in tokens.
    :param context_len: the context window (prompt + output) in tokens; the longest prompt allowed is one less
        (at least one token must be generated).
    """
    limit = context_len - 1
    if api == "anthropic":
        return APIError(400, "invalid_request_error", f"prompt is too long: {prompt_tokens} tokens > {limit} maximum")
    field = "input" if api == "responses" else "messages"
    return APIError(
        400,
        "invalid_request_error",
        f"This model's maximum context length is {context_len} tokens. However, your {field} resulted in "
        f"{prompt_tokens} tokens, leaving no room for the output. Please reduce the length of the {field}.",
        code=CONTEXT_LENGTH_EXCEEDED,
        param=field,
    )


def anthropic_error(e: APIError) -> dict[str, Any]:
    """The Anthropic error body."""
    return {"type": "error", "error": {"type": e.kind, "message": e.message}}


def openai_error(e: APIError) -> dict[str, Any]:
    """The OpenAI error body."""
    kind = {
        "invalid_request_error": "invalid_request_error",
        "authentication_error": "invalid_api_key",
        "overloaded_error": "server_error",
        "api_error": "server_error",
    }.get(e.kind, e.kind)
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.code}}


@dataclass
class ChatRequest:
    """One API request in canonical form.

    :ivar api: ``anthropic``, ``chat`` or ``responses``.
    :ivar model: the model name the client asked for (echoed back).
    :ivar messages: the conversation.
    :ivar tools: tool schemas normalised by :func:`~vime_core.agent.tool_parsers.tool_schema`.
    :ivar tool_choice: ``auto``, ``none``, ``required`` or a tool name.
    :ivar max_tokens: requested output budget (tokens) or ``None``.
    :ivar stop: stop strings.
    """

    api: str
    model: str
    messages: list[ChatMessage]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "auto"
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass
class ChatResult:
    """One answered turn, API-neutral.

    :ivar content: visible assistant text (tool calls removed).
    :ivar tool_calls: parsed calls.
    :ivar stop: ``end_turn``, ``tool_use``, ``max_tokens`` or ``stop_sequence``.
    :ivar stop_sequence: the stop string that ended the turn, if one did.
    :ivar input_tokens: prompt tokens; :ivar output_tokens: sampled tokens.
    """

    content: str
    tool_calls: list[ToolCall]
    stop: str
    stop_sequence: str | None
    input_tokens: int
    output_tokens: int


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def _merge_assistant(messages: list[ChatMessage], content: str = "", calls: list[ToolCall] | None = None) -> None:
    """Append assistant text/calls, merging into the previous assistant message (one model turn)."""
    if messages and messages[-1].role == "assistant" and not (content and messages[-1].tool_calls):
        m = messages[-1]
        if content:
            m.content = f"{m.content}\n{content}" if m.content else content
        m.tool_calls.extend(calls or [])
    else:
        messages.append(ChatMessage("assistant", content, list(calls or [])))


def _tools(raw: Any) -> list[dict[str, Any]]:
    out = []
    for t in raw or []:
        if not isinstance(t, dict):
            continue
        if t.get("type") not in (None, "function", "custom") and "input_schema" not in t:
            continue  # server/built-in tools (web search, local_shell, …) are not model-side tools
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        if "name" not in fn:
            continue
        out.append(tool_schema(t))
    return out


def _int(v: Any) -> int | None:
    return None if v is None else int(v)


# the words each API uses for a tool result and its id (error messages name the client's own fields)
_RESULT_TERMS = {
    "anthropic": ("`tool_result` block", "`tool_result` blocks", "`tool_use_id`", "`tool_use` block"),
    "chat": ("message with role 'tool'", "messages with role 'tool'", "'tool_call_id'", "'tool_calls' entry"),
    "responses": ("'function_call_output' item", "'function_call_output' items", "'call_id'", "'function_call' item"),
}


def pair_tool_results(messages: list[ChatMessage], api: str, *, strict: bool = True) -> list[ChatMessage]:
    """Pair every tool result with the call it answers and put the results in the order of their calls.

    A run of consecutive ``tool`` messages answers the calls of the assistant message right before it. Each result
    must name one of those calls by id, at most once; the run is reordered to the calls' order (results that arrive
    in another order are shown to the model as the calls were made) and each result gets its call's tool name.
    Calls without a result are left as they are.

    :param api: ``anthropic``, ``chat`` or ``responses`` (the error messages use that API's field names).
    :param strict: the APIs' rule; ``False`` (prompt data of the ``multi_turn`` generate function): a result
        without an id answers the next unanswered call, and results after no call are kept in place.
    :return: the messages, results reordered (the list is rebuilt; messages are updated in place).
    :raises APIError: 400 for a result without an id (strict), with an id that matches no call of the preceding
        assistant message, answering a call twice, or not preceded by calls (strict).
    """
    what, whats, id_field, call_kind = _RESULT_TERMS[api]
    out: list[ChatMessage] = []
    i = 0
    while i < len(messages):
        if messages[i].role != "tool":
            out.append(messages[i])
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j].role == "tool":
            j += 1
        run = messages[i:j]
        prev = out[-1] if out else None
        calls = prev.tool_calls if prev is not None and prev.role == "assistant" else []
        if not calls:
            if strict:
                raise APIError(
                    400,
                    "invalid_request_error",
                    f"a {what} must answer a {call_kind} of the assistant message right before it; "
                    f"there is none before result {run[0].tool_call_id or '(no id)'}",
                )
            out += run
            i = j
            continue
        index = {c.id: k for k, c in enumerate(calls)}
        known = ", ".join(c.id for c in calls)
        taken: dict[int, ChatMessage] = {}
        for m in run:
            if not m.tool_call_id:
                if strict:
                    raise APIError(
                        400,
                        "invalid_request_error",
                        f"a {what} has no {id_field}; each result must name the call it answers "
                        f"(calls of the previous assistant message: {known})",
                    )
                free = [k for k in range(len(calls)) if k not in taken]
                if not free:
                    raise APIError(400, "invalid_request_error", f"more {whats} than calls ({len(calls)})")
                m.tool_call_id = calls[free[0]].id
            k = index.get(m.tool_call_id)
            if k is None:
                raise APIError(
                    400,
                    "invalid_request_error",
                    f"unexpected {id_field} found in {whats}: {m.tool_call_id}. Each {what} must have a "
                    f"corresponding {call_kind} in the previous assistant message (its ids: {known})",
                )
            if k in taken:
                raise APIError(400, "invalid_request_error", f"{id_field} {m.tool_call_id} is answered twice")
            m.name = m.name or calls[k].name
            taken[k] = m
        out += [taken[k] for k in sorted(taken)]
        i = j
    return out


# -- Anthropic Messages ------------------------------------------------------------------------------------------
def parse_anthropic(body: dict[str, Any]) -> ChatRequest:
    """Canonical request from an Anthropic Messages body.

    :raises APIError: 400 on a malformed body or a ``tool_result`` that answers no ``tool_use``
        (:func:`pair_tool_results`).
    """
    if not isinstance(body.get("messages"), list):
        raise APIError(400, "invalid_request_error", "messages: field required (a list)")
    msgs: list[ChatMessage] = []
    system = body.get("system")
    if system:
        msgs.append(ChatMessage("system", text_of(system)))
    for m in body["messages"]:
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant", "system"):
            raise APIError(400, "invalid_request_error", f"messages: unknown role {role!r}")
        if role == "system":  # Claude Code (2.1+) sends system messages between turns (e.g. the agent list)
            msgs.append(ChatMessage("system", text_of(content)))
            continue
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        if role == "assistant":
            texts, calls = [], []
            for b in blocks:
                if b.get("type") == "text":
                    texts.append(b.get("text", ""))
                elif b.get("type") in ("tool_use", "server_tool_use"):
                    calls.append(
                        ToolCall(b.get("name", ""), dict(b.get("input") or {}), b.get("id") or _new_id("toolu_"))
                    )
            _merge_assistant(msgs, "\n".join(texts), calls)
            continue
        texts = []
        for b in blocks:
            t = b.get("type")
            if t == "tool_result":
                result = text_of(b.get("content"))
                if b.get("is_error"):
                    result = f"Error: {result}" if result else "Error"
                msgs.append(ChatMessage("tool", result, tool_call_id=b.get("tool_use_id")))
            elif t in ("thinking", "redacted_thinking"):
                continue
            else:
                texts.append(text_of([b]))
        if texts:
            msgs.append(ChatMessage("user", "\n".join(texts)))
    tc = body.get("tool_choice") or {}
    choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.get("type"), "auto")
    if tc.get("type") == "tool":
        choice = tc.get("name") or "required"
    if "max_tokens" not in body:
        raise APIError(400, "invalid_request_error", "max_tokens: field required")
    return ChatRequest(
        api="anthropic",
        model=str(body.get("model", "")),
        messages=pair_tool_results(msgs, "anthropic"),
        tools=_tools(body.get("tools")),
        tool_choice=choice,
        max_tokens=_int(body.get("max_tokens")),
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        top_k=_int(body.get("top_k")),
        stop=list(body.get("stop_sequences") or []),
        stream=bool(body.get("stream")),
        raw=body,
    )


_ANTHROPIC_STOP = {
    "end_turn": "end_turn",
    "tool_use": "tool_use",
    "max_tokens": "max_tokens",
    "stop_sequence": "stop_sequence",
}


def anthropic_blocks(res: ChatResult) -> list[dict[str, Any]]:
    """Content blocks: text (if any, or an empty one when there is nothing else), then ``tool_use`` blocks."""
    blocks: list[dict[str, Any]] = []
    if res.content or not res.tool_calls:
        blocks.append({"type": "text", "text": res.content})
    for c in res.tool_calls:
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments})
    return blocks


def anthropic_message(req: ChatRequest, res: ChatResult, msg_id: str) -> dict[str, Any]:
    """The non-streaming Messages response."""
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": anthropic_blocks(res),
        "stop_reason": _ANTHROPIC_STOP[res.stop],
        "stop_sequence": res.stop_sequence,
        "usage": {
            "input_tokens": res.input_tokens,
            "output_tokens": res.output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def anthropic_start_event(req: ChatRequest, msg_id: str, input_tokens: int) -> dict[str, Any]:
    """``message_start`` (sent before generation finishes)."""
    return {
        "type": "message_start",
        "message": {
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": input_tokens,
                "output_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        },
    }


def anthropic_events(res: ChatResult) -> list[dict[str, Any]]:
    """The events after ``message_start``: one start/delta/stop per block, ``message_delta``, ``message_stop``."""
    ev: list[dict[str, Any]] = []
    for i, b in enumerate(anthropic_blocks(res)):
        if b["type"] == "text":
            ev.append({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}})
            if b["text"]:
                ev.append(
                    {"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": b["text"]}}
                )
        else:
            ev.append(
                {
                    "type": "content_block_start",
                    "index": i,
                    "content_block": {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}},
                }
            )
            ev.append(
                {
                    "type": "content_block_delta",
                    "index": i,
                    "delta": {"type": "input_json_delta", "partial_json": json.dumps(b["input"], ensure_ascii=False)},
                }
            )
        ev.append({"type": "content_block_stop", "index": i})
    ev.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": _ANTHROPIC_STOP[res.stop], "stop_sequence": res.stop_sequence},
            "usage": {"output_tokens": res.output_tokens},
        }
    )
    ev.append({"type": "message_stop"})
    return ev


# -- OpenAI Chat Completions -------------------------------------------------------------------------------------
def _openai_choice(tc: Any) -> str:
    if isinstance(tc, str):
        return tc if tc in ("auto", "none", "required") else "auto"
    if isinstance(tc, dict):
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else tc
        if fn.get("name"):
            return str(fn["name"])
    return "auto"


def _calls_from_openai(raw: Any) -> list[ToolCall]:
    calls = []
    for c in raw or []:
        fn = c.get("function") or {}
        args = fn.get("arguments") or "{}"
        try:
            parsed = json.loads(args) if isinstance(args, str) else dict(args)
        except json.JSONDecodeError:
            parsed = {"_raw": args}
        calls.append(
            ToolCall(
                fn.get("name", ""),
                parsed if isinstance(parsed, dict) else {"_value": parsed},
                c.get("id") or _new_id("call_"),
            )
        )
    return calls


def parse_chat(body: dict[str, Any], *, strict_tool_ids: bool = True) -> ChatRequest:
    """Canonical request from an OpenAI Chat Completions body.

    :param strict_tool_ids: the API's rule for tool results (see :func:`pair_tool_results`); ``False`` for prompt
        data, whose tool messages often carry no ``tool_call_id``.
    :raises APIError: 400 on a malformed body, ``n != 1`` or a tool result that answers no call.
    """
    if not isinstance(body.get("messages"), list):
        raise APIError(400, "invalid_request_error", "messages: field required (a list)")
    if body.get("n", 1) not in (1, None):
        raise APIError(400, "invalid_request_error", "n must be 1 (one trajectory per request)")
    msgs: list[ChatMessage] = []
    for m in body["messages"]:
        role = m.get("role")
        if role in ("system", "developer"):
            msgs.append(ChatMessage("system", text_of(m.get("content"))))
        elif role == "user":
            msgs.append(ChatMessage("user", text_of(m.get("content"))))
        elif role == "assistant":
            _merge_assistant(msgs, text_of(m.get("content")), _calls_from_openai(m.get("tool_calls")))
        elif role == "tool":
            msgs.append(
                ChatMessage("tool", text_of(m.get("content")), tool_call_id=m.get("tool_call_id"), name=m.get("name"))
            )
        else:
            raise APIError(400, "invalid_request_error", f"messages: unknown role {role!r}")
    stop = body.get("stop")
    so = body.get("stream_options") or {}
    return ChatRequest(
        api="chat",
        model=str(body.get("model", "")),
        messages=pair_tool_results(msgs, "chat", strict=strict_tool_ids),
        tools=_tools(body.get("tools")),
        tool_choice=_openai_choice(body.get("tool_choice")),
        max_tokens=_int(body.get("max_completion_tokens", body.get("max_tokens"))),
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        top_k=_int(body.get("top_k")),
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stream=bool(body.get("stream")),
        include_usage=bool(so.get("include_usage")),
        raw=body,
    )


_CHAT_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls", "max_tokens": "length"}


def _chat_usage(res: ChatResult) -> dict[str, int]:
    return {
        "prompt_tokens": res.input_tokens,
        "completion_tokens": res.output_tokens,
        "total_tokens": res.input_tokens + res.output_tokens,
    }


def chat_completion(req: ChatRequest, res: ChatResult, cid: str) -> dict[str, Any]:
    """The non-streaming Chat Completions response."""
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": res.content if (res.content or not res.tool_calls) else None,
    }
    if res.tool_calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json()}}
            for c in res.tool_calls
        ]
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [{"index": 0, "message": msg, "finish_reason": _CHAT_FINISH[res.stop], "logprobs": None}],
        "usage": _chat_usage(res),
    }


def chat_chunks(req: ChatRequest, res: ChatResult, cid: str) -> list[dict[str, Any]]:
    """The streamed chunks (role, content, each tool call, finish; usage when asked for)."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }

    out = [chunk({"role": "assistant", "content": ""})]
    if res.content:
        out.append(chunk({"content": res.content}))
    for i, c in enumerate(res.tool_calls):
        out.append(
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": i,
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments_json()},
                        }
                    ]
                }
            )
        )
    out.append(chunk({}, _CHAT_FINISH[res.stop]))
    if req.include_usage:
        out.append(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": req.model,
                "choices": [],
                "usage": _chat_usage(res),
            }
        )
    return out


# -- OpenAI Responses --------------------------------------------------------------------------------------------
def parse_responses(body: dict[str, Any], history: list[ChatMessage] | None = None) -> ChatRequest:
    """Canonical request from an OpenAI Responses body; ``history`` is the conversation of
    ``previous_response_id`` (looked up by the gateway).

    :raises APIError: 400 on a malformed body or a ``function_call_output`` that answers no ``function_call``
        (:func:`pair_tool_results`).
    """
    msgs: list[ChatMessage] = [
        ChatMessage(m.role, m.content, list(m.tool_calls), m.tool_call_id, m.name) for m in history or []
    ]
    if body.get("instructions"):
        if msgs and msgs[0].role == "system":
            msgs[0] = ChatMessage("system", text_of(body["instructions"]))
        else:
            msgs.insert(0, ChatMessage("system", text_of(body["instructions"])))
    inp = body.get("input")
    items = [{"role": "user", "content": inp}] if isinstance(inp, str) else list(inp or [])
    for it in items:
        if not isinstance(it, dict):
            raise APIError(400, "invalid_request_error", "input items must be objects")
        t = it.get("type", "message")
        if t == "message":
            role = it.get("role")
            text = text_of(it.get("content"))
            if role in ("system", "developer"):
                msgs.append(ChatMessage("system", text))
            elif role == "user":
                msgs.append(ChatMessage("user", text))
            elif role == "assistant":
                _merge_assistant(msgs, text)
            else:
                raise APIError(400, "invalid_request_error", f"input: unknown role {role!r}")
        elif t == "function_call":
            args = it.get("arguments") or "{}"
            try:
                parsed = json.loads(args)
            except json.JSONDecodeError:
                parsed = {"_raw": args}
            _merge_assistant(
                msgs,
                "",
                [
                    ToolCall(
                        it.get("name", ""),
                        parsed if isinstance(parsed, dict) else {"_value": parsed},
                        it.get("call_id") or _new_id("call_"),
                    )
                ],
            )
        elif t == "function_call_output":
            out = it.get("output")
            msgs.append(
                ChatMessage("tool", out if isinstance(out, str) else text_of(out), tool_call_id=it.get("call_id"))
            )
        # reasoning and other item types carry nothing the model needs re-rendered
    return ChatRequest(
        api="responses",
        model=str(body.get("model", "")),
        messages=pair_tool_results(msgs, "responses"),
        tools=_tools(body.get("tools")),
        tool_choice=_openai_choice(body.get("tool_choice")),
        max_tokens=_int(body.get("max_output_tokens")),
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        stream=bool(body.get("stream")),
        raw=body,
    )


def responses_output(res: ChatResult) -> list[dict[str, Any]]:
    """Output items: a message (if there is text, or nothing else), then one ``function_call`` per call."""
    items: list[dict[str, Any]] = []
    if res.content or not res.tool_calls:
        items.append(
            {
                "type": "message",
                "id": _new_id("msg_"),
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": res.content, "annotations": []}],
            }
        )
    for c in res.tool_calls:
        items.append(
            {
                "type": "function_call",
                "id": _new_id("fc_"),
                "call_id": c.id,
                "name": c.name,
                "arguments": c.arguments_json(),
                "status": "completed",
            }
        )
    return items


def responses_object(
    req: ChatRequest, rid: str, created: float, *, status: str, output: list[dict[str, Any]], res: ChatResult | None
) -> dict[str, Any]:
    """A Response object (``status`` ``in_progress``, ``completed`` or ``incomplete``)."""
    raw = req.raw
    obj: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": req.model,
        "output": output,
        "error": None,
        "incomplete_details": None,
        "instructions": raw.get("instructions"),
        "metadata": raw.get("metadata") or {},
        "parallel_tool_calls": bool(raw.get("parallel_tool_calls", True)),
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": raw.get("tool_choice") or "auto",
        "tools": raw.get("tools") or [],
        "max_output_tokens": req.max_tokens,
        "previous_response_id": raw.get("previous_response_id"),
        "store": bool(raw.get("store", False)),
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": None,
    }
    if res is not None:
        obj["usage"] = {
            "input_tokens": res.input_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": res.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": res.input_tokens + res.output_tokens,
        }
        if res.stop == "max_tokens":
            obj["status"] = "incomplete"
            obj["incomplete_details"] = {"reason": "max_output_tokens"}
    return obj


def responses_events(
    req: ChatRequest, rid: str, created: float, res: ChatResult, output: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The streamed events after ``response.created``/``response.in_progress``: per item added → (content part,
    text delta/done | arguments delta/done) → item done, then ``response.completed`` (or ``response.incomplete``).
    ``sequence_number`` is filled in by the caller."""
    ev: list[dict[str, Any]] = []
    for i, item in enumerate(output):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            ev.append(
                {
                    "type": "response.output_item.added",
                    "output_index": i,
                    "item": {**item, "status": "in_progress", "content": []},
                }
            )
            part = {"type": "output_text", "text": "", "annotations": []}
            ev.append(
                {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": i,
                    "content_index": 0,
                    "part": part,
                }
            )
            if text:
                ev.append(
                    {
                        "type": "response.output_text.delta",
                        "item_id": item["id"],
                        "output_index": i,
                        "content_index": 0,
                        "delta": text,
                        "logprobs": [],
                    }
                )
            ev.append(
                {
                    "type": "response.output_text.done",
                    "item_id": item["id"],
                    "output_index": i,
                    "content_index": 0,
                    "text": text,
                    "logprobs": [],
                }
            )
            ev.append(
                {
                    "type": "response.content_part.done",
                    "item_id": item["id"],
                    "output_index": i,
                    "content_index": 0,
                    "part": item["content"][0],
                }
            )
        else:
            ev.append(
                {
                    "type": "response.output_item.added",
                    "output_index": i,
                    "item": {**item, "status": "in_progress", "arguments": ""},
                }
            )
            ev.append(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item["id"],
                    "output_index": i,
                    "delta": item["arguments"],
                }
            )
            ev.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": i,
                    "arguments": item["arguments"],
                    "name": item["name"],
                }
            )
        ev.append({"type": "response.output_item.done", "output_index": i, "item": item})
    final = responses_object(req, rid, created, status="completed", output=output, res=res)
    ev.append(
        {"type": "response.incomplete" if final["status"] == "incomplete" else "response.completed", "response": final}
    )
    return ev

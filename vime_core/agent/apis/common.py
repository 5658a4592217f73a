"""What the gateway's three chat APIs share: the canonical request and result, API errors, tool-result pairing, and
the HTTP plumbing of their routes (session key, JSON body, server-sent events, one turn served plainly or streamed).

Each API module (:mod:`.anthropic_messages`, :mod:`.openai_chat`, :mod:`.openai_responses`) converts its wire format
to and from :class:`ChatRequest` / :class:`ChatResult` and holds its routes (a FastAPI ``APIRouter``); the
:class:`~vime_core.agent.gateway.AgentGateway` serves the turn in between. The routes see it through the
:class:`TurnServer` protocol, so that no import runs back from the APIs to the gateway.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from vime_core.agent.chat import ChatMessage, ChatRenderer
from vime_core.agent.session import Session
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


def new_id(prefix: str) -> str:
    """``prefix`` followed by 24 random hex digits (message, call and response ids)."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def merge_assistant(messages: list[ChatMessage], content: str = "", calls: list[ToolCall] | None = None) -> None:
    """Append assistant text/calls, merging into the previous assistant message (one model turn)."""
    if messages and messages[-1].role == "assistant" and not (content and messages[-1].tool_calls):
        m = messages[-1]
        if content:
            m.content = f"{m.content}\n{content}" if m.content else content
        m.tool_calls.extend(calls or [])
    else:
        messages.append(ChatMessage("assistant", content, list(calls or [])))


def request_tools(raw: Any) -> list[dict[str, Any]]:
    """The model-side tools of a request's ``tools`` list, normalised by
    :func:`~vime_core.agent.tool_parsers.tool_schema` (server/built-in tools and entries without a name dropped)."""
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


def int_or_none(v: Any) -> int | None:
    """``int(v)``, or ``None`` for ``None``."""
    return None if v is None else int(v)


def openai_tool_choice(tc: Any) -> str:
    """The canonical ``tool_choice`` of an OpenAI request (Chat Completions and Responses): ``auto``, ``none``,
    ``required`` or a tool name."""
    if isinstance(tc, str):
        return tc if tc in ("auto", "none", "required") else "auto"
    if isinstance(tc, dict):
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else tc
        if fn.get("name"):
            return str(fn["name"])
    return "auto"


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


# -- HTTP plumbing of the routes ---------------------------------------------------------------------------------
#: a route's streamed answer: ``(request, prompt plan, the generation task, session, ping interval in seconds)`` →
#: the response body's chunks
StreamFn = Callable[[ChatRequest, Any, "asyncio.Task[ChatResult]", Session, float], AsyncIterator[bytes]]


class TurnServer(Protocol):
    """The gateway as the routes see it (:class:`~vime_core.agent.gateway.AgentGateway` is one): sessions, the turn
    lifecycle, the chat renderer and the keep-alive interval."""

    renderer: ChatRenderer
    ping_interval_s: float

    def lookup_session(self, sid: str | None) -> Session:
        """The open session of API key ``sid``; raises :class:`APIError` (401) for a missing or unknown one."""

    def begin_turn(self, session: Session) -> None:
        """Count a model call against the session's turn budget; raises :class:`APIError` (400) once it is spent."""

    def prepare_turn(self, session: Session, req: ChatRequest) -> tuple[Any, dict[str, Any]]:
        """The prompt plan and sampling parameters of a turn; raises :class:`APIError` for one it refuses."""

    async def generate_turn(self, session: Session, req: ChatRequest, plan: Any, params: dict[str, Any]) -> ChatResult:
        """Generate, parse and record one turn."""

    def end_turn(self, session: Session) -> None:
        """A turn started by :meth:`begin_turn` is over (answered, refused or failed)."""


def gateway_of(request: Request) -> TurnServer:
    """The gateway serving ``request`` (``app.state.gateway``, set when the gateway builds its app)."""
    return request.app.state.gateway


def key_of(request: Request) -> str | None:
    """The session key of a request: ``x-api-key``, else the ``Authorization: Bearer`` token (``None``: neither)."""
    key = request.headers.get("x-api-key")
    if key:
        return key
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


async def body_of(request: Request) -> dict[str, Any]:
    """The request's JSON object body.

    :raises APIError: 400 if the body is not JSON or not an object.
    """
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, "invalid_request_error", f"body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise APIError(400, "invalid_request_error", "body must be a JSON object")
    return body


def error_response(e: APIError, error_body: Callable[[APIError], dict[str, Any]]) -> JSONResponse:
    """``e`` as a JSON response with its status, in the API's format (``error_body``)."""
    return JSONResponse(error_body(e), status_code=e.status)


def sse(event: dict[str, Any]) -> bytes:
    """A server-sent event named by the event's ``type`` (Anthropic, OpenAI Responses)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


def data(obj: dict[str, Any]) -> bytes:
    """A server-sent ``data:`` line without an event name (OpenAI Chat Completions)."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def event_stream(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    """A ``text/event-stream`` response of ``chunks``."""
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"cache-control": "no-cache"})


async def wait_with_pings(task: asyncio.Task, ping: bytes | None, interval_s: float) -> AsyncIterator[bytes]:
    """Yield ``ping`` every ``interval_s`` seconds until ``task`` is done (keeps a streamed turn's connection alive
    while the engine works)."""
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=interval_s)
        if not done and ping is not None:
            yield ping


async def turn_stream(
    task: asyncio.Task,
    ping: bytes | None,
    ping_s: float,
    error_chunk: Callable[[APIError], bytes],
    result_chunks: Callable[[ChatResult], list[bytes]],
) -> AsyncIterator[bytes]:
    """The body of a streamed turn after its opening events: ``ping`` every ``ping_s`` seconds while ``task``
    generates, then the result's chunks, or the error chunk if the turn failed with an :class:`APIError`."""
    async for p in wait_with_pings(task, ping, ping_s):
        yield p
    try:
        res = task.result()
    except APIError as e:
        yield error_chunk(e)
        return
    for chunk in result_chunks(res):
        yield chunk


async def serve(
    request: Request,
    *,
    parse: Callable[[dict[str, Any], Session], ChatRequest],
    respond: Callable[[ChatRequest, ChatResult, Session], dict[str, Any]],
    stream: StreamFn,
    error_body: Callable[[APIError], dict[str, Any]],
    refused_stream: Callable[[ChatRequest, APIError], AsyncIterator[bytes] | None] | None = None,
) -> Any:
    """Serve one model turn over HTTP: find the session, parse the body, start the turn
    (:meth:`~vime_core.agent.gateway.AgentGateway.begin_turn`), prepare and generate it, and answer plainly
    (``respond``) or streamed (``stream``).

    The generation runs as its own task: a client that hangs up does not cancel the turn (it is still recorded).

    :param parse: body and session → canonical request (may raise :class:`APIError`).
    :param respond: the non-streamed response body.
    :param stream: the streamed response body (errors after the stream started are sent inside it).
    :param error_body: the API's error format.
    :param refused_stream: for a streamed request refused before generation, a stream to answer with instead of an
        error response (``None`` from it, or no function: the error response).
    """
    gateway = gateway_of(request)
    try:
        session = gateway.lookup_session(key_of(request))
        req = parse(await body_of(request), session)
        gateway.begin_turn(session)
    except APIError as e:
        return error_response(e, error_body)
    try:
        plan, params = gateway.prepare_turn(session, req)
    except APIError as e:
        gateway.end_turn(session)
        refused = refused_stream(req, e) if req.stream and refused_stream is not None else None
        if refused is not None:
            return event_stream(refused)
        return error_response(e, error_body)
    task = asyncio.ensure_future(gateway.generate_turn(session, req, plan, params))
    task.add_done_callback(lambda _t: gateway.end_turn(session))
    if req.stream:
        return event_stream(stream(req, plan, task, session, gateway.ping_interval_s))
    try:
        res = await asyncio.shield(task)  # a client that hangs up does not cancel the turn (it is recorded)
    except APIError as e:
        return error_response(e, error_body)
    return JSONResponse(respond(req, res, session))

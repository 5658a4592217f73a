"""The OpenAI Responses API (``POST /v1/responses``, as Codex uses it): its codec, its route and the session's store
of past responses (``previous_response_id``).

Requests: ``instructions``, ``input`` (a string or items: messages with ``input_text``/``output_text`` parts,
``function_call``, ``function_call_output``; ``reasoning`` items are dropped), ``previous_response_id`` (the gateway
keeps the session's last :data:`MAX_STORED_RESPONSES` responses), ``tools`` (flat ``function`` tools; others
ignored), ``tool_choice``, ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``. Errors are OpenAI error
bodies, except that a streamed request whose prompt overflows the context window gets ``response.created`` then
``response.failed`` with code ``context_length_exceeded`` (where Codex looks for it).

Sources: OpenAI's Responses API reference and the ``openai`` Python SDK's stream accumulator, which the tests drive.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from vime_core.agent.apis.common import (
    CONTEXT_LENGTH_EXCEEDED,
    APIError,
    ChatRequest,
    ChatResult,
    int_or_none,
    merge_assistant,
    new_id,
    openai_error,
    openai_tool_choice,
    pair_tool_results,
    request_tools,
    serve,
    sse,
    turn_stream,
)
from vime_core.agent.chat import ChatMessage, text_of
from vime_core.agent.session import Session
from vime_core.agent.tool_parsers import ToolCall

#: how many responses per session ``previous_response_id`` can refer to (the most recent ones)
MAX_STORED_RESPONSES = 32


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
                merge_assistant(msgs, text)
            else:
                raise APIError(400, "invalid_request_error", f"input: unknown role {role!r}")
        elif t == "function_call":
            args = it.get("arguments") or "{}"
            try:
                parsed = json.loads(args)
            except json.JSONDecodeError:
                parsed = {"_raw": args}
            merge_assistant(
                msgs,
                "",
                [
                    ToolCall(
                        it.get("name", ""),
                        parsed if isinstance(parsed, dict) else {"_value": parsed},
                        it.get("call_id") or new_id("call_"),
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
        tools=request_tools(body.get("tools")),
        tool_choice=openai_tool_choice(body.get("tool_choice")),
        max_tokens=int_or_none(body.get("max_output_tokens")),
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
                "id": new_id("msg_"),
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": res.content, "annotations": []}],
            }
        )
    for c in res.tool_calls:
        items.append(
            {
                "type": "function_call",
                "id": new_id("fc_"),
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


# -- route and the session's stored responses --------------------------------------------------------------------
router = APIRouter()


def _parse(body: dict[str, Any], session: Session) -> ChatRequest:
    prev = body.get("previous_response_id")
    history = None
    if prev:
        with session.lock:
            history = session.responses.get(prev)
        if history is None:
            raise APIError(400, "invalid_request_error", f"previous_response_id {prev!r} not found")
    return parse_responses(body, history)


def remember(session: Session, rid: str, req: ChatRequest, res: ChatResult) -> None:
    """Store the conversation of response ``rid`` (request + answer) for a later ``previous_response_id``; only the
    session's last :data:`MAX_STORED_RESPONSES` are kept."""
    convo = copy.deepcopy(req.messages)
    convo.append(ChatMessage("assistant", res.content, list(res.tool_calls)))
    with session.lock:
        session.responses[rid] = convo
        while len(session.responses) > MAX_STORED_RESPONSES:  # oldest first (dicts keep insertion order)
            session.responses.pop(next(iter(session.responses)))


def _respond(req: ChatRequest, res: ChatResult, session: Session) -> dict[str, Any]:
    rid = new_id("resp_")
    remember(session, rid, req, res)
    return responses_object(req, rid, time.time(), status="completed", output=responses_output(res), res=res)


def responses_failed(req: ChatRequest, rid: str, created: float, e: APIError) -> dict[str, Any]:
    """A Response object with status ``failed`` carrying ``e`` (``code``: ``e.code`` or ``server_error``)."""
    failed = responses_object(req, rid, created, status="failed", output=[], res=None)
    failed["error"] = {"code": e.code or "server_error", "message": e.message}
    return failed


async def _stream(
    req: ChatRequest, plan: Any, task: asyncio.Task, session: Session, ping_s: float
) -> AsyncIterator[bytes]:
    rid, created = new_id("resp_"), time.time()
    seq = 0

    def ev(e: dict[str, Any]) -> bytes:
        nonlocal seq
        e["sequence_number"] = seq
        seq += 1
        return sse(e)

    pending = responses_object(req, rid, created, status="in_progress", output=[], res=None)
    yield ev({"type": "response.created", "response": pending})
    yield ev({"type": "response.in_progress", "response": pending})

    def failed(e: APIError) -> bytes:
        return ev({"type": "response.failed", "response": responses_failed(req, rid, created, e)})

    def completed(res: ChatResult) -> list[bytes]:
        remember(session, rid, req, res)
        return [ev(e) for e in responses_events(req, rid, created, res, responses_output(res))]

    async for chunk in turn_stream(task, b": ping\n\n", ping_s, failed, completed):
        yield chunk


async def _failed_stream(req: ChatRequest, e: APIError) -> AsyncIterator[bytes]:
    """A streamed request refused before generation: ``response.created``, ``response.failed``."""
    rid, created = new_id("resp_"), time.time()
    pending = responses_object(req, rid, created, status="in_progress", output=[], res=None)
    yield sse({"type": "response.created", "response": pending, "sequence_number": 0})
    failed = responses_failed(req, rid, created, e)
    yield sse({"type": "response.failed", "response": failed, "sequence_number": 1})


def _refused_stream(req: ChatRequest, e: APIError) -> AsyncIterator[bytes] | None:
    # OpenAI reports a context overflow in the stream: Codex reads the code only from a response.failed event
    return _failed_stream(req, e) if e.code == CONTEXT_LENGTH_EXCEEDED else None


@router.post("/v1/responses")
async def responses(request: Request) -> Any:
    """OpenAI Responses: one model turn of the request's session."""
    return await serve(
        request,
        parse=_parse,
        respond=_respond,
        stream=_stream,
        error_body=openai_error,
        refused_stream=_refused_stream,
    )

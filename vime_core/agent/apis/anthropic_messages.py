"""The Anthropic Messages API (``POST /v1/messages`` and ``/v1/messages/count_tokens``, as Claude Code uses it):
its codec and its routes.

Requests: ``system`` (string or text blocks), ``messages`` with text / ``tool_use`` / ``tool_result`` blocks
(``thinking`` and ``redacted_thinking`` blocks are dropped: the model's own text already carries what it thought),
``tools`` (``input_schema``; server tools without a schema are ignored), ``tool_choice`` ``auto|any|tool|none``,
``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop_sequences``, ``stream``. Errors are Anthropic error
bodies; a streamed turn sends ``message_start`` at once and ``ping`` events while the engine works.

Sources: the Anthropic Messages API reference (messages, streaming events) and the ``anthropic`` Python SDK's stream
accumulator, which the tests drive.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vime_core.agent.apis.common import (
    APIError,
    ChatRequest,
    ChatResult,
    body_of,
    error_response,
    gateway_of,
    int_or_none,
    key_of,
    merge_assistant,
    new_id,
    pair_tool_results,
    request_tools,
    serve,
    sse,
    turn_stream,
)
from vime_core.agent.chat import ChatMessage, text_of
from vime_core.agent.session import Session
from vime_core.agent.tool_parsers import ToolCall


def anthropic_error(e: APIError) -> dict[str, Any]:
    """The Anthropic error body."""
    return {"type": "error", "error": {"type": e.kind, "message": e.message}}


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
                        ToolCall(b.get("name", ""), dict(b.get("input") or {}), b.get("id") or new_id("toolu_"))
                    )
            merge_assistant(msgs, "\n".join(texts), calls)
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
        tools=request_tools(body.get("tools")),
        tool_choice=choice,
        max_tokens=int_or_none(body.get("max_tokens")),
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        top_k=int_or_none(body.get("top_k")),
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


# -- routes ------------------------------------------------------------------------------------------------------
router = APIRouter()


async def _stream(
    req: ChatRequest, plan: Any, task: asyncio.Task, session: Session, ping_s: float
) -> AsyncIterator[bytes]:
    msg_id = new_id("msg_")
    yield sse(anthropic_start_event(req, msg_id, len(plan.prompt_ids)))
    body = turn_stream(
        task,
        sse({"type": "ping"}),
        ping_s,
        lambda e: sse(anthropic_error(e)),
        lambda res: [sse(ev) for ev in anthropic_events(res)],
    )
    async for chunk in body:
        yield chunk


@router.post("/v1/messages")
async def messages(request: Request) -> Any:
    """Anthropic Messages: one model turn of the request's session."""
    return await serve(
        request,
        parse=lambda b, s: parse_anthropic(b),
        respond=lambda req, res, s: anthropic_message(req, res, new_id("msg_")),
        stream=_stream,
        error_body=anthropic_error,
    )


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Any:
    """The prompt's token count as the policy's chat template renders it (no engine call, not recorded)."""
    gateway = gateway_of(request)
    try:
        gateway.lookup_session(key_of(request))
        body = await body_of(request)
        req = parse_anthropic({"max_tokens": 1, **body})
        text = gateway.renderer.render(req.messages, req.tools or None)
    except APIError as e:
        return error_response(e, anthropic_error)
    return JSONResponse({"input_tokens": len(gateway.renderer.encode(text))})

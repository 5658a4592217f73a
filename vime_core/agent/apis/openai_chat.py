"""The OpenAI Chat Completions API (``POST /v1/chat/completions``): its codec and its route.

Requests: ``system``/``developer``/``user``/``assistant`` (``tool_calls``)/``tool`` messages, ``tools``
(``function``), ``tool_choice``, ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``,
``n`` = 1, ``stream`` (+ ``stream_options``). Errors are OpenAI error bodies; a streamed turn sends ``: ping``
comments while the engine works, then the chunks and ``data: [DONE]``.

Sources: OpenAI's Chat Completions API reference and the ``openai`` Python SDK's stream accumulator, which the tests
drive.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from vime_core.agent.apis.common import (
    APIError,
    ChatRequest,
    ChatResult,
    data,
    int_or_none,
    merge_assistant,
    new_id,
    openai_error,
    openai_tool_choice,
    pair_tool_results,
    request_tools,
    serve,
    turn_stream,
)
from vime_core.agent.chat import ChatMessage, text_of
from vime_core.agent.session import Session
from vime_core.agent.tool_parsers import ToolCall


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
                c.get("id") or new_id("call_"),
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
            merge_assistant(msgs, text_of(m.get("content")), _calls_from_openai(m.get("tool_calls")))
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
        tools=request_tools(body.get("tools")),
        tool_choice=openai_tool_choice(body.get("tool_choice")),
        max_tokens=int_or_none(body.get("max_completion_tokens", body.get("max_tokens"))),
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        top_k=int_or_none(body.get("top_k")),
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


# -- route -------------------------------------------------------------------------------------------------------
router = APIRouter()


async def _stream(
    req: ChatRequest, plan: Any, task: asyncio.Task, session: Session, ping_s: float
) -> AsyncIterator[bytes]:
    cid = new_id("chatcmpl-")

    def chunks(res: ChatResult) -> list[bytes]:
        return [*(data(c) for c in chat_chunks(req, res, cid)), b"data: [DONE]\n\n"]

    async for chunk in turn_stream(task, b": ping\n\n", ping_s, lambda e: data(openai_error(e)), chunks):
        yield chunk


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    """OpenAI Chat Completions: one model turn of the request's session."""
    return await serve(
        request,
        parse=lambda b, s: parse_chat(b),
        respond=lambda req, res, s: chat_completion(req, res, new_id("chatcmpl-")),
        stream=_stream,
        error_body=openai_error,
    )

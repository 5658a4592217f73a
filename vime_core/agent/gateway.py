"""The agent gateway: Anthropic- and OpenAI-compatible HTTP endpoints in front of the policy, recording every turn.

An unmodified agent (Claude Code: ``ANTHROPIC_BASE_URL=<url>``, ``ANTHROPIC_AUTH_TOKEN=<session id>``; Codex or any
OpenAI client: ``base_url=<url>/v1``, ``api_key=<session id>``) talks to the gateway as it would to the vendor's API.
For each request the gateway renders the conversation with the policy's chat template (tools included), builds the
prompt ids incrementally (:meth:`~vime_core.agent.trajectory.Trajectory.plan`: held ids reused, only new text
tokenised), calls the backend with token ids (the router: :class:`~vime_core.agent.backends.RouterBackend`; or a
:class:`~vime_core.agent.backends.ScriptedBackend`), parses tool calls, answers in the API's format (streamed or not)
and records a :class:`~vime_core.agent.trajectory.TurnRecord` in the session's trajectory.

Endpoints (``127.0.0.1`` by default): ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic),
``POST /v1/chat/completions``, ``POST /v1/responses``, ``GET /v1/models``, ``GET /health``.

Sessions are keyed by the API key (``x-api-key``) or bearer token (``Authorization: Bearer``): call
:meth:`AgentGateway.open_session` before an episode and :meth:`AgentGateway.close_session` after it to get the
episode's Samples; requests with an unknown key get a 401 (unless ``auto_open_sessions``). Sessions never share
state, and requests of one session may run concurrently (each is placed by the trajectory rules on arrival of its
result).

Behaviour worth knowing:

* **Sampling**: the session's ``sampling_params`` (e.g. the rollout temperature) override the request's;
  ``max_tokens`` is the smaller of both, and is clipped to the context left (``max_context_len``).
* **Forced tool calls**: ``tool_choice`` = required / a named tool is enforced with a grammar
  (:meth:`~vime_core.agent.tool_parsers.ToolParser.call_grammar`, vLLM ``structured_outputs``) when ``xgrammar``
  is installed. vLLM reports the log-probs of such a turn under the grammar mask (not the unconstrained policy's),
  so the turn is flagged ``metadata["constrained"]`` in its :class:`TurnRecord`; its tokens are still exact.
* **Aborted generations** (engines paused with ``mode=abort`` for a weight update) are answered with a retryable
  error (Anthropic 529 ``overloaded_error``, OpenAI 503) and are not recorded; agents retry.
* **Turns cut by the token budget** come back as text with stop reason ``max_tokens`` / ``length`` and no tool calls
  (a call cut in the middle is never executed); they are recorded truncated (not trained).
* **Tool results** must answer, by id, a call of the assistant message right before them (400 otherwise) and are
  rendered in the order of the calls (:func:`~vime_core.agent.apis.pair_tool_results`).
* **Context overflow**: a prompt that leaves no room to generate within ``max_context_len``, or that the engine
  refuses as longer than its ``max_model_len``, gets the error each client acts on
  (:func:`~vime_core.agent.apis.context_overflow_error`: Anthropic "prompt is too long: N tokens > M maximum", OpenAI
  ``context_length_exceeded``, in a ``response.failed`` event for a streamed Responses request); it does not count
  against ``max_turns``, and the samples record ``context_exhausted`` / ``context_overflows``.
* **Streaming** sends ``message_start`` / ``response.created`` at once and pings while the engine works, then the
  whole turn (the engine call itself is not streamed).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from vime_core.agent.apis import (
    CONTEXT_LENGTH_EXCEEDED,
    APIError,
    ChatRequest,
    ChatResult,
    anthropic_error,
    anthropic_events,
    anthropic_message,
    anthropic_start_event,
    chat_chunks,
    chat_completion,
    context_overflow_error,
    openai_error,
    parse_anthropic,
    parse_chat,
    parse_responses,
    responses_events,
    responses_object,
    responses_output,
)
from vime_core.agent.backends import GatewayBackend, engine_versions
from vime_core.agent.chat import ChatMessage, ChatRenderer, ModelTurn
from vime_core.agent.tool_parsers import ToolCall, ToolParser
from vime_core.agent.trajectory import DEFAULT_MAX_REALIGN_TOKENS, Placement, Trajectory, TurnRecord
from vime_core.types import Sample

logger = logging.getLogger("vime.agent")

#: Responses API: how many responses per session ``previous_response_id`` can refer to (the most recent ones).
MAX_STORED_RESPONSES = 32
#: vLLM's refusal of a prompt longer than the engine's context (``max_model_len``); group 1 is that length
_ENGINE_CONTEXT_LIMIT = re.compile(r"maximum (?:context|model) length (?:is |of )?(\d+)")
#: error message of a request beyond the session's ``max_turns`` (harnesses look for it to report ``max_turns``)
TURN_BUDGET_MESSAGE = "vime agent gateway: the episode's turn budget is spent"


def _signature(content: str, calls: list[ToolCall]) -> str:
    """What identifies an assistant message when a client re-sends it: its text (surrounding whitespace ignored) and
    its calls' names and arguments (ids differ between APIs)."""
    return json.dumps([content.strip(), [[c.name, c.arguments] for c in calls]], sort_keys=True, ensure_ascii=False)


@dataclass
class Session:
    """One agent episode's state (internal; use the gateway's methods).

    :ivar sid: the API key / bearer token.
    :ivar trajectory: the turns placed so far.
    :ivar turns: every recorded turn, in arrival order.
    :ivar sampling_params: engine parameters that override the request's.
    :ivar max_context_len: prompt + output token limit (``None``: the gateway's).
    :ivar max_turns: model calls allowed (``None``: no limit); later requests get a 400 with
        :data:`TURN_BUDGET_MESSAGE` and are not recorded.
    """

    sid: str
    trajectory: Trajectory
    sampling_params: dict[str, Any] = field(default_factory=dict)
    max_context_len: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    turns: list[TurnRecord] = field(default_factory=list)
    placements: list[Placement] = field(default_factory=list)
    responses: dict[str, list[ChatMessage]] = field(default_factory=dict)
    generated: dict[str, ModelTurn] = field(default_factory=dict)  # history="model": signature → the model's output
    lock: threading.Lock = field(default_factory=threading.Lock)
    idle: threading.Condition = field(init=False)
    inflight: int = 0
    closed: bool = False
    errors: int = 0
    max_turns: int | None = None
    started_turns: int = 0
    refused_turns: int = 0
    context_overflows: int = 0

    def __post_init__(self) -> None:
        self.idle = threading.Condition(self.lock)


class AgentGateway:
    """Anthropic/OpenAI-compatible recording proxy (see the module docstring).

    :param tokenizer: the policy's Hugging Face tokenizer.
    :param backend: a :class:`~vime_core.agent.backends.GatewayBackend` (router or scripted).
    :param host: bind address (127.0.0.1 by default; the gateway has no authentication beyond session keys).
    :param port: TCP port (0: a free one, see :attr:`url` after :meth:`start`).
    :param chat_template: template source overriding the tokenizer's.
    :param tool_parser: tool-call format of the model (name, ``pkg.mod:Class`` or instance).
    :param served_model_name: the name ``/v1/models`` lists (any model name is accepted in requests).
    :param max_realign_tokens: the trajectory's realign bound (see :mod:`vime_core.agent.trajectory`).
    :param default_max_tokens: output budget when a request gives none (OpenAI APIs), in tokens.
    :param max_context_len: prompt + output limit in tokens (``None``: none from the gateway).
    :param auto_open_sessions: open a session on the first request of an unknown key instead of answering 401.
    :param weight_version: version recorded for tokens whose engine reported none (updated by the caller).
    :param constrain_tool_choice: enforce ``tool_choice`` required/named with a grammar.
    :param template_kwargs: extra chat-template variables.
    :param ping_interval_s: seconds between keep-alive events while a streamed turn is generated.
    :param history: ``"client"`` renders the conversation as the client sent it (drift → realign or fork);
        ``"model"`` renders every assistant message this session generated (matched by text and tool calls) as the
        model's own output tokens, so re-sent history never drifts — even when the client or the template drops an
        earlier thinking section or reformats a tool call — at the price of the model seeing its turns as it wrote
        them rather than as the template would re-render them.
    :raises ValueError: for an unknown ``history``.
    """

    def __init__(
        self,
        tokenizer: Any,
        backend: GatewayBackend,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        chat_template: str | None = None,
        tool_parser: str | ToolParser = "hermes",
        served_model_name: str = "vime-policy",
        max_realign_tokens: int = DEFAULT_MAX_REALIGN_TOKENS,
        default_max_tokens: int = 1024,
        max_context_len: int | None = None,
        auto_open_sessions: bool = False,
        weight_version: int = 0,
        constrain_tool_choice: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        ping_interval_s: float = 5.0,
        history: str = "client",
    ) -> None:
        if history not in ("client", "model"):
            raise ValueError(f"history must be 'client' or 'model', not {history!r}")
        self.history = history
        self.renderer = ChatRenderer(
            tokenizer, chat_template=chat_template, tool_parser=tool_parser, template_kwargs=template_kwargs
        )
        self.backend = backend
        self.host, self.port = host, port
        self.served_model_name = served_model_name
        self.max_realign_tokens = max_realign_tokens
        self.default_max_tokens = default_max_tokens
        self.max_context_len = max_context_len
        self.auto_open_sessions = auto_open_sessions
        self.weight_version = weight_version
        self.constrain_tool_choice = constrain_tool_choice
        self.ping_interval_s = ping_interval_s
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.app = self._build_app()

    # -- sessions --------------------------------------------------------------------------------------------
    def open_session(
        self,
        sid: str,
        *,
        sampling_params: dict[str, Any] | None = None,
        max_context_len: int | None = None,
        metadata: dict[str, Any] | None = None,
        max_turns: int | None = None,
    ) -> None:
        """Start an episode for API key ``sid``.

        :param sampling_params: engine parameters forced on every request of the session (``temperature``,
            ``top_p``, ``top_k``, ``seed``, …; ``max_tokens`` is an upper bound).
        :param max_context_len: prompt + output limit for this session (tokens).
        :param max_turns: model calls the session may make (``AgentBudget.max_turns``; enforced here for agents
            without a turn limit of their own, e.g. Codex): later requests get a 400 carrying
            :data:`TURN_BUDGET_MESSAGE` and are not recorded (``metadata["refused_turns"]`` of the samples).
        :raises ValueError: if ``sid`` is empty or already open.
        """
        if not sid:
            raise ValueError("session id must be a non-empty string")
        with self._lock:
            if sid in self._sessions:
                raise ValueError(f"session {sid!r} is already open")
            self._sessions[sid] = Session(
                sid,
                Trajectory(max_realign_tokens=self.max_realign_tokens),
                dict(sampling_params or {}),
                max_context_len,
                dict(metadata or {}),
                max_turns=max_turns,
            )

    def close_session(
        self,
        sid: str,
        base_sample: Sample,
        reward: float | dict[str, float] | None = None,
        *,
        extra_metadata: dict[str, Any] | None = None,
        timeout_s: float = 60.0,
    ) -> list[Sample]:
        """End the episode of ``sid`` and return its Samples (one per trajectory segment, sharing a
        ``episode_id``; see :meth:`vime_core.agent.trajectory.Trajectory.to_samples`).

        Waits up to ``timeout_s`` seconds for the session's in-flight requests; later ones get a 401.

        :raises KeyError: if ``sid`` is not open.
        :raises TimeoutError: if requests are still in flight after ``timeout_s`` (the session stays open).
        """
        with self._lock:
            session = self._sessions.get(sid)
        if session is None:
            raise KeyError(f"no open session {sid!r}")
        with session.idle:
            if not session.idle.wait_for(lambda: session.inflight == 0, timeout=timeout_s):
                raise TimeoutError(f"session {sid!r}: {session.inflight} requests still in flight")
            session.closed = True
            meta = {
                "session_id": sid,
                "session_turns": len(session.turns),
                "gateway_errors": session.errors,
                "refused_turns": session.refused_turns,
                "context_exhausted": session.context_overflows > 0,
                "context_overflows": session.context_overflows,
                **session.metadata,
                **(extra_metadata or {}),
            }
            samples = session.trajectory.to_samples(base_sample, reward, extra_metadata=meta)
        with self._lock:
            self._sessions.pop(sid, None)
        return samples

    def drop_session(self, sid: str) -> None:
        """Forget ``sid`` without building samples (no-op if unknown)."""
        with self._lock:
            session = self._sessions.pop(sid, None)
        if session is not None:
            with session.lock:
                session.closed = True

    def session_turns(self, sid: str) -> list[TurnRecord]:
        """A copy of the turns recorded so far for ``sid``.

        :raises KeyError: if ``sid`` is not open.
        """
        with self._lock:
            session = self._sessions[sid]
        with session.lock:
            return list(session.turns)

    def _session(self, sid: str | None) -> Session:
        if not sid:
            raise APIError(401, "authentication_error", "missing API key (x-api-key or Authorization: Bearer)")
        with self._lock:
            s = self._sessions.get(sid)
            if s is None and self.auto_open_sessions:
                s = self._sessions[sid] = Session(sid, Trajectory(max_realign_tokens=self.max_realign_tokens))
        if s is None or s.closed:
            raise APIError(401, "authentication_error", "unknown or closed session (open_session first)")
        return s

    # -- one turn --------------------------------------------------------------------------------------------
    def _sampling_params(self, session: Session, req: ChatRequest, prompt_len: int) -> dict[str, Any]:
        p: dict[str, Any] = {
            k: v
            for k, v in (("temperature", req.temperature), ("top_p", req.top_p), ("top_k", req.top_k))
            if v is not None
        }
        forced = dict(session.sampling_params)
        cap = forced.pop("max_tokens", None)
        p.update(forced)
        max_tokens = req.max_tokens if req.max_tokens is not None else self.default_max_tokens
        if cap is not None:
            max_tokens = min(max_tokens, int(cap))
        ctx = session.max_context_len or self.max_context_len
        if ctx:
            room = ctx - prompt_len
            if room <= 0:
                raise self._context_overflow(session, req, prompt_len, ctx)
            max_tokens = min(max_tokens, room)
        if max_tokens < 1:
            raise APIError(400, "invalid_request_error", "max_tokens must be at least 1")
        p["max_tokens"] = max_tokens
        if req.stop:
            p["stop"] = list(req.stop)
        if self.constrain_tool_choice and req.tools and req.tool_choice not in ("auto", "none"):
            tools = (
                req.tools if req.tool_choice == "required" else [t for t in req.tools if t["name"] == req.tool_choice]
            )
            if not tools:
                raise APIError(400, "invalid_request_error", f"tool_choice names an unknown tool {req.tool_choice!r}")
            grammar = self.renderer.parser.call_grammar(tools)
            if grammar is not None:
                p["structured_outputs"] = {"grammar": grammar}
        return p

    def _context_overflow(self, session: Session, req: ChatRequest, prompt_len: int, ctx: int) -> APIError:
        """Record that the episode's context ran out; the error the client recognises (the request is not counted
        against ``max_turns``: the agent compacts its conversation and retries)."""
        with session.lock:
            session.context_overflows += 1
            session.started_turns -= 1
        logger.info("session %s: prompt of %d tokens fills the context window of %d", session.sid, prompt_len, ctx)
        return context_overflow_error(req.api, prompt_len, ctx)

    def _render(self, session: Session, req: ChatRequest) -> str:
        """The prompt text; with ``history="model"``, assistant messages this session generated are rendered as the
        model's own output (spliced in place of a sentinel the template rendered as the message)."""
        tools = req.tools or None
        if self.history != "model":
            return self.renderer.render(req.messages, tools)
        with session.lock:
            generated = dict(session.generated)
        turns: dict[int, ModelTurn] = {}
        for i, m in enumerate(req.messages):
            turn = generated.get(_signature(m.content, m.tool_calls)) if m.role == "assistant" else None
            if turn is not None:
                turns[i] = turn
        if not turns:
            return self.renderer.render(req.messages, tools)
        spliced = self.renderer.render_with_turns(req.messages, tools, turns)
        if spliced is None:  # the template did not render the content verbatim
            return self.renderer.render(req.messages, tools)
        return spliced.text

    def _remember_output(self, session: Session, content: str, calls: list[ToolCall], ids: list[int]) -> None:
        """history="model": remember the raw output behind the message the client will re-send (session locked)."""
        session.generated[_signature(content, calls)] = self.renderer.model_turn(ids)

    def _prepare(self, session: Session, req: ChatRequest) -> tuple[Any, dict[str, Any]]:
        """Render, plan the prompt ids, choose sampling parameters (no engine call)."""
        try:
            text = self._render(session, req)
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise APIError(400, "invalid_request_error", f"chat template failed: {type(e).__name__}: {e}") from e
        with session.lock:
            plan = session.trajectory.plan(text, self.renderer.encode, self.renderer.decode)
        return plan, self._sampling_params(session, req, len(plan.prompt_ids))

    async def _generate(self, session: Session, req: ChatRequest, plan: Any, params: dict[str, Any]) -> ChatResult:
        """:meth:`_turn`, with any unexpected failure turned into an API error (500) that the client can read."""
        try:
            return await self._turn(session, req, plan, params)
        except APIError:
            raise
        except Exception as e:
            logger.exception("session %s: turn failed", session.sid)
            raise APIError(500, "api_error", f"gateway error: {type(e).__name__}: {e}") from e

    async def _turn(self, session: Session, req: ChatRequest, plan: Any, params: dict[str, Any]) -> ChatResult:
        """Call the engine, parse, record the turn; the result for the API layer."""
        try:
            out = await self.backend.generate(plan.prompt_ids, params, session_id=session.sid)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - engine/router failure: a server error the agent may retry
            m = re.search(r" returned (4\d\d)", str(e))  # RouterClientError of a 4xx: the request's fault
            limit = _ENGINE_CONTEXT_LIMIT.search(str(e)) if m else None
            if limit:  # vLLM refused a prompt longer than its max_model_len
                raise self._context_overflow(session, req, len(plan.prompt_ids), int(limit.group(1))) from e
            with session.lock:
                session.errors += 1
                session.started_turns -= 1  # not recorded: the retry does not count against max_turns
            logger.warning("session %s: engine call failed: %s: %s", session.sid, type(e).__name__, e)
            if m:
                raise APIError(400, "invalid_request_error", f"the engine rejected the request: {e}") from e
            raise APIError(
                529 if req.api == "anthropic" else 503,
                "overloaded_error",
                f"engine call failed: {type(e).__name__}: {e}",
            ) from e
        if out.finish_reason == "abort":
            with session.lock:
                session.errors += 1
                session.started_turns -= 1  # not recorded: the retry does not count against max_turns
            raise APIError(
                529 if req.api == "anthropic" else 503,
                "overloaded_error",
                "generation aborted (weights are being updated); retry",
            )
        ids = list(out.token_ids)
        visible = self.renderer.visible_text(ids)
        stop_sequence = None
        ended_by_eos = bool(ids) and ids[-1] == self.renderer.eos_token_id
        if out.finish_reason == "stop" and not ended_by_eos:
            for s in req.stop:
                if s and visible.endswith(s):
                    visible, stop_sequence = visible[: -len(s)], s
                    break
        calls: list[ToolCall] = []
        ill_formed = False
        content = visible
        if req.tools and req.tool_choice != "none" and out.finish_reason != "length":
            # a turn cut by the token budget is never executed: its text (a call cut in the middle included) goes
            # back as text with stop reason max_tokens, and the turn is recorded truncated (not trained)
            parsed = self.renderer.parser.parse(visible)
            content, calls, ill_formed = parsed.content, parsed.tool_calls, parsed.ill_formed
            prefix = "toolu_" if req.api == "anthropic" else "call_"
            for c in calls:
                c.id = prefix + uuid.uuid4().hex[:24]
        if out.finish_reason == "length":
            stop = "max_tokens"
        elif calls:
            stop = "tool_use"
        elif stop_sequence is not None:
            stop = "stop_sequence"
        else:
            stop = "end_turn"
        turn = TurnRecord(
            prompt_ids=plan.prompt_ids,
            output_ids=ids,
            output_log_probs=list(out.log_probs),
            weight_versions=engine_versions(out, self.weight_version),
            finish_reason=out.finish_reason,
            ill_formed=ill_formed,
            prompt_text=plan.prompt_text,
            output_text=self.renderer.decode(ids),
            metadata={
                "api": req.api,
                "tools": [t["name"] for t in req.tools],  # the tool names the request declared, in its order
                "tool_calls": len(calls),
                "stop": stop,
                "constrained": "structured_outputs" in params,
            },
        )
        with session.lock:
            if session.closed:
                logger.warning("session %s closed while a request was in flight; turn not recorded", session.sid)
            else:
                session.turns.append(turn)
                session.placements.append(session.trajectory.record(turn, plan))
                if self.history == "model":
                    self._remember_output(session, content, calls, ids)
        return ChatResult(content, calls, stop, stop_sequence, len(plan.prompt_ids), len(ids))

    async def run_turn(self, sid: str, req: ChatRequest) -> ChatResult:
        """Serve one canonical request for session ``sid`` (what every endpoint does, without the HTTP layer).

        :raises APIError: unknown session (401), bad request (400), engine failure or abort (529/503).
        """
        session = self._session(sid)
        self._enter(session)
        try:
            plan, params = self._prepare(session, req)
            return await self._generate(session, req, plan, params)
        finally:
            self._leave(session)

    def _enter(self, session: Session) -> None:
        with session.lock:
            if session.max_turns is not None and session.started_turns >= session.max_turns:
                session.refused_turns += 1
                raise APIError(400, "invalid_request_error", f"{TURN_BUDGET_MESSAGE} ({session.max_turns} turns)")
            session.started_turns += 1
            session.inflight += 1

    def _leave(self, session: Session) -> None:
        with session.idle:
            session.inflight -= 1
            session.idle.notify_all()

    # -- HTTP ------------------------------------------------------------------------------------------------
    def _build_app(self) -> Any:
        @asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[None]:
            yield
            close = getattr(self.backend, "aclose", None)
            if close is not None:
                await close()

        app = FastAPI(title="vime agent gateway", lifespan=lifespan)

        def key_of(request: Request) -> str | None:
            key = request.headers.get("x-api-key")
            if key:
                return key
            auth = request.headers.get("authorization", "")
            return auth[7:].strip() if auth.lower().startswith("bearer ") else None

        def error(e: APIError, api: str) -> JSONResponse:
            return JSONResponse(anthropic_error(e) if api == "anthropic" else openai_error(e), status_code=e.status)

        async def body_of(request: Request, api: str) -> dict[str, Any]:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(400, "invalid_request_error", f"body is not JSON: {e}") from e
            if not isinstance(body, dict):
                raise APIError(400, "invalid_request_error", "body must be a JSON object")
            return body

        def sse(event: dict[str, Any]) -> bytes:
            return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()

        def data(obj: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()

        async def serve(
            request: Request,
            api: str,
            parse: Callable[[dict[str, Any], Session], ChatRequest],
            respond: Callable[[ChatRequest, ChatResult, Any], dict[str, Any]],
            stream: Callable[[ChatRequest, Any, asyncio.Task, Session], AsyncIterator[bytes]],
        ) -> Any:
            try:
                session = self._session(key_of(request))
                req = parse(await body_of(request, api), session)
                self._enter(session)
            except APIError as e:
                return error(e, api)
            try:
                plan, params = self._prepare(session, req)
            except APIError as e:
                self._leave(session)
                if req.stream and api == "responses" and e.code == CONTEXT_LENGTH_EXCEEDED:
                    # OpenAI reports it in the stream: Codex reads the code only from a response.failed event
                    return StreamingResponse(
                        responses_failed_stream(req, e),
                        media_type="text/event-stream",
                        headers={"cache-control": "no-cache"},
                    )
                return error(e, api)
            task = asyncio.ensure_future(self._generate(session, req, plan, params))
            task.add_done_callback(lambda _t: self._leave(session))
            if req.stream:
                return StreamingResponse(
                    stream(req, plan, task, session),
                    media_type="text/event-stream",
                    headers={"cache-control": "no-cache"},
                )
            try:
                res = await asyncio.shield(task)  # a client that hangs up does not cancel the turn (it is recorded)
            except APIError as e:
                return error(e, api)
            return JSONResponse(respond(req, res, session))

        async def wait_with_pings(task: asyncio.Task, ping: bytes | None) -> AsyncIterator[bytes]:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=self.ping_interval_s)
                if not done and ping is not None:
                    yield ping

        # Anthropic ------------------------------------------------------------------------------------------
        async def anthropic_stream(
            req: ChatRequest, plan: Any, task: asyncio.Task, session: Session
        ) -> AsyncIterator[bytes]:
            msg_id = "msg_" + uuid.uuid4().hex[:24]
            yield sse(anthropic_start_event(req, msg_id, len(plan.prompt_ids)))
            async for ping in wait_with_pings(task, sse({"type": "ping"})):
                yield ping
            try:
                res = task.result()
            except APIError as e:
                yield sse(anthropic_error(e))
                return
            for ev in anthropic_events(res):
                yield sse(ev)

        @app.post("/v1/messages")
        async def messages(request: Request) -> Any:
            return await serve(
                request,
                "anthropic",
                lambda b, s: parse_anthropic(b),
                lambda req, res, s: anthropic_message(req, res, "msg_" + uuid.uuid4().hex[:24]),
                anthropic_stream,
            )

        @app.post("/v1/messages/count_tokens")
        async def count_tokens(request: Request) -> Any:
            try:
                self._session(key_of(request))
                body = await body_of(request, "anthropic")
                req = parse_anthropic({"max_tokens": 1, **body})
                text = self.renderer.render(req.messages, req.tools or None)
            except APIError as e:
                return error(e, "anthropic")
            return JSONResponse({"input_tokens": len(self.renderer.encode(text))})

        # OpenAI Chat Completions ----------------------------------------------------------------------------
        async def chat_stream(
            req: ChatRequest, plan: Any, task: asyncio.Task, session: Session
        ) -> AsyncIterator[bytes]:
            cid = "chatcmpl-" + uuid.uuid4().hex[:24]
            async for ping in wait_with_pings(task, b": ping\n\n"):
                yield ping
            try:
                res = task.result()
            except APIError as e:
                yield data(openai_error(e))
                return
            for chunk in chat_chunks(req, res, cid):
                yield data(chunk)
            yield b"data: [DONE]\n\n"

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Any:
            return await serve(
                request,
                "chat",
                lambda b, s: parse_chat(b),
                lambda req, res, s: chat_completion(req, res, "chatcmpl-" + uuid.uuid4().hex[:24]),
                chat_stream,
            )

        # OpenAI Responses -----------------------------------------------------------------------------------
        def parse_resp(body: dict[str, Any], session: Session) -> ChatRequest:
            prev = body.get("previous_response_id")
            history = None
            if prev:
                with session.lock:
                    history = session.responses.get(prev)
                if history is None:
                    raise APIError(400, "invalid_request_error", f"previous_response_id {prev!r} not found")
            return parse_responses(body, history)

        def remember(session: Session, rid: str, req: ChatRequest, res: ChatResult) -> None:
            convo = copy.deepcopy(req.messages)
            convo.append(ChatMessage("assistant", res.content, list(res.tool_calls)))
            with session.lock:
                session.responses[rid] = convo
                while len(session.responses) > MAX_STORED_RESPONSES:  # oldest first (dicts keep insertion order)
                    session.responses.pop(next(iter(session.responses)))

        def respond_resp(req: ChatRequest, res: ChatResult, session: Session) -> dict[str, Any]:
            rid = "resp_" + uuid.uuid4().hex[:24]
            remember(session, rid, req, res)
            return responses_object(req, rid, time.time(), status="completed", output=responses_output(res), res=res)

        async def responses_stream(
            req: ChatRequest, plan: Any, task: asyncio.Task, session: Session
        ) -> AsyncIterator[bytes]:
            rid, created = "resp_" + uuid.uuid4().hex[:24], time.time()
            seq = 0

            def ev(e: dict[str, Any]) -> bytes:
                nonlocal seq
                e["sequence_number"] = seq
                seq += 1
                return sse(e)

            pending = responses_object(req, rid, created, status="in_progress", output=[], res=None)
            yield ev({"type": "response.created", "response": pending})
            yield ev({"type": "response.in_progress", "response": pending})
            async for ping in wait_with_pings(task, b": ping\n\n"):
                yield ping
            try:
                res = task.result()
            except APIError as e:
                yield ev({"type": "response.failed", "response": responses_failed(req, rid, created, e)})
                return
            remember(session, rid, req, res)
            for e in responses_events(req, rid, created, res, responses_output(res)):
                yield ev(e)

        def responses_failed(req: ChatRequest, rid: str, created: float, e: APIError) -> dict[str, Any]:
            failed = responses_object(req, rid, created, status="failed", output=[], res=None)
            failed["error"] = {"code": e.code or "server_error", "message": e.message}
            return failed

        async def responses_failed_stream(req: ChatRequest, e: APIError) -> AsyncIterator[bytes]:
            """A streamed Responses request refused before generation: ``response.created``, ``response.failed``."""
            rid, created = "resp_" + uuid.uuid4().hex[:24], time.time()
            pending = responses_object(req, rid, created, status="in_progress", output=[], res=None)
            yield sse({"type": "response.created", "response": pending, "sequence_number": 0})
            failed = responses_failed(req, rid, created, e)
            yield sse({"type": "response.failed", "response": failed, "sequence_number": 1})

        @app.post("/v1/responses")
        async def responses(request: Request) -> Any:
            return await serve(request, "responses", parse_resp, respond_resp, responses_stream)

        # misc -----------------------------------------------------------------------------------------------
        @app.get("/v1/models")
        async def models(request: Request) -> Any:
            if request.headers.get("anthropic-version"):
                return {
                    "data": [
                        {
                            "type": "model",
                            "id": self.served_model_name,
                            "display_name": self.served_model_name,
                            "created_at": "1970-01-01T00:00:00Z",
                        }
                    ],
                    "has_more": False,
                    "first_id": self.served_model_name,
                    "last_id": self.served_model_name,
                }
            return {
                "object": "list",
                "data": [{"id": self.served_model_name, "object": "model", "created": 0, "owned_by": "vime"}],
            }

        @app.get("/health")
        async def health() -> Any:
            return {"status": "ok", "sessions": len(self._sessions)}

        return app

    # -- server lifecycle ------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``http://host:port`` (the real port once started)."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> AgentGateway:
        """Serve in a background thread (uvicorn, its own event loop) until :meth:`stop`.

        :raises RuntimeError: if the server does not come up within ``timeout_s`` seconds.
        """
        import uvicorn

        if self._thread is not None:
            raise RuntimeError("gateway already started")
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            lifespan="on",
            access_log=False,
            timeout_keep_alive=30,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="vime-agent-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"agent gateway did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        self.port = int(self._server.servers[0].sockets[0].getsockname()[1])
        logger.info("agent gateway listening on %s", self.url)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop serving (in-flight requests get ``timeout_s`` seconds); no-op if not started."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        self._server, self._thread = None, None

    def __enter__(self) -> AgentGateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

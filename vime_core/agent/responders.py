"""Responders: what answers the gateway's engine calls — the policy behind vime's router, or a script.

A responder is anything with ``async generate(prompt_ids, sampling_params, session_id) ->``
:class:`~vime_core.engines.client.GenerateOutput` (optionally ``async aclose()``), the call of
:meth:`vime_core.engines.client.RouterClient.generate`: :class:`RouterResponder` (the policy, one client per event
loop) and :class:`ScriptedResponder` (fixed assistant turns, every call recorded, for deterministic tests).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from vime_core.engines.client import GenerateOutput, RouterClient


@runtime_checkable
class Responder(Protocol):
    """The engine call the gateway makes (see the module docstring)."""

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: dict[str, Any],
        session_id: str | None = None,
        images: list[str] | None = None,
    ) -> GenerateOutput:
        """Generate one continuation; the contract of :meth:`RouterClient.generate`."""
        ...


class RouterResponder:
    """The policy behind vllm-router (or one vLLM server).

    :param base_url: router URL, e.g. ``http://127.0.0.1:30000``.
    :param model: served model name.
    :param timeout_s: per-request timeout (seconds); keep it above the longest weight update (requests block while
        engines are paused).
    :param api: see :class:`RouterClient`.
    :param eos_token_ids: see :class:`RouterClient`.
    :param capabilities: see :class:`RouterClient`.
    :param tokenizer: see :class:`RouterClient`.
    :param weight_version: returns the version the engines serve (a release that tags no tokens gets it; see
        :attr:`RouterClient.weight_version`); default: always 0.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        timeout_s: float | None = 600.0,
        api: str = "auto",
        eos_token_ids: Iterable[int] = (),
        capabilities: Any = None,
        tokenizer: Any = None,
        weight_version: Callable[[], int] | None = None,
    ) -> None:
        self.base_url, self.model, self.timeout_s, self.api = base_url, model, timeout_s, api
        self.eos_token_ids = tuple(eos_token_ids)
        self.capabilities, self.tokenizer = capabilities, tokenizer
        self.weight_version = weight_version or (lambda: 0)
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, RouterClient] = weakref.WeakKeyDictionary()

    @classmethod
    def from_client(cls, client: RouterClient) -> RouterResponder:
        """A responder with the same router, model, API and engine release as ``client`` (which it does not use
        itself), following its :attr:`RouterClient.weight_version`."""
        return cls(
            client.base_url,
            client.model,
            api=client.api,
            eos_token_ids=client.eos_token_ids,
            capabilities=client.capabilities,
            tokenizer=client.tokenizer,
            weight_version=lambda: client.weight_version,
        )

    def _client(self) -> RouterClient:
        loop = asyncio.get_running_loop()
        c = self._clients.get(loop)
        if c is None:
            c = self._clients[loop] = RouterClient(
                self.base_url,
                self.model,
                self.timeout_s,
                api=self.api,  # type: ignore[arg-type]
                eos_token_ids=self.eos_token_ids,
                capabilities=self.capabilities,
                tokenizer=self.tokenizer,
            )
        c.weight_version = self.weight_version()
        return c

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: dict[str, Any],
        session_id: str | None = None,
        images: list[str] | None = None,
    ) -> GenerateOutput:
        """:meth:`RouterClient.generate` through this loop's client (``session_id`` → ``x-session-id``; ``images``
        with a vision-language prompt)."""
        if images:
            return await self._client().generate(
                prompt_token_ids, sampling_params, session_id=session_id, images=images
            )
        return await self._client().generate(prompt_token_ids, sampling_params, session_id=session_id)

    async def aclose(self) -> None:
        """Close the client of the running loop."""
        c = self._clients.pop(asyncio.get_running_loop(), None)
        if c is not None:
            await c.aclose()


@dataclass
class ScriptedTurn:
    """One scripted assistant turn.

    :ivar text: the assistant text (tokenised with the policy's tokenizer, no special tokens added); or
    :ivar token_ids: exact ids instead of ``text``.
    :ivar finish_reason: ``"stop"`` (the end-of-turn token is appended when ``end_of_turn``), ``"length"`` or
        ``"abort"`` (nothing appended).
    :ivar end_of_turn: append the tokenizer's EOS id on ``"stop"``.
    :ivar log_prob: the log-prob reported for every token (≤ 0).
    """

    text: str | None = None
    token_ids: list[int] | None = None
    finish_reason: str = "stop"
    end_of_turn: bool = True
    log_prob: float = -0.5


@dataclass
class EngineCall:
    """One call a :class:`ScriptedResponder` answered: what it was given and what it returned."""

    session_id: str | None
    prompt_ids: list[int]
    sampling_params: dict[str, Any]
    output: GenerateOutput
    images: list[str] = field(default_factory=list)  # a vision-language prompt's images, as sent


@dataclass
class ScriptedResponder:
    """Answers with a fixed sequence of turns, per session or shared.

    :param tokenizer: the policy tokenizer (to tokenise texts and find the end-of-turn id).
    :param script: a sequence of turns (``str`` = ``ScriptedTurn(text=...)``) used by every session in call order,
        or a mapping ``session_id → sequence`` (unknown sessions use the key ``"*"`` if present).
    :param weight_version: the version reported for every token.
    :raises RuntimeError: (from :meth:`generate`) when a session's script is exhausted.
    """

    tokenizer: Any
    script: Sequence[ScriptedTurn | str] | Mapping[str, Sequence[ScriptedTurn | str]]
    weight_version: int = 0
    calls: list[EngineCall] = field(default_factory=list)
    _pos: dict[str, int] = field(default_factory=dict)

    def _turns(self, session_id: str | None) -> tuple[str, Sequence[ScriptedTurn | str]]:
        if isinstance(self.script, Mapping):
            key = session_id if session_id in self.script else "*"
            if key not in self.script:
                raise RuntimeError(f"no script for session {session_id!r}")
            return key, self.script[key]
        return "", self.script

    def turn_ids(self, turn: ScriptedTurn | str) -> tuple[list[int], str]:
        """The ids (EOS appended on a stop) and finish reason a turn produces before ``max_tokens``."""
        t = ScriptedTurn(text=turn) if isinstance(turn, str) else turn
        ids = (
            list(t.token_ids)
            if t.token_ids is not None
            else list(self.tokenizer(t.text or "", add_special_tokens=False)["input_ids"])
        )
        if t.finish_reason == "stop" and t.end_of_turn and self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        return ids, t.finish_reason

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: dict[str, Any],
        session_id: str | None = None,
        images: list[str] | None = None,
    ) -> GenerateOutput:
        """The session's next scripted turn, cut to ``sampling_params["max_tokens"]`` (then ``"length"``)."""
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        key, turns = self._turns(session_id)
        i = self._pos.get(key, 0)
        if i >= len(turns):
            raise RuntimeError(
                f"scripted responder: the script of {key or 'all sessions'!r} has only {len(turns)} turns"
            )
        self._pos[key] = i + 1
        turn = turns[i]
        ids, finish = self.turn_ids(turn)
        max_tokens = sampling_params.get("max_tokens")
        if max_tokens is not None and len(ids) > int(max_tokens):
            ids, finish = ids[: int(max_tokens)], "length"
        lp = turn.log_prob if isinstance(turn, ScriptedTurn) else -0.5
        out = GenerateOutput(
            token_ids=ids,
            log_probs=[float(lp)] * len(ids),
            finish_reason=finish,
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            weight_versions=[str(self.weight_version)] * len(ids),
        )
        self.calls.append(
            EngineCall(session_id, list(prompt_token_ids), dict(sampling_params), out, list(images or []))
        )
        return out


def engine_versions(out: Any, fallback: int | None = None) -> list[int]:
    """Per-token weight versions of an engine output (``len(out.token_ids)`` ints): its labels, which the router
    client always sets — the engine's own, or the version the client knew the engines served
    (docs/vllm_releases.md). An output without them, with a wrong count or a label that is not an integer (an engine
    never given a version says ``"default"``) is an error, never a silent default.

    :param fallback: unused; kept for callers written against the old signature.
    :raises ValueError: naming what is wrong with the labels.
    """
    n = len(out.token_ids)
    versions = getattr(out, "weight_versions", None)
    if versions is None or len(versions) != n:
        got = "none" if versions is None else f"{len(versions)}"
        raise ValueError(f"the engine output has {n} tokens but {got} weight-version labels")
    try:
        return [int(v) for v in versions]
    except (TypeError, ValueError):
        raise ValueError(
            f"the engine output's weight-version labels are not integers: {sorted(set(versions))} (an engine never "
            "given a version says 'default': label it with VLLMServer.set_weight_version, as the rollout manager does)"
        ) from None

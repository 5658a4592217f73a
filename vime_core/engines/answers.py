"""Reading the engines' answers: the client's error type, an error status's message, and each answer field decoded
and checked (weight-version spans, routed experts, prompt log-probs, msgspec-decoded generate choices folded into the
client's accumulator). Every missing or malformed field is a :class:`RouterClientError` naming the route."""

from __future__ import annotations

import base64
import binascii
import io
import json
from typing import Any

import msgspec
import numpy as np

from vime_core.engines.engine_api import GenerateChoice
from vime_core.failures import EngineError


class RouterClientError(EngineError):
    """The router or server answered with an error status or a malformed body (a sample failed by it is
    ``engine_error``: :class:`vime_core.failures.EngineError`).

    :ivar status: the HTTP status of an error answer (``None``: a malformed body or a stream's error event).
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def is_client_error(error: BaseException) -> bool:
    """Whether ``error`` is an engine's or router's 4xx answer other than 408 and 429: the request itself is refused
    (a sampling parameter out of range, a prompt over the context), so sending it again cannot succeed."""
    status = error.status if isinstance(error, RouterClientError) else None
    return status is not None and 400 <= status < 500 and status not in (408, 429)


def _error_answer(path: str, status: int, text: str) -> RouterClientError:
    """The error of an answer with status ``status``: vLLM's own message (``{"error": {"message": ...}}``) when
    the body has one, else the body (4000 characters at most)."""
    try:
        body = json.loads(text)
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else body["message"]
    except (ValueError, KeyError, TypeError, AttributeError):
        message = text[:4000]
    return RouterClientError(f"POST {path} returned {status}: {message}", status)


def _expand_versions(spans: list[dict[str, Any]], n: int, where: str) -> list[str]:
    """Per-token labels from vLLM's ``[{"start", "end", "version"}]`` spans over ``n`` tokens.

    :raises RouterClientError: a token no span covers.
    """
    out: list[str | None] = [None] * n
    for s in spans:
        for i in range(max(0, int(s["start"])), min(n, int(s["end"]))):
            out[i] = str(s["version"])
    if None in out:
        raise RouterClientError(f"{where}: weight_versions {spans!r:.500} do not cover all {n} tokens")
    return out  # type: ignore[return-value]


def _field(obj: dict[str, Any], name: str, where: str) -> Any:
    """``obj[name]``; a missing field is an error naming where it was expected, never an empty default."""
    try:
        return obj[name]
    except (KeyError, TypeError):
        raise RouterClientError(f"{where}: the answer has no {name!r}: {obj!r:.1000}") from None


def decode_routed_experts(value: Any, where: str) -> np.ndarray:
    """An answer's ``routed_experts`` (vLLM: base64 of a ``.npy`` file, uint8/uint16/int32) as an int16
    ``[tokens, layers, top_k]`` array.

    :param where: the route, for the error.
    :raises RouterClientError: naming ``where``: not base64 ``.npy`` data, not 3-D integers, or an id outside int16.
    """
    try:
        arr = np.load(io.BytesIO(base64.b64decode(value, validate=True)), allow_pickle=False)
    except (TypeError, ValueError, OSError, EOFError, binascii.Error) as e:
        raise RouterClientError(f"{where}: routed_experts is not base64 .npy data ({e}): {value!r:.200}") from None
    if not isinstance(arr, np.ndarray) or arr.ndim != 3 or arr.dtype.kind not in "iu":
        got = f"{arr.dtype} {arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__
        raise RouterClientError(f"{where}: routed_experts is {got}, expected integers [tokens, layers, top_k]")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > np.iinfo(np.int16).max):
        raise RouterClientError(f"{where}: routed_experts holds ids {int(arr.min())}..{int(arr.max())}, not int16")
    return arr.astype(np.int16)


def _prompt_logprob(entry: dict[str, Any] | None, token_id: int, pos: int) -> float:
    if not entry or str(token_id) not in entry:
        raise RouterClientError(f"no prompt log-prob for token {token_id} at position {pos}: {entry!r}")
    return float(entry[str(token_id)]["logprob"])


def _decode(decoder: msgspec.json.Decoder, raw: bytes | str, where: str) -> Any:
    """``raw`` decoded into the answer's shape; a missing or mistyped field is a :class:`RouterClientError` naming
    the route and where in the answer it is (msgspec's path, e.g. ``$.choices[0].token_ids``)."""
    try:
        return decoder.decode(raw)
    except msgspec.DecodeError as e:
        text = raw if isinstance(raw, bytes) else raw.encode()
        raise RouterClientError(f"{where}: {e}: {text[:1000]!r}") from None


def _fold(acc: dict[str, Any], ch: GenerateChoice, where: str, text: bool, arrival_version: str) -> None:
    """Add one generate choice (a whole answer, or a stream chunk's) to ``acc``, the client's form of an answer
    (:meth:`RouterClient._new_choice`): ids, the sampled tokens' log-probs as floats, text, finish reason, the
    engine's weight-version spans (the final chunk's cover every token).

    :raises RouterClientError: tokens without ``logprobs``, or no ``text`` from a release that sends it.
    """
    ids = ch.token_ids or []  # a chunk may carry no new token (null or [])
    if ids:
        if ch.logprobs is None:
            raise RouterClientError(f"{where}: the answer has no 'logprobs' for its {len(ids)} tokens")
        acc["log_probs"].extend([e.logprob for e in ch.logprobs.content])
    acc["token_ids"].extend(ids)
    acc["arrival_versions"].extend([arrival_version] * len(ids))
    if text:
        if ch.text is msgspec.UNSET:
            raise RouterClientError(f"{where}: the answer has no 'text'")
        acc["text"] += ch.text
    if ch.finish_reason is not None:
        acc["finish_reason"] = ch.finish_reason
    if ch.weight_versions:  # spans over all output tokens (a stream sends them with its final chunk)
        acc["weight_versions"] = ch.weight_versions
    if ch.routed_experts is not None:  # the whole request's (a stream sends them with its final chunk)
        acc["routed_experts"] = ch.routed_experts

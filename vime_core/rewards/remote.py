"""The ``remote`` reward: score each sample with a reward-model service over HTTP (slime's ``remote_rm``).

:func:`remote_reward` posts ``{"prompt", "response", "label", "metadata"}`` (:func:`request_body`) to ``--rm-url``
and reads a number, a dict reward or ``{"reward": ...}`` back (:func:`parse_reward`), with at most
``--rm-concurrency`` requests in flight and retries with backoff on transient errors; a sample whose every attempt
failed is excluded, never scored 0. The protocol and the retries: docs/rewards.md, "remote".
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from typing import Any

import httpx

from vime_core.config.context import PluginContext, takes_context
from vime_core.failures import FailureCause, SampleFailure
from vime_core.types import Sample

logger = logging.getLogger("vime.rewards.remote")

BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 8.0
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# one client + semaphore per event loop (an httpx client is bound to the loop it was first used on)
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[httpx.AsyncClient, asyncio.Semaphore]] = (
    weakref.WeakKeyDictionary()
)


def backoff_s(attempt: int) -> float:
    """Seconds to wait before retry number ``attempt`` (0-based): ``min(0.5 * 2**attempt, 8)``."""
    return min(BACKOFF_BASE_S * 2**attempt, BACKOFF_MAX_S)


def request_body(sample: Sample) -> bytes:
    """The JSON body sent for ``sample`` (module docstring)."""
    payload = {
        "prompt": sample.prompt,
        "response": sample.response,
        "label": sample.label,
        "metadata": sample.metadata,
    }
    return json.dumps(payload, default=str).encode()


def parse_reward(body: Any) -> Any:
    """The reward in a service's JSON answer: a number, ``body["reward"]``, or the object itself (validated by
    :func:`vime_core.rewards.call.validate_reward`)."""
    if isinstance(body, dict) and "reward" in body:
        return body["reward"]
    return body


def _client(concurrency: int) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
    loop = asyncio.get_running_loop()
    state = _clients.get(loop)
    if state is None:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        state = (httpx.AsyncClient(limits=limits), asyncio.Semaphore(concurrency))
        _clients[loop] = state
    return state


@takes_context
async def remote_reward(ctx: PluginContext, sample: Sample) -> Any:
    """POST ``sample`` to ``--rm-url`` and return the service's reward (see the module docstring).

    Flags (``ctx.reward``, its :class:`~vime_core.config.RewardConfig`): ``--rm-url`` (required), ``--rm-concurrency``,
    ``--rm-timeout`` (seconds), ``--rm-max-retries``.

    :raises ValueError: ``--rm-url`` is not set.
    :raises SampleFailure: the service is unreachable, keeps failing, refuses the request, or answers non-JSON.
    """
    cfg = ctx.reward
    url = cfg.rm_url
    if not url:
        raise ValueError(
            "--reward remote needs --rm-url (the reward-model service's URL, e.g. http://host:8000/score)"
        )
    concurrency, timeout_s, retries = cfg.rm_concurrency, cfg.rm_timeout, cfg.rm_max_retries
    client, sem = _client(concurrency)
    body = request_body(sample)
    last: str = ""
    timed_out = False
    for attempt in range(retries + 1):
        if attempt:
            await asyncio.sleep(backoff_s(attempt - 1))
        try:
            async with sem:
                resp = await client.post(
                    url, content=body, headers={"content-type": "application/json"}, timeout=timeout_s
                )
        except httpx.TimeoutException as e:
            last, timed_out = f"no answer within {timeout_s:g} s (--rm-timeout): {type(e).__name__}", True
        except httpx.TransportError as e:
            last, timed_out = f"{type(e).__name__}: {e}", False
        else:
            if resp.status_code == 200:
                try:
                    return parse_reward(resp.json())
                except ValueError as e:
                    raise SampleFailure(
                        FailureCause.REWARD_ERROR, f"reward model at {url} answered non-JSON: {resp.text[:500]!r}"
                    ) from e
            last, timed_out = f"HTTP {resp.status_code}: {resp.text[:500]}", False
            if resp.status_code not in _RETRY_STATUS:
                raise SampleFailure(FailureCause.REWARD_ERROR, f"reward model at {url} refused the sample: {last}")
        logger.info("remote reward: attempt %d/%d to %s failed: %s", attempt + 1, retries + 1, url, last)
    cause = FailureCause.REWARD_TIMEOUT if timed_out else FailureCause.REWARD_ERROR
    raise SampleFailure(
        cause,
        f"reward model at {url} failed {retries + 1} attempt(s) (--rm-max-retries {retries}); last error: {last}. "
        "Is the service running and reachable from this machine?",
    )

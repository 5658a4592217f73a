"""Why a sample failed: one cause per ``failed`` sample, recorded on it and counted per step.

A ``failed`` sample is excluded from the loss (:mod:`vime_core.types`); it is never scored 0. Its cause is stored
in ``sample.metadata["failure"]`` (a :class:`FailureCause` value) next to ``metadata["error"]`` (the message), and
:func:`failure_metrics` counts the causes as ``rollout/failed/<cause>``.

A *policy* timeout is different: an agent killed at its own wall-time budget (``--agent-wall-time``) produced a
trajectory that is scored (usually 0) and trained, because running out of time is the policy's behaviour. Such a
sample carries ``metadata["policy_timeout"] = True``, keeps its status and is counted as ``rollout/policy_timeout``,
apart from the failures.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable

import httpx

from vime_core.types import Sample, Status


class FailureCause(str, enum.Enum):
    """Why a sample was excluded (the value is the metric suffix: ``rollout/failed/<value>``)."""

    ENGINE_ERROR = "engine_error"  # the router/engine answered with an error or the connection broke
    TIMEOUT = "timeout"  # a generation request (engine, teacher) timed out: infrastructure, not the policy
    SANDBOX_ERROR = "sandbox_error"  # the sandbox could not be created, died, or its backend failed
    AGENT_ERROR = "agent_error"  # the agent harness could not be installed/started, or made no model call
    GENERATE_ERROR = "generate_error"  # anything else the generate function raised (a malformed row, a bug)
    REWARD_ERROR = "reward_error"  # the reward function (or the reward service) raised
    REWARD_TIMEOUT = "reward_timeout"  # the reward did not return within its time limit
    REWARD_INVALID = "reward_invalid"  # the reward returned NaN, ±inf or something that is not a number


class EngineError(RuntimeError):
    """Base of the errors an inference engine or the router in front of it answers with (an error status, a
    malformed body): outside the ``"reward"`` stage they are ``engine_error``. The router client's
    :class:`~vime_core.engines.answers.RouterClientError` subclasses it, so this module imports no engine code."""


class SampleFailure(Exception):
    """An error that knows its cause (raised by reward helpers, e.g. :class:`~vime_core.rewards.call`)."""

    def __init__(self, cause: FailureCause, message: str) -> None:
        super().__init__(message)
        self.failure_cause = FailureCause(cause)


def classify_failure(error: BaseException, stage: str) -> FailureCause:
    """The cause of ``error`` raised while a sample was in ``stage``.

    An exception may name its own cause with a ``failure_cause`` attribute (a :class:`FailureCause` or its value;
    plugins use this, e.g. a reward's ``RewardInfraError``; every :class:`~vime_core.sandbox.SandboxError` carries
    ``sandbox_error``, so it is that in any stage). Otherwise, in the ``"reward"`` stage a :class:`TimeoutError` is
    ``reward_timeout`` and anything else ``reward_error``; in other stages (``"generate"``, ``"teacher"``) an
    HTTP/asyncio timeout is ``timeout``, an :class:`EngineError` or HTTP error ``engine_error`` and anything else
    ``generate_error``.

    :raises ValueError: ``failure_cause`` is not a known cause.
    """
    own = getattr(error, "failure_cause", None)
    if own is not None:
        return FailureCause(own)
    if stage == "reward":
        if isinstance(error, (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException)):
            return FailureCause.REWARD_TIMEOUT
        return FailureCause.REWARD_ERROR
    if isinstance(error, (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException)):
        return FailureCause.TIMEOUT
    if isinstance(error, (EngineError, httpx.HTTPError)):
        return FailureCause.ENGINE_ERROR
    return FailureCause.GENERATE_ERROR


def mark_failed(sample: Sample, cause: FailureCause, error: BaseException | str) -> Sample:
    """Set ``sample`` to ``failed`` with ``metadata["failure"] = cause`` and ``metadata["error"]``; drop any reward
    (a failed sample has none, so it can never be trained as 0 or NaN). Returns ``sample``."""
    sample.status = Status.FAILED
    sample.reward = None
    sample.metadata["failure"] = FailureCause(cause).value
    sample.metadata["error"] = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return sample


def failure_metrics(samples: Iterable[Sample]) -> dict[str, float]:
    """Per-cause counts of one step's samples.

    :return: ``rollout/failed/<cause>`` for every :class:`FailureCause` (0.0 when none; a failed sample without a
        recorded cause counts as ``generate_error``), and ``rollout/policy_timeout``: samples that are not failed
        and carry ``metadata["policy_timeout"]`` (scored and trained).
    """
    counts = {c.value: 0 for c in FailureCause}
    policy_timeouts = 0
    for s in samples:
        if s.status == Status.FAILED:
            cause = s.metadata.get("failure") or FailureCause.GENERATE_ERROR.value
            counts[cause if cause in counts else FailureCause.GENERATE_ERROR.value] += 1
        elif s.metadata.get("policy_timeout"):
            policy_timeouts += 1
    m = {f"rollout/failed/{c}": float(n) for c, n in counts.items()}
    m["rollout/policy_timeout"] = float(policy_timeouts)
    return m


class RunFailedError(RuntimeError):
    """A systemic rollout failure: the run cannot go on, so ``vime run`` stops (exit 1, this message as one
    ``vime: error:`` line, ``summary.json`` with ``"status": "failed"``).

    Systemic (docs/loop_modes.md, "Flakes and systemic failures"): every sample of a step failed, or the
    ``fully-async`` producer died (its data source raised). One sample in many failing is a flake: it is excluded
    and counted in ``rollout/failed/<cause>``, and the step trains on the rest.
    """


def raise_if_all_failed(step: int, samples: list[Sample], log_dir: str) -> None:
    """End the run if every sample of ``step`` failed (a systemic failure, not a flake).

    :param log_dir: where the engine and router logs are (named in the message).
    :raises RunFailedError: naming the step, how many samples failed and the first sample's own error.
    """
    failed = [s for s in samples if s.status == Status.FAILED]
    if failed and len(failed) == len(samples):
        raise RunFailedError(
            f"every sample of step {step} failed ({len(failed)} of {len(samples)}); first error: "
            f"{failed[0].metadata.get('error')} (engine and router logs: {log_dir})"
        )

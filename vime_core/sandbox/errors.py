"""The sandbox errors: infrastructure failures and expiry raise, a failing command does not (see
:mod:`vime_core.sandbox.base`)."""

from __future__ import annotations


class SandboxError(Exception):
    """Base of sandbox errors. Each carries its failure cause (:func:`vime_core.failures.classify_failure`): a sample
    that raised one is ``rollout/failed/sandbox_error`` in any stage."""

    failure_cause = "sandbox_error"


class SandboxInfraError(SandboxError):
    """The sandbox infrastructure failed (could not create, service unreachable, sandbox vanished).

    Not the command's fault: a reward must mark the sample failed (excluded), never score it 0.
    """


class SandboxExpiredError(SandboxError):
    """The sandbox reached its wall-time limit (``SandboxLimits.wall_time_s``) and was killed, or was closed."""

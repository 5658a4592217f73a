"""The agent-harness contract: how vime runs an unmodified coding agent (Claude Code, Codex, …) in a sandbox.

A harness is registered by name through ``vime_register_agent_harnesses`` (``--agent NAME``) and subclasses
:class:`AgentHarness`. For one episode the ``coding_agent`` generate function:

1. creates a sandbox and lays out the task's workspace;
2. opens an agent-gateway session whose id is the episode's API key;
3. makes the gateway reachable from inside the sandbox (:meth:`vime_core.sandbox.base.Sandbox.expose_host_port`),
   which gives the in-sandbox ``base_url``;
4. calls :meth:`AgentHarness.install` (idempotent: puts the CLI into the sandbox, or checks a prepared copy is
   there), then :meth:`AgentHarness.run` with an :class:`AgentEndpoint` and an :class:`AgentBudget`;
5. closes the gateway session into Samples; the :class:`AgentRunResult` says how the agent ended (a harness that
   could not start the agent at all raises :class:`AgentHarnessError`: the episode is excluded, not scored 0).

The harness never talks to the model itself and must configure its agent to talk **only** to ``endpoint.base_url``
(no telemetry, no update checks, no other provider): the sandbox has no other network.
"""

from __future__ import annotations

import abc
import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from vime_core.sandbox.base import Sandbox

AgentApi = Literal["anthropic", "openai-chat", "openai-responses"]
AgentEndStatus = Literal["completed", "max_turns", "timeout", "error"]


class AgentHarnessError(RuntimeError):
    """The agent could not be installed or started (infrastructure, not the model's doing): exclude the episode."""


@dataclass(frozen=True)
class AgentEndpoint:
    """Where the agent sends its LLM calls, as seen from inside the sandbox.

    :param base_url: gateway root URL reachable in the sandbox, e.g. ``http://127.0.0.1:41234`` (no ``/v1``).
    :param api_key: the per-episode key; it is the gateway session id.
    :param model: the model name the agent must request (the gateway's served model name).
    """

    base_url: str
    api_key: str
    model: str


@dataclass(frozen=True)
class AgentBudget:
    """Limits of one episode.

    :param max_turns: agent turns (LLM calls the CLI may make), or ``None`` for the CLI's default.
    :param max_tokens: output tokens per LLM call.
    :param wall_time_s: seconds before the agent process is killed (status ``"timeout"``).
    """

    max_turns: int | None = 8
    max_tokens: int = 1024
    wall_time_s: float = 600.0


@dataclass
class AgentRunResult:
    """How an agent run ended.

    :param status: ``completed`` (the agent finished on its own), ``max_turns`` (stopped by the turn budget),
        ``timeout`` (killed at ``wall_time_s``), ``error`` (the agent exited with an error after starting, e.g. an
        API error it could not recover from; the episode's samples stay usable).
    :param exit_code: the CLI's exit code.
    :param duration_s: wall time of the run, seconds.
    :param final_message: the agent's last text answer when the CLI reports one.
    :param stdout: CLI stdout (possibly truncated by the sandbox's output limit).
    :param stderr: CLI stderr (same).
    """

    status: AgentEndStatus
    exit_code: int
    duration_s: float
    final_message: str = ""
    stdout: str = ""
    stderr: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


class AgentHarness(abc.ABC):
    """Runs one agent CLI inside a :class:`~vime_core.sandbox.base.Sandbox`.

    Subclasses set :attr:`NAME` and :attr:`api` (which gateway API the agent speaks) and implement
    :meth:`install` and :meth:`run`. Construct with keyword options (:meth:`from_args` reads
    ``--agent-<name>-*`` flags that the plugin adds through ``vime_add_arguments``).
    """

    NAME: ClassVar[str] = ""
    api: ClassVar[AgentApi] = "anthropic"

    @classmethod
    def from_args(cls, args: argparse.Namespace | None) -> AgentHarness:
        """A harness configured from ``vime run`` arguments (``None``: defaults)."""
        return cls()

    @abc.abstractmethod
    async def install(self, sandbox: Sandbox) -> None:
        """Make the agent CLI runnable in ``sandbox`` (install it, or check that a prepared copy is present).

        Idempotent. Runs with the sandbox's network setting (normally off): install from a copy the host prepared.

        :raises AgentHarnessError: the CLI cannot be made available.
        """

    @abc.abstractmethod
    async def run(
        self, sandbox: Sandbox, *, prompt: str, endpoint: AgentEndpoint, budget: AgentBudget, cwd: str | None = None
    ) -> AgentRunResult:
        """Run the agent non-interactively on ``prompt`` in ``cwd`` (default: the sandbox workspace).

        Writes the agent's configuration so that it uses only ``endpoint``, launches it with the budget, waits
        (at most ``budget.wall_time_s`` seconds) and reports how it ended.

        :raises AgentHarnessError: the agent could not be started (missing CLI, bad configuration).
        """

"""The state of one agent episode in the gateway (:class:`Session`), keyed by its API key."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

from vime_core.agent.chat import ChatMessage, ModelTurn
from vime_core.agent.tool_parsers import ToolCall
from vime_core.agent.trajectory import Placement, Trajectory, TurnRecord

#: the error text of a model call refused because the episode's turn budget is spent (the harnesses look for it;
#: here, not in the gateway, so a harness module imports no web framework)
TURN_BUDGET_MESSAGE = "vime agent gateway: the episode's turn budget is spent"


def signature(content: str, calls: list[ToolCall]) -> str:
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
    responses: dict[str, list[ChatMessage]] = field(default_factory=dict)  # Responses API: id → conversation
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

"""Agents: token-correct trajectories (:mod:`.trajectory`), the Anthropic/OpenAI-compatible recording gateway
(:mod:`.gateway`, needs ``fastapi`` and ``uvicorn``), chat rendering (:mod:`.chat`), tool-call parsers
(:mod:`.tool_parsers`) and engine backends (:mod:`.backends`: the router, or a scripted responder).

Importing this package is cheap: the gateway (and FastAPI) load only when :mod:`vime_core.agent.gateway` is imported.
"""

from vime_core.agent.trajectory import Drift, Placement, PromptPlan, Trajectory, TurnRecord, check_token_exact

__all__ = ["Drift", "Placement", "PromptPlan", "Trajectory", "TurnRecord", "check_token_exact"]

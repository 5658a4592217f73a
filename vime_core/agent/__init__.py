"""Agents: token-correct trajectories (:mod:`.trajectory`), the Anthropic/OpenAI-compatible recording gateway
(:mod:`.gateway` with its sessions, :mod:`.session`, and one module per API under :mod:`.apis`; needs ``fastapi``
and ``uvicorn``), chat rendering (:mod:`.chat`), tool-call parsers (:mod:`.tool_parsers`), what answers the gateway's
engine calls (:mod:`.responders`: the router, or a script) and the agent-harness contract (:mod:`.harness`).

Importing this package is cheap: the gateway and the APIs (and FastAPI) load only when :mod:`vime_core.agent.gateway`
or :mod:`vime_core.agent.apis` is imported.
"""

from vime_core.agent import qwen3_xml  # noqa: F401 - registers the qwen3_coder tool-call parser
from vime_core.agent.trajectory import Drift, Placement, PromptPlan, Trajectory, TurnRecord, check_token_exact

__all__ = ["Drift", "Placement", "PromptPlan", "Trajectory", "TurnRecord", "check_token_exact"]

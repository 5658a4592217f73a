"""What the group side of the rollout actor asks of the engine side: a small protocol, so that the group producer,
over-sampling and the fully-async producer depend on it instead of on :class:`~vime_core.engines.fleet.EngineFleet`
or the rollout manager (no import runs back from them to either).
"""

from __future__ import annotations

from typing import Protocol


class EngineHealth(Protocol):
    """The engine fleet as the group producer sees it (:class:`~vime_core.engines.fleet.EngineFleet` is one)."""

    def check_engines(self) -> None:
        """Raise if the engines are lost (dead engine, or every engine gone under the health monitor)."""

    async def abort_inflight(self) -> int:
        """Abort the in-flight requests on every engine; return how many request ids were sent."""

    def health_metrics(self) -> dict[str, float]:
        """The health monitor's metrics since the last call."""

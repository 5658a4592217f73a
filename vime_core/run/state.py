"""One ``vime run`` as its phases hand it on (:class:`RunState`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vime_core.config import LoggingConfig, RunConfig
from vime_core.run.metrics import MetricsSink
from vime_core.run.step_source import GroupSource


@dataclass
class RunState:
    """One ``vime run`` as its phases hand it on: the configs, the actors, the step counters and what was logged.

    The failure paths (:func:`stop_engines_lost`, :func:`save_after_failed_write`) read the step, the weight
    version, the trainer, the rollout actor and the group source from it.

    :ivar step: the step being run (the first one, ``start_step``, until training starts).
    :ivar version: the weight version the engines serve (and the trainer's checkpoints record).
    :ivar info: what the rollout actor's ``start`` answered (router and engine addresses, startup seconds).
    :ivar setup_done: until then a failure or a signal may find the rollout manager busy starting the engines.
    :ivar failed: a failure ends the run within ``--failure-exit-timeout``.
    :ivar resumed_at: the steps at which earlier invocations resumed the run (from its last ``summary.json``).
    """

    flags: dict[str, Any]
    cfg: RunConfig
    log: LoggingConfig
    out: Path
    trainer: Any
    rollout: Any
    source: GroupSource | None
    board: Any = None
    sink: MetricsSink | None = None
    start_step: int = 0
    step: int = 0
    version: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    setup_done: bool = False
    failed: bool = False
    resumed_at: list[int] = field(default_factory=list)

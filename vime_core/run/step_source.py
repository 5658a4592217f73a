"""Where a step's groups come from, per ``--loop`` (:class:`GroupSource`), and the wait for a rollout that shows its
progress (:func:`wait_rollout`)."""

from __future__ import annotations

import logging
from typing import Any

from vime_core.cluster.orchestration import call
from vime_core.config import RolloutConfig
from vime_core.rollout.group_producer import rollout_metrics
from vime_core.run.debug_rollout import load_debug_rollout
from vime_core.run.progress import StepProgress, rollout_phase
from vime_core.types import Sample

logger = logging.getLogger("vime.loop")


class GroupSource:
    """Where a step's groups come from, per ``--loop``.

    * ``sync``: generate now with the current weights.
    * ``one-step-off``: the groups of step k+1 are requested before step k trains, so their generation overlaps
      training; the rollout actor runs calls in order, so the weight update after step k is applied only once that
      generation finished — every sample is exactly one version old (slime's ``train_async.py``).
    * ``fully-async``: the rollout actor's background producer hands out groups within ``--max-staleness``.
    * replay: ``--load-debug-rollout-data``.
    """

    def __init__(self, cfg: RolloutConfig, rollout: Any, wait: Any = None) -> None:
        import ray

        self.config = cfg
        self.rollout = rollout
        self.prefetched: Any = None
        self.wait = wait or ray.get  # ObjectRef -> result (the loop passes one that updates the progress bar)
        self.last_taken: dict[str, list] = {}  # the prompts of the groups the last get() returned

    def unconsumed(self) -> list[list[Sample]]:
        """Groups taken from the data buffer but not handed to a step yet: with ``one-step-off``, the next step's
        groups (generated while this step trained); a checkpoint saves them, so a resume trains them next instead of
        skipping their prompts. A prefetch that raised returns none: the rollout manager put its groups back into
        the buffer (:meth:`~vime_core.rollout.manager.RolloutManager.generate`)."""
        if self.prefetched is None:
            return []
        try:
            groups, _ = self.wait(self.prefetched)
        except Exception as e:  # noqa: BLE001 - the groups are back in the buffer; the caller reports its own error
            logger.warning("the prefetched rollout failed; its groups stay in the buffer: %s", e)
            return []
        return groups

    def get(self, step: int, version: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """The groups (and rollout metrics) of ``step`` at weight version ``version``; records their prompts in
        :attr:`last_taken` (``{"prompt_index": [...], "group_index": [...]}``, one entry per group)."""
        groups, metrics = self._get(step, version)
        self.last_taken = {
            "prompt_index": [g[0].prompt_index if g else None for g in groups],
            "group_index": [g[0].group_index if g else None for g in groups],
        }
        return groups, metrics

    def _get(self, step: int, version: int) -> tuple[list[list[Sample]], dict[str, float]]:
        cfg = self.config
        if cfg.load_debug_rollout_data:
            groups = load_debug_rollout(cfg.load_debug_rollout_data, step)
            return groups, rollout_metrics([s for g in groups for s in g], cfg.reward_key)
        if cfg.loop == "fully-async":
            return call(self.rollout, "get_async_groups", step, version, wait=self.wait)
        if cfg.loop == "one-step-off":
            ref = self.prefetched if self.prefetched is not None else self.rollout.generate.remote(step)
            self.prefetched = self.rollout.generate.remote(step + 1) if step + 1 < cfg.num_rollout else None
            return self.wait(ref)
        return call(self.rollout, "generate", step, wait=self.wait)


def wait_rollout(ref: Any, progress: StepProgress, board: Any) -> Any:
    """``ray.get(ref)``; on a terminal, meanwhile show ``rollout n/m samples`` from the progress actor."""
    import ray

    progress.phase("rollout")
    if not progress.live or board is None:
        return ray.get(ref)
    while not ray.wait([ref], timeout=0.5)[0]:
        progress.phase(rollout_phase(*ray.get(board.get.remote())))
    return ray.get(ref)

"""One RL step of ``vime run`` (:func:`one_step`): take the step's groups, build the batch, train, push the weights."""

from __future__ import annotations

import logging
import time

from vime_core.algorithms.batch import build_batch
from vime_core.cluster.orchestration import call
from vime_core.config import RunConfig
from vime_core.config.context import PluginContext
from vime_core.engines.health import engines_lost
from vime_core.plugins.manager import get_plugins
from vime_core.run.debug_rollout import save_debug_rollout
from vime_core.run.metrics import staleness_histogram
from vime_core.run.progress import StepProgress

logger = logging.getLogger("vime.loop")


def one_step(
    cfg: RunConfig, step, source, rollout, trainer, estimator, version, progress: StepProgress | None = None
) -> tuple[dict[str, float], int]:
    """One step at weight version ``version``: take the groups, train, push the weights as ``version + 1``.

    A step with no trainable sample trains nothing and pushes nothing, so the version stays (the next step's
    groups are judged against the version the engines really serve). The advantage estimator gets
    ``PluginContext(cfg)`` with the loaded plugins (:func:`~vime_core.algorithms.batch.build_batch`).

    :return: ``(metrics, the weight version after the step)``.
    """
    rollout_cfg = cfg.rollout
    metrics: dict[str, float] = {}
    t0 = time.perf_counter()
    groups, m = source.get(step, version)
    metrics.update(m)
    metrics["perf/rollout_time"] = time.perf_counter() - t0
    if rollout_cfg.save_debug_rollout_data:
        save_debug_rollout(rollout_cfg.save_debug_rollout_data, step, groups)
    versions = [v for g in groups for s in g for v in s.trained_weight_versions()]
    if versions:
        metrics["rollout/staleness_max"] = float(version - min(versions))
        metrics.update(staleness_histogram(version, versions))
    if trainer is None:
        return metrics, version
    batch = build_batch(PluginContext(cfg, plugins=get_plugins()), groups, estimator, step)
    metrics.update(batch.metrics)
    if not batch.samples:
        logger.warning("step %d: no trainable sample (all failed/aborted); skipping the update", step)
        return metrics, version
    # the engines free the GPUs they share with the trainer (vLLM sleep mode), unless --no-offload-rollout
    colocated = rollout is not None and cfg.cluster.colocate and cfg.cluster.offload_rollout
    if colocated:
        free_awake = call(trainer, "gpu_free_bytes")
        t_sleep = time.perf_counter()
        metrics.update(call(rollout, "sleep_engines") or {})
        metrics["perf/sleep_time"] = time.perf_counter() - t_sleep
        metrics.update(_free_gib("awake", free_awake) | _free_gib("asleep", call(trainer, "gpu_free_bytes")))
    t1 = time.perf_counter()
    if progress is not None:
        progress.phase("train")
    metrics.update(call(trainer, "train_step", batch))
    metrics["perf/train_time"] = time.perf_counter() - t1
    if "perf/train_worker_time" in metrics:  # the rest: the batch to the trainer, the call and its answer
        metrics["perf/train_transfer_time"] = metrics["perf/train_time"] - metrics["perf/train_worker_time"]
    t2 = time.perf_counter()
    if progress is not None:
        progress.phase("sync")
    if colocated:
        metrics.update(call(rollout, "wake_engines") or {})
        metrics["perf/wake_time"] = time.perf_counter() - t2
        metrics.update(_free_gib("woken", call(trainer, "gpu_free_bytes")))
    update = call(trainer, "push_weights", version + 1)
    if rollout is not None:
        try:
            metrics.update(call(rollout, "update_weights", update))
        except Exception as e:
            if engines_lost(e):
                raise LostAfterTraining(e, update.version) from e
            raise
    metrics["perf/sync_time"] = time.perf_counter() - t2
    metrics["perf/step_time"] = time.perf_counter() - t0
    return metrics, update.version


def _free_gib(phase: str, free_bytes: int | None) -> dict[str, float]:
    """``colocate/free_gib_<phase>``: free memory (GiB) of trainer rank 0's GPU with the engines awake, asleep and
    woken again (how much vLLM's sleep mode hands the trainer); nothing without a GPU."""
    return {} if free_bytes is None else {f"colocate/free_gib_{phase}": free_bytes / 2**30}


class LostAfterTraining(Exception):
    """Every engine was lost during the weight update after a step trained (:func:`one_step`): the step counts
    as finished, at weight version :attr:`version`."""

    def __init__(self, error: BaseException, version: int) -> None:
        super().__init__(str(error))
        self.error, self.version = error, version

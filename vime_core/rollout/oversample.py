"""Over-sampling, abort and partial rollout (slime's ``--over-sampling-batch-size``, ``abort()`` and
``--partial-rollout``).

:func:`collect_groups` keeps groups generating, filters each finished group (``--dynamic-sampling-filter``, DAPO),
refills when the batch can no longer be filled, aborts the requests still in flight once it is full, and with
``--partial-rollout`` returns unfinished groups to the data buffer to resume later. The rules and metrics:
docs/loop_modes.md, "Over-sampling, abort and partial rollout".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from vime_core.config import RolloutConfig
from vime_core.config.context import PluginContext
from vime_core.data.source import DataSource
from vime_core.failures import RunFailedError
from vime_core.rollout.async_producer import fresh_copy
from vime_core.rollout.runner import FINISHED_STATUSES, GroupRunner
from vime_core.types import Sample

logger = logging.getLogger("vime.rollout")

ABORT_SWEEP_SECONDS = 1.0  # re-send aborts this often: a request routed after a sweep is caught by the next one


def _return_to_buffer(group: list[Sample], step: int) -> list[Sample]:
    """The group as it goes back to the buffer: aborted fan-out rollouts restart from their prompt (their segments
    cannot be continued as one token stream); everything else is kept as it is, tagged ``start_rollout_id``."""
    by_pos: dict[tuple[int, int], list[Sample]] = {}
    for s in group:
        by_pos.setdefault((s.group_index, s.index), []).append(s)
    out: list[Sample] = []
    for segs in by_pos.values():
        fanned = len(segs) > 1 or segs[0].episode_id is not None
        if fanned and any(s.status not in FINISHED_STATUSES for s in segs):
            out.extend(fresh_copy(segs))
            continue
        for s in segs:
            s.metadata.setdefault("start_rollout_id", step)
            out.append(s)
    return out


async def collect_groups(
    step: int,
    *,
    ctx: PluginContext,
    config: RolloutConfig,
    runner: GroupRunner,
    data_source: DataSource,
    dynamic_filter: Callable | None,
    abort: Callable[[], Awaitable[int]],
) -> tuple[list[list[Sample]], list[Sample], dict[str, float]]:
    """Generate until ``--rollout-batch-size`` groups pass the filter, then abort the rest (see the module doc).

    ``runner`` generates and scores the groups ``data_source`` hands out (``--partial-rollout`` groups go back to
    it); ``dynamic_filter(ctx, group)`` keeps or drops a finished group; ``abort()`` aborts the requests in flight
    on every engine (:meth:`~vime_core.engines.fleet.EngineFleet.abort_inflight`).

    Refill rule: a new chunk of ``--over-sampling-batch-size`` groups is requested when the groups kept plus the
    groups in flight are fewer than the batch, until ``--dynamic-sampling-max-rounds`` chunks were requested; then
    the step goes on with the groups it has. Finished groups are examined in the order they were requested.

    :return: ``(groups, examined, metrics)``: the batch, every sample that finished generating this step (for the
        all-failed check), and ``rollout/dynamic_filter_*`` (with a filter), ``rollout/aborted_groups``,
        ``rollout/partial_returned_groups``, ``rollout/partial_resumed_samples``,
        ``rollout/partial_masked_tokens``, ``perf/abort_time``.
    :raises RunFailedError: the data source raised.
    :raises Exception: whatever a group's generation raised outside the per-sample error handling.
    """
    cfg = config
    want = cfg.rollout_batch_size
    chunk = max(cfg.over_sampling_batch_size or want, 1)
    max_rounds = max(cfg.dynamic_sampling_max_rounds, 1)
    keep = dynamic_filter
    sem = asyncio.Semaphore(cfg.rollout_concurrency)  # one bound for every group of the step
    tasks: dict[asyncio.Future, tuple[int, list[Sample]]] = {}
    kept: list[list[Sample]] = []
    surplus_groups: list[list[Sample]] = []  # passed, but the batch was already full
    examined: list[Sample] = []
    dropped = surplus = rounds = seq = 0

    def submit() -> None:
        nonlocal rounds, seq
        rounds += 1
        try:
            chunk_groups = data_source.get_groups(chunk)
        except Exception as e:
            raise RunFailedError(f"the data source failed: {type(e).__name__}: {e}") from e
        for g in chunk_groups:
            tasks[asyncio.ensure_future(runner.run([g], step, sem))] = (seq, g)
            seq += 1

    submit()
    while tasks and len(kept) < want:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in sorted(done, key=lambda t: tasks[t][0]):
            _, g = tasks.pop(t)
            t.result()
            examined.extend(g)
            if keep is not None and not keep(ctx, g):
                dropped += 1
            elif len(kept) < want:
                kept.append(g)
            else:
                surplus += 1
                surplus_groups.append(g)
        if len(kept) < want and len(kept) + len(tasks) < want and rounds < max_rounds:
            submit()

    t_abort = time.perf_counter()
    inflight = [g for _, g in sorted(tasks.values(), key=lambda x: x[0])]
    await _abort_inflight(tasks, runner, abort)
    returned = 0
    if cfg.partial_rollout and (inflight or surplus_groups):
        back = surplus_groups + inflight
        data_source.add_groups([_return_to_buffer(g, step) for g in back])
        returned = len(back)
    resumed = [s for g in kept for s in g if "partial_rollout" in s.metadata]
    metrics = {
        "rollout/aborted_groups": float(len(inflight)),
        "rollout/partial_returned_groups": float(returned),
        "rollout/partial_resumed_samples": float(len(resumed)),
        "rollout/partial_masked_tokens": float(sum(s.metadata["partial_rollout"]["masked_tokens"] for s in resumed)),
        "perf/abort_time": time.perf_counter() - t_abort,
    }
    if keep is not None:
        metrics.update(_filter_metrics(dropped, len(kept), surplus, rounds, want))
    return kept, examined, metrics


async def _abort_inflight(
    tasks: dict[asyncio.Future, tuple[int, list[Sample]]], runner: GroupRunner, abort: Callable[[], Awaitable[int]]
) -> None:
    """Abort the requests of the groups still generating (``tasks``, emptied) on every engine, again every
    :data:`ABORT_SWEEP_SECONDS` until each group returned; meanwhile no waiting sample is sent (``runner.aborting``).

    :raises Exception: whatever a group's generation raised outside the per-sample error handling.
    """
    if not tasks:
        return
    runner.aborting = True
    try:
        while tasks:
            await abort()
            done, _ = await asyncio.wait(tasks, timeout=ABORT_SWEEP_SECONDS)
            for t in done:
                tasks.pop(t)
                t.result()
    finally:
        runner.aborting = False


def _filter_metrics(dropped: int, kept: int, surplus: int, rounds: int, want: int) -> dict[str, float]:
    """``rollout/dynamic_filter_*`` of a step: the drop ratio among examined groups, the groups that passed after
    the batch was full, the chunks requested and whether the batch stayed short of ``want`` groups."""
    return {
        "rollout/dynamic_filter_drop_ratio": dropped / max(dropped + kept + surplus, 1),
        "rollout/dynamic_filter_surplus": float(surplus),
        "rollout/dynamic_filter_rounds": float(rounds),
        "rollout/dynamic_filter_insufficient": float(kept < want),
    }

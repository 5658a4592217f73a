"""The group producer: turns the data buffer's prompts into scored groups for training steps and evaluations.

:class:`GroupProducer` drives the group runner (:mod:`vime_core.rollout.runner`) directly, through over-sampling
(:mod:`vime_core.rollout.oversample`) or through the fully-async producer and its admission
(:mod:`vime_core.rollout.async_producer`), and keeps the data buffer's checkpoint state. It sees the engines only
through :class:`~vime_core.rollout.fleet_view.EngineHealth`.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vime_core.config import EvalConfig, RolloutConfig
from vime_core.config.context import PluginContext, legacy_args
from vime_core.config.sampling import sampling_params
from vime_core.data.source import DataSource, new_group
from vime_core.failures import RunFailedError, failure_metrics, raise_if_all_failed
from vime_core.rollout.async_producer import AsyncRolloutProducer
from vime_core.rollout.evaluation import dump_eval_samples, eval_metrics
from vime_core.rollout.fleet_view import EngineHealth
from vime_core.rollout.overlong import overlong_metrics
from vime_core.rollout.oversample import collect_groups
from vime_core.rollout.runner import GroupRunner
from vime_core.types import Sample, Status

logger = logging.getLogger("vime.rollout")


class GroupProducer:
    """Scored groups for training steps (sync, over-sampled or fully-async) and evaluations; the buffer's state.

    :param ctx: the run's configuration, passed to the dynamic filter and the hooks.
    :param config: the rollout flags.
    :param eval_config: the evaluation flags.
    :param runner: generates and scores groups (and keeps the engines' weight version).
    :param data_source: the training data buffer (``None`` for ``vime eval``).
    :param eval_sets: ``[(eval set, rows)]`` of ``--eval-prompt-data``.
    :param eval_reward_fns: eval set name → its reward function (``--eval-set-reward``, else ``--eval-reward``,
        default ``--reward``).
    :param dynamic_filter: the ``--dynamic-sampling-filter`` function, or ``None``.
    :param hook: the plugin manager's hook relay (``vime_on_rollout_end``).
    :param fleet: the engines' health and abort (:class:`~vime_core.rollout.fleet_view.EngineHealth`).
    :param loop: the rollout actor's event loop (the fully-async producer's thread runs it).
    """

    def __init__(
        self,
        ctx: PluginContext,
        config: RolloutConfig,
        eval_config: EvalConfig,
        runner: GroupRunner,
        data_source: DataSource | None,
        eval_sets: list,
        eval_reward_fns: dict[str, Callable],
        dynamic_filter: Callable | None,
        hook: Any,
        fleet: EngineHealth,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.ctx = ctx
        self.config = config
        self.eval_config = eval_config
        self.runner = runner
        self.data_source = data_source
        self.eval_sets = eval_sets
        self.eval_reward_fns = eval_reward_fns
        self.dynamic_filter = dynamic_filter
        self.hook = hook
        self.fleet = fleet
        self.loop = loop
        self.producer: AsyncRolloutProducer | None = None  # in --loop fully-async

    @property
    def fully_async(self) -> bool:
        """Whether the fully-async producer runs (weight updates then keep in-flight requests, frozen)."""
        return self.producer is not None

    def admit_now(self) -> None:
        """Fully-async: admit the groups the engines' new weight version allows before returning (no-op else)."""
        if self.producer is not None:
            self.producer.admit_now()

    def stop(self) -> None:
        """Stop the fully-async producer (its in-flight requests are cancelled); never raises."""
        if self.producer is not None:
            try:
                self.producer.stop()
            except Exception:  # noqa: BLE001
                logger.exception("stopping the async producer")

    # -- rollout ---------------------------------------------------------------------------------------------------
    def generate(self, step: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """Generate and score ``--rollout-batch-size`` groups for ``step``.

        With ``--dynamic-sampling-filter`` (DAPO) or ``--over-sampling-batch-size`` above the batch, groups are
        over-sampled, filtered and refilled until the batch is full, then the requests still in flight are aborted
        (``--partial-rollout``: their groups return to the buffer and resume later); see
        :mod:`vime_core.rollout.oversample`. A group is kept or dropped whole (never split across batches).

        A step that raises (every engine lost, every sample failed) takes nothing from the buffer: its state is
        put back as it was before the step (fresh prompts and partial-rollout groups alike), so a checkpoint taken
        then (:meth:`data_state`) hands them to the resumed run, which trains each exactly once.

        :return: ``(groups, metrics)``; metrics ``rollout/*`` and ``perf/rollout_time``.
        :raises RunFailedError: every sample failed (the first error is included), or the data source raised.
        :raises EnginesLostError: (health monitor) every engine is gone and no restart is left.
        """
        before = self.data_source.state_dict()
        try:
            return self._generate(step)
        except BaseException:
            self.data_source.load_state_dict(before)
            raise

    def _generate(self, step: int) -> tuple[list[list[Sample]], dict[str, float]]:
        t0 = time.perf_counter()
        self.fleet.check_engines()
        want = self.config.rollout_batch_size
        self.runner.report_progress(0, want * self.config.n_samples_per_prompt)
        extra: dict[str, float] = {}
        if self.dynamic_filter is None and (self.config.over_sampling_batch_size or 0) <= want:
            try:
                groups = self.data_source.get_groups(want)
            except Exception as e:
                raise RunFailedError(f"the data source failed: {type(e).__name__}: {e}") from e
            self.loop.run_until_complete(self.runner.run(groups, step))
            samples = [s for g in groups for s in g]
        else:
            groups, samples, extra = self.loop.run_until_complete(
                collect_groups(
                    step,
                    ctx=self.ctx,
                    config=self.config,
                    runner=self.runner,
                    data_source=self.data_source,
                    dynamic_filter=self.dynamic_filter,
                    abort=self.fleet.abort_inflight,
                )
            )
        self.fleet.check_engines()  # an engine that died mid-step is reported by its actor, with its log tail
        raise_if_all_failed(step, samples, str(Path(self.config.output_dir) / "logs"))  # systemic, not a flake
        self.runner.report_progress(self.runner.samples_done)  # the last count, which the throttle may have held back
        return groups, self._end_rollout(step, [s for g in groups for s in g], extra, "perf/rollout_time", t0)

    def _end_rollout(
        self, step: int, samples: list[Sample], extra: dict[str, float], time_key: str, t0: float
    ) -> dict[str, float]:
        """The step's metrics (``rollout/*``, overlong, ``extra``, the health monitor's, ``time_key``: seconds since
        ``t0``), handed to the ``vime_on_rollout_end`` hook and returned."""
        metrics = rollout_metrics(samples, self.config.reward_key)
        metrics.update(overlong_metrics(self.config, samples))
        metrics.update(extra)
        metrics.update(self.fleet.health_metrics())
        metrics[time_key] = time.perf_counter() - t0
        self.hook.vime_on_rollout_end(
            ctx=self.ctx, step=step, samples=samples, metrics=metrics, args=legacy_args(self.ctx.config)
        )
        return metrics

    def start_async(self) -> None:
        """``--loop fully-async``: start generating in the background (see :mod:`vime_core.rollout.async_producer`);
        the first groups (up to ``(--max-staleness + 1) × --rollout-batch-size`` and ``--rollout-inflight-groups``)
        are admitted before this returns."""
        self.producer = AsyncRolloutProducer(
            self.runner,
            self.data_source,
            self.loop,
            concurrency=self.config.rollout_concurrency,
            batch_groups=self.config.rollout_batch_size,
            max_staleness=self.config.max_staleness,
            inflight_bound=self.config.rollout_inflight_groups,
        )
        self.producer.start()

    def get_async_groups(self, step: int, current_version: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """``--loop fully-async``: the next batch of groups within ``--max-staleness`` of ``current_version``.

        :raises EnginesLostError: (health monitor) every engine is gone and no restart is left; groups already
            taken go back to the data buffer as fresh prompts (:meth:`data_state` saves them).
        :raises RunFailedError: every sample of the batch failed, or the producer died (its data source raised).
        """
        t0 = time.perf_counter()
        self.fleet.check_engines()
        groups, extra = self.producer.get_groups(
            self.config.rollout_batch_size,
            current_version,
            self.config.max_staleness,
            self.config.stale_policy,
            check=self.fleet.check_engines,
        )
        samples = [s for g in groups for s in g]
        try:
            self.fleet.check_engines()  # samples that failed because the engines died are not a batch to train
            raise_if_all_failed(step, samples, str(Path(self.config.output_dir) / "logs"))  # systemic, not a flake
        except BaseException:
            self.producer.give_back(groups)
            raise
        return groups, self._end_rollout(step, samples, extra, "perf/rollout_wait_time", t0)

    # -- evaluation ------------------------------------------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, float]:
        """Generate and score every ``--eval-prompt-data`` set at the engines' current weight version.

        Each prompt gets ``--n-samples-per-eval-prompt`` samples with the ``--eval-*`` sampling parameters, through
        the training generate function and the set's reward (``--eval-set-reward``, else ``--eval-reward``, default
        ``--reward``). Eval samples never enter the
        training buffer, and the ``vime_on_sample`` / ``vime_on_rollout_end`` hooks are not called for them. With
        ``--save-eval-samples`` they are written to ``OUTPUT_DIR/eval_samples/<name>/step_<step>.jsonl``.

        :param step: finished training steps (the metric step and the dump's file name).
        :return: ``eval/<name>/*`` metrics of every set (:func:`vime_core.rollout.evaluation.eval_metrics`) plus
            ``eval/weight_version`` and ``perf/eval_time`` (seconds).
        :raises RunFailedError: if every sample of a set failed (the first error is included; one ``vime: error:``
            line).
        """
        t0 = time.perf_counter()
        version = self.runner.weight_version
        ecfg = self.eval_config
        n = ecfg.n_samples_per_eval_prompt
        metrics: dict[str, float] = {"eval/weight_version": float(version)}
        for eval_set, rows in self.eval_sets:
            params = sampling_params(ecfg, eval_set.name)  # the set's own --eval-set-sampling-params
            groups = [new_group(row, i, n) for i, row in enumerate(rows)]
            reward_fn = self.eval_reward_fns[eval_set.name]
            coro = self.runner.run(groups, step, params=params, reward_fn=reward_fn, train=False)
            if self.producer is not None:  # fully-async: the manager's loop runs in the producer thread
                asyncio.run_coroutine_threadsafe(coro, self.loop).result()
            else:
                self.loop.run_until_complete(coro)
            samples = [s for g in groups for s in g]
            failed = [s for s in samples if s.status == Status.FAILED]
            if failed and len(failed) == len(samples):
                self.fleet.check_engines()  # a dead engine is the likelier cause: report it, with its log tail
                raise RunFailedError(
                    f"eval set {eval_set.name!r}: every sample failed; first error: {failed[0].metadata.get('error')}"
                    f" (engine and router logs: {Path(self.eval_config.output_dir) / 'logs'})"
                )
            metrics.update(eval_metrics(eval_set.name, groups, ecfg.reward_key, ecfg.eval_pass_threshold))
            if ecfg.save_eval_samples:
                dump_eval_samples(ecfg.output_dir, eval_set.name, step, version, groups, ecfg.reward_key)
        metrics["perf/eval_time"] = time.perf_counter() - t0
        return metrics

    # -- state -----------------------------------------------------------------------------------------------------
    def data_state(self, unconsumed: list[list[Sample]] | None = None) -> dict[str, Any]:
        """The buffer state to save with a checkpoint: what was trained counts as consumed; in-flight and finished
        but untaken ``fully-async`` groups go back as fresh prompts, and ``unconsumed`` groups (``one-step-off``:
        the next step's groups, generated but not trained) go back as they are, first in line, so a resume trains
        them next without generating them again."""
        state = self.producer.buffer_state() if self.producer is not None else self.data_source.state_dict()
        if unconsumed:
            state["returned"] = [[s.to_dict() for s in g] for g in unconsumed] + state["returned"]
        return state

    def load_data_state(self, state: dict[str, Any]) -> None:
        """Restore the buffer state of a checkpoint."""
        self.data_source.load_state_dict(state)


def rollout_metrics(samples: list[Sample], reward_key: str | None = None) -> dict[str, float]:
    """``rollout/*`` metrics of one step: reward mean/std over scored samples, response length, statuses, and the
    failures counted by cause (``rollout/failed/<cause>``, ``rollout/policy_timeout``:
    :func:`vime_core.failures.failure_metrics`)."""
    scored = [s for s in samples if s.status in (Status.COMPLETED, Status.TRUNCATED) and s.reward is not None]
    rewards = [s.reward_value(reward_key) for s in scored]
    lengths = [s.response_length for s in samples if s.status in (Status.COMPLETED, Status.TRUNCATED)]
    n = max(len(samples), 1)
    m = {
        "rollout/reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "rollout/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "rollout/response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "rollout/truncated_frac": sum(s.status == Status.TRUNCATED for s in samples) / n,
        "rollout/failed_frac": sum(s.status == Status.FAILED for s in samples) / n,
        "rollout/aborted_frac": sum(s.status == Status.ABORTED for s in samples) / n,
        "rollout/num_samples": float(len(samples)),
    }
    m.update(failure_metrics(samples))
    return m

"""The RL loop of ``vime run`` in every loop mode (``--loop sync``, ``one-step-off``, ``fully-async``, and the replay
of ``--load-debug-rollout-data``): generate → advantages → train → weight sync, with checkpoints.

:func:`run` checks everything first, then passes one :class:`RunState` through its phases: create the actors,
resume, start the engines, train, write the summary (or, on a failure, the failed summary), stop.

Per step it prints one progress line (rollout / train / sync seconds, mean reward, response length; on a terminal
also a live bar with the current phase, see :mod:`vime_core.progress`), writes metrics to ``metrics.jsonl``,
TensorBoard and (``--use-wandb``) W&B, and every ``--save-interval`` steps (and at the end) a checkpoint that a
resume continues from without repeating or skipping prompts. At the end it writes ``OUTPUT_DIR/report.html``
(:mod:`vime_core.report`; ``--no-report`` to skip). With
``--eval-prompt-data`` it evaluates before training, every ``--eval-interval`` steps and after the last step
(:func:`vime_core.evaluation.eval_steps`); an evaluation is its own ``metrics.jsonl`` record whose ``step`` is the
number of finished training steps. ``vime eval`` (:func:`evaluate`) runs one such evaluation of a model without
training.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from vime_core.algorithms.batch import build_batch
from vime_core.checkpoint import commit_checkpoint, latest_checkpoint, new_checkpoint_dir
from vime_core.config import LoggingConfig, RolloutConfig, RunConfig
from vime_core.context import PluginContext, legacy_args
from vime_core.data.source import read_rows
from vime_core.evaluation import eval_line, eval_steps, load_eval_sets
from vime_core.failures import RunFailedError
from vime_core.lora.options import check_lora_model
from vime_core.metrics import MetricsSink, staleness_histogram, wandb_config
from vime_core.orchestration import (
    TrainerGroup,
    call,
    driver_node_id,
    init_ray,
    place,
    remote_actor,
    stop_actors,
    wait_setup,
)
from vime_core.plugins import get_plugins
from vime_core.progress import RolloutProgress, StepProgress, rollout_phase, summary_lines
from vime_core.report import write_report
from vime_core.rollout.group_producer import rollout_metrics
from vime_core.rollout.health import EnginesLostError, engines_lost
from vime_core.rollout.manager import RolloutManager
from vime_core.rollout.process import start_run_reaper
from vime_core.rollout.prompt_checks import check_prompts
from vime_core.run_checks import (
    check_vllm_values,
    check_vlm_run,
    checked_model,
    engine_sampling,
    resolve_plugins,
)
from vime_core.run_dir import OutputDirLock, check_output_dir, write_json_atomic
from vime_core.run_signals import INTERRUPT_GRACE_S, claim_signals, interrupted
from vime_core.run_summary import completed_summary, failed_summary
from vime_core.types import Sample
from vime_core.weight_sync.base import WeightWriteError

logger = logging.getLogger("vime.loop")
console = Console(stderr=False, highlight=False, markup=False, soft_wrap=True)  # no wrap at 80 cols in logs


def save_debug_rollout(pattern: str, step: int, groups: list[list[Sample]]) -> Path:
    """``torch.save`` the step's groups to ``pattern.format(rollout_id=step)``."""
    path = Path(pattern.format(rollout_id=step))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"rollout_id": step, "groups": [[s.to_dict() for s in g] for g in groups]}, path)
    return path


def load_debug_rollout(pattern: str, step: int) -> list[list[Sample]]:
    """Inverse of :func:`save_debug_rollout`.

    :raises FileNotFoundError: naming the expected file.
    """
    path = Path(pattern.format(rollout_id=step))
    if not path.exists():
        raise FileNotFoundError(f"--load-debug-rollout-data: {path} not found (rollout_id={step})")
    data = torch.load(path, weights_only=False)
    return [[Sample.from_dict(d) for d in g] for g in data["groups"]]


def run(cfg: RunConfig, flags: dict[str, Any]) -> dict[str, Any]:
    """Run training as configured by ``cfg`` (built by the CLI from :func:`vime_core.arguments.parse_run_args`).

    :param flags: every resolved flag by name, plugin flags included: what ``args.json`` and the W&B run config
        record (the configuration itself is read from ``cfg`` only).
    :return: the summary also written to ``OUTPUT_DIR/summary.json``.
    """
    log = cfg.logging
    out = Path(log.output_dir)
    # every check before the output directory changes or anything expensive starts: a typo fails in a second
    check_output_dir(out)
    plugins = get_plugins()
    resolve_plugins(plugins, cfg)
    estimator = plugins.resolve("advantage", cfg.algorithm.advantage_estimator)
    load_eval_sets(cfg.eval)  # a bad eval set fails before any engine starts
    data = cfg.data
    rows = (
        None
        if log.debug_train_only
        else read_rows(data.prompt_data, data.input_key, data.label_key, data.metadata_key, image_key=data.image_key)
    )
    t_setup = time.perf_counter()
    model_path = checked_model(log.model)
    console.print(f"[vime] model: {model_path}")
    # no tokenizer, no chat template, an over-long prompt: fails here, before any engine starts
    overlong = 0 if rows is None else check_prompts(data, model_path, rows)
    check_lora_model(cfg.lora, model_path)  # --target-modules / --lora-adapter-path against the model
    check_vlm_run(cfg, model_path)  # a vision-language model: the torch trainer, no LoRA, no critic
    if not log.debug_train_only:  # vLLM's own parser and SamplingParams, before Ray starts
        check_vllm_values(list(cfg.engine.vllm_args), engine_sampling(cfg))
    with OutputDirLock(out, "vime run"):  # one run per output directory
        # what the run records about itself: only now, each file whole or not at all
        write_json_atomic(out / "plugins.json", plugins.describe())
        write_json_atomic(out / "args.json", flags)  # paths as strings
        return _run(flags, cfg, estimator, rows, model_path, overlong, t_setup)


def _run(
    flags: dict[str, Any], cfg: RunConfig, estimator, rows, model_path: Path, overlong: int, t_setup: float
) -> dict[str, Any]:
    """:func:`run` once its checks passed and it holds the output directory."""
    import ray

    start_run_reaper()  # whatever ends this process, nothing carrying the run's marker outlives it by long
    init_ray(address=cfg.cluster.ray_address, worker_niceness=cfg.cluster.ray_worker_niceness)
    claim_signals()  # Ray's own SIGTERM handler would abort the driver with a core dump
    try:  # whatever happens from here (a signal while actors are created), Ray and every actor of the run stop
        return _run_on_ray(flags, cfg, estimator, rows, model_path, overlong, t_setup)
    finally:
        ray.shutdown()


@dataclass
class RunState:
    """One ``vime run`` as its phases hand it on: the configs, the actors, the step counters and what was logged.

    The failure paths (:func:`_stop_engines_lost`, :func:`_save_after_failed_write`) read the step, the weight
    version, the trainer, the rollout actor and the group source from it.

    :ivar step: the step being run (the first one, ``start_step``, until training starts).
    :ivar version: the weight version the engines serve (and the trainer's checkpoints record).
    :ivar info: what the rollout actor's ``start`` answered (router and engine addresses, startup seconds).
    :ivar setup_done: until then a failure or a signal may find the rollout manager busy starting the engines.
    :ivar failed: a failure ends the run within ``--failure-exit-timeout``.
    """

    flags: dict[str, Any]
    cfg: RunConfig
    log: LoggingConfig
    out: Path
    trainer: Any
    rollout: Any
    source: _GroupSource | None
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


def _run_on_ray(
    flags: dict[str, Any], cfg: RunConfig, estimator, rows, model_path: Path, overlong: int, t_setup: float
) -> dict[str, Any]:
    """:func:`_run` on a started Ray: place, start the actors, set up, train, write the summary."""
    run = _create_actors(flags, cfg, model_path)
    try:
        ckpt = _resume(run)
        _start_engines(run, ckpt)
        _finish_setup(run, t_setup)
        _train(run, estimator, overlong)
        return _write_summary(run)
    except Exception as e:
        run.failed = True
        error = getattr(e, "cause", None) or e  # raised in a Ray actor: the actor's own exception
        try:
            write_json_atomic(run.out / "summary.json", failed_summary(run.out, run.history, run.start_step, error))
        except Exception:  # noqa: BLE001 - the run's own error is the one to report
            logger.exception("writing the failed run's summary.json")
        if isinstance(error, RunFailedError) and type(e) is not RunFailedError:
            raise RunFailedError(str(error)) from None  # one line, without Ray's traceback
        raise
    finally:
        _stop(run)


def _create_actors(flags: dict[str, Any], cfg: RunConfig, model_path: Path) -> RunState:
    """Place the run (``plan.json``) and create its actors: the rollout manager and the progress board on the
    driver's node, the trainer group on its bundles; the metrics sink."""
    log, out = cfg.logging, Path(cfg.logging.output_dir)
    plan, pg = place(cfg.cluster)  # an impossible plan fails here, naming the flag
    console.print("[vime] " + plan.describe())
    write_json_atomic(out / "plan.json", plan.to_dict())
    placement = (plan, pg)
    # the rollout manager (and with it the router) runs on the driver's node; engines and ranks on their bundles
    board = None if log.debug_train_only else remote_actor(RolloutProgress, node_id=driver_node_id())
    rollout = (
        None
        if log.debug_train_only
        else remote_actor(RolloutManager, cfg, str(model_path), placement, board, node_id=driver_node_id())
    )
    trainer = None if log.debug_rollout_only else TrainerGroup(cfg, model_path, plan, pg)
    sink = MetricsSink(out, log.use_tensorboard, wandb_config(log, flags))
    return RunState(flags, cfg, log, out, trainer, rollout, None, board, sink)


def _resume(run: RunState) -> Path | None:
    """With ``--resume`` and a checkpoint: roll the records back to it, load the trainer's state and the data
    buffer's; :attr:`RunState.start_step` and :attr:`RunState.version` are then the checkpoint's.

    :return: the checkpoint, or ``None``.
    """
    import ray

    ckpt = latest_checkpoint(run.out) if run.log.resume else None
    if ckpt is not None:
        meta = json.loads((ckpt / "meta.json").read_text())
        run.start_step, run.version = meta["step"], meta["weight_version"]
        run.step = run.start_step
        console.print(f"[vime] resuming from {ckpt} (step {run.start_step}, weight version {run.version})")
        roll_back_records(run.out, run.start_step)  # steps after the checkpoint are trained again
        if run.trainer is not None:
            run.trainer.load_checkpoint(str(ckpt / "trainer"))
        if run.rollout is not None:
            ray.get(run.rollout.load_data_state.remote(json.loads((ckpt / "data_source.json").read_text())))
    return ckpt


def _start_engines(run: RunState, ckpt: Path | None) -> None:
    """Start the engines and the router while the trainer ranks load (whichever fails first ends the run at
    once), check the shared weight directory, and after a resume push the checkpoint's weights."""
    import ray

    rollout, trainer, cfg = run.rollout, run.trainer, run.cfg
    if rollout is None:
        return
    if trainer is not None and cfg.cluster.colocate:
        wait_setup(trainer.ready_calls())  # loaded: the engines size their GPU share by what is left free
    # the engines start while the trainer ranks load: whichever fails first ends the run at once
    calls = {"rollout manager": rollout.start.remote(), **(trainer.ready_calls() if trainer else {})}
    run.info = info = wait_setup(calls)["rollout manager"]
    console.print(
        f"[vime] router {info['router_url']} → engines {info['engine_urls']} "
        f"(ready in {info['startup_seconds']:.1f} s)"
    )
    if "teacher_router_url" in info:
        console.print(f"[vime] teacher {cfg.engine.distill_teacher}: router {info['teacher_router_url']}")
    if trainer is not None and cfg.weight_sync.weight_sync in ("disk", "disk-delta"):
        trainer.check_shared_dir(str(cfg.weight_sync.update_weight_disk_dir), rollout)
    if ckpt is not None and trainer is not None:
        ray.get(rollout.update_weights.remote(trainer.push_weights(run.version)))


def _finish_setup(run: RunState, t_setup: float) -> None:
    """Wait for the trainer ranks, record where every actor landed (``placement.json``), print the setup time."""
    if run.trainer is not None:
        wait_setup(run.trainer.ready_calls())
    run.setup_done = True
    placed = {
        "engines": run.info.get("engines", []) if run.rollout is not None else [],
        "trainer": run.trainer.placements() if run.trainer is not None else [],
    }
    write_json_atomic(run.out / "placement.json", placed)  # where every actor landed
    console.print(f"[vime] setup {time.perf_counter() - t_setup:.1f} s")


def _train(run: RunState, estimator, overlong: int) -> None:
    """The steps from :attr:`RunState.start_step` to ``--num-rollout`` in the run's loop mode, with the
    evaluations (:func:`~vime_core.evaluation.eval_steps`) and checkpoints between them; a step whose engines are
    lost, or whose weights could not be written, ends the run through its failure path."""
    import ray

    cfg, rollout, plugins = run.cfg, run.rollout, get_plugins()
    eval_at: set[int] = set()
    if rollout is not None and cfg.eval.eval_prompt_data:
        before_train = not cfg.eval.skip_eval_before_train
        eval_at = set(eval_steps(cfg.rollout.num_rollout, cfg.eval.eval_interval, run.start_step, before_train))
    if 0 in eval_at:  # before training, at weight version 0 (before the async producer competes for the engines)
        run.evals.append(_evaluate(rollout, run.sink, 0))
    if rollout is not None and cfg.rollout.loop == "fully-async":
        ray.get(rollout.start_async.remote())
    last_save = time.monotonic()
    with StepProgress(console, cfg.rollout.num_rollout, run.start_step) as progress:
        run.source = _GroupSource(cfg.rollout, rollout, lambda ref: _wait_rollout(ref, progress, run.board))
        for step in range(run.start_step, cfg.rollout.num_rollout):
            run.step = step
            metrics = _guarded_step(run, estimator, progress)
            if cfg.data.rollout_max_prompt_len:
                metrics["data/overlong_prompts_filtered"] = float(overlong)
            run.history.append(metrics)
            run.sink.log(step, metrics)
            _append_jsonl(run.out / TRAINED_PROMPTS_FILE, {"step": step, **run.source.last_taken})
            plugins.pm.hook.vime_on_train_step_end(
                ctx=PluginContext(cfg), step=step, metrics=metrics, args=legacy_args(cfg)
            )
            progress.step_done(step, metrics)
            if step + 1 in eval_at:  # after the weight update: the engines serve version step + 1
                run.evals.append(_evaluate(rollout, run.sink, step + 1, progress.console))
            if run.trainer is not None and should_save(run.log, step + 1, time.monotonic() - last_save):
                _save_checkpoint(
                    run.log, run.out, step + 1, run.version, run.trainer, rollout, run.source.unconsumed()
                )
                last_save = time.monotonic()


def _guarded_step(run: RunState, estimator, progress: StepProgress) -> dict[str, float]:
    """:func:`_one_step` at :attr:`RunState.step`, advancing :attr:`RunState.version`; a lost fleet or a failed
    weight write raises the error of its failure path (after its checkpoint)."""
    try:
        metrics, run.version = _one_step(
            run.cfg, run.step, run.source, run.rollout, run.trainer, estimator, run.version, progress
        )
    except WeightWriteError as e:  # trained, but the weights could not be written for the engines
        raise _save_after_failed_write(run, e) from None
    except _LostAfterTraining as e:  # trained, but no engine is left to take the weights
        raise _stop_engines_lost(run, e.error, e.version) from None
    except Exception as e:
        if not engines_lost(e):
            raise
        # nothing left to generate with: keep what trained, stop with the monitor's report
        raise _stop_engines_lost(run, e) from None
    return metrics


def _write_summary(run: RunState) -> dict[str, Any]:
    """The completed run's ``summary.json`` (with the first and last evaluation, the final HF model and adapter),
    its printed lines and ``report.html``."""
    import ray

    log, out, trainer = run.log, run.out, run.trainer
    summary = completed_summary(out, run.history, run.start_step)
    if run.evals:
        summary["eval_first"], summary["eval_last"] = run.evals[0], run.evals[-1]
    summary["ray_node_ip"] = ray.util.get_node_ip_address()
    if trainer is not None and log.save_hf:
        trainer.save_hf(str(out / "final_hf"))  # with LoRA: the merged model
        summary["final_hf"] = str(out / "final_hf")
        if run.cfg.lora.enabled:
            trainer.save_adapter(str(out / "final_adapter"))
            summary["final_adapter"] = str(out / "final_adapter")
    write_json_atomic(out / "summary.json", summary)
    for line in summary_lines(summary):
        console.print(line)
    if log.report:
        console.print(f"[vime] report: {write_report(out)}")
    return summary


def _stop(run: RunState) -> None:
    """Close the metrics sink, stop the actors and Ray: after a signal or a failed setup the manager may be busy
    (an engine start, a rollout): seconds, not minutes; after a failure the run ends within
    ``--failure-exit-timeout`` (half of it for the manager, then it is killed)."""
    import ray

    run.sink.close()
    grace = 120.0
    if interrupted() or not run.setup_done:
        grace = INTERRUPT_GRACE_S
    elif run.failed:
        grace = min(grace, run.log.failure_exit_timeout / 2)
    stop_actors(run.rollout, run.trainer, grace)
    ray.shutdown()


def evaluate(cfg: RunConfig, flags: dict[str, Any]) -> dict[str, Any]:
    """``vime eval``: start the engines and router for ``--model``, evaluate every ``--eval-prompt-data`` set once
    (the code path of evaluations during ``vime run``: :meth:`RolloutManager.evaluate`), write the metrics as step 0
    of ``OUTPUT_DIR/metrics.jsonl`` (and TensorBoard) and ``OUTPUT_DIR/summary.json``, stop everything.

    The manager runs in this process (no Ray: there is no trainer to place).

    :param cfg: built by the CLI from :func:`vime_core.arguments.parse_run_args` with ``command="eval"``.
    :param flags: every resolved flag by name (``args.json``, the W&B run config).
    :return: the ``eval/*`` metrics plus ``model`` and ``output_dir``.
    :raises DataError: an unreadable eval set (before any engine starts).
    """
    out = Path(cfg.logging.output_dir)
    check_output_dir(out)
    resolve_plugins(get_plugins(), cfg, train=False)
    load_eval_sets(cfg.eval)  # a bad eval set fails before any engine starts
    model_path = checked_model(cfg.logging.model)
    console.print(f"[vime] model: {model_path}")
    check_vllm_values(list(cfg.engine.vllm_args), engine_sampling(cfg))
    with OutputDirLock(out, "vime eval"):
        write_json_atomic(out / "args.json", flags)
        return _evaluate_locked(flags, cfg, out, model_path)


def _evaluate_locked(flags: dict[str, Any], cfg: RunConfig, out: Path, model_path: Path) -> dict[str, Any]:
    """:func:`evaluate` once its checks passed and it holds the output directory."""
    manager = RolloutManager(cfg, model_path)
    sink = MetricsSink(out, cfg.logging.use_tensorboard, wandb_config(cfg.logging, flags))
    try:
        info = manager.start()
        console.print(
            f"[vime] router {info['router_url']} → engines {info['engine_urls']} "
            f"(ready in {info['startup_seconds']:.1f} s)"
        )
        metrics = _evaluate(manager, sink, 0)
    finally:
        sink.close()
        manager.shutdown()
    summary = {"model": str(model_path), "output_dir": str(out), **metrics}
    write_json_atomic(out / "summary.json", summary)
    for line in summary_lines(summary):
        console.print(line)
    return summary


def _evaluate(rollout: Any, sink: MetricsSink, step: int, out_console: Console = console) -> dict[str, float]:
    """Evaluate at ``step`` finished training steps (a Ray actor handle or a plain :class:`RolloutManager`), log
    the metrics as their own record with that ``step``, print one line."""
    metrics = call(rollout, "evaluate", step)
    sink.log(step, metrics)
    out_console.print(eval_line(step, metrics))
    return metrics


class _GroupSource:
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


def _wait_rollout(ref: Any, progress: StepProgress, board: Any) -> Any:
    """``ray.get(ref)``; on a terminal, meanwhile show ``rollout n/m samples`` from the progress actor."""
    import ray

    progress.phase("rollout")
    if not progress.live or board is None:
        return ray.get(ref)
    while not ray.wait([ref], timeout=0.5)[0]:
        progress.phase(rollout_phase(*ray.get(board.get.remote())))
    return ray.get(ref)


def _one_step(
    cfg: RunConfig, step, source, rollout, trainer, estimator, version, progress: StepProgress | None = None
) -> tuple[dict[str, float], int]:
    """One step at weight version ``version``: take the groups, train, push the weights as ``version + 1``.

    A step with no trainable sample trains nothing and pushes nothing, so the version stays (the next step's
    groups are judged against the version the engines really serve). The advantage estimator gets
    ``PluginContext(cfg)`` (:func:`~vime_core.algorithms.batch.build_batch`).

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
    batch = build_batch(PluginContext(cfg), groups, estimator, step)
    metrics.update(batch.metrics)
    if not batch.samples:
        logger.warning("step %d: no trainable sample (all failed/aborted); skipping the update", step)
        return metrics, version
    colocated = rollout is not None and cfg.cluster.colocate
    if colocated:  # the engines free the GPUs they share with the trainer (vLLM sleep mode)
        free_awake = call(trainer, "gpu_free_bytes")
        t_sleep = time.perf_counter()
        call(rollout, "sleep_engines")
        metrics["perf/sleep_time"] = time.perf_counter() - t_sleep
        metrics.update(_free_gib("awake", free_awake) | _free_gib("asleep", call(trainer, "gpu_free_bytes")))
    t1 = time.perf_counter()
    if progress is not None:
        progress.phase("train")
    metrics.update(call(trainer, "train_step", batch))
    metrics["perf/train_time"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    if progress is not None:
        progress.phase("sync")
    if colocated:
        call(rollout, "wake_engines")
        metrics["perf/wake_time"] = time.perf_counter() - t2
        metrics.update(_free_gib("woken", call(trainer, "gpu_free_bytes")))
    update = call(trainer, "push_weights", version + 1)
    if rollout is not None:
        try:
            metrics.update(call(rollout, "update_weights", update))
        except Exception as e:
            if engines_lost(e):
                raise _LostAfterTraining(e, update.version) from e
            raise
    metrics["perf/sync_time"] = time.perf_counter() - t2
    metrics["perf/step_time"] = time.perf_counter() - t0
    return metrics, update.version


def _free_gib(phase: str, free_bytes: int | None) -> dict[str, float]:
    """``colocate/free_gib_<phase>``: free memory (GiB) of trainer rank 0's GPU with the engines awake, asleep and
    woken again (how much vLLM's sleep mode hands the trainer); nothing without a GPU."""
    return {} if free_bytes is None else {f"colocate/free_gib_{phase}": free_bytes / 2**30}


def should_save(log: LoggingConfig, steps_done: int, seconds_since_save: float) -> bool:
    """Whether to checkpoint after ``steps_done`` finished steps: after the last step, every ``--save-interval``
    steps, and once ``--save-interval-minutes`` have passed since the last checkpoint (or the start)."""
    if steps_done == log.num_rollout:
        return True
    if log.save_interval and steps_done % log.save_interval == 0:
        return True
    minutes = log.save_interval_minutes
    return bool(minutes) and seconds_since_save >= minutes * 60


def _save_checkpoint(
    log: LoggingConfig, out: Path, step: int, version: int, trainer, rollout, unconsumed: list[list[Sample]]
) -> Path:
    """Checkpoint after ``step`` finished steps (:mod:`vime_core.checkpoint`); ``unconsumed`` groups (taken from
    the buffer, not yet trained) are saved with the buffer so a resume trains them next."""
    tmp = new_checkpoint_dir(out, step)
    trainer.save_checkpoint(str(tmp / "trainer"))
    data_state = call(rollout, "data_state", unconsumed) if rollout is not None else None
    meta = {"step": step, "weight_version": version}
    return commit_checkpoint(tmp, meta, data_state, log.max_checkpoints)


class _LostAfterTraining(Exception):
    """Every engine was lost during the weight update after a step trained (:func:`_one_step`): the step counts
    as finished, at weight version :attr:`version`."""

    def __init__(self, error: BaseException, version: int) -> None:
        super().__init__(str(error))
        self.error, self.version = error, version


def _stop_engines_lost(run: RunState, error: BaseException, trained_version: int | None = None) -> EnginesLostError:
    """Every engine is lost during step ``run.step`` (at weight version ``run.version``): checkpoint what trained so
    the run can resume.

    * The rollout failed (``trained_version`` None): ``step`` steps finished; the groups the failed step took are
      back in the rollout manager's buffer (:meth:`~vime_core.rollout.manager.RolloutManager.generate`; with
      ``fully-async`` re-queued by the producer), so the checkpoint's data state holds them and a resume trains
      them — each prompt once.
    * The step trained but its weight update found no engine (``trained_version``: the weights it pushed): the
      step counts as finished (``step + 1`` steps, weight version ``trained_version``; a resume pushes the weights
      in full) and its prompts are recorded in ``trained_prompts.jsonl``.

    Either way, with ``one-step-off`` the next step's groups, if they were generated, are saved as unconsumed.

    :return: the error to raise: the monitor's report (without Ray's traceback) and what was saved.
    """
    step, version, out, source = run.step, run.version, run.out, run.source
    done = step
    if trained_version is not None:
        _append_jsonl(out / TRAINED_PROMPTS_FILE, {"step": step, **source.last_taken})
        done, version = step + 1, trained_version
    saved = None
    if run.trainer is not None:
        saved = _save_checkpoint(run.log, out, done, version, run.trainer, run.rollout, source.unconsumed())
    where = f"checkpoint of {done} finished step(s) saved: {saved}" if saved else "no trainer to save"
    return EnginesLostError(f"{getattr(error, 'cause', None) or error}\n{where}")


def _save_after_failed_write(run: RunState, error: BaseException) -> WeightWriteError:
    """Step ``run.step`` trained but its weights could not be written for the engines (full or read-only
    ``--update-weight-disk-dir``; the engines keep version ``run.version``): checkpoint the trained step (weight
    version ``run.version + 1``; a resume pushes it to the engines in full) so nothing trained is lost, when the
    checkpoint directory can be written.

    :return: the error to raise: the write error's message (without Ray's traceback) and what was saved.
    """
    step, version, out, source = run.step, run.version, run.out, run.source
    message = str(getattr(error, "cause", None) or error)
    _append_jsonl(out / TRAINED_PROMPTS_FILE, {"step": step, **source.last_taken})
    try:
        saved = _save_checkpoint(run.log, out, step + 1, version + 1, run.trainer, run.rollout, source.unconsumed())
    except Exception as e:  # noqa: BLE001 - the write error is the one to report
        logger.exception("checkpoint after the failed weight write")
        return WeightWriteError(f"step {step + 1}: {message}; its training could not be checkpointed either ({e})")
    return WeightWriteError(f"step {step + 1}: {message}; the trained step is saved in {saved} (a re-run resumes it)")


TRAINED_PROMPTS_FILE = "trained_prompts.jsonl"


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def roll_back_records(out: Path, start_step: int) -> None:
    """On a resume from a checkpoint after ``start_step`` steps: drop the records of the steps after it (a run
    killed after the checkpoint trained them, and trains them again now) from ``metrics.jsonl`` and
    ``trained_prompts.jsonl`` — training records with ``step >= start_step`` and evaluation records (``eval/*``
    keys) with ``step > start_step``. Torn last lines (a kill mid-write) are dropped too."""
    for name in ("metrics.jsonl", TRAINED_PROMPTS_FILE):
        path = out / name
        if not path.exists():
            continue
        kept = []
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            is_eval = any(k.startswith("eval/") for k in rec)
            if rec.get("step", 0) < start_step or (is_eval and rec["step"] == start_step):
                kept.append(line + "\n")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)

"""The RL loop of ``vime run`` in every loop mode (``--loop sync``, ``one-step-off``, ``fully-async``, and the replay
of ``--load-debug-rollout-data``): generate → advantages → train → weight sync, with checkpoints.

:func:`run` checks everything first, then passes one :class:`RunState` through its phases: create the actors,
resume, start the engines, train, write the summary (or, on a failure, the failed summary), stop.

Per step it prints one progress line (rollout / train / sync seconds, mean reward, response length; on a terminal
also a live bar with the current phase, see :mod:`vime_core.run.progress`), writes metrics to ``metrics.jsonl``,
TensorBoard and (``--use-wandb``) W&B, and every ``--save-interval`` steps (and at the end) a checkpoint that a
resume continues from without repeating or skipping prompts. At the end it writes ``OUTPUT_DIR/report.html``
(:mod:`vime_core.run.report`; ``--no-report`` to skip). With
``--eval-prompt-data`` it evaluates before training, every ``--eval-interval`` steps and after the last step
(:func:`vime_core.rollout.evaluation.eval_steps`); an evaluation is its own ``metrics.jsonl`` record whose ``step`` is
the number of finished training steps. ``vime eval`` (:func:`evaluate`) runs one such evaluation of a model without
training.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from vime_core.cluster.orchestration import init_ray, stop_actors
from vime_core.config import RunConfig
from vime_core.config.context import PluginContext, legacy_args
from vime_core.engines.health import engines_lost
from vime_core.engines.process import start_run_reaper
from vime_core.failures import RunFailedError
from vime_core.plugins.manager import get_plugins
from vime_core.rollout.evaluation import eval_steps
from vime_core.run.checkpoint_schedule import TRAINED_PROMPTS_FILE, append_jsonl, save_checkpoint, should_save
from vime_core.run.evaluate import evaluate, evaluate_at
from vime_core.run.failed_step import save_after_failed_write, stop_engines_lost
from vime_core.run.output_dir import (
    OutputDirLock,
    archive_records,
    finished_run,
    read_summary,
    rotate_logs,
    share_like_outputs,
    write_json_atomic,
)
from vime_core.run.preflight import Preflight, preflight
from vime_core.run.progress import StepProgress, console, summary_lines
from vime_core.run.report import write_report
from vime_core.run.setup import create_actors, finish_setup, resume, start_engines
from vime_core.run.signals import INTERRUPT_GRACE_S, SETUP_INTERRUPT_GRACE_S, claim_signals, interrupted
from vime_core.run.state import RunState
from vime_core.run.step import LostAfterTraining, one_step
from vime_core.run.step_source import GroupSource, wait_rollout
from vime_core.run.summary import completed_summary, failed_summary
from vime_core.weight_sync.base import WeightWriteError

__all__ = ["evaluate", "run"]

logger = logging.getLogger("vime.loop")


def run(cfg: RunConfig, flags: dict[str, Any], checked: Preflight | None = None) -> dict[str, Any]:
    """Run training as configured by ``cfg`` (built by the CLI from :func:`vime_core.cli.arguments.parse_run_args`).

    An output directory that holds a finished run of ``--num-rollout`` steps
    (:func:`~vime_core.run.output_dir.finished_run`) is left as it is: one line says so and its ``summary.json`` is
    returned. With ``--no-resume`` the records of an earlier run there move to ``OUTPUT_DIR/previous/N/`` first; the
    logs of earlier invocations are rotated (``logs/router.1.log``, ...).

    :param flags: every resolved flag by name, plugin flags included: what ``args.json`` and the W&B run config
        record (the configuration itself is read from ``cfg`` only).
    :param checked: the result of :func:`~vime_core.run.preflight.preflight` when the caller ran it (the ``vime``
        command, before importing this module); ``None``: run it here.
    :return: the summary also written to ``OUTPUT_DIR/summary.json``.
    """
    log, out = cfg.logging, Path(cfg.logging.output_dir)
    if log.resume and (note := finished_run(out, cfg.rollout.num_rollout)) is not None:
        console.print(note)
        return read_summary(out) or {}
    pre = checked or preflight(cfg)  # every check before the output directory changes or anything expensive starts
    console.print(f"[vime] model: {pre.model_path}")
    with OutputDirLock(out, "vime run"):  # one run per output directory
        if not log.resume and (moved := archive_records(out)) is not None:
            console.print(f"[vime] --no-resume: the earlier run's records moved to {moved}")
        rotate_logs(out / "logs")  # an earlier invocation's logs stay, as router.1.log, ...
        # what the run records about itself: only now, each file whole or not at all
        write_json_atomic(out / "plugins.json", pre.plugins.describe())
        write_json_atomic(out / "args.json", flags)  # paths as strings
        return _run(flags, cfg, pre)


def _run(flags: dict[str, Any], cfg: RunConfig, pre: Preflight) -> dict[str, Any]:
    """:func:`run` once its checks passed and it holds the output directory."""
    import ray

    start_run_reaper()  # whatever ends this process, nothing carrying the run's marker outlives it by long
    init_ray(address=cfg.cluster.ray_address, worker_niceness=cfg.cluster.ray_worker_niceness)
    claim_signals()  # Ray's own SIGTERM handler would abort the driver with a core dump
    try:  # whatever happens from here (a signal while actors are created), Ray and every actor of the run stop
        return _run_on_ray(flags, cfg, pre)
    finally:
        ray.shutdown()


def _run_on_ray(flags: dict[str, Any], cfg: RunConfig, pre: Preflight) -> dict[str, Any]:
    """:func:`_run` on a started Ray: place, start the actors, set up, train, write the summary."""
    run = create_actors(flags, cfg, pre)
    try:
        ckpt = resume(run)
        start_engines(run, ckpt)
        finish_setup(run, pre.t_setup)
        _train(run, pre.estimator, pre.overlong)
        return _write_summary(run)
    except Exception as e:
        run.failed = True
        error = getattr(e, "cause", None) or e  # raised in a Ray actor: the actor's own exception
        try:
            write_json_atomic(run.out / "summary.json", failed_summary(run.out, run.start_step, error, run.resumed_at))
        except Exception:  # noqa: BLE001 - the run's own error is the one to report
            logger.exception("writing the failed run's summary.json")
        if isinstance(error, RunFailedError) and type(e) is not RunFailedError:
            raise RunFailedError(str(error)) from None  # one line, without Ray's traceback
        raise
    finally:
        _stop(run)


def _train(run: RunState, estimator, overlong: int) -> None:
    """The steps from :attr:`RunState.start_step` to ``--num-rollout`` in the run's loop mode, with the
    evaluations (:func:`~vime_core.rollout.evaluation.eval_steps`) and checkpoints between them; a step whose engines
    are lost, or whose weights could not be written, ends the run through its failure path."""
    import ray

    cfg, rollout, plugins = run.cfg, run.rollout, get_plugins()
    eval_at: set[int] = set()
    if rollout is not None and cfg.eval.eval_prompt_data:
        before_train = not cfg.eval.skip_eval_before_train
        eval_at = set(eval_steps(cfg.rollout.num_rollout, cfg.eval.eval_interval, run.start_step, before_train))
    if 0 in eval_at:  # before training, at weight version 0 (before the async producer competes for the engines)
        run.evals.append(evaluate_at(rollout, run.sink, 0))
    if rollout is not None and cfg.rollout.loop == "fully-async":
        ray.get(rollout.start_async.remote())
    last_save = time.monotonic()
    with StepProgress(console, cfg.rollout.num_rollout, run.start_step) as progress:
        run.source = GroupSource(cfg.rollout, rollout, lambda ref: wait_rollout(ref, progress, run.board))
        for step in range(run.start_step, cfg.rollout.num_rollout):
            run.step = step
            metrics = _guarded_step(run, estimator, progress)
            if cfg.data.rollout_max_prompt_len:
                metrics["data/overlong_prompts_filtered"] = float(overlong)
            run.history.append(metrics)
            run.sink.log(step, metrics)
            append_jsonl(run.out / TRAINED_PROMPTS_FILE, {"step": step, **run.source.last_taken})
            plugins.pm.hook.vime_on_train_step_end(
                ctx=PluginContext(cfg, plugins=plugins), step=step, metrics=metrics, args=legacy_args(cfg)
            )
            progress.step_done(step, metrics)
            if step + 1 in eval_at:  # after the weight update: the engines serve version step + 1
                run.evals.append(evaluate_at(rollout, run.sink, step + 1, progress.console))
            if run.trainer is not None and should_save(run.log, step + 1, time.monotonic() - last_save):
                save_checkpoint(run.log, run.out, step + 1, run.version, run.trainer, rollout, run.source.unconsumed())
                last_save = time.monotonic()


def _guarded_step(run: RunState, estimator, progress: StepProgress) -> dict[str, float]:
    """:func:`one_step` at :attr:`RunState.step`, advancing :attr:`RunState.version`; a lost fleet or a failed
    weight write raises the error of its failure path (after its checkpoint)."""
    try:
        metrics, run.version = one_step(
            run.cfg, run.step, run.source, run.rollout, run.trainer, estimator, run.version, progress
        )
    except WeightWriteError as e:  # trained, but the weights could not be written for the engines
        raise save_after_failed_write(run, e) from None
    except LostAfterTraining as e:  # trained, but no engine is left to take the weights
        raise stop_engines_lost(run, e.error, e.version) from None
    except Exception as e:
        if not engines_lost(e):
            raise
        # nothing left to generate with: keep what trained, stop with the monitor's report
        raise stop_engines_lost(run, e) from None
    return metrics


def _write_summary(run: RunState) -> dict[str, Any]:
    """The completed run's ``summary.json`` (with the first and last evaluation, the final HF model and adapter),
    its printed lines and ``report.html``."""
    import ray

    log, out, trainer = run.log, run.out, run.trainer
    summary = completed_summary(out, run.start_step, run.resumed_at)  # the whole run, every invocation
    summary["ray_node_ip"] = ray.util.get_node_ip_address()
    if trainer is not None and log.save_hf:
        trainer.save_hf(str(out / "final_hf"))  # with LoRA: the merged model
        share_like_outputs(out / "final_hf")  # transformers writes model.safetensors readable by its owner only
        summary["final_hf"] = str(out / "final_hf")
        if run.cfg.lora.enabled:
            trainer.save_adapter(str(out / "final_adapter"))
            share_like_outputs(out / "final_adapter")
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
    if interrupted() and not run.setup_done:
        grace = SETUP_INTERRUPT_GRACE_S
    elif interrupted() or not run.setup_done:
        grace = INTERRUPT_GRACE_S
    elif run.failed:
        grace = min(grace, run.log.failure_exit_timeout / 2)
    stop_actors(run.rollout, run.trainer, grace)
    ray.shutdown()

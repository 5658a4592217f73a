"""Evaluation from the driver: ``vime eval`` (:func:`evaluate`, one evaluation of a model without training) and the
evaluations of ``vime run`` (:func:`evaluate_at`, logged as their own ``metrics.jsonl`` record)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from vime_core.cluster.orchestration import call
from vime_core.config import RunConfig
from vime_core.rollout.evaluation import eval_line
from vime_core.rollout.manager import RolloutManager
from vime_core.run.metrics import MetricsSink, wandb_config
from vime_core.run.output_dir import OutputDirLock, archive_records, write_json_atomic
from vime_core.run.preflight import Preflight, preflight
from vime_core.run.progress import console, summary_lines


def evaluate(cfg: RunConfig, flags: dict[str, Any], checked: Preflight | None = None) -> dict[str, Any]:
    """``vime eval``: start the engines and router for ``--model``, evaluate every ``--eval-prompt-data`` set once
    (the code path of evaluations during ``vime run``: :meth:`RolloutManager.evaluate`), write the metrics as step 0
    of ``OUTPUT_DIR/metrics.jsonl`` (and TensorBoard) and ``OUTPUT_DIR/summary.json``, stop everything.

    The manager runs in this process (no Ray: there is no trainer to place).

    :param cfg: built by the CLI from :func:`vime_core.cli.arguments.parse_run_args` with ``command="eval"``.
    :param flags: every resolved flag by name (``args.json``, the W&B run config).
    :param checked: :func:`~vime_core.run.preflight.preflight`'s result when the caller ran it (``None``: run it here).
    :return: the ``eval/*`` metrics plus ``model`` and ``output_dir``.
    :raises DataError: an unreadable eval set (before any engine starts).
    """
    out = Path(cfg.logging.output_dir)
    checked = checked or preflight(cfg, "eval")
    console.print(f"[vime] model: {checked.model_path}")
    with OutputDirLock(out, "vime eval"):
        if (moved := archive_records(out)) is not None:  # an earlier evaluation's records are kept
            console.print(f"[vime] the earlier evaluation's records moved to {moved}")
        write_json_atomic(out / "args.json", flags)
        return _evaluate_locked(flags, cfg, out, checked.model_path)


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
        metrics = manager.evaluate(0)
        metrics.pop("eval/weight_version", None)  # the model as given, not a weight version of a run
        sink.log(0, metrics)
        console.print(eval_line(0, metrics, model=str(model_path)))
    finally:
        sink.close()
        manager.shutdown()
    summary = {"model": str(model_path), "output_dir": str(out), **metrics}
    write_json_atomic(out / "summary.json", summary)
    for line in summary_lines(summary):
        console.print(line)
    return summary


def evaluate_at(rollout: Any, sink: MetricsSink, step: int, out_console: Console = console) -> dict[str, float]:
    """Evaluate at ``step`` finished training steps (a Ray actor handle or a plain :class:`RolloutManager`), log
    the metrics as their own record with that ``step``, print one line."""
    metrics = call(rollout, "evaluate", step)
    sink.log(step, metrics)
    out_console.print(eval_line(step, metrics))
    return metrics

"""The synchronous RL loop of ``vime run``: generate → advantages → train → weight sync, with checkpoints.

Per step it prints one progress line (rollout / train / sync seconds, mean reward, response length), writes
metrics to TensorBoard and ``metrics.jsonl``, and every ``--save-interval`` steps (and at the end) a checkpoint
that a resume continues from without repeating or skipping prompts. With ``--eval-prompt-data`` it evaluates before
training, every ``--eval-interval`` steps and after the last step (:func:`vime_core.evaluation.eval_steps`); an
evaluation is its own ``metrics.jsonl`` record whose ``step`` is the number of finished training steps.
``vime eval`` (:func:`evaluate`) runs one such evaluation of a model without training.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from vime_core.algorithms.batch import build_batch
from vime_core.checkpoint import commit_checkpoint, latest_checkpoint, new_checkpoint_dir
from vime_core.evaluation import eval_line, eval_steps, load_eval_sets
from vime_core.metrics import MetricsSink
from vime_core.plugins import get_plugins
from vime_core.types import Sample

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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run training as configured by ``args`` (from :func:`vime_core.arguments.parse_run_args`).

    :return: the summary also written to ``OUTPUT_DIR/summary.json``.
    """
    import ray

    from vime_core.models import resolve_model
    from vime_core.orchestration import TrainerWorker, init_ray, remote_actor
    from vime_core.rollout.manager import RolloutManager

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    plugins = get_plugins()
    (out / "plugins.json").write_text(json.dumps(plugins.describe(), indent=1))
    (out / "args.json").write_text(json.dumps(vars(args), indent=1, default=str))  # paths as strings
    estimator = plugins.resolve("advantage", args.advantage_estimator)
    # resolve every named part before starting anything expensive, so a typo fails in a second
    for kind, name in (
        ("generate", args.generate),
        ("reward", args.reward),
        ("reward", args.eval_reward or args.reward),
        ("trainer", args.trainer),
        ("weight_sync", args.weight_sync),
    ):
        plugins.resolve(kind, name)
    load_eval_sets(args)  # a bad eval set fails before any engine starts

    t_setup = time.perf_counter()
    model_path = resolve_model(args.model)
    console.print(f"[vime] model: {model_path}")
    init_ray()
    rollout = None if args.debug_train_only else remote_actor(RolloutManager, args, str(model_path))
    trainer = None if args.debug_rollout_only else remote_actor(TrainerWorker, args, str(model_path))
    sink = MetricsSink(out, args.use_tensorboard)
    history: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    start_step, version = 0, 0
    try:
        ckpt = latest_checkpoint(out) if args.resume else None
        if ckpt is not None:
            meta = json.loads((ckpt / "meta.json").read_text())
            start_step, version = meta["step"], meta["weight_version"]
            console.print(f"[vime] resuming from {ckpt} (step {start_step}, weight version {version})")
            if trainer is not None:
                ray.get(trainer.load_checkpoint.remote(str(ckpt / "trainer")))
            if rollout is not None:
                ray.get(rollout.load_data_state.remote(json.loads((ckpt / "data_source.json").read_text())))
        if rollout is not None:
            info = ray.get(rollout.start.remote())
            console.print(
                f"[vime] router {info['router_url']} → engines {info['engine_urls']} "
                f"(ready in {info['startup_seconds']:.1f} s)"
            )
            if "teacher_router_url" in info:
                console.print(f"[vime] teacher {args.distill_teacher}: router {info['teacher_router_url']}")
            if ckpt is not None and trainer is not None:
                ray.get(rollout.update_weights.remote(ray.get(trainer.push_weights.remote(version))))
        console.print(f"[vime] setup {time.perf_counter() - t_setup:.1f} s")

        eval_at: set[int] = set()
        if rollout is not None and args.eval_prompt_data:
            eval_at = set(
                eval_steps(args.num_rollout, args.eval_interval, start_step, not args.skip_eval_before_train)
            )
        if 0 in eval_at:  # before training, at weight version 0 (before the async producer competes for the engines)
            evals.append(_evaluate(rollout, sink, 0))
        if rollout is not None and args.loop == "fully-async":
            ray.get(rollout.start_async.remote())
        source = _GroupSource(args, rollout)
        with Progress(
            TextColumn("[vime] step", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        ) as progress:
            task = progress.add_task("steps", total=args.num_rollout, completed=start_step)
            for step in range(start_step, args.num_rollout):
                metrics = _one_step(args, step, source, rollout, trainer, estimator, version)
                if trainer is not None:
                    version = step + 1
                history.append(metrics)
                sink.log(step, metrics)
                plugins.pm.hook.vime_on_train_step_end(args=args, step=step, metrics=metrics)
                progress.console.print(_progress_line(step, args.num_rollout, metrics))
                progress.advance(task)
                if step + 1 in eval_at:  # after the weight update: the engines serve version step + 1
                    evals.append(_evaluate(rollout, sink, step + 1, progress.console))
                last = step + 1 == args.num_rollout
                if trainer is not None and (last or (args.save_interval and (step + 1) % args.save_interval == 0)):
                    _save_checkpoint(out, step + 1, version, trainer, rollout)
        summary = _summary(args, out, history, start_step)
        if evals:
            summary["eval_first"], summary["eval_last"] = evals[0], evals[-1]
        summary["ray_node_ip"] = ray.util.get_node_ip_address()
        if trainer is not None and args.save_hf:
            ray.get(trainer.save_hf.remote(str(out / "final_hf")))
            summary["final_hf"] = str(out / "final_hf")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        console.print("[vime] summary: " + json.dumps(summary))
        return summary
    finally:
        sink.close()
        if rollout is not None:
            try:
                ray.get(rollout.shutdown.remote(), timeout=120)
            except Exception:  # noqa: BLE001
                logger.exception("rollout shutdown")
        ray.shutdown()


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """``vime eval``: start the engines and router for ``--model``, evaluate every ``--eval-prompt-data`` set once
    (the code path of evaluations during ``vime run``: :meth:`RolloutManager.evaluate`), write the metrics as step 0
    of ``OUTPUT_DIR/metrics.jsonl`` (and TensorBoard) and ``OUTPUT_DIR/summary.json``, stop everything.

    The manager runs in this process (no Ray: there is no trainer to place).

    :param args: from :func:`vime_core.arguments.parse_run_args` with ``command="eval"``.
    :return: the ``eval/*`` metrics plus ``model`` and ``output_dir``.
    :raises DataError: an unreadable eval set (before any engine starts).
    """
    from vime_core.models import resolve_model
    from vime_core.rollout.manager import RolloutManager

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "args.json").write_text(json.dumps(vars(args), indent=1, default=str))
    plugins = get_plugins()
    plugins.resolve("generate", args.generate)
    plugins.resolve("reward", args.eval_reward or args.reward)
    load_eval_sets(args)  # a bad eval set fails before any engine starts
    model_path = resolve_model(args.model)
    console.print(f"[vime] model: {model_path}")
    manager = RolloutManager(args, model_path)
    sink = MetricsSink(out, args.use_tensorboard)
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
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    console.print("[vime] summary: " + json.dumps(summary))
    return summary


def _evaluate(rollout: Any, sink: MetricsSink, step: int, out_console: Console = console) -> dict[str, float]:
    """Evaluate at ``step`` finished training steps (a Ray actor handle or a plain :class:`RolloutManager`), log
    the metrics as their own record with that ``step``, print one line."""
    if hasattr(rollout.evaluate, "remote"):
        import ray

        metrics = ray.get(rollout.evaluate.remote(step))
    else:
        metrics = rollout.evaluate(step)
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

    def __init__(self, args: argparse.Namespace, rollout: Any) -> None:
        self.args = args
        self.rollout = rollout
        self.prefetched: Any = None

    def get(self, step: int, version: int) -> tuple[list[list[Sample]], dict[str, float]]:
        import ray

        args = self.args
        if args.load_debug_rollout_data:
            from vime_core.rollout.manager import rollout_metrics

            groups = load_debug_rollout(args.load_debug_rollout_data, step)
            return groups, rollout_metrics([s for g in groups for s in g], args.reward_key)
        if args.loop == "fully-async":
            return ray.get(self.rollout.get_async_groups.remote(step, version))
        if args.loop == "one-step-off":
            ref = self.prefetched if self.prefetched is not None else self.rollout.generate.remote(step)
            self.prefetched = self.rollout.generate.remote(step + 1) if step + 1 < args.num_rollout else None
            return ray.get(ref)
        return ray.get(self.rollout.generate.remote(step))


def _one_step(args, step, source, rollout, trainer, estimator, version) -> dict[str, float]:
    import ray

    metrics: dict[str, float] = {}
    t0 = time.perf_counter()
    groups, m = source.get(step, version)
    metrics.update(m)
    metrics["perf/rollout_time"] = time.perf_counter() - t0
    if args.save_debug_rollout_data:
        save_debug_rollout(args.save_debug_rollout_data, step, groups)
    versions = [v for g in groups for s in g for v in s.trained_weight_versions()]
    if versions:
        metrics["rollout/staleness_max"] = float(version - min(versions))
    if trainer is None:
        return metrics
    batch = build_batch(args, groups, estimator, step)
    metrics.update(batch.metrics)
    if not batch.samples:
        logger.warning("step %d: no trainable sample (all failed/aborted); skipping the update", step)
        return metrics
    t1 = time.perf_counter()
    metrics.update(ray.get(trainer.train_step.remote(batch)))
    metrics["perf/train_time"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    update = ray.get(trainer.push_weights.remote(step + 1))
    if rollout is not None:
        metrics.update(ray.get(rollout.update_weights.remote(update)))
    metrics["perf/sync_time"] = time.perf_counter() - t2
    metrics["perf/step_time"] = time.perf_counter() - t0
    return metrics


def _save_checkpoint(out: Path, step: int, version: int, trainer, rollout) -> Path:
    import ray

    tmp = new_checkpoint_dir(out, step)
    ray.get(trainer.save_checkpoint.remote(str(tmp / "trainer")))
    data_state = ray.get(rollout.data_state.remote()) if rollout is not None else None
    return commit_checkpoint(tmp, {"step": step, "weight_version": version}, data_state)


def _progress_line(step: int, total: int, m: dict[str, float]) -> str:
    parts = [f"step {step + 1}/{total}"]
    if "rollout/reward_mean" in m:
        parts.append(f"reward {m['rollout/reward_mean']:.3f}")
    if "rollout/response_len_mean" in m:
        parts.append(f"resp_len {m['rollout/response_len_mean']:.1f}")
    for key, label in (("perf/rollout_time", "rollout"), ("perf/train_time", "train"), ("perf/sync_time", "sync")):
        if key in m:
            parts.append(f"{label} {m[key]:.1f}s")
    if "train/train_rollout_logprob_abs_diff" in m:
        parts.append(f"|Δlogp| {m['train/train_rollout_logprob_abs_diff']:.4f}")
    return "[vime] " + " | ".join(parts)


def _summary(args, out: Path, history: list[dict[str, float]], start_step: int) -> dict[str, Any]:
    rewards = [m["rollout/reward_mean"] for m in history if "rollout/reward_mean" in m]
    times = [m.get("perf/step_time", m.get("perf/rollout_time", 0.0)) for m in history]
    return {
        "output_dir": str(out),
        "steps_run": len(history),
        "first_step": start_step,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "mean_step_seconds": sum(times) / len(times) if times else None,
    }

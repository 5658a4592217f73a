"""The setup phases of ``vime run`` on a started Ray: place the run and create its actors (:func:`create_actors`),
resume from a checkpoint (:func:`resume`), start the engines while the trainer loads (:func:`start_engines`),
record where everything landed (:func:`finish_setup`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from vime_core.cluster.orchestration import driver_node_id, place, remote_actor, wait_setup
from vime_core.config import RunConfig
from vime_core.rollout.manager import RolloutManager
from vime_core.run.checkpoint import latest_checkpoint
from vime_core.run.checkpoint_schedule import roll_back_records
from vime_core.run.metrics import MetricsSink, wandb_config
from vime_core.run.output_dir import read_summary, write_json_atomic
from vime_core.run.preflight import Preflight
from vime_core.run.progress import RolloutProgress, console
from vime_core.run.state import RunState
from vime_core.trainer.group import TrainerGroup


def create_actors(flags: dict[str, Any], cfg: RunConfig, pre: Preflight) -> RunState:
    """Place the run (``plan.json``) and create its actors: the rollout manager and the progress board on the
    driver's node, the trainer group (handed the classes ``pre`` resolved) on its bundles; the metrics sink."""
    model_path = pre.model_path
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
    trainer = None if log.debug_rollout_only else TrainerGroup(cfg, model_path, pre.trainer_classes, plan, pg)
    sink = MetricsSink(out, log.use_tensorboard, wandb_config(log, flags))
    return RunState(flags, cfg, log, out, trainer, rollout, None, board, sink)


def resume(run: RunState) -> Path | None:
    """With ``--resume`` and a checkpoint: roll the records back to it, load the trainer's state and the data
    buffer's; :attr:`RunState.start_step` and :attr:`RunState.version` are then the checkpoint's, and
    :attr:`RunState.resumed_at` the earlier resumes (from the run's last ``summary.json``). Without a checkpoint
    every record goes (an invocation killed before its first checkpoint runs every step again).

    :return: the checkpoint, or ``None``.
    """
    import ray

    ckpt = latest_checkpoint(run.out) if run.log.resume else None
    if ckpt is None:
        roll_back_records(run.out, 0)  # an invocation killed before its first checkpoint: every step runs again
    else:
        meta = json.loads((ckpt / "meta.json").read_text())
        run.start_step, run.version = meta["step"], meta["weight_version"]
        run.step = run.start_step
        run.resumed_at = list((read_summary(run.out) or {}).get("resumed_at") or [])
        console.print(f"[vime] resuming from {ckpt} (step {run.start_step}, weight version {run.version})")
        roll_back_records(run.out, run.start_step)  # steps after the checkpoint are trained again
        if run.trainer is not None:
            run.trainer.load_checkpoint(str(ckpt / "trainer"))
        if run.rollout is not None:
            ray.get(run.rollout.load_data_state.remote(json.loads((ckpt / "data_source.json").read_text())))
    return ckpt


def start_engines(run: RunState, ckpt: Path | None) -> None:
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


def finish_setup(run: RunState, t_setup: float) -> None:
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

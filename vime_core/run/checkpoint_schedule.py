"""When ``vime run`` checkpoints (:func:`should_save`), what a checkpoint holds of the run's actors
(:func:`save_checkpoint`), and what a resume rolls back of the run's records (:func:`roll_back_records`,
``trained_prompts.jsonl``). The layout itself: :mod:`vime_core.run.checkpoint`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vime_core.cluster.orchestration import call
from vime_core.config import LoggingConfig
from vime_core.run.checkpoint import commit_checkpoint, new_checkpoint_dir
from vime_core.types import Sample


def should_save(log: LoggingConfig, steps_done: int, seconds_since_save: float) -> bool:
    """Whether to checkpoint after ``steps_done`` finished steps: after the last step, every ``--save-interval``
    steps, and once ``--save-interval-minutes`` have passed since the last checkpoint (or the start)."""
    if steps_done == log.num_rollout:
        return True
    if log.save_interval and steps_done % log.save_interval == 0:
        return True
    minutes = log.save_interval_minutes
    return bool(minutes) and seconds_since_save >= minutes * 60


def save_checkpoint(
    log: LoggingConfig, out: Path, step: int, version: int, trainer, rollout, unconsumed: list[list[Sample]]
) -> Path:
    """Checkpoint after ``step`` finished steps (:mod:`vime_core.run.checkpoint`); ``unconsumed`` groups (taken from
    the buffer, not yet trained) are saved with the buffer so a resume trains them next."""
    tmp = new_checkpoint_dir(out, step)
    trainer.save_checkpoint(str(tmp / "trainer"))
    data_state = call(rollout, "data_state", unconsumed) if rollout is not None else None
    meta = {"step": step, "weight_version": version}
    return commit_checkpoint(tmp, meta, data_state, log.keep_checkpoints or None)  # 0: keep all


TRAINED_PROMPTS_FILE = "trained_prompts.jsonl"


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def roll_back_records(out: Path, start_step: int) -> None:
    """On a resume from a checkpoint after ``start_step`` steps: drop the records of the steps after it (a run
    killed after the checkpoint trained them, and trains them again now) from ``metrics.jsonl`` and
    ``trained_prompts.jsonl`` — training records with ``step >= start_step`` and evaluation records (``eval/*``
    keys) with ``step > start_step`` (``start_step`` 0, a start without a checkpoint: every evaluation too, the
    one before training runs again). Torn last lines (a kill mid-write) are dropped too."""
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
            if rec.get("step", 0) < start_step or (is_eval and rec["step"] == start_step and start_step > 0):
                kept.append(line + "\n")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)

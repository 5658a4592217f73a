"""``OUTPUT_DIR/summary.json`` of ``vime run``: ``"status": "completed"`` with the final model, or ``"failed"`` with
the error and the last completed step (docs/loop_modes.md, "Flakes and systemic failures").

The summary covers the whole run, every invocation of it (a resume continues the run): it is computed from the
run's records in ``metrics.jsonl``, which a resume rolls back to its checkpoint, not from the last invocation's
steps only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vime_core.failures import RunFailedError


def run_records(out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training records and the evaluation records (those with ``eval/*`` keys) of ``OUTPUT_DIR/metrics.jsonl``,
    in file order, ``step`` included; a torn line (a kill mid-write) is skipped. No file: two empty lists."""
    path = Path(out) / "metrics.jsonl"
    train: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    if not path.is_file():
        return train, evals
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            (evals if any(k.startswith("eval/") for k in rec) else train).append(rec)
    return train, evals


def completed_summary(out: Path, start_step: int, resumed_at: list[int] | None = None) -> dict[str, Any]:
    """``summary.json`` of a run whose steps all finished (``"status": "completed"``), over every invocation:
    ``steps_run`` (training steps in ``metrics.jsonl``), ``resumed_at`` (the steps at which an invocation resumed
    it: ``resumed_at`` of the previous summary plus ``start_step`` when above 0), the first, last and mean
    ``rollout/reward_mean``, the mean step time (``perf/step_time``, else ``perf/rollout_time``) and, when the run
    evaluated, ``eval_first`` / ``eval_last`` (the first and last evaluation record without ``step``)."""
    train, evals = run_records(out)
    rewards = [m["rollout/reward_mean"] for m in train if "rollout/reward_mean" in m]
    times = [m.get("perf/step_time", m.get("perf/rollout_time", 0.0)) for m in train]
    summary: dict[str, Any] = {
        "output_dir": str(out),
        "status": "completed",
        "steps_run": len(train),
        "resumed_at": list(resumed_at or []) + ([start_step] if start_step else []),
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "mean_step_seconds": sum(times) / len(times) if times else None,
    }
    if evals:
        first, last = evals[0], evals[-1]
        summary["eval_first"] = {k: v for k, v in first.items() if k != "step"}
        summary["eval_last"] = {k: v for k, v in last.items() if k != "step"}
    return summary


def failed_summary(
    out: Path, start_step: int, error: BaseException, resumed_at: list[int] | None = None
) -> dict[str, Any]:
    """``summary.json`` of a run that failed: :func:`completed_summary`'s fields with ``"status": "failed"``,
    ``error`` (the original error's message), ``last_completed_step`` (0-based index of the last step that finished,
    in this invocation or an earlier one; None if none) and ``failed_step``; no ``final_hf`` (a failed run saves no
    final model)."""
    summary = completed_summary(out, start_step, resumed_at)
    done = summary["steps_run"]
    return {
        **summary,
        "status": "failed",
        "error": f"{error}" if isinstance(error, RunFailedError) else f"{type(error).__name__}: {error}",
        "last_completed_step": done - 1 if done else None,
        "failed_step": done,
    }

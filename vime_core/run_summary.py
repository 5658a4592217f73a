"""``OUTPUT_DIR/summary.json`` of ``vime run``: ``"status": "completed"`` with the final model, or ``"failed"`` with
the error and the last completed step (docs/loop_modes.md, "Flakes and systemic failures")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vime_core.failures import RunFailedError


def completed_summary(out: Path, history: list[dict[str, float]], start_step: int) -> dict[str, Any]:
    """``summary.json`` of a run whose steps all finished (``"status": "completed"``): steps, rewards, step time."""
    rewards = [m["rollout/reward_mean"] for m in history if "rollout/reward_mean" in m]
    times = [m.get("perf/step_time", m.get("perf/rollout_time", 0.0)) for m in history]
    return {
        "output_dir": str(out),
        "status": "completed",
        "steps_run": len(history),
        "first_step": start_step,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "mean_step_seconds": sum(times) / len(times) if times else None,
    }


def failed_summary(
    out: Path, history: list[dict[str, float]], start_step: int, error: BaseException
) -> dict[str, Any]:
    """``summary.json`` of a run that failed: ``"status": "failed"``, ``error`` (the original error's message),
    ``last_completed_step`` (0-based index of the last step that finished, in this run or before its resume; None if
    none) and ``failed_step``; no ``final_hf`` (a failed run saves no final model)."""
    done = start_step + len(history)
    return {
        **completed_summary(out, history, start_step),
        "status": "failed",
        "error": f"{error}" if isinstance(error, RunFailedError) else f"{type(error).__name__}: {error}",
        "last_completed_step": done - 1 if done else None,
        "failed_step": done,
    }

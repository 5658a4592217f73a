"""Progress output of ``vime run``.

* stdout is not a terminal (a log file, CI, a pipe): exactly one line per step, no bar redraws
  (:func:`step_line`, e.g. ``[vime] step 3/10 | reward 0.500 | resp_len 12.0 | rollout 2.0s | train 3.0s | sync
  1.0s | |Δlogp| 0.0012``; ``|Δlogp|`` in two significant digits: ``6.4e-06``, never ``0.0000``);
* a terminal: the same step lines, plus a live rich bar under them with the current phase (``rollout 12/32
  samples``, ``train``, ``sync``), removed when the run ends;
* at the end, a short summary (:func:`summary_lines`); the whole record stays in ``OUTPUT_DIR/summary.json``.

:class:`RolloutProgress` is the counter the rollout manager (a Ray actor) updates as samples finish and the driver
reads while it waits for the rollout.
"""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

#: the driver's output: one line per event and step (no wrap at 80 columns in logs)
console = Console(stderr=False, highlight=False, markup=False, soft_wrap=True)

STEP_LINE_FIELDS = (
    ("perf/rollout_time", "rollout"),
    ("perf/train_time", "train"),
    ("perf/sync_time", "sync"),
)


def step_line(step: int, total: int, m: dict[str, float]) -> str:
    """The one line printed per step (``step`` counts from 0 as in ``metrics.jsonl``; the line from 1). Fields
    without their metric are left out."""
    parts = [f"step {step + 1}/{total}"]
    if "rollout/reward_mean" in m:
        parts.append(f"reward {m['rollout/reward_mean']:.3f}")
    if "rollout/response_len_mean" in m:
        parts.append(f"resp_len {m['rollout/response_len_mean']:.1f}")
    for key, label in STEP_LINE_FIELDS:
        if key in m:
            parts.append(f"{label} {m[key]:.1f}s")
    if "train/train_rollout_logprob_abs_diff" in m:
        # significant digits, not decimals: a drift of 6e-6 must not print as 0.0000
        parts.append(f"|Δlogp| {m['train/train_rollout_logprob_abs_diff']:.2g}")
    return "[vime] " + " | ".join(parts)


def summary_lines(summary: dict) -> list[str]:
    """The closing lines of ``vime run`` / ``vime eval`` from their ``summary.json`` record: steps and reward, the
    evaluations' reward first → last per set, where the outputs are. Fields the record lacks are left out."""
    lines = []
    if "steps_run" in summary:
        text = f"[vime] done: {summary['steps_run']} step(s)"
        if summary.get("resumed_at"):
            text += f" (resumed at step {', '.join(map(str, summary['resumed_at']))})"
        if summary.get("mean_step_seconds") is not None:
            text += f", {summary['mean_step_seconds']:.1f} s a step"
        if summary.get("reward_first") is not None:
            text += f" | reward {summary['reward_first']:.3f} → {summary['reward_last']:.3f}"
            text += f" (mean {summary['reward_mean']:.3f})"
        lines.append(text)
    first_eval, last_eval = summary.get("eval_first"), summary.get("eval_last")
    evals = {k: v for k, v in summary.items() if k.startswith("eval/") and k.endswith("/reward_mean")}
    if first_eval and last_eval:
        keys = sorted(k for k in first_eval if k.startswith("eval/") and k.endswith("/reward_mean"))
        parts = [f"{k.split('/')[1]} {first_eval[k]:.3f} → {last_eval[k]:.3f}" for k in keys if k in last_eval]
        if parts:
            lines.append("[vime] eval reward: " + " | ".join(parts))
    elif evals:
        parts = [f"{k.split('/')[1]} {v:.3f}" for k, v in sorted(evals.items())]
        lines.append("[vime] eval reward: " + " | ".join(parts))
    outputs = [name for name in ("final_hf", "final_adapter") if summary.get(name)]
    where = f"[vime] outputs: {summary['output_dir']} (summary.json, metrics.jsonl"
    lines.append(where + "".join(f", {name}/" for name in outputs) + ")")
    return lines


class RolloutProgress:
    """Samples finished out of those wanted in the current rollout (run as a Ray actor with
    :func:`vime_core.cluster.orchestration.remote_actor`; the rollout manager calls :meth:`set`, the driver
    :meth:`get`)."""

    def __init__(self) -> None:
        self.done, self.total = 0, 0

    def set(self, done: int, total: int) -> None:
        """Record ``done`` finished samples out of ``total`` wanted."""
        self.done, self.total = done, total

    def get(self) -> tuple[int, int]:
        """``(done, total)``."""
        return self.done, self.total


class StepProgress:
    """The per-step output of a run (a context manager).

    :param console: where to print; ``console.is_terminal`` picks the live bar or plain lines.
    :param total: steps of the run (``--num-rollout``).
    :param completed: steps already done (a resumed run).
    """

    def __init__(self, console: Console, total: int, completed: int = 0) -> None:
        self.console = console
        self.total = total
        self.completed = completed
        self.live = console.is_terminal
        self._progress: Progress | None = None
        self._task = None

    def __enter__(self) -> StepProgress:
        if self.live:
            self._progress = Progress(
                TextColumn("[vime] step", markup=False),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[phase]}", markup=False),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,  # the bar goes when the run ends; the step lines stay
            )
            self._progress.start()
            self._task = self._progress.add_task("steps", total=self.total, completed=self.completed, phase="")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def phase(self, text: str) -> None:
        """Show the current phase (``rollout 3/32 samples``, ``train``, ``sync``) on the bar; nothing without a
        terminal."""
        if self._progress is not None:
            self._progress.update(self._task, phase=text)

    def step_done(self, step: int, metrics: dict[str, float]) -> str:
        """Print the step's line (:func:`step_line`) and advance the bar; returns the line."""
        line = step_line(step, self.total, metrics)
        if self._progress is not None:
            self._progress.console.print(line)
            self._progress.update(self._task, advance=1, phase="")
        else:
            self.console.print(line)
        return line


def rollout_phase(done: int, total: int) -> str:
    """The phase text of a rollout: ``rollout 12/32 samples`` (``rollout`` before the first report)."""
    return f"rollout {done}/{total} samples" if total else "rollout"

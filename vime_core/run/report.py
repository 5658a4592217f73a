"""``vime report``: one self-contained HTML page of a run's curves, drawn with matplotlib from ``metrics.jsonl``.

:func:`build_figures` returns the matplotlib figures (one per panel; tests read the plotted data back from them),
:func:`write_report` saves each as a PNG and embeds the same bytes in the HTML; every curve is drawn against the
number of finished training steps (:func:`finished_steps`), and ``--compare`` overlays other runs. The panels and
their metrics: docs/report.md, "vime report".
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure  # not pyplot: no global figure registry, no display backend
from matplotlib.ticker import MaxNLocator

from vime_core.run.metrics import STALENESS_TOKENS_PREFIX

TIME_KEYS = (("perf/rollout_time", "rollout"), ("perf/train_time", "train"), ("perf/sync_time", "sync"))
MIB = float(1 << 20)
FIGSIZE, DPI = (7.5, 3.6), 100  # inches, dots per inch: 750 x 360 pixel PNGs


class ReportError(ValueError):
    """A run directory without readable metrics; the message names the file (and line) and what was expected."""


@dataclass
class Run:
    """One run's records: ``records`` are the ``metrics.jsonl`` lines in order (each a dict with ``step``)."""

    name: str
    path: Path
    records: list[dict[str, float]]
    args: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)

    def keys(self) -> set[str]:
        """Every metric key present in at least one record (``step`` excluded)."""
        return {k for r in self.records for k in r if k != "step"}

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """``(x, values)`` of the records holding ``key``, in file order; ``x`` counts finished training steps
        (:func:`finished_steps`), the x of every curve of the report."""
        xs = [float(finished_steps(r["step"], key)) for r in self.records if key in r]
        ys = [float(r[key]) for r in self.records if key in r]
        return xs, ys


#: the x axis of every report panel but the staleness histogram
X_LABEL = "finished training steps"


def finished_steps(step: int, key: str) -> int:
    """The report's x of metric ``key`` logged with ``step``: the number of finished training steps.

    A training record's ``step`` is slime's rollout id (0 .. N-1), logged when that step has finished, so it is
    plotted at ``step + 1``; an evaluation record's ``step`` (``eval/*`` keys) already counts finished steps
    (0 = before training, :mod:`vime_core.run.loop`), so eval and training curves share one x axis.
    """
    return step if key.startswith("eval/") else step + 1


def load_run(path: Path, name: str | None = None) -> Run:
    """Read ``path/metrics.jsonl`` (and ``args.json`` / ``summary.json`` when present).

    :raises ReportError: if the file is missing, empty, or a line is not a JSON object with an integer ``step``.
    """
    path = Path(path)
    mfile = path / "metrics.jsonl"
    if not mfile.is_file():
        raise ReportError(f"{mfile}: not found (expected the metrics.jsonl a `vime run` writes into its --output-dir)")
    records: list[dict[str, float]] = []
    for lineno, line in enumerate(mfile.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReportError(f"{mfile}:{lineno}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise ReportError(f"{mfile}:{lineno}: expected a JSON object with an integer 'step'")
        records.append(rec)
    if not records:
        raise ReportError(f"{mfile}: no metrics (the run logged no step)")
    extra = {}
    for fname in ("args.json", "summary.json"):
        f = path / fname
        try:
            extra[fname] = json.loads(f.read_text()) if f.is_file() else {}
        except json.JSONDecodeError:
            extra[fname] = {}  # informational only; the curves come from metrics.jsonl
    return Run(name or path.resolve().name, path, records, extra["args.json"], extra["summary.json"])


@dataclass
class Panel:
    """One figure: ``keys`` are exact metric names or regular expressions (``pattern=True``)."""

    id: str
    title: str
    ylabel: str
    keys: tuple[str, ...]
    pattern: bool = False
    scale: float = 1.0  # plotted value = metric / scale

    def matching(self, run: Run) -> list[str]:
        """The metric keys of ``run`` this panel plots, in a stable order."""
        have = run.keys()
        if not self.pattern:
            return [k for k in self.keys if k in have]
        return sorted(k for k in have if any(re.fullmatch(p, k) for p in self.keys))


LINE_PANELS = (
    Panel("reward", "Reward (training rollouts)", "mean reward", ("rollout/reward_mean",)),
    Panel("eval_reward", "Eval reward", "mean reward", (r"eval/.+/reward_mean",), pattern=True),
    Panel("eval_pass_at_k", "Eval pass@k", "pass@k", (r"eval/.+/pass@\d+",), pattern=True),
    Panel(
        "response_len",
        "Response length",
        "tokens",
        (r"rollout/response_len_mean", r"eval/.+/response_len_mean"),
        pattern=True,
    ),
    Panel(
        "truncated",
        "Truncated fraction",
        "fraction of samples",
        (r"rollout/truncated_frac", r"eval/.+/truncated_frac"),
        pattern=True,
    ),
    Panel(
        "logprob_diff",
        "|Δlogp| trainer vs engine",
        "nats per token",
        ("train/train_rollout_logprob_abs_diff",),
    ),
    Panel("entropy", "Entropy", "nats per token", ("train/entropy_loss",)),
    Panel("grad_norm", "Gradient norm", "L2 norm (before clipping)", ("train/grad_norm", "train/critic_grad_norm")),
    Panel("kl", "KL", "nats", ("train/kl_loss", "train/ppo_kl", "rollout/distill_reverse_kl")),
    Panel("pg_loss", "Policy loss", "loss", ("train/pg_loss",)),
    Panel("weight_sync_bytes", "Weight-sync bytes per step", "MiB", ("weight_sync/bytes",), scale=MIB),
)
ALL_PANEL_IDS = tuple(p.id for p in LINE_PANELS) + ("time_split", "staleness")


def _new_axes() -> tuple[Figure, Any]:
    fig = Figure(figsize=FIGSIZE, layout="constrained")
    return fig, fig.subplots()


def _grouped_x(positions: list[int], i: int, n: int) -> tuple[list[float], float]:
    """Bar centres of run ``i`` of ``n`` side by side around each integer position, and the bar width."""
    width = 0.8 / n
    return [x - 0.4 + width * (i + 0.5) for x in positions], width


def _label(run: Run, key: str, multi: bool) -> str:
    return f"{run.name} · {key}" if multi else key


def _args_flag(run: Run, dest: str, default: Any = None) -> Any:
    """A flag of ``run`` from its ``args.json`` (``default`` when the run did not record it)."""
    return run.args.get(dest, default)


def kl_note(run: Run) -> str | None:
    """Why ``run`` has no KL-loss curve, from its flags: the KL loss was off (``--use-kl-loss`` not set) or only
    logged (``--kl-loss-coef 0``); ``None`` when the run trained on it (or recorded no flags)."""
    if not run.args:
        return None
    if not _args_flag(run, "use_kl_loss", False):
        coef = _args_flag(run, "kl_coef", 0.0)
        shaping = f"; KL reward shaping --kl-coef {coef:g}" if coef else ""
        return f"KL loss off (--use-kl-loss not set{shaping})"
    if not _args_flag(run, "kl_loss_coef", 0.0):
        return "KL loss logged, not trained on (--kl-loss-coef 0)"
    return None


#: a curve whose values differ by less than this (relative to 1 or its largest magnitude) is drawn flat
FLAT_TOLERANCE = 1e-6


def flat_note(run: Run, key: str, values: list[float]) -> str | None:
    """Why the curve of ``key`` is flat (its values within :data:`FLAT_TOLERANCE` of each other), or ``None`` when
    it is not flat (or has one point): the reasons known from the metric and the run's flags (an on-policy ratio of
    1, advantages centred on 0, a group of one), else the value it stays at."""
    if len(values) < 2:
        return None
    scale = max(1.0, *(abs(v) for v in values))
    if max(values) - min(values) > FLAT_TOLERANCE * scale:
        return None
    zero = all(abs(v) <= FLAT_TOLERANCE for v in values)
    if key == "train/ppo_kl" and zero:
        return (
            "train/ppo_kl is 0 at every step: each rollout is trained in one optimizer step (on-policy), so the "
            "ratio to the sampling policy is 1"
        )
    if key in ("train/pg_loss", "train/loss") and zero:
        n, estimator = _args_flag(run, "n_samples_per_prompt"), _args_flag(run, "advantage_estimator")
        if n == 1 and estimator in ("grpo", "gspo", "rloo", "reinforce_plus_plus_baseline"):
            return (
                f"{key} is 0 at every step: --advantage-estimator {estimator} with --n-samples-per-prompt 1 makes "
                "every advantage 0, so nothing was trained"
            )
        return (
            f"{key} is ~0 at every step (|value| <= {FLAT_TOLERANCE:g}): on-policy the ratio is 1 and the loss is "
            "minus the mean advantage, which the estimator centres on 0; its gradient is not 0 (see the reward "
            "and |Δlogp| panels)"
        )
    return f"{key} stays at {values[0]:.4g} at every step"


#: the panels whose flat curves are explained (a flat reward or byte count needs no note)
FLAT_EXPLAINED = ("kl", "pg_loss")


def panel_notes(panel: Panel, runs: list[Run]) -> list[str]:
    """The notes printed on a panel and under it: why a curve of the KL or loss panel is flat (:func:`flat_note`)
    and, on the KL panel,
    why there is no KL-loss curve (:func:`kl_note`); each prefixed with the run's name when several are shown."""
    notes = []
    for run in runs:
        prefix = f"{run.name}: " if len(runs) > 1 else ""
        if panel.id == "kl" and (note := kl_note(run)):
            notes.append(prefix + note)
        for key in panel.matching(run) if panel.id in FLAT_EXPLAINED else ():
            if (note := flat_note(run, key, run.series(key)[1])) is not None:
                notes.append(prefix + note)
    return notes


def _line_figure(panel: Panel, runs: list[Run]) -> Figure | None:
    multi = len(runs) > 1
    fig, ax = _new_axes()
    n = 0
    for i, run in enumerate(runs):
        for j, key in enumerate(panel.matching(run)):
            xs, ys = run.series(key)
            ax.plot(
                xs,
                [y / panel.scale for y in ys],
                marker="o" if len(xs) < 30 else None,
                markersize=3,
                linestyle=("-", "--", ":", "-.")[i % 4],
                color=f"C{(j if not multi else i * 3 + j) % 10}",
                label=_label(run, key, multi),
            )
            n += 1
    if n == 0:
        return None
    ax.set(title=panel.title, xlabel=X_LABEL, ylabel=panel.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    notes = panel_notes(panel, runs)
    if notes:  # a flat line says why, on the plot itself (the PNG may be seen alone)
        ax.text(0.01, 0.02, "\n".join(notes), transform=ax.transAxes, fontsize=7, va="bottom", wrap=True,
                bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "#bbb"})  # fmt: skip
    return fig


def _time_split_figure(runs: list[Run]) -> Figure | None:
    """Stacked bars per step (rollout / train / sync seconds); with several runs, bars side by side per step."""
    have = [r for r in runs if any(k in r.keys() for k, _ in TIME_KEYS)]
    if not have:
        return None
    fig, ax = _new_axes()
    for i, run in enumerate(have):
        # one bar per step record that has any time key (the step's own record)
        recs = [r for r in run.records if any(k in r for k, _ in TIME_KEYS)]
        xs, width = _grouped_x([finished_steps(r["step"], TIME_KEYS[0][0]) for r in recs], i, len(have))
        bottom = [0.0] * len(recs)
        for j, (key, name) in enumerate(TIME_KEYS):
            ys = [float(r.get(key, 0.0)) for r in recs]
            label = f"{run.name} · {name}" if len(have) > 1 else name
            ax.bar(xs, ys, width=width, bottom=bottom, color=f"C{j}", alpha=1.0 - 0.35 * i, label=label, gid=key)
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
    ax.set(title="Time per step (stacked)", xlabel=X_LABEL, ylabel="seconds")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, axis="y")
    fig.legend(fontsize=8, loc="outside right upper")  # beside the bars, never over them
    return fig


def staleness_counts(run: Run) -> dict[int, float]:
    """Trained tokens per staleness ``k`` summed over the run's steps (from ``rollout/staleness_tokens/<k>``)."""
    counts: dict[int, float] = {}
    for r in run.records:
        for k, v in r.items():
            if k.startswith(STALENESS_TOKENS_PREFIX):
                s = int(k[len(STALENESS_TOKENS_PREFIX) :])
                counts[s] = counts.get(s, 0.0) + float(v)
    return dict(sorted(counts.items()))


def _is_async(run: Run) -> bool:
    return run.args.get("loop", "sync") != "sync" or any(k > 0 for k in staleness_counts(run))


def _staleness_figure(runs: list[Run]) -> Figure | None:
    have = [r for r in runs if _is_async(r) and staleness_counts(r)]
    if not have:
        return None
    fig, ax = _new_axes()
    for i, run in enumerate(have):
        counts = staleness_counts(run)
        xs, width = _grouped_x(list(counts), i, len(have))
        ax.bar(xs, list(counts.values()), width=width, color=f"C{i}", label=f"{run.name} ({run.args.get('loop')})")
    ax.set(
        title="Staleness of trained tokens (all steps)",
        xlabel="weight versions behind the trainer",
        ylabel="tokens",
    )
    ax.set_xticks(sorted({k for r in have for k in staleness_counts(r)}))
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="best")
    return fig


def build_figures(runs: list[Run]) -> dict[str, Figure]:
    """One matplotlib figure per panel that has data in at least one run, keyed by panel id (in
    :data:`ALL_PANEL_IDS` order). The figures are plain :class:`matplotlib.figure.Figure` objects (not registered
    with pyplot), freed when no longer referenced."""
    figs: dict[str, Figure] = {}
    for panel in LINE_PANELS:
        fig = _line_figure(panel, runs)
        if fig is not None:
            figs[panel.id] = fig
    for pid, make in (("time_split", _time_split_figure), ("staleness", _staleness_figure)):
        fig = make(runs)
        if fig is not None:
            figs[pid] = fig
    return figs


PANEL_TITLES = {p.id: p.title for p in LINE_PANELS} | {
    "time_split": "Time per step (rollout / train / sync)",
    "staleness": "Staleness histogram (async loops)",
}


def _summary_rows(runs: list[Run]) -> str:
    rows = []
    for run in runs:
        steps = sorted({r["step"] for r in run.records})
        rewards = run.series("rollout/reward_mean")[1]
        evals = sorted(k for k in run.keys() if re.fullmatch(r"eval/.+/reward_mean", k))
        ev = "; ".join(f"{k.split('/')[1]}: {run.series(k)[1][0]:.3f} → {run.series(k)[1][-1]:.3f}" for k in evals)
        cells = [
            run.name,
            str(run.path),
            str(run.args.get("model", "")),
            str(run.args.get("loop", "")),
            f"{steps[0]}–{steps[-1]}",
            f"{rewards[0]:.3f} → {rewards[-1]:.3f}" if rewards else "",
            ev,
        ]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = "".join(
        f"<th>{h}</th>"
        for h in ("run", "directory", "model", "loop", "steps", "reward first → last", "eval reward first → last")
    )
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def render_html(runs: list[Run], pngs: dict[str, bytes]) -> str:
    """The report page: a summary table, then each panel's PNG embedded as a base64 data URL."""
    title = "vime report: " + ", ".join(r.name for r in runs)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:24px;max-width:1150px}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
        ".grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(540px,1fr));gap:12px}"
        "figure{margin:0}img{width:100%;border:1px solid #eee}figcaption{font-size:12px;color:#555}</style>",
        "</head><body>",
        f"<h1>{html.escape(title)}</h1>",
        _summary_rows(runs),
        '<div class="grid">',
    ]
    panels = {p.id: p for p in LINE_PANELS}
    for pid, png in pngs.items():
        data = base64.b64encode(png).decode("ascii")
        notes = panel_notes(panels[pid], runs) if pid in panels else []
        why = "".join(f"<br>{html.escape(n)}" for n in notes)
        parts.append(
            f'<figure id="{pid}"><img alt="{html.escape(PANEL_TITLES[pid])}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(PANEL_TITLES[pid])} ({pid}.png){why}</figcaption></figure>"
        )
    parts.append("</div>")
    missing = [PANEL_TITLES[p] for p in ALL_PANEL_IDS if p not in pngs]
    if missing:
        parts.append("<p><b>Not shown</b> (no run has these metrics): " + html.escape(", ".join(missing)) + "</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(run_dir: Path, compare: list[Path] | None = None, out: Path | None = None) -> Path:
    """Render the report of ``run_dir`` (overlaying ``compare`` runs) to ``out`` (default
    ``run_dir/report.html``); the PNGs go to ``<out without .html>_files/<panel>.png``.

    :return: the HTML path.
    :raises ReportError: if a run directory has no readable ``metrics.jsonl``.
    """
    runs = [load_run(Path(run_dir))] + [load_run(Path(c)) for c in compare or []]
    names = [r.name for r in runs]
    for i, r in enumerate(runs):  # two runs called "run": tell them apart
        if names.count(r.name) > 1:
            r.name = f"{r.name}#{i}"
    out = Path(out) if out is not None else Path(run_dir) / "report.html"
    files = out.with_name(out.stem + "_files")
    files.mkdir(parents=True, exist_ok=True)
    pngs: dict[str, bytes] = {}
    for pid, fig in build_figures(runs).items():
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI)
        pngs[pid] = buf.getvalue()
        (files / f"{pid}.png").write_bytes(pngs[pid])
    out.write_text(render_html(runs, pngs))
    return out

"""``vime report``: figures built from recorded metrics.jsonl files (tests/data/report/*, from real ``vime run``s:
``async_run`` = examples/fully_async 3 steps, ``sync_run`` = examples/quickstart 3 steps); the plotted data is read
back from the matplotlib artists and compared with the metrics, and the written PNG/HTML files are checked."""

import base64
import io
import json
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from vime_core.cli.commands import main
from vime_core.run.report import (
    ALL_PANEL_IDS,
    LINE_PANELS,
    ReportError,
    build_figures,
    load_run,
    staleness_counts,
    write_report,
)

pytestmark = pytest.mark.unit

DATA = Path(__file__).parents[1] / "data" / "report"
ASYNC, SYNC = DATA / "async_run", DATA / "sync_run"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _lines(fig) -> dict[str, tuple[list[float], list[float]]]:
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in fig.axes[0].get_lines()}


@pytest.fixture
def figs_async():
    return build_figures([load_run(ASYNC)])


def test_line_panels_plot_exactly_the_metrics(figs_async):
    recs = _records(ASYNC)
    assert [r["step"] for r in recs] == [0, 1, 2]
    expected = {
        "reward": ["rollout/reward_mean"],
        "response_len": ["rollout/response_len_mean"],
        "truncated": ["rollout/truncated_frac"],
        "logprob_diff": ["train/train_rollout_logprob_abs_diff"],
        "entropy": ["train/entropy_loss"],
        "grad_norm": ["train/grad_norm"],
        "kl": ["train/ppo_kl"],
        "pg_loss": ["train/pg_loss"],
    }
    for pid, keys in expected.items():
        lines = _lines(figs_async[pid])
        assert sorted(lines) == keys, pid
        for key in keys:
            # x = finished training steps: the step with rollout id r has finished r + 1 steps
            assert lines[key] == ([1.0, 2.0, 3.0], [r[key] for r in recs]), (pid, key)
        assert figs_async[pid].axes[0].get_xlabel() == "finished training steps", pid
    # bytes are plotted in MiB
    xs, ys = _lines(figs_async["weight_sync_bytes"])["weight_sync/bytes"]
    assert ys == [r["weight_sync/bytes"] / (1 << 20) for r in recs]
    assert ys[0] == pytest.approx(513.1, abs=0.1)  # SmolLM2-135M in float32: 538 MB per full sync


def test_time_split_is_a_stacked_bar_of_rollout_train_sync(figs_async):
    recs = _records(ASYNC)
    ax = figs_async["time_split"].axes[0]
    bars = {c.get_label(): c for c in ax.containers}
    assert list(bars) == ["rollout", "train", "sync"]
    bottom = [0.0] * 3
    for name in ("rollout", "train", "sync"):
        rects = bars[name].patches
        assert [r.get_height() for r in rects] == pytest.approx([r[f"perf/{name}_time"] for r in recs])
        assert [r.get_y() for r in rects] == pytest.approx(bottom)
        assert [r.get_x() + r.get_width() / 2 for r in rects] == pytest.approx([1, 2, 3])
        bottom = [b + r[f"perf/{name}_time"] for b, r in zip(bottom, recs, strict=True)]


def test_staleness_histogram_sums_tokens_per_version_lag(figs_async):
    # step 0: 256 tokens on-policy; steps 1 and 2: 294 tokens each one version old (fully-async, max staleness 1)
    assert staleness_counts(load_run(ASYNC)) == {0: 256.0, 1: 588.0}
    ax = figs_async["staleness"].axes[0]
    rects = ax.containers[0].patches
    assert [(r.get_x() + r.get_width() / 2, r.get_height()) for r in rects] == [(0.0, 256.0), (1.0, 588.0)]


def test_absent_metrics_skip_their_panel(figs_async):
    # the recorded async run has no eval set configured and no KL loss; every other panel is drawn
    assert [p for p in ALL_PANEL_IDS if p not in figs_async] == ["eval_reward", "eval_pass_at_k"]
    sync_figs = build_figures([load_run(SYNC)])
    assert "staleness" not in sync_figs  # --loop sync: every token is on-policy, no histogram
    assert "reward" in sync_figs and "time_split" in sync_figs


def test_eval_metrics_are_plotted_when_present(tmp_path):
    run = tmp_path / "with_eval"
    shutil.copytree(ASYNC, run)
    evals = [  # what the eval loop writes: extra lines with the same step key, at step 0 and after steps
        {"step": 0, "eval/arith/reward_mean": 0.25, "eval/arith/pass@1": 0.25, "eval/arith/pass@4": 0.5,
         "eval/arith/response_len_mean": 30.5, "eval/arith/truncated_frac": 0.125},
        {"step": 3, "eval/arith/reward_mean": 0.375, "eval/arith/pass@1": 0.375, "eval/arith/pass@4": 0.75,
         "eval/arith/response_len_mean": 28.0, "eval/arith/truncated_frac": 0.0},
    ]  # fmt: skip
    with (run / "metrics.jsonl").open("a") as f:
        for e in evals:
            f.write(json.dumps(e) + "\n")
    figs = build_figures([load_run(run)])
    assert _lines(figs["eval_reward"]) == {"eval/arith/reward_mean": ([0.0, 3.0], [0.25, 0.375])}
    assert _lines(figs["eval_pass_at_k"]) == {
        "eval/arith/pass@1": ([0.0, 3.0], [0.25, 0.375]),
        "eval/arith/pass@4": ([0.0, 3.0], [0.5, 0.75]),
    }
    assert _lines(figs["response_len"])["eval/arith/response_len_mean"] == ([0.0, 3.0], [30.5, 28.0])
    assert _lines(figs["truncated"])["eval/arith/truncated_frac"] == ([0.0, 3.0], [0.125, 0.0])
    # the training curve is unchanged by the extra lines (eval lines hold no rollout/* key); both share one x:
    # finished training steps (the eval at 3 ran after the third step, whose training point is at 3 too)
    train = [r["rollout/response_len_mean"] for r in _records(ASYNC)]
    assert _lines(figs["response_len"])["rollout/response_len_mean"] == ([1.0, 2.0, 3.0], train)
    for pid in ("eval_reward", "eval_pass_at_k", "response_len", "truncated"):
        assert figs[pid].axes[0].get_xlabel() == "finished training steps", pid


def test_compare_overlays_runs_with_their_names():
    figs = build_figures([load_run(ASYNC), load_run(SYNC)])
    lines = _lines(figs["reward"])
    assert sorted(lines) == ["async_run · rollout/reward_mean", "sync_run · rollout/reward_mean"]
    for run in (ASYNC, SYNC):
        recs = _records(run)
        assert lines[f"{run.name} · rollout/reward_mean"] == (
            [float(r["step"] + 1) for r in recs],
            [r["rollout/reward_mean"] for r in recs],
        )
    labels = [c.get_label() for c in figs["time_split"].axes[0].containers]
    assert labels == [f"{n} · {p}" for n in ("async_run", "sync_run") for p in ("rollout", "train", "sync")]


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs, self.tags, self.figure_ids = [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if tag == "img":
            self.imgs.append(a["src"])
        if tag == "figure":
            self.figure_ids.append(a["id"])


def test_write_report_files(tmp_path):
    out = tmp_path / "r" / "report.html"
    assert write_report(ASYNC, [SYNC], out) == out
    page = _Page()
    text = out.read_text()
    page.feed(text)
    page.close()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    drawn = [p for p in ALL_PANEL_IDS if p not in ("eval_reward", "eval_pass_at_k")]
    assert page.figure_ids == drawn
    assert sorted(p.name for p in (tmp_path / "r" / "report_files").iterdir()) == sorted(f"{p}.png" for p in drawn)
    for pid, src in zip(page.figure_ids, page.imgs, strict=True):
        prefix = "data:image/png;base64,"
        assert src.startswith(prefix)
        png = base64.b64decode(src[len(prefix) :])
        assert png == (tmp_path / "r" / "report_files" / f"{pid}.png").read_bytes()  # the page embeds the files
        assert png[:8] == PNG_MAGIC
        with Image.open(io.BytesIO(png)) as im:
            im.load()  # decodes every pixel
            assert im.size == (750, 360)
    assert "Not shown</b> (no run has these metrics): Eval reward, Eval pass@k" in text
    assert "async_run" in text and "sync_run" in text


def test_cli_report_default_out_and_errors(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(SYNC, run)
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "report.html")
    assert (run / "report.html").is_file()
    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"vime report: error: {tmp_path / 'nope' / 'metrics.jsonl'}: not found (expected the metrics.jsonl a "
        "`vime run` writes into its --output-dir)"
    )


def test_bad_metrics_lines_name_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "a": 1}\n{"step": 1, "a": \n')
    with pytest.raises(ReportError) as e:
        load_run(tmp_path)
    assert str(e.value) == f"{tmp_path / 'metrics.jsonl'}:2: not JSON (Expecting value)"
    (tmp_path / "metrics.jsonl").write_text('{"a": 1}\n')
    with pytest.raises(ReportError) as e:
        load_run(tmp_path)
    assert str(e.value) == f"{tmp_path / 'metrics.jsonl'}:1: expected a JSON object with an integer 'step'"


def test_every_line_panel_id_is_unique():
    ids = [p.id for p in LINE_PANELS]
    assert len(ids) == len(set(ids)) and set(ids) < set(ALL_PANEL_IDS)


def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].texts]


def test_flat_kl_and_loss_curves_say_why_on_the_plot_and_under_it(tmp_path):
    """The quickstart's recorded run: no KL loss, one optimizer step per rollout (ppo_kl exactly 0) and GRPO's policy
    loss within 1e-8 of 0 — each flat curve is explained, in the PNG and in the page (issue 35)."""
    figs = build_figures([load_run(SYNC)])
    assert _texts(figs["kl"]) == [
        "KL loss off (--use-kl-loss not set)\n"
        "train/ppo_kl is 0 at every step: each rollout is trained in one optimizer step (on-policy), so the ratio to "
        "the sampling policy is 1"
    ]
    assert _texts(figs["pg_loss"]) == [
        "train/pg_loss is ~0 at every step (|value| <= 1e-06): on-policy the ratio is 1 and the loss is minus the "
        "mean advantage, which the estimator centres on 0; its gradient is not 0 (see the reward and |Δlogp| panels)"
    ]
    assert _texts(figs["reward"]) == [] and _texts(figs["weight_sync_bytes"]) == []  # flat or not: no note needed
    out = write_report(SYNC, [], tmp_path / "r.html")
    assert "(kl.png)<br>KL loss off (--use-kl-loss not set)<br>train/ppo_kl is 0 at every step" in out.read_text()


@pytest.mark.parametrize(
    ("args", "values", "notes"),
    [
        ({"use_kl_loss": True, "kl_loss_coef": 0.0}, [0.5, 0.75],
         ["KL loss logged, not trained on (--kl-loss-coef 0)"]),
        ({"use_kl_loss": True, "kl_loss_coef": 0.1}, [0.5, 0.75], []),
        ({"use_kl_loss": False, "kl_coef": 0.05}, [0.5, 0.75],
         ["KL loss off (--use-kl-loss not set; KL reward shaping --kl-coef 0.05)"]),
        ({"use_kl_loss": True, "kl_loss_coef": 0.1}, [0.25, 0.25], ["train/ppo_kl stays at 0.25 at every step"]),
        ({}, [0.0, 0.0], ["train/ppo_kl is 0 at every step: each rollout is trained in one optimizer step "
                          "(on-policy), so the ratio to the sampling policy is 1"]),
    ],
)  # fmt: skip
def test_kl_panel_notes_follow_the_runs_flags(tmp_path, args, values, notes):
    from vime_core.run.report import panel_notes

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "train/ppo_kl": v}) + "\n"
                                                    for i, v in enumerate(values)))  # fmt: skip
    (tmp_path / "args.json").write_text(json.dumps(args))
    kl = next(p for p in LINE_PANELS if p.id == "kl")
    assert panel_notes(kl, [load_run(tmp_path)]) == notes


def test_a_zero_policy_loss_of_a_group_of_one_says_nothing_was_trained(tmp_path):
    from vime_core.run.report import panel_notes

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "train/pg_loss": 0.0}\n{"step": 1, "train/pg_loss": 0.0}\n')
    (tmp_path / "args.json").write_text('{"advantage_estimator": "grpo", "n_samples_per_prompt": 1}')
    loss = next(p for p in LINE_PANELS if p.id == "pg_loss")
    assert panel_notes(loss, [load_run(tmp_path)]) == [
        "train/pg_loss is 0 at every step: --advantage-estimator grpo with --n-samples-per-prompt 1 makes every "
        "advantage 0, so nothing was trained"
    ]

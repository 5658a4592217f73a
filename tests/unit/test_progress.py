"""Progress output: one exact line per step without a terminal, a live bar with the phase on a terminal, and the
rollout manager's sample counter."""

import io
import re
from types import SimpleNamespace

import pytest
from rich.console import Console

from vime_core.run.progress import RolloutProgress, StepProgress, rollout_phase, step_line

pytestmark = pytest.mark.unit

M1 = {
    "rollout/reward_mean": 0.5,
    "rollout/response_len_mean": 12.0,
    "perf/rollout_time": 2.04,
    "perf/train_time": 3.0,
    "perf/sync_time": 0.96,
    "train/train_rollout_logprob_abs_diff": 0.00123,
}
M2 = {"rollout/reward_mean": 0.75, "rollout/response_len_mean": 9.25, "perf/rollout_time": 1.5}  # debug-rollout-only


def test_step_line_format():
    assert step_line(2, 10, M1) == (
        "[vime] step 3/10 | reward 0.500 | resp_len 12.0 | rollout 2.0s | train 3.0s | sync 1.0s | |Δlogp| 0.0012"
    )
    assert step_line(0, 1, {}) == "[vime] step 1/1"
    # |Δlogp| in significant digits: an engine that serves the trainer's weights agrees to ~1e-6 (issue 35)
    for drift, shown in ((6.4e-6, "6.4e-06"), (1e-6, "1e-06"), (0.0, "0"), (0.0123, "0.012"), (0.31, "0.31")):
        assert step_line(0, 1, {"train/train_rollout_logprob_abs_diff": drift}) == f"[vime] step 1/1 | |Δlogp| {shown}"


def test_not_a_terminal_prints_one_line_per_step_and_nothing_else():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=80, highlight=False, markup=False, soft_wrap=True)
    with StepProgress(console, total=3, completed=1) as p:
        assert p.live is False
        p.phase("rollout 3/32 samples")  # no terminal: phases are not printed
        p.step_done(1, M1)
        p.phase("train")
        p.step_done(2, M2)
    assert buf.getvalue() == (
        "[vime] step 2/3 | reward 0.500 | resp_len 12.0 | rollout 2.0s | train 3.0s | sync 1.0s | |Δlogp| 0.0012\n"
        "[vime] step 3/3 | reward 0.750 | resp_len 9.2 | rollout 1.5s\n"
    )  # one line per step, wider than 80 columns and still unwrapped, no escape codes, no bar


def test_terminal_shows_a_live_bar_with_the_phase():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, color_system=None, highlight=False, markup=False)
    with StepProgress(console, total=4, completed=1) as p:
        assert p.live is True
        p.phase(rollout_phase(12, 32))
        p._progress.refresh()
        bar_with_rollout = buf.getvalue()
        p.step_done(1, M2)
        p.phase("sync")
        p._progress.refresh()
    out = buf.getvalue()
    assert "[vime] step" in bar_with_rollout and "1/4" in bar_with_rollout
    assert "rollout 12/32 samples" in bar_with_rollout
    assert "[vime] step 2/4 | reward 0.750 | resp_len 9.2 | rollout 1.5s" in out
    assert re.search(r"2/4 sync", out)  # the bar advanced and shows the new phase
    assert "\x1b[" in out  # cursor movement: the bar redraws in place


def test_rollout_phase_text():
    assert rollout_phase(0, 0) == "rollout"
    assert rollout_phase(5, 32) == "rollout 5/32 samples"


def test_rollout_manager_reports_finished_samples(tiny_model_dir, tmp_path):
    """The rollout manager tells the progress counter how many samples of the step finished."""
    from tests.support.rollout import manager_with_hooks

    board = RolloutProgress()
    seen = []

    def record(done, total):
        seen.append((done, total))
        board.set(done, total)

    mgr = manager_with_hooks(tiny_model_dir, tmp_path)
    mgr.runner.progress = SimpleNamespace(set=SimpleNamespace(remote=record))  # an actor handle's .set.remote
    mgr.runner.progress_throttle.interval_s = 0.0  # report every sample
    groups, _ = mgr.generate(0)
    n = sum(len(g) for g in groups)
    assert n == 4  # 2 prompts x 2 samples
    assert seen == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4), (4, 4)]  # the last one is forced (past the throttle)
    assert board.get() == (4, 4)
    # throttled: only the first sample's report and the forced ones at the start and the end
    seen.clear()
    mgr.runner.progress_throttle.interval_s = 3600.0
    mgr.generate(1)
    assert seen == [(0, 4), (4, 4)]

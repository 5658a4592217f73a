"""--loop fully-async against the real engine: a run whose production is bounded with staleness unbounded and whose
rollouts then all fail ends within --failure-exit-timeout with the error, summary.json "failed", no final_hf/ and
nothing left running.

The one-step-off and fully-async runs that checked the exact staleness from the per-token versions and the
evaluations at the weight version of their step are test_resume_kill.py's off-policy runs (killed after step 3 and
resumed), which carry those checks across the resume."""

from __future__ import annotations

import json
import time

import pytest

from tests.integration.helpers import Run, external_engine_flags, run_flags

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_fully_async_is_bounded_and_a_run_whose_rollouts_all_fail_fails(
    tiny_model_dir, prompt_file, tmp_path, runs, engine_at_v0
):
    """Staleness unbounded, at most 4 groups in flight, 2 per step, a trainer slowed by 2 s a step, prompts in file
    order; the reward raises for rows 6 and later (tests/integration/async_faults.py).

    Steps 0-2 train rows 0-5: after step k's take exactly 4 + 2k groups were taken from the data (the producer
    generated up to the bound of 4 and waited for the trainer; main ran ahead without limit), 2(k + 1) trained, 2
    waiting or running, none dropped, and the counters add up. Step 3's batch (rows 6, 7) has no sample that did not
    fail: the run exits 1 with that error as one ``vime: error:`` line well within --failure-exit-timeout, writes
    summary.json "failed" with step 2 as the last completed step, saves no final_hf/ and leaves nothing running
    (main: "no trainable sample; skipping the update" for every later step, exit 0, a final_hf/)."""
    out = tmp_path / "fa-fail"
    argv = [
        *run_flags(tiny_model_dir, prompt_file, out),
        *("--n-samples-per-prompt", "2", "--rollout-max-response-len", "8", "--num-rollout", "6"),
        *("--loop", "fully-async", "--use-tis", "--max-staleness", "1000", "--rollout-inflight-groups", "4"),
        *("--no-rollout-shuffle", "--reward", "tests.integration.async_faults:reward"),
        *("--advantage-estimator", "tests.integration.async_faults:slow_grpo", "--failure-exit-timeout", "60"),
        *("--no-report", "--no-use-tensorboard", *external_engine_flags(engine_at_v0)),  # the session's engine
    ]
    run = Run(argv, tmp_path / "run.log")
    runs.append(run)
    rc, _ = run.wait_exit(600)
    ended = time.time()
    text = run.text()
    assert rc == 1, text[-4000:]
    errors = [line for line in text.splitlines() if line.startswith("vime: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "vime: error: every sample of step 3 failed (4 of 4); first error: ValueError: reward service refused label"
    ), text[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert ended - (out / "summary.json").stat().st_mtime < 60  # from the failure to the exit
    assert (summary["status"], summary["steps_run"], summary["last_completed_step"], summary["failed_step"]) == (
        "failed",
        3,
        2,
        3,
    )
    assert summary["error"] == errors[0].removeprefix("vime: error: ")
    assert "final_hf" not in summary and not (out / "final_hf").exists()
    run.assert_nothing_left(within_s=15)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    kinds = ("admitted", "trained", "waiting", "running", "dropped", "peak")
    counters = [{k: r[f"rollout/async_{k}_groups"] for k in kinds} for r in records]
    assert [c["admitted"] for c in counters] == [4.0, 6.0, 8.0], counters  # 4 + 2k: refilled to the bound, no more
    assert [c["trained"] for c in counters] == [2.0, 4.0, 6.0], counters
    assert [c["waiting"] + c["running"] for c in counters] == [2.0, 2.0, 2.0], counters
    assert [(c["dropped"], c["peak"]) for c in counters] == [(0.0, 4.0)] * 3, counters
    assert all(c["admitted"] == c["trained"] + c["waiting"] + c["running"] + c["dropped"] for c in counters)
    assert [r["rollout/failed_frac"] for r in records] == [0.0, 0.0, 0.0]

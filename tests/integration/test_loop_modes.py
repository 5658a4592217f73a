"""--loop one-step-off and fully-async against the real engine: exact staleness from the per-token versions,
evaluation in both loops at the weight version of its step (the engine's per-token version tags), and a fully-async
run whose production is bounded with staleness unbounded and whose rollouts then all fail: it ends within
--failure-exit-timeout with the error, summary.json "failed", no final_hf/ and nothing left running."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests.integration.helpers import Run, run_flags
from vime_core.testing.cli import run_vime as _vime

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _eval_flags(tmp_path) -> list[str]:
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Held out {i}:", "label": str(i)}) + "\n" for i in range(2)))
    return ["--eval-prompt-data", "held", str(path), "--eval-interval", "2", "--eval-max-response-len", "4"] + [
        "--save-eval-samples"
    ]


def _check_evals(out, expected_steps: list[int]) -> list[dict]:
    """Each evaluation ran at the weight version of its step; returns the training records."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/held/reward_mean" in r]
    assert [(r["step"], r["eval/weight_version"]) for r in evals] == [(s, float(s)) for s in expected_steps]
    for step in expected_steps:
        rows = [json.loads(x) for x in (out / "eval_samples" / "held" / f"step_{step:06d}.jsonl").open()]
        assert len(rows) == 2 and all(r["token_weight_versions"] == [step] for r in rows), (step, rows)
    return [r for r in records if "eval/held/reward_mean" not in r]


def _dumped(out, step):
    data = torch.load(out / "debug" / f"rollout_{step}.pt", weights_only=False)
    return [s for g in data["groups"] for s in g]


def test_one_step_off_trains_on_samples_exactly_one_version_old(tiny_model_dir, prompt_file, tmp_path):
    """Also the end-to-end run of ``--weight-sync nccl`` (trainer-hosted Gloo group on CPU)."""
    out = tmp_path / "osf"
    _vime(
        "run",
        *run_flags(tiny_model_dir, prompt_file, out),
        "--num-rollout",
        "3",
        "--loop",
        "one-step-off",
        "--use-tis",
        "--weight-sync",
        "nccl",
        "--save-debug-rollout-data",
        str(out / "debug" / "rollout_{rollout_id}.pt"),
        *_eval_flags(tmp_path),
    )
    for step, expected_version in ((0, 0), (1, 0), (2, 1)):
        for s in _dumped(out, step):
            assert s["weight_versions"] == [expected_version] * s["response_length"], (step, s["weight_versions"])
    metrics = _check_evals(out, [0, 2, 3])  # the eval after step 2 follows the prefetch and the weight update
    assert [m["rollout/staleness_max"] for m in metrics] == [0.0, 1.0, 1.0]
    assert [m["weight_sync/version"] for m in metrics] == [1.0, 2.0, 3.0]
    assert all(m["weight_sync/bytes"] > 0 for m in metrics)


def test_fully_async_never_trains_beyond_max_staleness(tiny_model_dir, prompt_file, tmp_path):
    out = tmp_path / "fa"
    _vime(
        "run",
        *run_flags(tiny_model_dir, prompt_file, out),
        "--num-rollout",
        "4",
        "--loop",
        "fully-async",
        "--use-tis",
        "--max-staleness",
        "1",
        "--rollout-inflight-groups",
        "4",
        "--save-debug-rollout-data",
        str(out / "debug" / "rollout_{rollout_id}.pt"),
        *_eval_flags(tmp_path),
    )
    metrics = _check_evals(out, [0, 2, 4])  # alongside the background producer, no weight update mid-evaluation
    assert len(metrics) == 4
    seen_versions = set()
    for step in range(4):
        samples = _dumped(out, step)
        assert len(samples) == 8
        for s in samples:
            trained = [v for v, m in zip(s["weight_versions"], s["loss_mask"], strict=True) if m]
            seen_versions.update(trained)
            # the trainer is at version `step` when it trains on this batch
            assert all(0 <= step - v <= 1 for v in trained), (step, s["weight_versions"])
        assert metrics[step]["rollout/staleness_max"] <= 1.0
    assert seen_versions - {0}, "no sample was generated after a weight update"
    assert sum(m["rollout/stale_dropped"] for m in metrics) >= 0.0


def test_fully_async_is_bounded_and_a_run_whose_rollouts_all_fail_fails(tiny_model_dir, prompt_file, tmp_path, runs):
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
        *("--no-report", "--no-use-tensorboard"),
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

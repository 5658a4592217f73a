"""End to end: ``vime data reasoning-gym`` exports a math task with a boxed-answer prompt, and ``vime run --reward
math`` trains one step on it through real vLLM, the router and Ray. The rollout actor scores with math-verify in its
worker processes: no sample fails, and every dumped reward equals the ``math`` reward of its response and label.
(~45 s on 2 cores; the tiny random model rarely boxes anything, so rewards are mostly 0.0: the check is that they
are the reward's, not that the model learned.)"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.integration.helpers import external_engine_flags, ray_flags
from vime_core.rewards.math_answer import math_reward
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample

pytestmark = [pytest.mark.integration, pytest.mark.extended]


def _vime(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "vime_core.cli", *argv], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, (
        f"vime {argv[0]} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc


def test_vime_run_reward_math_on_exported_reasoning_gym(tiny_model_dir, tmp_path, engine_at_v0, ray_cluster):
    data = tmp_path / "math.jsonl"
    _vime(
        "data", "reasoning-gym", "--task", "basic_arithmetic", "--size", "8", "--out", str(data),
        "--config", '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}',
        "--system-prompt", r"Reply with the final number only, written as \boxed{N}.",
        "--few-shot", json.dumps([["Calculate 3 + 5.", r"\boxed{8}"]]),
    )  # fmt: skip
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == 8 and rows[0]["prompt"][1:3] == [
        {"role": "user", "content": "Calculate 3 + 5."},
        {"role": "assistant", "content": r"\boxed{8}"},
    ]
    out = tmp_path / "run"
    _vime(
        "run", "--model", str(tiny_model_dir), "--prompt-data", str(data), "--reward", "math",
        "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--output-dir", str(out), *external_engine_flags(engine_at_v0),
        "--save-debug-rollout-data", str(out / "debug" / "rollout_{rollout_id}.pt"), *ray_flags(ray_cluster),
    )  # fmt: skip
    (m,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert m["rollout/num_samples"] == 4.0 and m["rollout/failed_frac"] == 0.0
    assert {k: v for k, v in m.items() if k.startswith("rollout/failed/")} == {
        f"rollout/failed/{c}": 0.0
        for c in (
            "engine_error", "timeout", "sandbox_error", "agent_error", "generate_error", "reward_error",
            "reward_timeout", "reward_invalid",
        )
    }  # fmt: skip
    dumped = [s for g in torch.load(out / "debug" / "rollout_0.pt", weights_only=False)["groups"] for s in g]
    args = plugin_context(math_verify_timeout=30.0, math_verify_workers=1)
    for s in dumped:
        assert s["status"] in ("completed", "truncated") and s["response_length"] >= 1
        expected = asyncio.run(math_reward(args, Sample(response=s["response"], label=s["label"])))
        assert s["reward"] == expected, s["response"]
    assert m["rollout/reward_mean"] == pytest.approx(sum(s["reward"] for s in dumped) / 4)

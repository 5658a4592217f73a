"""End to end: ``vime run --generate coding_agent --agent claude-code --sandbox docker --reward tests`` on HumanEval
with SmolLM2-135M-Instruct (examples/coding_agent/config.yaml), one GRPO step through the real vLLM engine, router,
Ray, agent gateway, Claude Code CLI, docker sandboxes and the tests reward.

SmolLM2 does not solve HumanEval; what is checked is the bookkeeping of what it did, exactly: every scored sample's
reward is its ``passed / total`` hidden tests, segments of one episode share their rollout id and reward, the
gateway recorded the episode's model calls, the trained tokens carry the engine's log-probs and weight version 0,
failed episodes are excluded placeholders, and the step trained.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "coding_agent" / "config.yaml"


def _docker_or_skip() -> None:
    try:
        from vime_sandbox_docker.image import build_image
        from vime_sandbox_docker.sandbox import DEFAULT_IMAGE, docker_client

        docker_client(timeout_s=10).ping()
        build_image(DEFAULT_IMAGE)
    except Exception as e:  # noqa: BLE001 - any failure to reach the daemon
        reason = f"dockerd unreachable ({type(e).__name__}: {e}); start it with scripts/ci_services.sh"
        print(f"SKIP: {reason}")
        pytest.skip(reason)


@pytest.mark.parametrize("agent", ["claude-code"])
def test_vime_run_coding_agent_docker(tmp_path, agent):
    _docker_or_skip()
    from vime_core.plugins import get_plugins

    get_plugins().resolve("agent", agent)().prepare(log=lambda *a: None)
    out = tmp_path / "run"
    dump = tmp_path / "dump" / "r_{rollout_id}.pt"
    argv = [
        sys.executable, "-m", "vime_core.cli", "run", "--config", str(CONFIG), "--agent", agent,
        "--output-dir", str(out), "--num-rollout", "1", "--save-debug-rollout-data", str(dump), "--no-resume",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, f"vime run exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0]
    m = metrics[0]
    groups = torch.load(str(dump).format(rollout_id=0), weights_only=False)["groups"]
    samples = [s for g in groups for s in g]
    failed = [s for s in samples if s["status"] == "failed"]
    scored = [s for s in samples if s["status"] in ("completed", "truncated")]
    assert len({s["rollout_id"] for s in scored}) + len(failed) == 2  # one task, two episodes
    assert m["coding_agent/episodes"] == len({s["rollout_id"] for s in scored})
    assert m["rollout/failed_frac"] == len(failed) / len(samples) < 1.0
    for s in failed:  # excluded placeholders: no reward, nothing trained
        assert s["reward"] is None and ("error" in s["metadata"] or "excluded" in s["metadata"])
    for s in scored:
        rt = s["metadata"]["reward_tests"]
        assert rt["total"] == s["metadata"]["tests"]["num_tests"] and rt["has_xml"] in (True, False)
        assert s["reward"] == rt["passed"] / rt["total"]
        assert s["metadata"]["session_turns"] >= 1 and "agent_result" in s["metadata"]
        n = s["response_length"]
        assert len(s["loss_mask"]) == len(s["rollout_log_probs"]) == len(s["weight_versions"]) == n
        trained = [i for i, x in enumerate(s["loss_mask"]) if x]
        assert all(s["rollout_log_probs"][i] <= 0.0 for i in trained)
        assert {s["weight_versions"][i] for i in trained} <= {0}
    by_rollout: dict[str, set] = {}
    for s in scored:
        by_rollout.setdefault(s["rollout_id"], set()).add(s["reward"])
    assert all(len(r) == 1 for r in by_rollout.values())
    assert (out / "summary.json").exists()

"""End to end, opt-in: ``vime run --generate coding_agent --agent claude-code --sandbox localvm --reward tests`` on
HumanEval with SmolLM2-135M-Instruct (examples/coding_agent/config.yaml), one GRPO step: every episode boots a VM
(QEMU, software emulation here), runs the real Claude Code CLI from the read-only 9p share at ``/opt/vime/agents``
against the agent gateway (SSH remote forward), and the reward boots a fresh VM for the hidden tests.

Opt-in (``VIME_TEST_CODING_AGENT_LOCALVM=1``): with 2 episodes it boots 4 VMs and took 5.7 minutes on 2 cores
without KVM (rollout 208 s, train 41 s; 10.5 minutes beside another ``vime run``; figures in
plugins/vime-sandbox-localvm/README.md), more than CI can spend on one backend pair;
the docker run (tests/integration/test_coding_agent_run.py) covers the same bookkeeping in CI, and
plugins/vime-sandbox-localvm/tests/test_localvm_agents.py the CLI-in-a-VM path with a scripted engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.extended]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "coding_agent" / "config.yaml"
OPT_IN = "VIME_TEST_CODING_AGENT_LOCALVM"


@pytest.mark.skipif(os.environ.get(OPT_IN) != "1", reason=f"opt-in: {OPT_IN}=1 (boots 4 VMs, 6-10 min under TCG)")
def test_vime_run_coding_agent_localvm(tmp_path):
    from vime_sandbox_localvm.image import IMAGE_FORMAT, build_vm_image, image_format

    from vime_core.plugins.manager import get_plugins

    image = build_vm_image(log=lambda *a: None)  # reused when present (scripts/ci_services.sh builds it)
    assert image_format(image) >= IMAGE_FORMAT
    harness = get_plugins().resolve("agent", "claude-code")()
    harness.prepare(log=lambda *a: None)
    out = tmp_path / "run"
    dump = tmp_path / "dump" / "r_{rollout_id}.pt"
    argv = [
        sys.executable, "-m", "vime_core.cli", "run", "--config", str(CONFIG), "--agent", "claude-code",
        "--sandbox", "localvm", "--output-dir", str(out), "--num-rollout", "1", "--save-debug-rollout-data",
        str(dump), "--no-resume",
    ]  # fmt: skip
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=1500, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )
    assert proc.returncode == 0, f"vime run exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    check_run(out, Path(str(dump).format(rollout_id=0)), harness)


def check_run(out: Path, dump: Path, harness) -> None:
    """The checks on a finished run's output directory and its step-0 rollout dump (exact bookkeeping)."""
    from vime_core.sandbox.base import SANDBOX_AGENTS_DIR

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0]
    m = metrics[0]
    samples = [s for g in torch.load(str(dump), weights_only=False)["groups"] for s in g]
    failed = [s for s in samples if s["status"] == "failed"]
    scored = [s for s in samples if s["status"] in ("completed", "truncated")]
    assert len({s["episode_id"] for s in scored}) + len(failed) == 2  # one task, two episodes
    assert m["coding_agent/episodes"] == len({s["episode_id"] for s in scored}) >= 1
    for s in failed:
        assert s["reward"] is None and ("error" in s["metadata"] or "excluded" in s["metadata"])
    exe = f"{SANDBOX_AGENTS_DIR}/claude-code/{harness.version}/{harness.EXECUTABLE}"
    for s in scored:
        agent = s["metadata"]["agent"]
        assert agent["metadata"]["command"].split()[0] == exe, "the CLI ran from the 9p share, not a copy"
        rt = s["metadata"]["reward_tests"]
        assert rt["total"] == s["metadata"]["tests"]["num_tests"]
        assert s["reward"] == rt["passed"] / rt["total"]
        assert s["metadata"]["session_turns"] >= 1
        n = s["response_length"]
        assert len(s["loss_mask"]) == len(s["rollout_log_probs"]) == len(s["weight_versions"]) == n
        trained = [i for i, x in enumerate(s["loss_mask"]) if x]
        assert all(s["rollout_log_probs"][i] <= 0.0 for i in trained)
        assert {s["weight_versions"][i] for i in trained} <= {0}
    by_rollout: dict[str, set] = {}
    for s in scored:
        by_rollout.setdefault(s["episode_id"], set()).add(s["reward"])
    assert all(len(r) == 1 for r in by_rollout.values())
    assert (out / "summary.json").exists()

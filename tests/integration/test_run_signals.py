"""A `vime run` its user cannot break (issue 27), with the real vLLM engine, vllm-router, Ray and torch trainer on the
tiny model:

* SIGINT during engine start, SIGTERM during training, and SIGINT followed by SIGKILL during the cleanup: each run
  ends within seconds (one line, exit 130/143, no traceback), and no process it started is left — every process
  carrying the run's environment marker (Ray's GCS, raylet and workers, the engine actors, the vLLM API server and
  its engine-core process, the router, the guards) is gone.
* SIGKILL of the driver during rollout: the same, with nothing of vime running to clean up.
* Two runs on one output directory: the second refuses at once, naming the first's pid and host.
* A trainer that cannot load its weights ends the run within seconds, with its own error.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.test_vime_run import _common

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MARK = "VIME_TEST_RUN_MARK"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"Count from {i}: {i}", "label": str(i + 2)}) + "\n" for i in range(8))
    )
    return path


def marked(mark: str) -> list[tuple[int, str]]:
    """``(pid, command)`` of every live process whose environment carries ``MARK=mark``."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found.append((int(entry), f.read().replace(b"\0", b" ").decode(errors="replace")[:120]))
            with open(f"/proc/{entry}/environ", "rb") as f:  # the run's own marker (vime_core.rollout.process)
                found[-1] = (*found[-1], [e for e in f.read().split(b"\0") if e.startswith(b"VIME_RUN_ID=")])
        except OSError:
            continue
    return found


class Run:
    """A `vime run` subprocess in its own session, its output in a file, its processes found by the marker."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.mark = uuid.uuid4().hex
        self.log = log
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{MARK: self.mark})
        self.out_file = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vime_core.cli", "run", *argv],
            stdout=self.out_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, needle: str, timeout_s: float = 600) -> float:
        t0 = time.monotonic()
        while needle not in self.text():
            assert self.proc.poll() is None, (
                f"the run ended (rc {self.proc.returncode}) before {needle!r}:\n" + (self.text()[-4000:])
            )
            assert time.monotonic() - t0 < timeout_s, f"no {needle!r} after {timeout_s} s:\n" + self.text()[-4000:]
            time.sleep(0.2)
        return time.monotonic() - t0

    def wait_for_engine_start(self, out: Path) -> None:
        """Until the engine's log file exists (its actor has started the vLLM server)."""
        t0 = time.monotonic()
        while not (out / "logs" / "vllm_engine_0.log").exists():
            assert self.proc.poll() is None, self.text()[-4000:]
            assert time.monotonic() - t0 < 600, self.text()[-4000:]
            time.sleep(0.2)

    def wait_exit(self, timeout_s: float) -> tuple[int, float]:
        t0 = time.monotonic()
        rc = self.proc.wait(timeout=timeout_s)
        return rc, time.monotonic() - t0

    def assert_nothing_left(self, within_s: float) -> float:
        t0 = time.monotonic()
        while left := marked(self.mark):
            if time.monotonic() - t0 > within_s:
                for pid, *_ in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                pytest.fail(f"{len(left)} process(es) of the run left {within_s} s after it ended: {left}")
            time.sleep(0.2)
        return time.monotonic() - t0

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid, *_ in marked(self.mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.out_file.close()


def _argv(model: Path, prompts: Path, out: Path, steps: int = 500) -> list[str]:
    return [*_common(model, prompts, out), "--num-rollout", str(steps), "--no-report", "--no-use-tensorboard"]


@pytest.fixture
def runs():
    started: list[Run] = []
    yield started
    for r in started:
        r.close()


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
    run = Run(_argv(tiny_model_dir, prompts, tmp_path / "out"), tmp_path / "run.log")
    runs.append(run)
    run.wait_for("step 1/")
    run.proc.send_signal(signal.SIGTERM)
    rc, seconds = run.wait_exit(60)
    text = run.text()
    assert rc == 143, text[-4000:]
    assert seconds < 15
    assert "vime run: stopped by SIGTERM; every process it started is gone" in text
    assert "Traceback" not in text
    run.assert_nothing_left(within_s=10)


def test_a_second_run_on_the_same_output_dir_refuses_at_once(tiny_model_dir, prompts, tmp_path, runs):
    out = tmp_path / "out"
    first = Run(_argv(tiny_model_dir, prompts, out), tmp_path / "first.log")
    runs.append(first)
    first.wait_for_engine_start(out)
    args_before = (out / "args.json").read_bytes()
    second = Run(_argv(tiny_model_dir, prompts, out), tmp_path / "second.log")
    runs.append(second)
    rc, seconds = second.wait_exit(60)
    assert rc == 2
    assert seconds < 30
    assert (
        f"vime: error: --output-dir {out} is in use by another run (pid {first.proc.pid} on host "
        f"{socket.gethostname()}, started " in second.text()
    )
    assert (out / "args.json").read_bytes() == args_before
    assert "[vime] placement" not in second.text()  # refused before Ray started
    second.assert_nothing_left(within_s=5)
    assert first.proc.poll() is None  # the first run goes on


def test_a_trainer_that_cannot_load_its_weights_ends_the_run_within_seconds(tiny_model_dir, prompts, tmp_path, runs):
    broken = tmp_path / "broken_model"
    broken.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.is_file():
            (broken / f.name).write_bytes(b"not a safetensors file" if f.suffix == ".safetensors" else f.read_bytes())
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

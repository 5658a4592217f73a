"""A run its user cannot break (issue 27): one run per output directory, and a start that fails an up-front check
changes nothing in the output directory (a finished run's records stay byte for byte).

Each case runs the real ``vime`` command in a subprocess; the refusals happen before Ray or any engine starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vime_core.run.output_dir import LOCK_NAME, OutputDirLock

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from vime_core.run.output_dir import OutputDirLock
    OutputDirLock(Path(sys.argv[1])).acquire()
    print("held", flush=True)
    time.sleep(600)
    """
)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1")


def _vime(*argv: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "vime_core.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )
    return proc, time.monotonic() - t0


def _hold(out: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True, env=_env())
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Count from {i}:", "label": str(i)}) + "\n" for i in range(4)))
    return path


def _args(model: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return [
        "run",
        "--model",
        str(model),
        "--prompt-data",
        str(prompts),
        "--output-dir",
        str(out),
        "--no-apply-chat-template",
        "--reward",
        "digit_fraction",
        *extra,
    ]


def test_a_second_run_on_a_held_output_dir_refuses_naming_pid_and_host(tiny_model_dir, prompts, tmp_path):
    out = tmp_path / "run"
    holder = _hold(out)
    try:
        # --load-debug-rollout-data: were it not refused, this run would start Ray and a trainer
        replay = ("--load-debug-rollout-data", "/none/{rollout_id}.pt")
        proc, seconds = _vime(*_args(tiny_model_dir, prompts, out, *replay))
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("vime")]
    assert lines == [
        f"vime: error: --output-dir {out} is in use by another run (pid {holder.pid} on host {socket.gethostname()}, "
        f"started {json.loads((out / LOCK_NAME).read_text())['started']}; lock {out / LOCK_NAME}): wait for it to "
        "end, stop it, or give this vime run another --output-dir"
    ]
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # no args.json, plugins.json, plan.json
    assert seconds < 30


def test_a_lock_left_by_a_killed_run_is_stale_and_taken_over(tmp_path):
    out = tmp_path / "run"
    holder = _hold(out)
    record = json.loads((out / LOCK_NAME).read_text())
    assert record["pid"] == holder.pid and record["host"] == socket.gethostname()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = OutputDirLock(out).acquire()  # the kernel dropped the killed holder's flock
    try:
        assert lock.stale == record
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert (out / LOCK_NAME).read_text() == ""  # a clean release leaves no record to call stale
    again = OutputDirLock(out).acquire()
    assert again.stale is None
    again.release()


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture
def finished_run(tmp_path) -> Path:
    out = tmp_path / "finished"
    out.mkdir()
    (out / "args.json").write_text('{"reward": "digit_fraction"}')
    (out / "plugins.json").write_text("[]")
    (out / "summary.json").write_text('{"steps_run": 2}')
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    return out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--reward", "digit_fractoin"],
            "vime: error: unknown reward 'digit_fractoin' for --reward; available: ",
        ),
        (
            ["--dynamic-sampling-filter", "check_reward_nonzero_stdd"],
            "vime: error: unknown dynamic_filter 'check_reward_nonzero_stdd' for --dynamic-sampling-filter; "
            "available: ",
        ),
        (
            ["--generate", "coding_agent", "--agent", "claude-code", "--sandbox", "dockr"],
            "vime: error: unknown sandbox 'dockr' for --sandbox; available: ",
        ),
        (
            ["--generate", "coding_agent"],
            "vime: error: --generate coding_agent needs --agent NAME (e.g. claude-code, codex; `vime plugins`)",
        ),
        (
            ["--vllm-max-model-len", "banana"],
            "vime: error: vLLM refuses argument --vllm-max-model-len: invalid human_readable_int_or_auto value: "
            "'banana'",
        ),
        (
            ["--rollout-sampling-params", '{"min_tokens": -1}'],
            "vime: error: vLLM cannot honour the sampling parameters of training rollouts (--rollout-*): "
            "VLLMValidationError: min_tokens must be greater than or equal to 0, got -1.",
        ),
    ],
    ids=["reward", "dynamic-filter", "sandbox", "agent", "vllm-value", "sampling-value"],
)
def test_a_failed_start_against_a_finished_run_changes_nothing(tiny_model_dir, prompts, finished_run, extra, message):
    before = _hashes(finished_run)
    proc, seconds = _vime(*_args(tiny_model_dir, prompts, finished_run, *extra))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("vime")]
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert _hashes(finished_run) == before  # same files, same bytes: no args.json/plugins.json rewritten
    assert seconds < 60  # vLLM's own parser (imported in a subprocess) is the slowest check


def test_a_model_directory_without_weights_fails_before_anything_starts(tiny_model_dir, prompts, tmp_path):
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            (weightless / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "run"
    proc, seconds = _vime(*_args(weightless, prompts, out))
    assert proc.returncode == 2, proc.stderr[-3000:]
    held = ", ".join(sorted(f.name for f in weightless.iterdir())[:8])
    assert proc.stderr.strip().splitlines()[-1] == (
        f"vime: error: --model {weightless}: no weights there (*.safetensors or *.bin); it holds {held}"
    )
    assert not out.exists()
    assert seconds < 30


def test_an_output_dir_that_is_a_file_and_a_missing_model_are_one_line(tiny_model_dir, prompts, tmp_path):
    a_file = tmp_path / "not_a_dir"
    a_file.write_text("x")
    proc, _ = _vime(*_args(tiny_model_dir, prompts, a_file))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"vime: error: --output-dir {a_file} is a file; give a directory"]
    missing = tmp_path / "no_such_model"
    proc, _ = _vime(*_args(missing, prompts, tmp_path / "run"))
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()
    assert len(last) == 1 and last[0].startswith(f"vime: error: --model {missing}: "), proc.stderr[-2000:]


def test_sandbox_cleanup_of_an_unknown_backend_says_so():
    proc, _ = _vime("sandbox", "cleanup", "--backend", "dockr")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vime: error: unknown sandbox 'dockr' for --sandbox; available: ")

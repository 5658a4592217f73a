"""The examples' `vime run` variants on the tiny model, one or two steps each, on the session's vLLM server
(``--rollout-external``; docs/testing.md, "Shared runs"). Two runs carry the checks of five examples:

* **mem_agent** (its config, one step, two document lengths evaluated): every turn of a rollout is a trained sample
  with the rollout's reward and episode id, the trainer serves the engine's log-probs back, and each document length
  is evaluated and reported per set, a fanned-out rollout counted once;
* **multi_task_eval + delta_weight_sync + on_policy_distillation** (the multi_task_eval config with the other two
  examples' flags, two steps, its own teacher engine): three eval tasks, each scored by its own reward with its own
  sampling (exact rewards recomputed from the dumped eval samples; greedy sets give equal samples); every weight
  sync is a delta smaller than the full weights; the distillation term is computed from a teacher of other weights;
  the two examples' scripts print their tables.

The generate functions of tau_bench, search_r1 and retool run against the same engine in test_examples_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.helpers import dumped_samples, external_engine_flags, read_metrics
from vime_core.testing.cli import run_vime
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.extended]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _head(src: Path, dst: Path, n: int) -> Path:
    """The first ``n`` rows of ``src`` written to ``dst``."""
    dst.write_text("".join(line + "\n" for line in src.read_text().splitlines()[:n]))
    return dst


@pytest.fixture(scope="module")
def mem_agent_run(tiny_model_dir, module_engine_at_v0, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mem_agent")
    data = EXAMPLES / "mem_agent" / "data"
    out = tmp / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLES / "mem_agent"), os.environ.get("PYTHONPATH", "")]))
        run_vime(
            "run", "--config", str(EXAMPLES / "mem_agent" / "config.yaml"), "--model", str(tiny_model_dir),
            *external_engine_flags(module_engine_at_v0), "--output-dir", str(out), "--num-rollout", "1",
            "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--lr", "1e-3",
            "--eval-prompt-data", "len200", str(_head(data / "eval_200w.jsonl", tmp / "e200.jsonl", 2)),
            "len800", str(_head(data / "eval_800w.jsonl", tmp / "e800.jsonl", 2)),
            "--save-debug-rollout-data", str(out / "debug" / "rollout_{rollout_id}.pt"),
        )  # fmt: skip
    return out


def test_mem_agent_trains_every_turn_with_its_rollouts_reward(mem_agent_run):
    sys.path.insert(0, str(EXAMPLES / "mem_agent"))
    try:
        import mem_agent
    finally:
        sys.path.remove(str(EXAMPLES / "mem_agent"))
    train, = [r for r in read_metrics(mem_agent_run) if "rollout/reward_mean" in r]  # fmt: skip
    samples = dumped_samples(mem_agent_run, 0)
    episodes: dict[str, list[dict]] = {}
    for s in samples:
        episodes.setdefault(s["episode_id"], []).append(s)
    assert len(episodes) == 2 and train["rollout/num_samples"] == float(len(samples))
    for turns in episodes.values():
        n = turns[0]["metadata"]["num_chunks"]
        assert n >= 2 and [t["metadata"]["mem_role"] for t in turns] == ["memory"] * n + ["answer"]
        assert [t["metadata"]["mem_turn"] for t in turns] == list(range(n + 1))
        expected = asyncio.run(mem_agent.reward(plugin_context(), Sample.from_dict(turns[0])))
        assert {t["reward"] for t in turns} == {expected}
        for t in turns:
            assert t["loss_mask"] == [1] * t["response_length"] and t["status"] in ("completed", "truncated")
            assert "context" not in t["metadata"] and t["response_length"] <= 48
    assert train["train/train_rollout_logprob_abs_diff"] < 1e-2  # the trainer scores the engine's tokens
    evals = [r for r in read_metrics(mem_agent_run) if "eval/weight_version" in r]
    assert [r["step"] for r in evals] == [0, 1]
    for r in evals:  # two documents per length, one rollout each: each rollout (of several turns) counted once
        assert r["eval/len200/num_samples"] == 2.0 and r["eval/len800/num_samples"] == 2.0
        assert r["eval/len200/failed_frac"] == 0.0 and r["eval/len800/failed_frac"] == 0.0


@pytest.fixture(scope="module")
def tasks_run(tiny_model_dir, module_engine_at_v0, tmp_path_factory):
    from vime_core.testing.tiny_model import build_tiny_model

    tmp = tmp_path_factory.mktemp("tasks")
    teacher = build_tiny_model(tmp / "teacher", seed=1)  # same tokenizer, other random weights
    delta = yaml.safe_load((EXAMPLES / "delta_weight_sync" / "config.yaml").read_text())
    distill = yaml.safe_load((EXAMPLES / "on_policy_distillation" / "config.yaml").read_text())
    quick, tasks = EXAMPLES / "quickstart" / "data", EXAMPLES / "multi_task_eval" / "data"
    out = tmp / "run"
    run_vime(
        "run", "--config", str(EXAMPLES / "multi_task_eval" / "config.yaml"), "--model", str(tiny_model_dir),
        *external_engine_flags(module_engine_at_v0), "--output-dir", str(out), "--num-rollout", "2",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--lr", "1e-3",
        "--eval-prompt-data", "arith", str(_head(quick / "eval.jsonl", tmp / "arith.jsonl", 3)),
        "boxed", str(_head(tasks / "boxed.jsonl", tmp / "boxed.jsonl", 3)),
        "copy", str(_head(tasks / "copy.jsonl", tmp / "copy.jsonl", 3)), "--save-eval-samples",
        # delta_weight_sync's settings
        "--weight-sync", delta["weight_sync"], "--update-weight-delta-encoding", delta["update_weight_delta_encoding"],
        # on_policy_distillation's settings, with a teacher the tiny model's tokenizer fits
        "--advantage-estimator", distill["advantage_estimator"], "--distill-coef", str(distill["distill_coef"]),
        "--distill-teacher", str(teacher),
    )  # fmt: skip
    return out


def _script(path: Path, out: Path) -> str:
    proc = subprocess.run([sys.executable, str(path), str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_multi_task_eval_scores_each_task_with_its_own_reward_and_sampling(tasks_run):
    from vime_core.rewards.math_answer import math_reward
    from vime_core.rewards.reasoning_gym import reasoning_gym_reward
    from vime_core.rewards.simple import exact_match

    evals = [r for r in read_metrics(tasks_run) if "eval/weight_version" in r]
    assert [r["step"] for r in evals] == [0, 2]  # before training and after the last step (eval_interval 2)
    ctx = plugin_context(math_verify_timeout=30.0, math_verify_workers=1)
    rewards = {"arith": reasoning_gym_reward, "boxed": math_reward, "copy": exact_match}
    budget = {"arith": 64, "boxed": 24, "copy": 8}
    for step in (0, 2):
        for task, fn in rewards.items():
            rows = [json.loads(x) for x in (tasks_run / "eval_samples" / task / f"step_{step:06d}.jsonl").open()]
            assert len(rows) == 6  # 3 prompts × 2 samples
            for r in rows:
                s = Sample(prompt=r["prompt"], response=r["response"], label=r["label"])
                if task == "arith":  # reasoning-gym scores with the row's entry
                    s.metadata = json.loads((tasks_run.parent / "arith.jsonl").read_text().splitlines()[
                        r["prompt_index"]])["metadata"]  # fmt: skip
                assert r["reward"] == asyncio.run(fn(ctx, s)), (task, r["response"])
                assert r["response_length"] <= budget[task]
            if task != "arith":  # greedy (temperature 0): both samples of a prompt are the same
                by_prompt: dict[int, set[str]] = {}
                for r in rows:
                    by_prompt.setdefault(r["prompt_index"], set()).add(r["response"])
                assert all(len(v) == 1 for v in by_prompt.values()), by_prompt
            if task == "copy":  # stopped at the first newline
                assert all("\n" not in r["response"] for r in rows)
            m = evals[step // 2]
            assert m[f"eval/{task}/reward_mean"] == pytest.approx(sum(r["reward"] for r in rows) / 6)
    summary = json.loads((tasks_run / "summary.json").read_text())
    assert {k for k in summary["eval_last"] if k.endswith("/reward_mean")} == {
        "eval/arith/reward_mean", "eval/boxed/reward_mean", "eval/copy/reward_mean"}  # fmt: skip


def test_delta_weight_sync_writes_less_than_the_full_weights(tasks_run, tiny_model_dir):
    from safetensors import safe_open

    with safe_open(str(tiny_model_dir / "model.safetensors"), "np") as f:
        full = sum(f.get_tensor(k).nbytes for k in f.keys())  # noqa: SIM118 - safe_open has no __iter__
    train = [r for r in read_metrics(tasks_run) if "weight_sync/bytes" in r]
    assert len(train) == 2
    for r in train:
        assert r["weight_sync/full_bytes"] == float(full) and 0 < r["weight_sync/bytes"] < full
    text = _script(EXAMPLES / "delta_weight_sync" / "sync_bytes.py", tasks_run)
    lines = text.splitlines()
    assert lines[0].split() == ["step", "written", "MiB", "full", "MiB", "written/full"]
    assert [x.split()[0] for x in lines[1:]] == ["1", "2", "all"]
    pct = 100 * train[0]["weight_sync/bytes"] / full
    assert lines[1].split()[-1] == f"{pct:.1f}%"


def test_on_policy_distillation_term_against_a_teacher_of_other_weights(tasks_run):
    train = [r for r in read_metrics(tasks_run) if "rollout/reward_mean" in r]
    kl = [r["rollout/distill_reverse_kl"] for r in train]
    assert len(kl) == 2 and all(k > 0.1 for k in kl), kl  # two random models disagree far beyond engine noise
    assert all(abs(r["train/adv/mean"] + r["rollout/distill_reverse_kl"]) < 1e-5 for r in train)  # A = logπ_T - logπ_S
    text = _script(EXAMPLES / "on_policy_distillation" / "distill_curve.py", tasks_run)
    assert [line.split()[:2] for line in text.splitlines()[1:]] == [["1", f"{kl[0]:.4f}"], ["2", f"{kl[1]:.4f}"]]

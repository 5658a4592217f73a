"""Evaluation: pass@k (exact values), eval metric aggregation, the eval schedule, the eval flags and their errors,
the sample dump, and RolloutManager.evaluate's bookkeeping (eval sampling parameters, eval reward, no training
buffer/hook side effects) with a scripted generate function; the real engines are in
tests/integration/test_vime_eval.py."""

from __future__ import annotations

import argparse
import json
import math
from fractions import Fraction
from pathlib import Path

import pytest

from vime_core.cli.arguments import ArgumentError, parse_run_args
from vime_core.config import EvalConfig, RunConfig
from vime_core.data.source import DataError
from vime_core.rollout.evaluation import (
    EvalArgumentError,
    EvalSet,
    dump_eval_samples,
    eval_line,
    eval_metrics,
    eval_sampling_params,
    eval_steps,
    load_eval_sets,
    parse_eval_prompt_data,
    pass_at_k,
    pass_at_k_values,
)
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit

BASE = ["--model", "m", "--prompt-data", "d.jsonl"]


def _exact(n: int, c: int, k: int) -> Fraction:
    """1 - C(n-c, k) / C(n, k) with exact integers (math.comb(a, b) = 0 for b > a)."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


# -- pass@k ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 0, 1, 0.0),  # c = 0: never passes
        (4, 0, 4, 0.0),
        (4, 4, 1, 1.0),  # c = n: always passes
        (4, 4, 4, 1.0),
        (4, 1, 1, 0.25),  # pass@1 = c/n
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 1, 4, 1.0),  # k = n and c >= 1: some draw of all n contains the correct one
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (6, 1, 4, 2 / 3),  # 1 - C(5,4)/C(6,4) = 1 - 5/15
        (8, 3, 2, 1 - 10 / 28),  # 1 - C(5,2)/C(8,2)
        (1, 0, 1, 0.0),
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_is_stable_where_binomials_overflow_floats():
    # C(2000, 512) ~ 1e480 does not fit a float; the product form stays within 1e-12 of the exact value
    for n, c, k in [(2000, 5, 512), (2000, 1, 1999), (1024, 37, 64), (200, 199, 100)]:
        assert pass_at_k(n, c, k) == pytest.approx(float(_exact(n, c, k)), abs=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError, match=f"n={n}, c={c}, k={k}"):
            pass_at_k(n, c, k)


def test_pass_at_k_values_are_powers_of_two_and_n():
    assert pass_at_k_values(1) == [1]
    assert pass_at_k_values(2) == [1, 2]
    assert pass_at_k_values(3) == [1, 2, 3]
    assert pass_at_k_values(4) == [1, 2, 4]
    assert pass_at_k_values(6) == [1, 2, 4, 6]
    assert pass_at_k_values(16) == [1, 2, 4, 8, 16]


# -- metrics ---------------------------------------------------------------------------------------------------------
def _s(gi: int, i: int, reward, status=Status.COMPLETED, length: int = 10, episode_id=None) -> Sample:
    return Sample(group_index=gi, index=i, reward=reward, status=status, response_length=length, episode_id=episode_id)


def test_eval_metrics_exact():
    groups = [
        # prompt 0: 2 correct of 4 (the 0.5 is partial credit: not correct at threshold 1.0)
        [
            _s(0, 0, 1.0, length=4),
            _s(0, 1, 0.0, length=6),
            _s(0, 2, 1.0, Status.TRUNCATED, 8),
            _s(0, 3, 0.5, length=2),
        ],
        # prompt 1: 0 correct; one failed sample (no reward, not scored, counted in n)
        [_s(1, 0, 0.0, length=10), _s(1, 1, None, Status.FAILED, 0), _s(1, 2, 0.0, length=5), _s(1, 3, 0.0, length=5)],
    ]
    m = eval_metrics("gsm", groups)
    assert m == {
        "eval/gsm/reward_mean": pytest.approx((1 + 0 + 1 + 0.5 + 0 + 0 + 0) / 7),
        "eval/gsm/response_len_mean": pytest.approx((4 + 6 + 8 + 2 + 10 + 5 + 5) / 7),
        "eval/gsm/truncated_frac": 1 / 8,
        "eval/gsm/failed_frac": 1 / 8,
        "eval/gsm/num_samples": 8.0,
        "eval/gsm/pass@1": pytest.approx((0.5 + 0.0) / 2),
        "eval/gsm/pass@2": pytest.approx((5 / 6 + 0.0) / 2),
        "eval/gsm/pass@4": pytest.approx((1.0 + 0.0) / 2),
    }
    # a lower threshold makes the 0.5 correct: prompt 0 has 3 of 4
    assert eval_metrics("gsm", groups, pass_threshold=0.5)["eval/gsm/pass@1"] == pytest.approx(0.75 / 2)


def test_eval_metrics_dict_reward_key_and_fanned_out_rollouts():
    # prompt 0: rollout "a" was fanned out into 2 segments (counted once), rollout "b" one segment
    g = [
        _s(0, 0, {"acc": 1.0, "fmt": 0.0}, episode_id="a", length=3),
        _s(0, 0, {"acc": 1.0, "fmt": 0.0}, episode_id="a", length=7),
        _s(0, 1, {"acc": 0.0, "fmt": 1.0}, episode_id="b", length=5),
    ]
    m = eval_metrics("x", [g], reward_key="acc")
    assert m["eval/x/num_samples"] == 2.0 and m["eval/x/reward_mean"] == 0.5
    assert m["eval/x/response_len_mean"] == 6.0  # last segment (7) of "a", 5 of "b"
    assert m["eval/x/pass@1"] == 0.5 and m["eval/x/pass@2"] == 1.0
    with pytest.raises(ValueError, match="groups of different sizes"):
        eval_metrics("x", [g, [_s(1, 0, {"acc": 1.0})]], reward_key="acc")
    with pytest.raises(ValueError, match="needs --reward-key"):
        eval_metrics("x", [g])


def test_eval_line_shows_reward_and_largest_pass_at_k():
    m = eval_metrics("gsm", [[_s(0, 0, 1.0, length=4), _s(0, 1, 0.0, length=6)]])
    m["eval/weight_version"] = 3.0
    line = "[vime] eval step 3 (weight version 3) | gsm reward 0.500 pass@2 1.000 resp_len 5.0 truncated 0.00"
    assert eval_line(3, m) == line
    # vime eval: labelled by the model it evaluates, never by a weight version (issue 35)
    assert eval_line(0, m, model="outputs/q/final_hf") == (
        "[vime] eval of outputs/q/final_hf | gsm reward 0.500 pass@2 1.000 resp_len 5.0 truncated 0.00"
    )


def test_dump_eval_samples_records(tmp_path):
    s = Sample(group_index=2, index=1, prompt="1+1=", response=" 2", response_length=1, label="2", reward=1.0)
    s.status = Status.COMPLETED
    f = Sample(group_index=2, index=0, prompt="1+1=", label="2", status=Status.FAILED)
    path = dump_eval_samples(tmp_path, "arith", 5, 5, [[f, s]], None)
    assert path == tmp_path / "eval_samples" / "arith" / "step_000005.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[1] == {
        "eval_set": "arith",
        "step": 5,
        "weight_version": 5,
        "prompt_index": 2,
        "sample_index": 1,
        "prompt": "1+1=",
        "response": " 2",
        "response_length": 1,
        "label": "2",
        "reward": 1.0,
        "status": "completed",
        "token_weight_versions": [],
    }
    assert rows[0]["reward"] is None and rows[0]["status"] == "failed"


# -- schedule --------------------------------------------------------------------------------------------------------
def test_eval_steps():
    assert eval_steps(5, None) == [0, 5]  # before and after training
    assert eval_steps(5, 2) == [0, 2, 4, 5]  # and every 2 finished steps
    assert eval_steps(4, 2) == [0, 2, 4]  # the last step is not evaluated twice
    assert eval_steps(5, 2, before_train=False) == [2, 4, 5]
    assert eval_steps(5, 2, start_step=2) == [4, 5]  # resumed after step 2: no step-0 eval
    assert eval_steps(1, 10) == [0, 1]


# -- flags -----------------------------------------------------------------------------------------------------------
def test_parse_eval_prompt_data_pairs_and_errors():
    assert parse_eval_prompt_data(None) == []
    assert parse_eval_prompt_data(["aime", "a.jsonl", "gsm8k", "/d/g.parquet"]) == [
        EvalSet("aime", Path("a.jsonl")),
        EvalSet("gsm8k", Path("/d/g.parquet")),
    ]
    with pytest.raises(EvalArgumentError, match=r"--eval-prompt-data expects NAME PATH pairs .* got 3 values"):
        parse_eval_prompt_data(["aime", "a.jsonl", "gsm8k"])
    with pytest.raises(EvalArgumentError, match="given twice"):
        parse_eval_prompt_data(["a", "x.jsonl", "a", "y.jsonl"])
    with pytest.raises(EvalArgumentError, match="set name 'a/b'"):
        parse_eval_prompt_data(["a/b", "x.jsonl"])


def test_eval_flag_defaults():
    args = parse_run_args(BASE + ["--reward", "digit_fraction"])
    assert args.eval_prompt_data is None and args.eval_interval is None and args.n_samples_per_eval_prompt == 1
    assert args.eval_reward == "digit_fraction"  # defaults to --reward
    assert args.eval_pass_threshold == 1.0 and args.save_eval_samples is False and args.skip_eval_before_train is False
    # sampling falls back to the rollout flags
    args = parse_run_args(BASE + ["--rollout-temperature", "0.7", "--rollout-max-response-len", "33"])
    assert eval_sampling_params(EvalConfig.from_args(args)) == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "max_tokens": 33,
    }


def test_eval_flags_override():
    args = parse_run_args(
        BASE
        + ["--eval-prompt-data", "a", "a.jsonl", "b", "b.jsonl", "--eval-interval", "5"]
        + ["--n-samples-per-eval-prompt", "8", "--eval-temperature", "0", "--eval-top-p", "0.9", "--eval-top-k", "3"]
        + ["--eval-max-response-len", "256", "--eval-reward", "math", "--rollout-stop", "\n\n"]
    )
    assert args.eval_prompt_data == ["a", "a.jsonl", "b", "b.jsonl"] and args.eval_interval == 5
    assert args.n_samples_per_eval_prompt == 8 and args.eval_reward == "math"
    assert eval_sampling_params(EvalConfig.from_args(args)) == {
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 3,
        "max_tokens": 256,
        "stop": ["\n\n"],
    }


def test_eval_flag_errors_name_the_flag():
    with pytest.raises(ArgumentError, match=r"--eval-prompt-data expects NAME PATH pairs .* got 1 values: e.jsonl"):
        parse_run_args(BASE + ["--eval-prompt-data", "e.jsonl"])
    with pytest.raises(ArgumentError, match="--eval-interval needs --eval-prompt-data"):
        parse_run_args(BASE + ["--eval-interval", "2"])
    with pytest.raises(ArgumentError, match="--eval-interval must be >= 1, got 0"):
        parse_run_args(BASE + ["--eval-prompt-data", "a", "a.jsonl", "--eval-interval", "0"])
    with pytest.raises(ArgumentError, match="--n-samples-per-eval-prompt must be >= 1, got 0"):
        parse_run_args(BASE + ["--eval-prompt-data", "a", "a.jsonl", "--n-samples-per-eval-prompt", "0"])
    with pytest.raises(ArgumentError, match="not work with --debug-train-only"):
        parse_run_args(
            ["--model", "m", "--load-debug-rollout-data", "x_{rollout_id}.pt"] + ["--eval-prompt-data", "a", "a"]
        )
    with pytest.raises(ArgumentError, match="did you mean --eval-interval"):
        parse_run_args(BASE + ["--eval-intervall", "2"])


def test_config_eval_sets_mapping_or_list_resolved_against_the_config(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "model: m\nprompt_data: train.jsonl\neval_prompt_data:\n  arith: data/eval.jsonl\n  abs: /x/y.jsonl\n"
    )
    args = parse_run_args(["--config", str(cfg)])
    assert args.eval_prompt_data == ["arith", str(tmp_path / "data" / "eval.jsonl"), "abs", "/x/y.jsonl"]
    cfg.write_text("model: m\nprompt_data: train.jsonl\neval_prompt_data: [arith, data/eval.jsonl]\n")
    assert parse_run_args(["--config", str(cfg)]).eval_prompt_data == ["arith", str(tmp_path / "data" / "eval.jsonl")]
    cfg.write_text("model: m\nprompt_data: train.jsonl\neval_prompt_data: [data/eval.jsonl]\n")
    with pytest.raises(ArgumentError, match=rf"--config {cfg}: eval_prompt_data must be a mapping NAME: PATH"):
        parse_run_args(["--config", str(cfg)])


def test_vime_eval_arguments(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: m\nprompt_data: train.jsonl\noutput_dir: outputs/train\neval_prompt_data: {a: e.jsonl}\n")
    args = parse_run_args(["--config", str(cfg), "--model", "final_hf"], command="eval")
    assert args.model == "final_hf" and args.prompt_data is None and args.debug_rollout_only
    assert args.output_dir == Path("outputs/eval")  # never the config's training output dir
    assert args.update_weight_disk_dir == Path("outputs/eval/weights")
    args = parse_run_args(["--model", "m", "--eval-prompt-data", "a", "e.jsonl", "--output-dir", "o"], command="eval")
    assert args.output_dir == Path("o") and args.eval_prompt_data == ["a", "e.jsonl"]
    with pytest.raises(ArgumentError, match="vime eval needs --eval-prompt-data"):
        parse_run_args(["--model", "m"], command="eval")


def test_missing_eval_set_fails_before_any_engine(tmp_path):
    args = parse_run_args(BASE + ["--eval-prompt-data", "arith", str(tmp_path / "nope.jsonl")])
    with pytest.raises(DataError, match=rf"--eval-prompt-data arith {tmp_path}/nope.jsonl: file not found"):
        load_eval_sets(EvalConfig.from_args(args))


# -- RolloutManager.evaluate with a scripted generate function --------------------------------------------------------
CALLS: list[dict] = []


async def scripted_generate(args: argparse.Namespace, sample: Sample, sampling_params: dict) -> Sample:
    """Answers the label for sample index 0 and 'wrong' otherwise; records the sampling parameters it got."""
    CALLS.append(dict(sampling_params))
    answer = sample.label if sample.index == 0 else "wrong"
    sample.append_response_tokens([1, 2, 3], trainable=True, log_probs=[-0.1] * 3, weight_version=0, text=answer)
    sample.tokens = [9] + sample.tokens
    sample.status = Status.TRUNCATED if sample.group_index == 1 else Status.COMPLETED
    return sample


async def exact_match(args: argparse.Namespace, sample: Sample) -> float:
    return float(sample.response == sample.label)


async def never_called(args: argparse.Namespace, sample: Sample) -> float:
    raise AssertionError("the training reward scored an eval sample")


def test_rollout_manager_evaluate(tiny_model_dir, tmp_path):
    from vime_core.rollout.manager import RolloutManager

    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "t", "label": "x"}) + "\n")
    ev = tmp_path / "eval.jsonl"
    ev.write_text("".join(json.dumps({"prompt": f"q{i}", "label": f"a{i}"}) + "\n" for i in range(3)))
    args = parse_run_args(
        ["--model", str(tiny_model_dir), "--prompt-data", str(train), "--output-dir", str(tmp_path / "out")]
        + ["--generate", f"{__name__}:scripted_generate", "--reward", f"{__name__}:never_called"]
        + ["--eval-reward", f"{__name__}:exact_match", "--eval-prompt-data", "qa", str(ev)]
        + ["--n-samples-per-eval-prompt", "4", "--eval-max-response-len", "7", "--eval-temperature", "0.5"]
        + ["--save-eval-samples"]
    )
    manager = RolloutManager(RunConfig.from_args(args), tiny_model_dir)
    state = manager.groups.data_source.state_dict()
    manager.weight_version = 3
    CALLS.clear()
    m = manager.evaluate(3)
    # 3 prompts × 4 samples, each with the eval sampling parameters
    # (and each its own engine seed, derived from --seed as training samples' are: sample_seed)
    from vime_core.rollout.runner import sample_seed

    assert sorted(c.pop("seed") for c in CALLS) == sorted(
        sample_seed(1234, 3, g, i) for g in range(3) for i in range(4)
    )
    assert CALLS == [{"temperature": 0.5, "top_p": 1.0, "top_k": -1, "max_tokens": 7}] * 12
    assert m.pop("perf/eval_time") > 0
    assert m == {
        "eval/weight_version": 3.0,
        "eval/qa/reward_mean": 0.25,
        "eval/qa/response_len_mean": 3.0,
        "eval/qa/truncated_frac": 4 / 12,
        "eval/qa/failed_frac": 0.0,
        "eval/qa/num_samples": 12.0,
        "eval/qa/pass@1": 0.25,
        "eval/qa/pass@2": 0.5,
        "eval/qa/pass@4": 1.0,
    }
    assert manager.groups.data_source.state_dict() == state  # the training buffer handed out nothing
    rows = [json.loads(x) for x in (tmp_path / "out" / "eval_samples" / "qa" / "step_000003.jsonl").open()]
    assert [(r["prompt_index"], r["sample_index"], r["reward"], r["weight_version"]) for r in rows[:5]] == [
        (0, 0, 1.0, 3),
        (0, 1, 0.0, 3),
        (0, 2, 0.0, 3),
        (0, 3, 0.0, 3),
        (1, 0, 1.0, 3),
    ]
    assert rows[4] == {
        "eval_set": "qa",
        "step": 3,
        "weight_version": 3,
        "prompt_index": 1,
        "sample_index": 0,
        "prompt": "q1",
        "response": "a1",
        "response_length": 3,
        "label": "a1",
        "reward": 1.0,
        "status": "truncated",
        "token_weight_versions": [0],
    }


async def half(args: argparse.Namespace, sample: Sample) -> float:
    return 0.5


def test_eval_set_reward_scores_each_set_with_its_own_reward(tiny_model_dir, tmp_path):
    """``--eval-set-reward``: one set keeps ``--eval-reward``, the other is scored by its own function, with its own
    sampling (``--eval-set-sampling-params``): several tasks in one evaluation (examples/multi_task_eval)."""
    from vime_core.rollout.manager import RolloutManager

    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "t", "label": "x"}) + "\n")
    ev = tmp_path / "eval.jsonl"
    ev.write_text("".join(json.dumps({"prompt": f"q{i}", "label": f"a{i}"}) + "\n" for i in range(2)))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"model: {tiny_model_dir}\nprompt_data: {train}\noutput_dir: {tmp_path / 'out'}\n"
        f"generate: {__name__}:scripted_generate\nreward: {__name__}:never_called\n"
        f"eval_reward: {__name__}:exact_match\neval_prompt_data: {{qa: {ev}, qb: {ev}}}\n"
        f"eval_set_reward: {{qb: '{__name__}:half'}}\neval_set_sampling_params: {{qb: {{max_tokens: 5}}}}\n"
        "n_samples_per_eval_prompt: 2\n"
    )
    args = parse_run_args(["--config", str(cfg)])
    assert args.eval_set_reward == {"qb": f"{__name__}:half"}
    assert args.eval_set_sampling_params == {"qb": {"max_tokens": 5}}
    manager = RolloutManager(RunConfig.from_args(args), tiny_model_dir)
    CALLS.clear()
    m = manager.evaluate(0)
    assert sorted(c["max_tokens"] for c in CALLS) == [5] * 4 + [128] * 4
    assert (m["eval/qa/reward_mean"], m["eval/qa/pass@2"]) == (0.5, 1.0)  # exact_match: index 0 answers the label
    assert (m["eval/qb/reward_mean"], m["eval/qb/pass@2"]) == (0.5, 0.0)  # 0.5 for every sample: never correct


def test_eval_set_reward_errors_name_the_flag(tmp_path):
    with pytest.raises(ArgumentError, match=r"^--eval-set-reward expects NAME REWARD pairs, got 1 values: a$"):
        parse_run_args(BASE + ["--eval-prompt-data", "a", "a.jsonl", "--eval-set-reward", "a"])
    with pytest.raises(ArgumentError, match=r"^--eval-set-reward b: no such --eval-prompt-data set \(sets: \['a'\]\)"):
        parse_run_args(BASE + ["--eval-prompt-data", "a", "a.jsonl", "--eval-set-reward", "b", "math"])
    with pytest.raises(ArgumentError, match=r"^--eval-set-reward a: given twice"):
        parse_run_args(BASE + ["--eval-prompt-data", "a", "a.jsonl", "--eval-set-reward", "a", "math", "a", "f1"])
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: m\nprompt_data: d.jsonl\neval_prompt_data: {a: a.jsonl}\neval_set_reward: {a: [math]}\n")
    with pytest.raises(ArgumentError, match=rf"^{cfg}:4: key 'eval_set_reward': expected a mapping of eval set NAME"):
        parse_run_args(["--config", str(cfg)])
    from vime_core.plugins.manager import get_plugins
    from vime_core.plugins.registry import RegistryError
    from vime_core.run.preflight import resolve_plugins

    args = parse_run_args(BASE + ["--eval-prompt-data", "a", "a.jsonl", "--eval-set-reward", "a", "no_such_reward"])
    with pytest.raises(RegistryError, match="no_such_reward"):
        resolve_plugins(get_plugins(), RunConfig.from_args(args))

"""Every sampling field vLLM honours can be set for training rollouts and for each eval set (issue 27, kind of
TRL #5831): ``--rollout-min-p``, ``--rollout-repetition-penalty``, ``--rollout-sampling-params JSON`` and their
eval counterparts, ``--eval-set-sampling-params NAME JSON`` per set; evaluation's settings never reach training;
a field the engine cannot honour is refused at start-up by vLLM's own ``SamplingParams``, naming the flags."""

from __future__ import annotations

import json

import pytest

from vime_core.cli.arguments import ArgumentError, parse_run_args, rollout_sampling_params
from vime_core.config import EvalConfig, RolloutConfig
from vime_core.rollout.evaluation import eval_sampling_params
from vime_core.run.preflight import check_vllm_values

pytestmark = pytest.mark.unit


def _args(tmp_path, *argv: str):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p", "label": "1"}\n')
    return parse_run_args(["--model", "m", "--prompt-data", str(data), *argv])


def test_min_p_repetition_penalty_and_any_other_field_reach_the_training_params(tmp_path):
    args = _args(
        tmp_path,
        "--rollout-min-p",
        "0.05",
        "--rollout-repetition-penalty",
        "1.1",
        "--rollout-sampling-params",
        '{"presence_penalty": 0.5, "frequency_penalty": 0.25}',
    )
    assert rollout_sampling_params(RolloutConfig.from_args(args)) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_tokens": 128,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
    }
    # not set: not sent (vLLM's own defaults apply), as before
    assert rollout_sampling_params(RolloutConfig.from_args(_args(tmp_path))) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_tokens": 128,
    }


def test_each_eval_set_gets_its_own_fields_and_training_never_sees_them(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for p in (a, b):
        p.write_text('{"prompt": "q", "label": "1"}\n')
    args = _args(
        tmp_path,
        "--rollout-min-p",
        "0.01",
        "--rollout-sampling-params",
        '{"presence_penalty": 0.5}',
        "--eval-prompt-data",
        "a",
        str(a),
        "b",
        str(b),
        "--eval-repetition-penalty",
        "1.3",
        "--eval-sampling-params",
        '{"presence_penalty": 0.0}',
        "--eval-set-sampling-params",
        "b",
        json.dumps({"temperature": 0.6, "min_p": 0.2, "seed": 3}),
    )
    ecfg = EvalConfig.from_args(args)
    base = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 128, "presence_penalty": 0.0}
    assert eval_sampling_params(ecfg, "a") == {**base, "min_p": 0.01, "repetition_penalty": 1.3}
    assert eval_sampling_params(ecfg, "b") == {
        **base,
        "temperature": 0.6,
        "min_p": 0.2,
        "repetition_penalty": 1.3,
        "seed": 3,
    }
    assert rollout_sampling_params(RolloutConfig.from_args(args)) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_tokens": 128,
        "min_p": 0.01,
        "presence_penalty": 0.5,
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--rollout-sampling-params", '{"temperature": 0.5}'],
            "--rollout-sampling-params: 'temperature' has its own flag: --rollout-temperature / --eval-temperature",
        ),
        (
            ["--eval-set-sampling-params", "gsm", '{"min_p": 0.1}'],
            "--eval-set-sampling-params gsm: no such --eval-prompt-data set (sets: [])",
        ),
        (
            ["--eval-set-sampling-params", "gsm"],
            "--eval-set-sampling-params expects NAME JSON pairs, got 1 values",
        ),
    ],
)
def test_bad_sampling_flags_are_one_line_naming_the_flag(argv, message, tmp_path):
    with pytest.raises(ArgumentError) as e:
        _args(tmp_path, *argv)
    assert str(e.value) == message


def test_a_field_the_engine_cannot_honour_is_refused_by_vllms_sampling_params():
    with pytest.raises(ArgumentError) as e:
        check_vllm_values([], {"training rollouts (--rollout-*)": {"temperature": 1.0, "min_p": 1.5}})
    assert str(e.value) == (
        "vLLM cannot honour the sampling parameters of training rollouts (--rollout-*): VLLMValidationError: "
        "min_p must be in [0, 1], got 1.5."
    )
    with pytest.raises(ArgumentError) as e:
        check_vllm_values([], {"eval set a (--eval-*)": {"no_such_field": 1}})
    assert str(e.value) == (
        "vLLM cannot honour the sampling parameters of eval set a (--eval-*): TypeError: Unexpected keyword "
        "argument 'no_such_field'"
    )
    check_vllm_values([], {"training rollouts (--rollout-*)": {"min_p": 0.1, "repetition_penalty": 1.2}})

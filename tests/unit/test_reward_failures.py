"""Failed samples by cause (vime_core.failures) and reward errors through the rollout manager: a reward that raises,
times out or returns NaN/inf/a non-number fails its sample with that cause (excluded, reward None, never 0);
group rewards score whole groups. Exact statuses, causes, rewards and metrics."""

import asyncio
import json
import math

import httpx
import pytest

from tests.support.rollout import manager_with_hooks
from vime_core import hookimpl
from vime_core.cli.arguments import ArgumentError, parse_run_args
from vime_core.engines.client import RouterClientError
from vime_core.failures import FailureCause, SampleFailure, classify_failure, failure_metrics, mark_failed
from vime_core.rewards.call import call_group_reward, call_reward, validate_reward
from vime_core.sandbox.base import SandboxInfraError
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit

ZERO = {f"rollout/failed/{c.value}": 0.0 for c in FailureCause} | {"rollout/policy_timeout": 0.0}


def _failure_part(metrics):
    return {k: v for k, v in metrics.items() if k.startswith("rollout/failed/") or k == "rollout/policy_timeout"}


def _text_generate(texts):
    """A generate function answering prompt ``pN`` with ``texts[N]`` (one trainable token per sample)."""

    async def generate(args, sample, sampling_params):
        sample.tokens = [1, 2]
        text = texts[int(sample.prompt[1:])]
        sample.append_response_tokens([3], trainable=True, log_probs=[-0.5], weight_version=0, text=text)
        sample.status = Status.COMPLETED
        return sample

    return generate


# -- vime_core.failures --------------------------------------------------------------------------------------------
class _OwnCause(Exception):
    failure_cause = "agent_error"


@pytest.mark.parametrize(
    ("error", "stage", "cause"),
    [
        (RouterClientError("POST /generate returned 500"), "generate", "engine_error"),
        (httpx.ConnectError("refused"), "generate", "engine_error"),
        (httpx.ReadTimeout("slow"), "generate", "timeout"),
        (asyncio.TimeoutError(), "teacher", "timeout"),
        (SandboxInfraError("docker daemon gone"), "generate", "sandbox_error"),
        (SandboxInfraError("docker daemon gone"), "reward", "sandbox_error"),
        (ValueError("row lacks 'task'"), "generate", "generate_error"),
        (_OwnCause("npm install failed"), "generate", "agent_error"),
        (RuntimeError("verifier crashed"), "reward", "reward_error"),
        (httpx.ConnectError("refused"), "reward", "reward_error"),
        (TimeoutError(), "reward", "reward_timeout"),
        (SampleFailure(FailureCause.REWARD_INVALID, "nan"), "reward", "reward_invalid"),
    ],
)
def test_classify_failure(error, stage, cause):
    assert classify_failure(error, stage).value == cause


def test_mark_failed_drops_the_reward():
    s = Sample(reward=1.0, status=Status.COMPLETED, loss_mask=[1], response_length=1, tokens=[1])
    assert mark_failed(s, FailureCause.REWARD_ERROR, ValueError("bad")) is s
    assert (s.status, s.reward, s.metadata) == (
        Status.FAILED,
        None,
        {"failure": "reward_error", "error": "ValueError: bad"},
    )
    assert not s.is_trainable()


def test_failure_metrics_count_each_cause_and_keep_policy_timeouts_apart():
    def failed(cause):
        return Sample(status=Status.FAILED, metadata={"failure": cause} if cause else {})

    samples = [
        failed("engine_error"),
        failed("engine_error"),
        failed("sandbox_error"),
        failed("reward_timeout"),
        failed(None),  # an old-style failure without a cause
        Sample(status=Status.COMPLETED, metadata={"policy_timeout": True}),  # scored and trained
        Sample(status=Status.TRUNCATED, metadata={"policy_timeout": False}),
        Sample(status=Status.COMPLETED),
    ]
    assert failure_metrics(samples) == ZERO | {
        "rollout/failed/engine_error": 2.0,
        "rollout/failed/sandbox_error": 1.0,
        "rollout/failed/reward_timeout": 1.0,
        "rollout/failed/generate_error": 1.0,
        "rollout/policy_timeout": 1.0,
    }


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, 1.0), (True, 1.0), (-0.5, -0.5), ({"acc": 1, "score": -1.0}, {"acc": 1.0, "score": -1.0})],
)
def test_validate_reward_accepts_finite_numbers(value, expected):
    assert validate_reward(value) == expected


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, None, "1.0", [1.0], {}, {"a": math.nan}, {1: 1.0}])
def test_validate_reward_refuses_the_rest(value):
    with pytest.raises(SampleFailure) as e:
        validate_reward(value)
    assert e.value.failure_cause is FailureCause.REWARD_INVALID


def test_call_reward_timeout():
    async def slow(args, sample):
        await asyncio.sleep(10)

    with pytest.raises(SampleFailure, match=r"within 0.05 s \(--reward-timeout\)") as e:
        asyncio.run(call_reward(slow, plugin_context(), Sample(), 0.05))
    assert e.value.failure_cause is FailureCause.REWARD_TIMEOUT


def test_call_group_reward_checks_length_and_each_entry():
    async def scores(args, group):
        return [1.0, math.nan, "x"][: len(group)]

    got = asyncio.run(call_group_reward(scores, plugin_context(), [Sample(), Sample(), Sample()]))
    assert got[0] == 1.0 and [e.failure_cause for e in got[1:]] == [FailureCause.REWARD_INVALID] * 2
    with pytest.raises(SampleFailure, match=r"one score per sample \(4\), got 3 entries"):
        asyncio.run(call_group_reward(scores, plugin_context(), [Sample()] * 4))


# -- through the rollout manager -----------------------------------------------------------------------------------
def test_reward_errors_fail_the_sample_by_cause(tiny_model_dir, tmp_path):
    """Prompt pN gets reward behaviour N: raise, NaN, inf, a string, None, too slow, a dict with a NaN, 1.0."""

    async def bad_reward(args, sample):
        n = int(sample.prompt[1:])
        if n == 0:
            raise RuntimeError("verifier crashed")
        if n == 5:
            await asyncio.sleep(30)
        return [None, math.nan, math.inf, "0.5", None, None, {"a": 1.0, "b": math.nan}, 1.0][n]

    class P:
        @staticmethod
        @hookimpl
        def vime_register_reward_functions(register):
            register("bad", bad_reward)

    m = manager_with_hooks(
        tiny_model_dir,
        tmp_path,
        P,
        generate=_text_generate(["x"] * 8),
        num_prompts=8,
        reward="bad",
        rollout_batch_size=8,
        n_samples_per_prompt=1,
        reward_timeout=0.5,
    )
    groups, metrics = m.generate(0)
    got = [(s.prompt, s.status.value, s.reward, s.metadata.get("failure")) for g in groups for s in g]
    assert got == [
        ("p0", "failed", None, "reward_error"),
        ("p1", "failed", None, "reward_invalid"),
        ("p2", "failed", None, "reward_invalid"),
        ("p3", "failed", None, "reward_invalid"),
        ("p4", "failed", None, "reward_invalid"),
        ("p5", "failed", None, "reward_timeout"),
        ("p6", "failed", None, "reward_invalid"),
        ("p7", "completed", 1.0, None),
    ]
    row = f"(the row at {tmp_path / 'p.jsonl'}:line 1)"  # a reward that raises names the row it scored
    assert groups[0][0].metadata["error"] == f"RuntimeError: verifier crashed {row}"
    assert groups[1][0].metadata["error"] == "SampleFailure: reward is nan, not a finite number"
    assert groups[5][0].metadata["error"] == (
        "SampleFailure: the reward function did not return within 0.5 s (--reward-timeout)"
    )
    assert [s.is_trainable() for g in groups for s in g] == [False] * 7 + [True]
    assert _failure_part(metrics) == ZERO | {
        "rollout/failed/reward_error": 1.0,
        "rollout/failed/reward_invalid": 5.0,
        "rollout/failed/reward_timeout": 1.0,
    }
    assert metrics["rollout/failed_frac"] == 7 / 8 and metrics["rollout/reward_mean"] == 1.0


def test_generate_failures_by_cause_and_policy_timeouts(tiny_model_dir, tmp_path):
    errors = [
        RouterClientError("POST /inference/v1/generate returned 500: engine dead"),
        httpx.ReadTimeout("timed out"),
        SandboxInfraError("sandbox vanished"),
        ValueError("malformed row"),
        _OwnCause("the agent made no model call"),
    ]

    async def generate(args, sample, sampling_params):
        n = int(sample.prompt[1:])
        if n < len(errors):
            raise errors[n]
        sample.tokens = [1, 2]
        sample.append_response_tokens([3], trainable=True, log_probs=[-0.5], weight_version=0, text="x")
        sample.status = Status.COMPLETED
        sample.metadata["policy_timeout"] = n == 5  # p5: the agent hit its own wall time; still trained
        return sample

    m = manager_with_hooks(
        tiny_model_dir, tmp_path, generate=generate, num_prompts=7, rollout_batch_size=7, n_samples_per_prompt=1
    )
    groups, metrics = m.generate(0)
    assert [s.metadata.get("failure") for g in groups for s in g] == [
        "engine_error",
        "timeout",
        "sandbox_error",
        "generate_error",
        "agent_error",
        None,
        None,
    ]
    assert [(s.status.value, s.reward, s.is_trainable()) for s in groups[5] + groups[6]] == [
        ("completed", 1.0, True),
        ("completed", 1.0, True),
    ]
    assert _failure_part(metrics) == ZERO | {
        "rollout/failed/engine_error": 1.0,
        "rollout/failed/timeout": 1.0,
        "rollout/failed/sandbox_error": 1.0,
        "rollout/failed/generate_error": 1.0,
        "rollout/failed/agent_error": 1.0,
        "rollout/policy_timeout": 1.0,
    }
    assert metrics["rollout/failed_frac"] == 5 / 7


def test_group_reward_scores_each_group_at_once(tiny_model_dir, tmp_path):
    """A pairwise group reward (longer response wins) through --group-reward: one call per group with the whole
    group, exact scores, vime_on_sample sees them; --reward is not called."""
    calls, seen = [], []

    async def longer_wins(args, group):
        calls.append([s.response for s in group])
        lens = [len(s.response) for s in group]
        return [sum(o < n for o in lens) / (len(lens) - 1) for n in lens]

    async def never(args, sample):
        raise AssertionError("--reward must not be called with --group-reward")

    class P:
        @staticmethod
        @hookimpl
        def vime_register_group_reward_functions(register):
            register("longer", longer_wins)

        @staticmethod
        @hookimpl
        def vime_register_reward_functions(register):
            register("never", never)

        @staticmethod
        @hookimpl
        def vime_on_sample(sample):
            seen.append((sample.prompt, sample.index, sample.reward))

    texts = {0: ["a", "abc", "ab"], 1: ["abcd", "a", "a"]}

    async def generate(args, sample, sampling_params):
        sample.tokens = [1, 2]
        text = texts[int(sample.prompt[1:])][sample.index]
        sample.append_response_tokens([3], trainable=True, log_probs=[-0.5], weight_version=0, text=text)
        sample.status = Status.COMPLETED
        return sample

    m = manager_with_hooks(
        tiny_model_dir,
        tmp_path,
        P,
        generate=generate,
        num_prompts=2,
        reward="never",
        group_reward="longer",
        n_samples_per_prompt=3,
    )
    groups, metrics = m.generate(0)
    assert sorted(calls) == [["a", "abc", "ab"], ["abcd", "a", "a"]]
    assert [[s.reward for s in g] for g in groups] == [[0.0, 1.0, 0.5], [1.0, 0.0, 0.0]]
    assert sorted(seen) == [("p0", 0, 0.0), ("p0", 1, 1.0), ("p0", 2, 0.5), ("p1", 0, 1.0), ("p1", 1, 0.0),
                            ("p1", 2, 0.0)]  # fmt: skip
    assert metrics["rollout/reward_mean"] == 2.5 / 6


def test_group_reward_failures(tiny_model_dir, tmp_path):
    """p0's group: the group reward raises → all three fail (reward_error); p1's: one NaN entry → only that
    sample fails (reward_invalid); a generation failure in p1 is left out of the group the reward sees."""
    seen_sizes = []

    async def scorer(args, group):
        seen_sizes.append(len(group))
        if group[0].prompt == "p0":
            raise RuntimeError("preference model crashed")
        return [1.0, math.nan][: len(group)]

    class P:
        @staticmethod
        @hookimpl
        def vime_register_group_reward_functions(register):
            register("scorer", scorer)

    async def generate(args, sample, sampling_params):
        if sample.prompt == "p1" and sample.index == 2:
            raise RouterClientError("engine died")
        sample.tokens = [1, 2]
        sample.append_response_tokens([3], trainable=True, log_probs=[-0.5], weight_version=0, text="x")
        sample.status = Status.COMPLETED
        return sample

    m = manager_with_hooks(
        tiny_model_dir, tmp_path, P, generate=generate, num_prompts=2, group_reward="scorer", n_samples_per_prompt=3
    )
    groups, metrics = m.generate(0)
    assert sorted(seen_sizes) == [2, 3]
    assert [[(s.status.value, s.reward, s.metadata.get("failure")) for s in g] for g in groups] == [
        [("failed", None, "reward_error")] * 3,
        [("completed", 1.0, None), ("failed", None, "reward_invalid"), ("failed", None, "engine_error")],
    ]
    assert [s.metadata["error"] for s in groups[0]] == [
        f"RuntimeError: preference model crashed (the row at {tmp_path / 'p.jsonl'}:line 1)"
    ] * 3
    assert _failure_part(metrics) == ZERO | {
        "rollout/failed/reward_error": 3.0,
        "rollout/failed/reward_invalid": 1.0,
        "rollout/failed/engine_error": 1.0,
    }


def test_math_reward_timeout_fails_one_sample_and_the_rollout_goes_on(tiny_model_dir, tmp_path):
    """A pathological boxed answer (sympy would expand x + 9^(9^(9^9))) is cut at --math-verify-timeout: that sample
    fails as reward_timeout, the other is scored 1.0, and the step finishes."""
    m = manager_with_hooks(
        tiny_model_dir,
        tmp_path,
        generate=_text_generate([r"\boxed{x + 9^{9^{9^{9}}}}", r"so \boxed{x}"]),
        num_prompts=2,
        reward="math",
        n_samples_per_prompt=1,
        math_verify_timeout=2.0,
        math_verify_workers=1,
    )
    groups, metrics = m.generate(0)
    assert [(s.status.value, s.reward, s.metadata.get("failure")) for g in groups for s in g] == [
        ("failed", None, "reward_timeout"),
        ("completed", 1.0, None),
    ]
    assert "math-verify did not finish within 2 s" in groups[0][0].metadata["error"]
    assert metrics["rollout/failed/reward_timeout"] == 1.0


# -- flags ---------------------------------------------------------------------------------------------------------
RUN = ["--model", "m", "--prompt-data", "p.jsonl"]


def test_reward_flags_defaults_and_checks():
    args = parse_run_args(RUN)
    assert (args.group_reward, args.reward_timeout, args.rm_url, args.rm_concurrency, args.rm_timeout) == (
        None,
        None,
        None,
        32,
        60.0,
    )
    assert (args.rm_max_retries, args.math_verify_timeout, args.math_verify_workers) == (3, 5.0, 2)
    assert args.math_last_number_fallback is False
    with pytest.raises(ArgumentError, match=r"--reward remote needs --rm-url"):
        parse_run_args(RUN + ["--reward", "remote"])
    assert parse_run_args(RUN + ["--reward", "remote", "--rm-url", "http://127.0.0.1:9/score"]).rm_url.endswith(
        "/score"
    )
    with pytest.raises(ArgumentError, match=r"--reward-timeout must be > 0 seconds, got 0.0"):
        parse_run_args(RUN + ["--reward-timeout", "0"])
    with pytest.raises(ArgumentError, match=r"--rm-concurrency must be >= 1, got 0"):
        parse_run_args(RUN + ["--rm-concurrency", "0"])
    with pytest.raises(ArgumentError, match=r"--rm-max-retries must be >= 0, got -1"):
        parse_run_args(RUN + ["--rm-max-retries", "-1"])


def test_a_label_the_math_reward_cannot_parse_fails_its_sample_not_scored_0(tiny_model_dir, tmp_path):
    """p0's label is empty (nothing math-verify can parse): the sample fails as reward_error with the label and the
    prompt file's line of its row in the error (line 2: a blank first line is skipped but counted), is excluded
    (never a 0 reward), and the other samples are scored as usual."""
    data = tmp_path / "labels.jsonl"
    data.write_text(
        "\n" + "".join(json.dumps({"prompt": f"p{i}", "label": lab}) + "\n" for i, lab in enumerate(["", "2", "2"]))
    )
    m = manager_with_hooks(
        tiny_model_dir,
        tmp_path,
        generate=_text_generate(["\\boxed{1}", "\\boxed{2}", "\\boxed{3}"]),
        num_prompts=3,
        prompt_data=data,
        reward="math",
        rollout_batch_size=3,
        n_samples_per_prompt=1,
    )
    groups, metrics = m.generate(0)
    got = [(s.prompt, s.status.value, s.reward, s.metadata.get("failure")) for g in groups for s in g]
    assert got == [
        ("p0", "failed", None, "reward_error"),
        ("p1", "completed", 1.0, None),
        ("p2", "completed", 0.0, None),
    ]
    assert groups[0][0].metadata["error"] == (
        "ValueError: math reward: the label '' is not a mathematical answer math-verify can parse"
        f" (the row at {data}:line 2)"
    )
    assert [s.metadata["prompt_source"] for g in groups for s in g] == [f"{data}:line {n}" for n in (2, 3, 4)]
    assert groups[0][0].prompt_index == 0 and not groups[0][0].is_trainable()
    assert _failure_part(metrics) == ZERO | {"rollout/failed/reward_error": 1.0}
    assert metrics["rollout/reward_mean"] == 0.5  # over the two scored samples only

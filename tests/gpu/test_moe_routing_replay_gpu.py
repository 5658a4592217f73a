"""Rollout routing replay, engine half, on one GPU: vLLM for CUDA (0.24) serves the tiny Qwen3-MoE of
vime_core/testing/tiny_moe.py with ``--enable-return-routed-experts``; the client reads every answer's routes; the
``megatron`` trainer with ``--use-rollout-routing-replay`` then selects exactly the engine's experts for every token
of every sample in every MoE layer, and |Δlogp| (engine vs trainer) is printed with and without replay. The same
for the DeepSeek-V3-style tiny model if vLLM serves it (otherwise the test is skipped with vLLM's error: the trainer
half of that family is tests/gpu/test_megatron_moe_gpu.py).

Marked ``gpu``; skipped without CUDA, vLLM for CUDA or megatron-core. With the offline site of docs/gpu.md
(~2 min on one H100: two engine starts, eager)::

    export VLLM_USE_FLASHINFER_SAMPLER=0
    PYTHONPATH=/tmp/site:$PWD python3 -m pytest tests/gpu/test_moe_routing_replay_gpu.py -q -s
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

from tests.gpu.test_megatron_moe_gpu import router_choices  # noqa: E402
from vime_core.testing.tiny_moe import build_tiny_moe  # noqa: E402
from vime_core.testing.trainer_args import trainer_config  # noqa: E402
from vime_core.types import Sample, Status  # noqa: E402


async def _generate(server, tokenizer, prompts: list[list[int]]) -> list:
    from vime_core.engines.client import RouterClient, eos_token_ids

    async with RouterClient(
        server.url,
        server.served_model_name,
        capabilities=server.capabilities,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(tokenizer),
        routed_experts=True,
    ) as client:
        sp = {"max_tokens": 48, "temperature": 1.0, "ignore_eos": True}
        return await asyncio.gather(*(client.generate(p, {**sp, "seed": i}) for i, p in enumerate(prompts)))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_trainers_experts_equal_the_engines_for_every_token(family, tmp_path):
    from transformers import AutoTokenizer

    from vime_core.engines.engine import VLLMServer, VLLMServerError
    from vime_core.trainer.megatron_backend import MegatronTrainer
    from vime_core.trainer.megatron_moe_model import set_replay_routes

    path = build_tiny_moe(tmp_path / family, family)
    tok = AutoTokenizer.from_pretrained(str(path))
    server = VLLMServer(
        path,
        dtype="bfloat16",
        enforce_eager=True,
        extra_args=["--enable-return-routed-experts", "--max-model-len", "512", "--gpu-memory-utilization", "0.3"],
        log_path=tmp_path / "vllm.log",
    )
    server.start()
    try:
        try:
            server.wait_ready(600)
        except VLLMServerError as e:
            if family == "deepseek_v3":  # the family's engine half is owed to a vLLM that serves the tiny MLA model
                pytest.skip(f"vLLM does not serve the tiny DeepSeek-V3 model: {str(e)[-1500:]}")
            raise
        assert server.capabilities.routed_experts, server.capabilities
        prompts = [tok(f"def f{i}(x):\n    return", add_special_tokens=False)["input_ids"] for i in range(6)]
        outs = asyncio.run(_generate(server, tok, prompts))
    finally:
        server.stop()
    samples = []
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        s = Sample(group_index=0, index=i, tokens=list(p), status=Status.COMPLETED)
        s.append_response_tokens(out.token_ids, trainable=True, log_probs=out.log_probs, weight_version=0)
        s.routed_experts = out.routed_experts
        s.validate()  # [len(tokens) - 1, layers, top_k]
        samples.append(s)
    trainer = MegatronTrainer(trainer_config(use_rollout_routing_replay=True), path)
    chosen, handles = router_choices(trainer)
    with torch.no_grad():
        replayed = trainer.policy_log_probs(samples, False)[0]
        seq = max(len(s.tokens) for s in samples)
        for layer, ids in chosen.items():
            grid = ids.view(seq, len(samples), -1)
            for i, s in enumerate(samples):
                want = np.sort(s.routed_experts[:, layer], axis=-1)
                assert grid[: len(s.tokens) - 1, i].tolist() == want.tolist(), (family, layer, i)
        ids, pos = trainer.token_batch(samples)
        set_replay_routes(trainer.gpt, None)
        live = trainer.response_slices(samples, trainer.token_log_probs(ids, pos)[0])
        live_choice = {layer: t.view(seq, len(samples), -1) for layer, t in chosen.items()}
    for h in handles:
        h.remove()
    differ = sum(
        int(
            (live_choice[layer][: len(s.tokens) - 1, i] != torch.from_numpy(np.sort(s.routed_experts[:, layer], -1)))
            .any(-1)
            .sum()
        )
        for layer in live_choice
        for i, s in enumerate(samples)
    )
    engine = [torch.tensor(s.rollout_log_probs) for s in samples]
    d_rep = torch.cat([(a.float().cpu() - b).abs() for a, b in zip(replayed, engine, strict=True)])
    d_live = torch.cat([(a.float().cpu() - b).abs() for a, b in zip(live, engine, strict=True)])
    print(
        f"{family}: |Δlogp| engine vs trainer, mean/max: with replay {d_rep.mean():.4f}/{d_rep.max():.4f}, "
        f"live routing {d_live.mean():.4f}/{d_live.max():.4f}; token-layers routed differently live: {differ}"
    )
    assert torch.isfinite(d_rep).all() and d_rep.mean() < 0.05

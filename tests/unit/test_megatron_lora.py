"""The megatron backend's LoRA layout (pure torch; tests/gpu/test_lora_megatron_gpu.py runs the backend): Megatron's
fused-layer adapters map to PEFT's HF names exactly both ways, give the same weight deltas as the HF projections
(in Megatron's fused layout), and shard over tensor parallelism like their base layers."""

from __future__ import annotations

import pytest
import torch

from vime_core.cli.arguments import default_args
from vime_core.config import LoraConfig
from vime_core.config.lora import LoraFlagError
from vime_core.trainer.megatron_convert import ArchConfig, hf_to_megatron, shard, unshard
from vime_core.trainer.megatron_lora import hf_targets, megatron_lora_to_peft, peft_to_megatron_lora

pytestmark = pytest.mark.unit

ARCH = ArchConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=8,
    num_query_groups=2,
    head_dim=8,
    ffn_hidden_size=48,
    vocab_size=40,
    tie_word_embeddings=False,
    qkv_bias=False,
)
R = 4
PROJ = {
    "q_proj": ("self_attn", 64, 32),
    "k_proj": ("self_attn", 16, 32),
    "v_proj": ("self_attn", 16, 32),
    "o_proj": ("self_attn", 32, 64),
    "gate_proj": ("mlp", 48, 32),
    "up_proj": ("mlp", 48, 32),
    "down_proj": ("mlp", 32, 48),
}


def _peft_adapter(seed: int = 0) -> dict[str, torch.Tensor]:
    """An HF-layout adapter as a Megatron-trained one is: q/k/v share A, gate/up share A."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(ARCH.num_layers):
        shared = {"self_attn": torch.randn(R, 32, generator=g), "mlp": torch.randn(R, 32, generator=g)}
        for proj, (parent, n_out, n_in) in PROJ.items():
            fused = proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
            a = shared[parent].clone() if fused else torch.randn(R, n_in, generator=g)
            base = f"base_model.model.model.layers.{layer}.{parent}.{proj}"
            out[f"{base}.lora_A.weight"] = a
            out[f"{base}.lora_B.weight"] = torch.randn(n_out, R, generator=g)
    return out


def test_megatron_adapter_maps_to_peft_names_and_back_exactly():
    hf = _peft_adapter()
    mc = peft_to_megatron_lora(hf, ARCH)
    assert sorted(mc) == sorted(
        f"decoder.layers.{i}.{k}.lora_{p}.weight"
        for i in range(2)
        for k in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
        for p in "AB"
    )
    assert mc["decoder.layers.0.self_attention.linear_qkv.lora_B.weight"].shape == (96, R)
    back = megatron_lora_to_peft(mc, ARCH)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_fused_deltas_equal_the_hf_projections_deltas_in_megatron_layout():
    """B_qkv · A is the Megatron-layout (per query group interleaved) weight delta of q/k/v's B · A, likewise
    [gate; up]: what vLLM adds to its q/k/v and gate/up layers is what the trainer's fused layers add."""
    hf = _peft_adapter()
    mc = peft_to_megatron_lora(hf, ARCH)
    deltas = {}
    g = torch.Generator().manual_seed(1)
    full_hf = {"model.embed_tokens.weight": torch.randn(40, 32, generator=g), "model.norm.weight": torch.ones(32)}
    full_hf["lm_head.weight"] = torch.randn(40, 32, generator=g)
    for layer in range(2):
        p = f"model.layers.{layer}."
        full_hf[p + "input_layernorm.weight"] = torch.ones(32)
        full_hf[p + "post_attention_layernorm.weight"] = torch.ones(32)
        for proj, (parent, _, _) in PROJ.items():
            base = f"base_model.model.{p}{parent}.{proj}"
            full_hf[f"{p}{parent}.{proj}.weight"] = hf[f"{base}.lora_B.weight"] @ hf[f"{base}.lora_A.weight"]
    deltas = hf_to_megatron(full_hf, ARCH)
    for layer in range(2):
        for kind in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            m = f"decoder.layers.{layer}.{kind}"
            got = mc[m + ".lora_B.weight"] @ mc[m + ".lora_A.weight"]
            torch.testing.assert_close(got, deltas[m + ".weight"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tp", [2, 4])
def test_adapter_shards_follow_their_base_layers_shards(tp):
    """Under TP, rank k's B rows (column layers) / A columns (row layers) produce rank k's shard of the delta: the
    base weight's sharding (gate/up halves per rank for fc1, query groups for qkv) applied to the adapter."""
    mc = peft_to_megatron_lora(_peft_adapter(), ARCH)
    for kind, sharded in (
        ("self_attention.linear_qkv", "B"),
        ("mlp.linear_fc1", "B"),
        ("self_attention.linear_proj", "A"),
        ("mlp.linear_fc2", "A"),
    ):
        m = f"decoder.layers.0.{kind}"
        a, b = mc[m + ".lora_A.weight"], mc[m + ".lora_B.weight"]
        delta = b @ a
        parts = []
        for rank in range(tp):
            if sharded == "B":
                part = shard(m + ".weight", b, rank, tp)
                local = part @ a
            else:
                part = shard(m + ".weight", a, rank, tp)
                local = b @ part
            torch.testing.assert_close(local, shard(m + ".weight", delta, rank, tp), atol=1e-5, rtol=1e-5)
            parts.append(part)
        assert torch.equal(unshard(m + ".weight", parts), b if sharded == "B" else a)


def test_unfused_projections_and_unknown_ones_are_refused():
    def cfg(**kw) -> LoraConfig:
        return LoraConfig.from_args(default_args(lora_rank=8, **kw))

    assert hf_targets(cfg()) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert hf_targets(cfg(target_modules=["q_proj,k_proj,v_proj", "down_proj"])) == [
        "q_proj",
        "k_proj",
        "v_proj",
        "down_proj",
    ]
    assert hf_targets(cfg(exclude_modules=["gate_proj", "up_proj"])) == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "down_proj",
    ]
    with pytest.raises(LoraFlagError) as e:
        hf_targets(cfg(target_modules=["q_proj", "v_proj"]))
    assert str(e.value) == (
        "--target-modules: Megatron fuses q_proj/k_proj/v_proj into linear_qkv, which gets one adapter: adapt all "
        "of q_proj k_proj v_proj or none (--trainer megatron)"
    )
    with pytest.raises(LoraFlagError) as e:
        hf_targets(cfg(target_modules=["c_attn"]))
    assert str(e.value) == (
        "--target-modules c_attn: the megatron backend adapts q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
        "down_proj"
    )
    hf = _peft_adapter()
    hf["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] += 1.0
    with pytest.raises(ValueError, match="layer 0: q_proj/k_proj/v_proj have different lora_A"):
        peft_to_megatron_lora(hf, ARCH)

"""The Megatron trainer's model families on the CPU: each family's HF config read into exact :class:`ArchConfig`
values, its HF ↔ Megatron round trip bit-exact (local and TE names) and split over TP = 2 and joined back exactly,
llama3 / linear RoPE inverse frequencies and cos/sin equal to transformers' to the bit beyond the original context,
and a megatron-core ``GPTModel`` built as the trainer builds it giving transformers' fp32 log-probs (in a fresh
process: tests/unit/megatron_families_main.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vime_core.cluster.net import find_free_port
from vime_core.models.families import RopeScaling, UnsupportedFeature
from vime_core.testing.tiny_model import TINY_FAMILIES, tiny_config
from vime_core.trainer.megatron_convert import (
    ArchConfig,
    ConversionError,
    hf_to_megatron,
    megatron_to_hf,
    shard,
    unshard,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ["qwen3", "qwen3-untied", "llama3.2"]
LLAMA32 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def tiny_hf(family: str, seed: int = 0):
    """The tiny ``family`` model of vime_core/testing/tiny_model.py (vocabulary 256: no tokenizer needed here)."""
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, TINY_FAMILIES[family][1])(tiny_config(family, 256)).eval()


def state_dict(model, arch: ArchConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    sd = {k: v.to(dtype) for k, v in model.state_dict().items()}
    if arch.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)), k


def test_arch_configs_of_the_tiny_families():
    qwen3 = ArchConfig.from_hf(tiny_config("qwen3", 256))
    assert qwen3 == ArchConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=32,  # not 64 / 4: Qwen3's head_dim is its own field
        ffn_hidden_size=128,
        vocab_size=256,
        tie_word_embeddings=True,
        qkv_bias=False,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        model_type="qwen3",
        qk_layernorm=True,
    )
    assert ArchConfig.from_hf(tiny_config("qwen3-untied", 256)).tie_word_embeddings is False
    llama = ArchConfig.from_hf(tiny_config("llama3.2", 256))
    assert llama.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert (llama.rope_theta, llama.max_position_embeddings, llama.qk_layernorm) == (500000.0, 131072, False)
    assert llama.tie_word_embeddings and llama.head_dim == 32 and llama.model_type == "llama"


def test_arch_config_from_a_config_json_dict_equals_the_transformers_config():
    """The up-front check reads config.json without transformers: the same reader gives the same architecture."""
    for family in FAMILIES:
        config = tiny_config(family, 256)
        assert ArchConfig.from_hf(json.loads(config.to_json_string())) == ArchConfig.from_hf(config), family


def test_older_config_json_rope_scaling_and_rope_theta_read_like_rope_parameters():
    """Llama-3.1/3.2's hub config.json (transformers 4 layout): top-level ``rope_theta`` and ``rope_scaling``."""
    old = {
        "model_type": "llama",
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "rope_scaling": dict(LLAMA32),
        "max_position_embeddings": 131072,
    }
    arch = ArchConfig.from_hf(old)
    assert arch.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192) and arch.rope_theta == 500000.0
    assert arch.head_dim == 64 and arch.num_query_groups == 8


@pytest.mark.parametrize(
    "fields,error",
    [
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_type 'dynamic' is not supported (rope_type default, linear or llama3)",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope_type 'yarn' is not supported (rope_type default, linear or llama3)",
        ),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_type 'llama3' needs low_freq_factor, "
            "high_freq_factor, original_max_position_embeddings in rope_parameters/rope_scaling",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported (hidden_act silu)"),
        ({"mlp_bias": True}, "mlp_bias is not supported (MLP without biases)"),
        ({"num_experts": 8}, "MoE layers (num_experts 8) is not supported (dense MLP layers)"),
        (
            {"partial_rotary_factor": 0.5},
            "partial_rotary_factor < 1 is not supported (rotary embeddings over the whole head)",
        ),
    ],
)
def test_llama_features_the_trainer_does_not_build_are_refused(fields, error):
    config = {**json.loads(tiny_config("llama3.2", 256).to_json_string()), **fields}
    if "rope_scaling" in fields:
        config.pop("rope_parameters")
    with pytest.raises(ConversionError) as e:
        ArchConfig.from_hf(config)
    assert str(e.value) == error


def test_sliding_window_and_rope_scaling_of_qwen3_are_refused():
    base = json.loads(tiny_config("qwen3", 256).to_json_string())
    with pytest.raises(UnsupportedFeature) as e:
        ArchConfig.from_hf({**base, "use_sliding_window": True, "sliding_window": 4096})
    assert str(e.value) == "sliding-window attention (sliding_window 4096) is not supported (full attention)"
    with pytest.raises(UnsupportedFeature) as e:
        ArchConfig.from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}})
    assert str(e.value) == "rope_type 'yarn' is not supported (rope_type default)"
    # Qwen3's config carries a sliding_window size that is only used with use_sliding_window
    assert ArchConfig.from_hf({**base, "use_sliding_window": False, "sliding_window": 4096}).qk_layernorm


def test_mistral_with_a_sliding_window_shorter_than_its_context_is_refused():
    import transformers

    with pytest.raises(UnsupportedFeature) as e:
        ArchConfig.from_hf(
            transformers.MistralConfig(
                hidden_size=64, num_attention_heads=2, num_key_value_heads=2, sliding_window=4096
            )
        )
    assert e.value.feature == "sliding-window attention (sliding_window 4096)"
    cfg = ArchConfig.from_hf(
        transformers.MistralConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, sliding_window=None)
    )
    assert cfg.model_type == "mistral" and cfg.rope_scaling is None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("te", [False, True], ids=["local", "te"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_real_family_models_round_trip_bit_exactly(family, te, dtype):
    model = tiny_hf(family)
    arch = ArchConfig.from_hf(model.config)
    sd = state_dict(model, arch, dtype)
    sd["model.norm.weight"][:3] = torch.tensor([float("inf"), -0.0, float("nan")], dtype=dtype)
    mc = hf_to_megatron(sd, arch, te=te)
    # 2 norms, linear_qkv, q/k layernorm (Qwen3), linear_proj, linear_fc1, linear_fc2 per layer
    per_layer = 6 + 2 * arch.qk_layernorm
    assert len(mc) == 2 + (not arch.tie_word_embeddings) + arch.num_layers * per_layer
    if arch.qk_layernorm:
        for part in ("q", "k"):
            assert torch.equal(
                mc[f"decoder.layers.1.self_attention.{part}_layernorm.weight"],
                sd[f"model.layers.1.self_attn.{part}_norm.weight"],
            )
    nh, ng, d = arch.num_attention_heads, arch.num_query_groups, arch.head_dim
    assert mc["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((nh + 2 * ng) * d, arch.hidden_size)
    assert_bitwise_equal(megatron_to_hf(mc, arch, te=te), sd)


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_two_shards_join_exactly_and_hold_whole_query_groups(family):
    model = tiny_hf(family)
    arch = ArchConfig.from_hf(model.config)
    sd = state_dict(model, arch, torch.float32)
    mc = hf_to_megatron(sd, arch)
    for name, full in mc.items():
        parts = [shard(name, full, r, 2) for r in range(2)]
        assert torch.equal(unshard(name, parts).view(torch.uint8), full.view(torch.uint8)), name
        if "layernorm" in name:  # q/k norms are per head_dim, the same on every rank
            assert parts[0] is full and parts[1] is full, name
    d, ng, nh = arch.head_dim, arch.num_query_groups, arch.num_attention_heads
    per, name = nh // ng, "decoder.layers.0.self_attention.linear_qkv.weight"
    q, k = sd["model.layers.0.self_attn.q_proj.weight"], sd["model.layers.0.self_attn.k_proj.weight"]
    assert ng == 2  # one query group per rank: its q heads, then its k and v head
    for r in range(2):
        qkv = shard(name, mc[name], r, 2)
        assert torch.equal(qkv[: per * d], q[r * per * d : (r + 1) * per * d])
        assert torch.equal(qkv[per * d : per * d + d], k[r * d : (r + 1) * d])


def test_rope_inverse_frequencies_and_cos_sin_equal_transformers_beyond_the_original_context():
    """Llama-3.1-8B (head_dim 128, factor 8) and Llama-3.2-1B (head_dim 64, factor 32): vime's inverse
    frequencies in megatron-core's RotaryEmbedding give transformers' cos and sin to the bit at every position up
    to 131072 (the original context is 8192). A non-standard llama3 config (original context 16, low/high 2/8),
    which megatron-core's own ``rope_scaling`` cannot express, and linear scaling are exact too."""
    pytest.importorskip("megatron.core")
    import transformers
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from vime_core.trainer.megatron_model import rope_inv_freq

    odd = {**LLAMA32, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 16}
    cases = [(128, {**LLAMA32, "factor": 8.0}, 131072), (64, LLAMA32, 131072), (32, odd, 4096)]
    cases.append((64, {"rope_type": "linear", "factor": 4.0}, 4096))
    for head_dim, rope, n in cases:
        config = transformers.LlamaConfig(
            hidden_size=4 * head_dim,
            num_attention_heads=4,
            head_dim=head_dim,
            max_position_embeddings=max(n, 131072),
            rope_theta=500000.0,
            rope_scaling=dict(rope),
        )
        hf = LlamaRotaryEmbedding(config)
        cos, sin = hf(torch.zeros(1), torch.arange(n)[None])
        arch = ArchConfig.from_hf(config)
        mc = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, rotary_base=500000, use_cpu_initialization=True)
        mc.inv_freq = rope_inv_freq(arch)
        assert torch.equal(mc.inv_freq, hf.inv_freq), rope
        freqs = mc.get_freqs_non_repeated(n)  # what megatron-core's RoPE multiplies q and k with
        emb = torch.cat([freqs, freqs], dim=-1)
        assert torch.equal(torch.cos(emb), cos[0]) and torch.equal(torch.sin(emb), sin[0]), rope
        scaled = rope["rope_type"] == "llama3" and rope["original_max_position_embeddings"] == 8192
        if scaled:  # megatron-core's own llama3 scaling (1 / 4 / 8192 fixed) agrees on the standard configs
            own = RotaryEmbedding(
                kv_channels=head_dim,
                rotary_percent=1.0,
                rotary_base=500000,
                rope_scaling=True,
                rope_scaling_factor=rope["factor"],
                use_cpu_initialization=True,
            )
            assert torch.equal(own.inv_freq, hf.inv_freq)
        elif rope["rope_type"] == "llama3":  # ... and not on others: the reason vime installs its own
            own = RotaryEmbedding(
                kv_channels=head_dim,
                rotary_percent=1.0,
                rotary_base=500000,
                rope_scaling=True,
                rope_scaling_factor=rope["factor"],
                use_cpu_initialization=True,
            )
            assert not torch.equal(own.inv_freq, hf.inv_freq)


def test_megatron_gpt_model_matches_transformers_fp32_on_cpu():
    """The trainer's model construction (TransformerConfig fields, local spec with q/k norms, RoPE installation,
    the mapping) on the CPU in fp32: log-probs equal transformers' within fp32 rounding for every family, with
    Megatron's own attention and with SDPA. ``llama3-short`` runs 48 positions past a 16-position original
    context; ``llama-linear`` uses linear RoPE scaling."""
    pytest.importorskip("megatron.core")
    port = find_free_port("127.0.0.1")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("megatron_families_main.py")), str(port)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    names = ["qwen2", "qwen3", "qwen3-untied", "llama3.2", "llama3-short", "llama-linear"]
    assert sorted(got) == sorted(f"{n}/{a}" for n in names for a in ("local", "sdpa"))
    for case, r in got.items():
        print(case, r)
        assert r["params"], case  # the mapping names exactly the model's parameters
        assert r["q_layernorm"] == case.startswith("qwen3"), case
        assert r["inv_freq_equal_hf"], case
        assert r["logprob_max_abs_diff"] < 1e-5, case  # fp32 rounding (measured ≤ 3e-6; 0.0 with SDPA)

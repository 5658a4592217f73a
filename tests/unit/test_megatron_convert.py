"""HF ↔ Megatron weight mapping (pure torch; the GPU tests load the result into a real GPTModel)."""

from __future__ import annotations

import itertools

import pytest
import torch

from vime_core.trainer.megatron_convert import (
    ArchConfig,
    ConversionError,
    hf_to_megatron,
    megatron_to_hf,
    pad_vocab,
    shard,
    unpad_vocab,
    unshard,
)

pytestmark = pytest.mark.unit

ARCHS = {
    "llama-gqa-untied": ArchConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=8,
        num_query_groups=2,
        head_dim=8,
        ffn_hidden_size=48,
        vocab_size=40,
        tie_word_embeddings=False,
        qkv_bias=False,
    ),
    "qwen2-bias-tied": ArchConfig(
        num_layers=3,
        hidden_size=24,
        num_attention_heads=4,
        num_query_groups=4,
        head_dim=6,
        ffn_hidden_size=40,
        vocab_size=36,
        tie_word_embeddings=True,
        qkv_bias=True,
    ),
    "mqa-headdim": ArchConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=4,
        num_query_groups=1,
        head_dim=12,
        ffn_hidden_size=20,
        vocab_size=8,
        tie_word_embeddings=False,
        qkv_bias=True,
    ),
}


def hf_tensors(cfg: ArchConfig, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF-named tensors of ``cfg`` (with inf / -0.0 / NaN payloads to prove bit-exactness)."""
    g = torch.Generator().manual_seed(seed)
    h, nh, ng, d, f, v = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_query_groups,
        cfg.head_dim,
        cfg.ffn_hidden_size,
        cfg.vocab_size,
    )

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    out = {"model.embed_tokens.weight": r(v, h), "model.norm.weight": r(h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": r(h),
                p + "post_attention_layernorm.weight": r(h),
                p + "self_attn.q_proj.weight": r(nh * d, h),
                p + "self_attn.k_proj.weight": r(ng * d, h),
                p + "self_attn.v_proj.weight": r(ng * d, h),
                p + "self_attn.o_proj.weight": r(h, nh * d),
                p + "mlp.gate_proj.weight": r(f, h),
                p + "mlp.up_proj.weight": r(f, h),
                p + "mlp.down_proj.weight": r(h, f),
            }
        )
        if cfg.qkv_bias:
            out.update(
                {
                    p + "self_attn.q_proj.bias": r(nh * d),
                    p + "self_attn.k_proj.bias": r(ng * d),
                    p + "self_attn.v_proj.bias": r(ng * d),
                }
            )
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = r(v, h)
    out["model.norm.weight"][:3] = torch.tensor([float("inf"), -0.0, float("nan")], dtype=dtype)
    return out


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)), k


CASES = list(itertools.product(ARCHS, [False, True], [torch.bfloat16, torch.float32]))


@pytest.mark.parametrize("arch,te,dtype", CASES)
def test_round_trip_is_bit_exact(arch, te, dtype):
    cfg = ARCHS[arch]
    hf = hf_tensors(cfg, dtype)
    mc = hf_to_megatron(hf, cfg, te=te)
    per_layer = 6 + cfg.qkv_bias  # 2 norms, linear_qkv (+ bias), linear_proj, linear_fc1, linear_fc2
    assert len(mc) == 2 + (not cfg.tie_word_embeddings) + cfg.num_layers * per_layer
    if te:
        assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in mc
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in mc
    else:
        assert "decoder.layers.0.input_layernorm.weight" in mc and "decoder.layers.0.pre_mlp_layernorm.weight" in mc
    assert_bitwise_equal(megatron_to_hf(mc, cfg, te=te), hf)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_qkv_splits_like_megatron_attention(arch):
    """Megatron's SelfAttention views linear_qkv's output as [ng, (nh/ng + 2) * d] and splits q, k, v per group;
    done on the fused weight this must give exactly the HF projections, group by group."""
    cfg = ARCHS[arch]
    hf = hf_tensors(cfg, torch.float32)
    mc = hf_to_megatron(hf, cfg)
    nh, ng, d, h = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim, cfg.hidden_size
    x = torch.randn(5, h, dtype=torch.float64)
    out = (x @ mc["decoder.layers.0.self_attention.linear_qkv.weight"].double().T).view(5, ng, (nh // ng + 2) * d)
    q, k, v = torch.split(out, [nh // ng * d, d, d], dim=-1)
    p = "model.layers.0.self_attn."
    close = dict(rtol=1e-12, atol=1e-12)  # float64 products of other matrix shapes may round differently
    torch.testing.assert_close(q.reshape(5, nh * d), x @ hf[p + "q_proj.weight"].double().T, **close)
    torch.testing.assert_close(k.reshape(5, ng * d), x @ hf[p + "k_proj.weight"].double().T, **close)
    torch.testing.assert_close(v.reshape(5, ng * d), x @ hf[p + "v_proj.weight"].double().T, **close)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_shards_round_trip_and_follow_megatron_layout(tp):
    cfg = ArchConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=8,
        num_query_groups=4,
        head_dim=4,
        ffn_hidden_size=16,
        vocab_size=24,
        tie_word_embeddings=False,
        qkv_bias=True,
    )
    hf = hf_tensors(cfg, torch.float32)
    mc = hf_to_megatron(hf, cfg)
    for name, full in mc.items():
        parts = [shard(name, full, r, tp) for r in range(tp)]
        assert torch.equal(unshard(name, parts).view(torch.uint8), full.view(torch.uint8)), name  # NaN-safe
    f = cfg.ffn_hidden_size
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    for r in range(tp):  # ColumnParallelLinear of a gated MLP: each rank holds [gate_r; up_r]
        fc1 = shard("decoder.layers.0.mlp.linear_fc1.weight", mc["decoder.layers.0.mlp.linear_fc1.weight"], r, tp)
        rows = slice(r * f // tp, (r + 1) * f // tp)
        assert torch.equal(fc1, torch.cat([gate[rows], up[rows]]))
        proj = shard(
            "decoder.layers.0.self_attention.linear_proj.weight",
            mc["decoder.layers.0.self_attention.linear_proj.weight"],
            r,
            tp,
        )
        assert proj.shape == (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim // tp)
        qkv = shard(
            "decoder.layers.0.self_attention.linear_qkv.weight",
            mc["decoder.layers.0.self_attention.linear_qkv.weight"],
            r,
            tp,
        )
        groups = cfg.num_query_groups // tp  # rank r holds whole query groups r*groups ... (r+1)*groups-1
        q_rows = qkv.view(groups, -1, cfg.hidden_size)[:, : 2 * cfg.head_dim].reshape(-1, cfg.hidden_size)
        q_heads = 2 * groups * cfg.head_dim
        assert torch.equal(q_rows, hf["model.layers.0.self_attn.q_proj.weight"][r * q_heads : (r + 1) * q_heads])
        norm = mc["decoder.final_layernorm.weight"]
        assert shard("decoder.final_layernorm.weight", norm, r, tp) is norm  # replicated


def test_vocab_padding_round_trip():
    cfg = ARCHS["llama-gqa-untied"]
    mc = hf_to_megatron(hf_tensors(cfg), cfg)
    padded = pad_vocab(mc, 48)
    assert padded["embedding.word_embeddings.weight"].shape[0] == 48
    assert not padded["output_layer.weight"][40:].any()
    assert_bitwise_equal(unpad_vocab(padded, 40), mc)


def test_errors_name_the_tensor():
    cfg = ARCHS["llama-gqa-untied"]
    hf = hf_tensors(cfg)
    with pytest.raises(ConversionError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
        hf_to_megatron({k: v for k, v in hf.items() if k != "model.layers.1.mlp.up_proj.weight"}, cfg)
    bad = dict(hf)
    bad["model.layers.0.self_attn.k_proj.weight"] = bad["model.layers.0.self_attn.k_proj.weight"][:-1]
    with pytest.raises(ConversionError, match="k_proj.weight: shape"):
        hf_to_megatron(bad, cfg)
    with pytest.raises(ConversionError, match="unexpected HF tensors"):
        hf_to_megatron({**hf, "model.extra.weight": torch.zeros(1)}, cfg)
    mc = hf_to_megatron(hf, cfg)
    with pytest.raises(ConversionError, match="unexpected Megatron tensors"):
        megatron_to_hf({**mc, "decoder.layers.9.mlp.linear_fc2.weight": torch.zeros(1)}, cfg)
    with pytest.raises(ConversionError, match="does not split"):
        shard("decoder.layers.0.mlp.linear_fc2.weight", mc["decoder.layers.0.mlp.linear_fc2.weight"], 0, 5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_real_transformers_models_round_trip(family):
    """A real (tiny, random) transformers model's state dict maps to Megatron and back unchanged."""
    import transformers

    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=100000.0,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
        model = transformers.Qwen2ForCausalLM(config)
    cfg = ArchConfig.from_hf(config)
    assert cfg.qkv_bias == (family == "qwen2") and cfg.head_dim == 8 and cfg.num_query_groups == 2
    if family == "llama":
        assert cfg.rope_theta == 100000.0
    sd = {k: v for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    assert_bitwise_equal(megatron_to_hf(hf_to_megatron(sd, cfg), cfg), sd)


def test_unsupported_configs_are_refused():
    import transformers

    with pytest.raises(ConversionError, match="model_type"):
        ArchConfig.from_hf(transformers.GPT2Config())
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ConversionError, match="multiple"):
        ArchConfig.from_hf(cfg)

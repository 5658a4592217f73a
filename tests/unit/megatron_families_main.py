"""Run by tests/unit/test_megatron_families.py in a fresh process (it initialises torch.distributed and Megatron's
parallel state, and shims megatron-core's hard-coded ``torch.cuda`` calls — none of which may leak into the test
process): for each tiny family model, a megatron-core ``GPTModel`` built on the CPU in fp32 exactly as the
``megatron`` trainer builds it (:func:`~vime_core.trainer.megatron_model.transformer_config_fields`,
:func:`~vime_core.trainer.megatron_model.layer_spec`, :func:`~vime_core.trainer.megatron_model.gpt_model_fields`,
:func:`~vime_core.trainer.megatron_model.install_rope`) and loaded through
:func:`~vime_core.trainer.megatron_convert.hf_to_megatron`, against transformers' fp32 forward of the same weights;
prints one JSON line ``{case: {...}}``.

The CPU shims (megatron-core calls ``torch.cuda`` unconditionally, docs/gpu.md): ``torch.cuda.current_device`` →
the CPU, the CUDA RNG state calls → the CPU's, and the local attention's default causal mask made on the CPU.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def shim_cuda_for_cpu() -> None:
    """Point megatron-core's ``torch.cuda`` calls at the CPU."""
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.get_rng_state = torch.get_rng_state
    torch.cuda.manual_seed = torch.manual_seed
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    # the local spec's causal mask (``--megatron-attention local``) is made with device="cuda"
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def cases() -> dict:
    """Case name → (tiny family, config overrides). ``llama3-short`` moves llama3's original context down to 16
    positions, so the 48-token forward runs far beyond it and crosses all three frequency bands."""
    short = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    return {
        "qwen2": ("qwen2", {}),
        "qwen3": ("qwen3", {}),
        "qwen3-untied": ("qwen3-untied", {}),
        "llama3.2": ("llama3.2", {}),
        "llama3-short": ("llama3.2", {"rope_scaling": short, "max_position_embeddings": 2048}),
        "llama-linear": ("llama3.2", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    }


def run_case(family: str, overrides: dict, attention: str) -> dict:
    import transformers
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from vime_core.testing.tiny_model import TINY_FAMILIES, tiny_config
    from vime_core.trainer.megatron_convert import ArchConfig, hf_to_megatron
    from vime_core.trainer.megatron_model import gpt_model_fields, install_rope, layer_spec, transformer_config_fields

    config = tiny_config(family, 256)
    for k, v in overrides.items():
        if k == "rope_scaling":
            config.rope_parameters = {**v, "rope_theta": config.rope_parameters["rope_theta"]}
        else:
            setattr(config, k, v)
    torch.manual_seed(0)
    hf = getattr(transformers, TINY_FAMILIES[family][1])(config).float().eval()
    arch = ArchConfig.from_hf(config)
    mcfg = TransformerConfig(
        **transformer_config_fields(arch),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    gpt = GPTModel(
        config=mcfg,
        transformer_layer_spec=layer_spec(attention, False, arch),
        vocab_size=arch.vocab_size,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        **gpt_model_fields(arch),
    )
    install_rope(gpt, arch)
    sd = {k: v for k, v in hf.state_dict().items() if not (arch.tie_word_embeddings and k == "lm_head.weight")}
    mc = hf_to_megatron(sd, arch)
    params = dict(gpt.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(mc[name])
    ids = torch.randint(0, arch.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(48).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        meg = gpt(ids, pos, None).float()
        ref = hf(input_ids=ids).logits.float()
    meg_lp, ref_lp = torch.log_softmax(meg, -1), torch.log_softmax(ref, -1)
    rope = gpt.rotary_pos_emb.inv_freq
    return {
        "params": sorted(params) == sorted(mc),
        "q_layernorm": "decoder.layers.0.self_attention.q_layernorm.weight" in params,
        "logits_max_abs_diff": (meg - ref).abs().max().item(),
        "logprob_max_abs_diff": (meg_lp - ref_lp).abs().max().item(),
        "logits_scale": ref.abs().max().item(),
        "inv_freq_equal_hf": bool(torch.equal(rope.cpu(), hf.model.rotary_emb.inv_freq.float().cpu())),
    }


def main(port: int) -> dict:
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    shim_cuda_for_cpu()
    out = {}
    for name, (family, overrides) in cases().items():
        for attention in ("local", "sdpa"):
            out[f"{name}/{attention}"] = run_case(family, overrides, attention)
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))

"""Run by tests/unit/test_megatron_moe.py in a fresh process (torch.distributed, Megatron's parallel state and the CPU
shims of tests/unit/megatron_families_main.py must not leak into the test process): for the tiny Qwen3-MoE and
DeepSeek-V3 models (vime_core/testing/tiny_moe.py), a megatron-core ``GPTModel`` built on the CPU in fp32 exactly as
the ``megatron`` trainer builds it (:func:`~vime_core.trainer.megatron_moe_model.moe_config_fields`, the MoE block
spec with local ``SequentialMLP`` experts, MLA) and loaded through :func:`~vime_core.trainer.megatron_convert.
hf_to_megatron`, against transformers' fp32 forward of the same weights; then rollout routing replay through
megatron-core's ``RouterReplay`` (:func:`~vime_core.trainer.megatron_moe_model.set_replay_routes`): the experts each
router selects for every token equal crafted routes that differ from live routing everywhere, and replaying the live
routes changes no logit. Prints one JSON line ``{case: {...}}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from megatron_families_main import shim_cuda_for_cpu  # noqa: E402

SEQ, BATCH = 12, 2


def build(family: str, attention: str, routing_replay: bool):
    import transformers
    from megatron.core.models.gpt import GPTModel

    from vime_core.testing.tiny_moe import tiny_moe_config
    from vime_core.trainer.megatron_convert import ArchConfig, hf_to_megatron
    from vime_core.trainer.megatron_model import gpt_model_fields, layer_spec, transformer_config_fields
    from vime_core.trainer.megatron_moe_model import moe_config_fields, transformer_config_class

    config = tiny_moe_config(family, 256, {"<|endoftext|>": 0, "<|im_end|>": 2})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for module in hf.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn_like(bias) * 0.1)
    arch = ArchConfig.from_hf(config)
    fields = {**transformer_config_fields(arch), **moe_config_fields(arch, routing_replay=routing_replay)}
    fields["moe_token_dispatcher_type"] = (
        "allgather"  # the all-to-all dispatcher makes a CUDA stream (same math at EP 1)
    )
    mcfg = transformer_config_class(arch)(
        **fields,
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
        transformer_layer_spec=layer_spec(attention, False, arch, mcfg),
        vocab_size=arch.vocab_size,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        **gpt_model_fields(arch),
    ).eval()
    sd = {k: v for k, v in hf.state_dict().items() if not (arch.tie_word_embeddings and k == "lm_head.weight")}
    mc = hf_to_megatron(sd, arch)
    own = dict(gpt.named_parameters()) | {k: v for k, v in gpt.named_buffers() if k.endswith("expert_bias")}
    with torch.no_grad():
        for name, t in own.items():
            t.copy_(mc[name])
    return hf, gpt, arch, sorted(own) == sorted(mc)


def selected(gpt) -> tuple[dict, list]:
    """Forward hooks on every router: the ``[N, top_k]`` experts of its routing map (sorted per token)."""
    from vime_core.trainer.megatron_moe_model import routers

    out: dict[int, torch.Tensor] = {}
    handles = []
    for layer, router in routers(gpt).items():

        def hook(_m, _a, output, layer=layer):
            routing_map = output[1]
            out[layer] = routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1)

        handles.append(router.register_forward_hook(hook))
    return out, handles


def run_case(family: str, attention: str) -> dict:
    from vime_core.trainer.megatron_moe_model import set_replay_routes

    hf, gpt, arch, names_match = build(family, attention, routing_replay=True)
    ids = torch.randint(0, arch.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(SEQ).unsqueeze(0).expand_as(ids)
    from vime_core.trainer.routing_replay import RoutingReplay

    hf_replay = RoutingReplay.of(hf)  # no routes set: records transformers' own choices ([batch * seq] order)
    chosen, handles = selected(gpt)
    with torch.no_grad():
        meg = gpt(ids, pos, None).float()
        ref = hf(input_ids=ids).logits.float()
    live = dict(chosen)
    # megatron-core's routers see the tokens sequence-major ([seq, batch] flattened), transformers' batch-major
    seq_major = all(
        torch.equal(live[layer].view(SEQ, BATCH, -1).transpose(0, 1), hf_ids.sort(-1).values.view(BATCH, SEQ, -1))
        for layer, hf_ids in hf_replay.chosen.items()
    )
    moe_layers = sorted(live)
    k, e_n = arch.moe.top_k, arch.moe.num_experts
    # crafted routes: experts the live top-k does not hold, for every token in every MoE layer
    routes = torch.zeros(arch.num_layers, SEQ * BATCH, k, dtype=torch.long)
    for layer in moe_layers:
        for n in range(SEQ * BATCH):
            free = [e for e in range(e_n) if e not in live[layer][n].tolist()]
            routes[layer, n] = torch.tensor(free[n % 3 :][:k])
    set_replay_routes(gpt, routes)
    with torch.no_grad():
        replayed = gpt(ids, pos, None).float()
    replay_ok = all(torch.equal(chosen[layer], routes[layer].sort(dim=-1).values) for layer in moe_layers)
    live_differs = all(
        not set(a) & set(b)
        for layer in moe_layers
        for a, b in zip(chosen[layer].tolist(), live[layer].tolist(), strict=True)
    )
    live_routes = torch.zeros_like(routes)
    for layer in moe_layers:
        live_routes[layer] = live[layer]
    set_replay_routes(gpt, live_routes)
    with torch.no_grad():
        same = gpt(ids, pos, None).float()
    set_replay_routes(gpt, None)
    for h in handles:
        h.remove()
    bias_kept = None
    if arch.moe.expert_bias:  # the correction bias stays fp32 and exact through the bf16 wrap
        import dataclasses

        from vime_core.trainer.megatron_experts import expert_bias_buffers, float16_module

        loaded = {n: b.clone() for n, b in expert_bias_buffers(gpt).items()}
        float16_module(dataclasses.replace(gpt.config, bf16=True), gpt)
        now = expert_bias_buffers(gpt)
        bias_kept = all(now[n].dtype == torch.float32 and torch.equal(now[n], b) for n, b in loaded.items())
    meg_lp, ref_lp = torch.log_softmax(meg, -1), torch.log_softmax(ref, -1)
    return {
        "params": names_match,
        "live_routes_equal_transformers_seq_major": seq_major,
        "moe_layers": moe_layers,
        "logits_max_abs_diff": (meg - ref).abs().max().item(),
        "logprob_max_abs_diff": (meg_lp - ref_lp).abs().max().item(),
        "logits_scale": ref.abs().max().item(),
        "replayed_experts_equal_routes": replay_ok,
        "live_routing_differs_everywhere": live_differs,
        "replay_changes_logits": not torch.equal(replayed, meg),
        "replaying_live_routes_max_abs_diff": (same - meg).abs().max().item(),
        "expert_bias_kept_fp32_through_bf16": bias_kept,
    }


def main(port: int) -> dict:
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    shim_cuda_for_cpu()
    out = {}
    for family, attention in (("qwen3_moe", "local"), ("qwen3_moe", "sdpa"), ("deepseek_v3", "sdpa")):
        out[f"{family}/{attention}"] = run_case(family, attention)  # MLA: no local core attention in megatron-core
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))

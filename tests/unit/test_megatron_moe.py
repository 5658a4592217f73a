"""The Megatron trainer's MoE families on the CPU (Qwen3-MoE; DeepSeek-V3-style: MLA, shared experts, first dense
layers, sigmoid routing with the correction bias): exact :class:`ArchConfig` values and refusals; bit-exact
HF ↔ Megatron round trips (local and TE names, from the checkpoint's per-expert keys and from transformers' fused
in-memory expert tensors); TP = 2 and EP = 2 splits joined back exactly; the expert-parallel checks; the routes
megatron-core's routers replay, laid out as they see their tokens; and, in a fresh process
(tests/unit/megatron_moe_main.py), megatron-core ``GPTModel``\\s built as the trainer builds them giving transformers'
fp32 log-probs, and megatron-core's ``RouterReplay`` selecting exactly the recorded experts."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vime_core.cluster.net import find_free_port
from vime_core.cluster.placement import NodeResources, PlacementError, ResourceFlags, plan_placement
from vime_core.models.families import UnsupportedModelError, check_trainer_model
from vime_core.models.moe_families import MLAConfig, MoEConfig
from vime_core.testing.tiny_moe import tiny_moe_config
from vime_core.trainer.megatron_convert import (
    ArchConfig,
    ConversionError,
    hf_to_megatron,
    megatron_to_hf,
    shard,
    unshard,
)
from vime_core.trainer.megatron_experts import check_expert_parallel
from vime_core.trainer.megatron_moe import ep_shard, ep_unshard, expert_of
from vime_core.trainer.routing_replay import megatron_routes
from vime_core.types import Sample

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("qwen3_moe", "deepseek_v3")
SPECIAL = {"<|endoftext|>": 0, "<|im_end|>": 2}


@functools.cache
def tiny_hf(family: str):
    """The tiny ``family`` model of vime_core/testing/tiny_moe.py (vocabulary 256), its in-memory tensors (experts
    fused) and its checkpoint tensors (the per-expert names ``save_pretrained`` writes); built once per family, read
    only."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family, 256, SPECIAL)).eval()
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "e_score_correction_bias", None) is not None:
                module.e_score_correction_bias.copy_(torch.randn(module.e_score_correction_bias.shape) * 0.1)
    fused = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return model, fused, revert_weight_conversion(model, dict(fused))


def test_arch_configs_of_the_tiny_moe_families():
    qwen = ArchConfig.from_hf(tiny_moe_config("qwen3_moe", 256, SPECIAL))
    assert (qwen.model_type, qwen.attention, qwen.qk_layernorm, qwen.head_dim, qwen.num_query_groups) == (
        "qwen3_moe",
        "gqa",
        True,
        32,
        1,
    )
    assert qwen.moe == MoEConfig(num_experts=8, top_k=2, expert_hidden_size=32, score_function="softmax")
    assert [qwen.mlp_kind(i) for i in range(2)] == ["moe", "moe"]
    ds = ArchConfig.from_hf(tiny_moe_config("deepseek_v3", 256, SPECIAL))
    assert ds.attention == "mla" and ds.mla == MLAConfig(32, 32, 32, 16, 32)
    assert ds.moe == MoEConfig(
        num_experts=8,
        top_k=2,
        expert_hidden_size=32,
        score_function="sigmoid",
        norm_topk_prob=True,
        expert_bias=True,
        num_groups=2,
        group_topk=1,
        scaling_factor=2.5,
        shared_expert_hidden_size=32,
        dense_layers=(0,),
    )
    assert [ds.mlp_kind(i) for i in range(3)] == ["dense", "moe", "moe"]
    # dense layers of Qwen3-MoE: mlp_only_layers and decoder_sparse_step
    cfg = tiny_moe_config("qwen3_moe", 256, SPECIAL).to_dict() | {"num_hidden_layers": 4, "decoder_sparse_step": 2}
    assert ArchConfig.from_hf(cfg | {"mlp_only_layers": [3]}).moe.dense_layers == (0, 2, 3)
    # config.json as transformers 5.19 writes it (num_local_experts) and as the hub has it (num_experts)
    cfg = tiny_moe_config("qwen3_moe", 256, SPECIAL).to_dict()
    assert "num_local_experts" in cfg
    hub = {k: v for k, v in cfg.items() if k != "num_local_experts"} | {"num_experts": 8}
    assert ArchConfig.from_hf(hub) == ArchConfig.from_hf(cfg)


@pytest.mark.parametrize(
    "family,fields,error",
    [
        (
            "deepseek_v3",
            {"rope_parameters": {"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0}},
            "DeepSeek-V3 (model_type 'deepseek_v3') with rope_type 'yarn' is not supported by --trainer megatron "
            "(it supports rope_type default)",
        ),
        (
            "deepseek_v3",
            {"n_group": 4, "topk_group": 2},
            "DeepSeek-V3 (model_type 'deepseek_v3') with group-limited routing with num_experts_per_tok 2 / "
            "topk_group 2 != 2 is not supported by --trainer megatron (it supports num_experts_per_tok / topk_group "
            "== 2 when n_group > 1)",
        ),
        (
            "deepseek_v3",
            {"norm_topk_prob": False},
            "DeepSeek-V3 (model_type 'deepseek_v3') with norm_topk_prob false is not supported by --trainer megatron "
            "(it supports norm_topk_prob true (megatron-core renormalises sigmoid weights))",
        ),
        (
            "qwen3_moe",
            {"use_sliding_window": True, "sliding_window": 64},
            "Qwen3-MoE (model_type 'qwen3_moe') with sliding-window attention (sliding_window 64) is not supported "
            "by --trainer megatron (it supports full attention)",
        ),
        (
            "qwen3_moe",
            {"num_experts_per_tok": 1},
            "Qwen3-MoE (model_type 'qwen3_moe') with num_experts_per_tok 1 with norm_topk_prob is not supported by "
            "--trainer megatron (it supports num_experts_per_tok >= 2)",
        ),
        (
            "qwen3_moe",
            {"hidden_act": "gelu"},
            "Qwen3-MoE (model_type 'qwen3_moe') with hidden_act 'gelu' is not supported by --trainer megatron (it "
            "supports hidden_act silu)",
        ),
    ],
)
def test_moe_features_the_trainer_does_not_build_are_refused_in_one_line(family, fields, error):
    cfg = tiny_moe_config(family, 256, SPECIAL).to_dict() | fields
    with pytest.raises(UnsupportedModelError) as e:
        check_trainer_model("megatron", cfg, "M")
    assert str(e.value) == f"--model M: {error}; --trainer torch takes any Hugging Face causal LM"


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("te", [False, True], ids=["local", "te"])
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_models_round_trip_bit_exactly(family, te, dtype):
    model, fused, checkpoint = tiny_hf(family)
    arch = ArchConfig.from_hf(model.config)
    hf = {k: v.to(dtype) for k, v in checkpoint.items()}
    assert any(".mlp.experts.7.down_proj.weight" in k for k in hf)  # the checkpoint's per-expert keys
    mc = hf_to_megatron(hf, arch, te=te)
    _bitwise(megatron_to_hf(mc, arch, te=te), hf)
    # transformers' fused in-memory experts map to the very same Megatron tensors
    _bitwise(hf_to_megatron({k: v.to(dtype) for k, v in fused.items()}, arch, te=te), mc)
    layer = "decoder.layers.1."
    f = arch.moe.expert_hidden_size
    e5 = mc[layer + ("mlp.experts.linear_fc1.weight5" if te else "mlp.experts.local_experts.5.linear_fc1.weight")]
    assert torch.equal(e5[:f], hf["model.layers.1.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(e5[f:], hf["model.layers.1.mlp.experts.5.up_proj.weight"])
    assert torch.equal(mc[layer + "mlp.router.weight"], hf["model.layers.1.mlp.gate.weight"])
    assert torch.equal(mc[layer + "pre_mlp_layernorm.weight"], hf["model.layers.1.post_attention_layernorm.weight"])
    if family == "deepseek_v3":
        bias = hf["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert torch.equal(mc[layer + "mlp.router.expert_bias"], bias) and bias.abs().sum() > 0
        assert "decoder.layers.0.mlp.linear_fc1.weight" in mc or "decoder.layers.0.mlp.linear_fc1.weight" in mc
        assert torch.equal(
            mc[layer + "self_attention.linear_kv_down_proj.weight"],
            hf["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"],
        )
        norm = "linear_kv_up_proj.layer_norm_weight" if te else "kv_layernorm.weight"
        assert torch.equal(mc[layer + "self_attention." + norm], hf["model.layers.1.self_attn.kv_a_layernorm.weight"])


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_two_and_expert_parallel_two_split_and_join_exactly(family):
    model, _, checkpoint = tiny_hf(family)
    arch = ArchConfig.from_hf(model.config)
    mc = hf_to_megatron(checkpoint, arch)
    for name, t in mc.items():
        parts = [shard(name, t, r, 2) for r in range(2)]
        assert torch.equal(unshard(name, parts), t), name
    f = arch.moe.expert_hidden_size
    fc1 = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    # an expert's fc1 splits like a dense MLP's: each TP rank holds its halves of gate and of up
    assert torch.equal(shard(fc1, mc[fc1], 1, 2), torch.cat([mc[fc1][f // 2 : f], mc[fc1][f + f // 2 :]]))
    router = "decoder.layers.1.mlp.router.weight"
    assert shard(router, mc[router], 1, 2) is mc[router]  # replicated over TP
    ranks = [ep_shard(mc, r, 2, 8) for r in range(2)]
    for r, part in enumerate(ranks):
        experts = sorted({expert_of(n)[1] for n in part if expert_of(n)})
        assert experts == [0, 1, 2, 3]  # local indices
        for e in range(4):
            name = f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2.weight"
            assert part[name] is mc[f"decoder.layers.1.mlp.experts.local_experts.{4 * r + e}.linear_fc2.weight"]
        assert part[router] is mc[router]  # non-expert tensors are on every EP rank
    joined = ep_unshard(ranks)
    assert sorted(joined) == sorted(mc) and all(joined[k] is mc[k] for k in mc)
    with pytest.raises(ConversionError) as e:
        ep_shard(mc, 0, 3, 8)
    assert str(e.value) == "8 experts do not split over --expert-model-parallel-size 3"
    assert expert_of("decoder.layers.2.mlp.experts.linear_fc2.weight7") == (
        "decoder.layers.2.mlp.experts.linear_fc2.weight",
        7,
        "",
    )


def test_expert_parallel_is_checked_against_the_model_and_the_gpus():
    qwen = ArchConfig.from_hf(tiny_moe_config("qwen3_moe", 256, SPECIAL))
    assert check_expert_parallel(qwen, 2, 1, 2) == 2
    for ep, tp, world, error in [
        (3, 1, 3, "--expert-model-parallel-size 3 must divide the model's 8 experts (model_type 'qwen3_moe')"),
        (2, 2, 2, "--expert-model-parallel-size 2 × --tensor-model-parallel-size 2 must divide the trainer's 2 GPUs"),
        (0, 1, 1, "--expert-model-parallel-size must be >= 1, got 0"),
    ]:
        with pytest.raises(ValueError) as e:
            check_expert_parallel(qwen, ep, tp, world)
        assert str(e.value) == error
    dense = ArchConfig.from_hf(
        {
            "model_type": "qwen3",
            "num_hidden_layers": 1,
            "hidden_size": 8,
            "num_attention_heads": 1,
            "intermediate_size": 8,
            "vocab_size": 8,
        }
    )
    with pytest.raises(ValueError, match=r"^--expert-model-parallel-size 2: model_type 'qwen3' has no experts$"):
        check_expert_parallel(dense, 2, 1, 2)
    # the placement plan, before anything starts: EP groups inside the trainer's GPUs
    node = [NodeResources("n", "127.0.0.1", 2, True)]
    plan = plan_placement(ResourceFlags(actor_num_gpus_per_node=2, colocate=True, trainer_ep=2), node)
    assert plan.trainer_ep == 2 and "trainer EP=2" in plan.describe().splitlines()[0]
    for flags, error in [
        (
            ResourceFlags(actor_num_gpus_per_node=2, colocate=True, trainer_ep=2, trainer_tp=2),
            "--expert-model-parallel-size 2 × --tensor-model-parallel-size 2 must divide the trainer's "
            "--actor-num-nodes × --actor-num-gpus-per-node = 2 GPUs",
        ),
        (
            ResourceFlags(trainer_ep=2),
            "--expert-model-parallel-size 2 needs trainer GPUs (one rank per GPU, --trainer megatron): set "
            "--actor-num-gpus-per-node",
        ),
    ]:
        with pytest.raises(PlacementError) as e:
            plan_placement(flags, node)
        assert str(e.value) == error


def test_megatron_routes_follow_the_routers_sequence_major_token_order():
    """megatron-core's routers see ``[seq, batch]`` flattened: token t of sample i is row ``t * batch + i``; each
    sample's last token and the padding get experts 0 … k-1; a sequence-parallel TP rank gets its slice."""
    layers, k = 2, 2
    samples = []
    for i, n in enumerate((3, 5)):
        s = Sample(group_index=1, index=i, tokens=list(range(10, 10 + n)), response_length=1, loss_mask=[1])
        s.rollout_log_probs, s.weight_versions = [0.0], [0]
        s.routed_experts = (np.arange((n - 1) * layers * k).reshape(n - 1, layers, k) % 8).astype(np.int16)
        samples.append(s)
    routes = megatron_routes(samples, 6, layers, k, 8)
    assert routes.shape == (layers, 12, k) and routes.dtype == torch.long
    grid = routes.view(layers, 6, 2, k)  # [layer, t, i, k]
    for i, s in enumerate(samples):
        n = len(s.tokens)
        assert grid[:, : n - 1, i].permute(1, 0, 2).tolist() == s.routed_experts.tolist()
        assert (grid[:, n - 1 :, i] == torch.arange(k)).all()  # the last token and the padding
    second = megatron_routes(samples, 6, layers, k, 8, tp_rank=1, tp_size=2)
    assert torch.equal(second, grid[:, 3:].reshape(layers, 6, k))
    samples[1].routed_experts = samples[1].routed_experts[:-1]
    with pytest.raises(
        ValueError, match=r"^sample 1/1: routed_experts is int16 \(3, 2, 2\), expected int16 \(4, 2, 2\)"
    ):
        megatron_routes(samples, 6, layers, k, 8)


def test_megatron_moe_models_match_transformers_fp32_and_replay_the_recorded_experts_on_cpu():
    """megatron-core 0.16 (the CPU venv's) with the CPU shims; the same build runs on the GPU with 0.19.2
    (tests/gpu/test_megatron_moe_gpu.py)."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("megatron_moe_main.py")), str(find_free_port())],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(got) == ["deepseek_v3/sdpa", "qwen3_moe/local", "qwen3_moe/sdpa"]
    for case, r in got.items():
        print(case, r)
        assert r["params"], case  # the mapping fills every parameter and correction bias the model has
        # live routing equals transformers' token by token, megatron-core's routers seeing [seq, batch] flattened
        # (the order vime_core.trainer.routing_replay.megatron_routes lays the recorded routes out in)
        assert r["live_routes_equal_transformers_seq_major"], case
        assert r["moe_layers"] == ([1, 2] if case.startswith("deepseek") else [0, 1]), case
        assert r["logprob_max_abs_diff"] < 1e-5 and r["logits_max_abs_diff"] < 1e-5 * r["logits_scale"] + 1e-5, case
        assert r["replayed_experts_equal_routes"] and r["live_routing_differs_everywhere"], case
        assert r["replay_changes_logits"] and r["replaying_live_routes_max_abs_diff"] == 0.0, case
        # DeepSeek-V3: megatron_experts.float16_module keeps the loaded correction bias exact in fp32
        assert r["expert_bias_kept_fp32_through_bf16"] is (True if case.startswith("deepseek") else None), case


def test_moe_flags_are_checked_against_the_model_before_anything_starts(tmp_path, tiny_model_dir):
    """``vime run`` (vime_core/run/loop.py, once ``--model`` is resolved): one line naming the flag and the model."""
    from vime_core.config.errors import ArgumentError
    from vime_core.run.preflight import check_moe_flags
    from vime_core.testing.tiny_moe import build_tiny_moe
    from vime_core.testing.trainer_args import trainer_config

    moe = build_tiny_moe(tmp_path / "qwen3_moe", "qwen3_moe")
    check_moe_flags(trainer_config(model=str(moe), use_rollout_routing_replay=True), moe)  # torch: replays it
    check_moe_flags(trainer_config(model=str(moe), trainer="megatron", expert_model_parallel_size=4), moe)
    for path, flags, error in [
        (
            tiny_model_dir,
            {"use_rollout_routing_replay": True},
            f"--use-rollout-routing-replay needs an MoE model; --model {tiny_model_dir} (model_type 'qwen2') has no "
            "routed experts",
        ),
        (
            moe,
            {"expert_model_parallel_size": 2},
            "--expert-model-parallel-size 2 needs --trainer megatron (got --trainer torch)",
        ),
        (
            moe,
            {"use_rollout_routing_replay": True, "generate": "coding_agent"},
            "--use-rollout-routing-replay: --generate coding_agent's agent gateway does not record the engine's "
            "routes yet (the default and multi_turn generate functions do)",
        ),
        (
            moe,
            {"trainer": "megatron", "lora_rank": 8},
            "--lora-rank 8: the megatron trainer has no LoRA for MoE models (model_type 'qwen3_moe'); --trainer torch "
            "trains their LoRA adapters",
        ),
        (
            moe,
            {"expert_model_parallel_size": 3, "trainer": "megatron"},
            f"--expert-model-parallel-size 3 must divide the routed experts of --model {moe} (model_type "
            "'qwen3_moe': 8)",
        ),
    ]:
        with pytest.raises(ArgumentError) as e:
            check_moe_flags(trainer_config(model=str(path), **flags), path)
        assert str(e.value) == error


def test_gathering_the_experts_of_two_ep_ranks_gives_the_full_model(tmp_path):
    """The trainer's gather over the EP group (gloo, two CPU processes here; NCCL on GPUs): each rank holds 4 of the 8
    experts per layer (fc1 and fc2: 8 tensors in layer 0) and gathers all 8 back under their global names, equal to
    the unsplit tensors (tests/unit/megatron_ep_gather_main.py)."""
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("megatron_ep_gather_main.py")),
            str(find_free_port()),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        assert got == {"gathered_equals_full": True, "local_expert_tensors_layer0": 8}, (rank, got)

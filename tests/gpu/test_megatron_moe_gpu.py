"""The ``megatron`` trainer with the MoE families on one GPU (tiny Qwen3-MoE and DeepSeek-V3-style models of
vime_core/testing/tiny_moe.py, random weights): HF → Megatron → HF bit-exact through the real trainer (bf16), the
trainer's bf16 log-probs against transformers' fp32 — with live routing and with transformers' own routes replayed
(R3) — and megatron-core's ``RouterReplay`` selecting exactly the recorded experts for every token in every layer.

Marked ``gpu``; skipped without CUDA or megatron-core. With the offline site of docs/gpu.md (~1 min on one H100)::

    PYTHONPATH=/tmp/site:$PWD python3 -m pytest tests/gpu/test_megatron_moe_gpu.py -q -s
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("megatron.core")

from vime_core.testing.tiny_moe import build_tiny_moe, random_samples, transformers_routes  # noqa: E402
from vime_core.testing.trainer_args import trainer_config  # noqa: E402

FAMILIES = ("qwen3_moe", "deepseek_v3")
#: bf16 Megatron vs fp32 transformers, max |Δ log-prob| over every token when both route alike (R3): bf16 rounding
REPLAYED_TOL = 0.1


def router_choices(trainer) -> tuple[dict[int, torch.Tensor], list]:
    """Forward hooks on every router of the policy: the ``[N, top_k]`` experts of its routing map (sorted)."""
    from vime_core.trainer.megatron_moe_model import routers

    out: dict[int, torch.Tensor] = {}
    handles = []
    for layer, router in routers(trainer.gpt).items():

        def hook(_m, _a, output, layer=layer):
            rmap = output[1]
            out[layer] = rmap.nonzero()[:, 1].view(rmap.shape[0], -1).cpu()

        handles.append(router.register_forward_hook(hook))
    return out, handles


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, build_tiny_moe(tmp_path_factory.mktemp("moe") / request.param, request.param)


def test_hf_megatron_hf_round_trip_is_bit_exact(family_dir):
    from safetensors.torch import load_file

    from vime_core.trainer.megatron_backend import MegatronTrainer

    family, path = family_dir
    trainer = MegatronTrainer(trainer_config(), path)
    original = load_file(str(path / "model.safetensors"))  # float32
    original.pop("lm_head.weight", None)
    got = dict(trainer.named_hf_tensors())
    assert sorted(got) == sorted(original)
    for k in original:  # bf16 parameters; megatron-core keeps the correction bias in fp32
        assert got[k].dtype == (torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16), k
        want = original[k].to(got[k].dtype).contiguous()
        assert torch.equal(got[k].cpu().view(torch.uint8), want.view(torch.uint8)), k


def test_bf16_log_probs_against_transformers_fp32_live_and_replayed(family_dir):
    """The parity figure of docs/models.md: max |Δ log-prob| per family, with live routing (bf16 may pick other
    experts where two score alike) and with transformers' routes replayed (R3: only bf16 rounding left); the replayed
    routers select exactly transformers' experts for every forwarded token."""
    from vime_core.trainer.megatron_backend import MegatronTrainer
    from vime_core.trainer.megatron_moe_model import set_replay_routes

    family, path = family_dir
    trainer = MegatronTrainer(trainer_config(use_rollout_routing_replay=True), path)
    samples = random_samples(trainer.arch.vocab_size)
    routes, hf_lps = transformers_routes(path, samples)
    for s, r in zip(samples, routes, strict=True):
        s.routed_experts = r
    chosen, handles = router_choices(trainer)
    with torch.no_grad():
        replayed = trainer.policy_log_probs(samples, False)[0]
        seq = max(len(s.tokens) for s in samples)
        grid = {layer: ids.view(seq, len(samples), -1) for layer, ids in chosen.items()}  # [t, sample, k]
        for layer, ids in grid.items():
            for i, s in enumerate(samples):
                want = np.sort(s.routed_experts[:, layer], axis=-1)
                assert ids[: len(s.tokens) - 1, i].tolist() == want.tolist(), (family, layer, i)
        ids, pos = trainer.token_batch(samples)
        set_replay_routes(trainer.gpt, None)  # live routing
        live = trainer.response_slices(samples, trainer.token_log_probs(ids, pos)[0])
    for h in handles:
        h.remove()
    d_replay = max((a.float().cpu() - b).abs().max().item() for a, b in zip(replayed, hf_lps, strict=True))
    d_live = max((a.float().cpu() - b).abs().max().item() for a, b in zip(live, hf_lps, strict=True))
    print(f"{family}: max |Δ log-prob| bf16 Megatron vs fp32 transformers: live {d_live:.4f}, replayed {d_replay:.4f}")
    assert d_replay < REPLAYED_TOL

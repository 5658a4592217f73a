"""The ``megatron`` trainer backend on a real GPU: HF ↔ Megatron round trip, logits against Hugging Face, the
trainer contract kit. Marked ``gpu`` (CI deselects it with ``-m "not gpu"``); skipped where CUDA or megatron-core is
missing. Run on the lent H200 with megatron-core carried as a wheel (see bench/megatron_step.py's docstring).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vime_core.testing import TrainerBackendContract
from vime_core.testing.trainer_args import trainer_config

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("megatron.core")


def build_hf(out: Path, family: str, seed: int = 0) -> Path:
    """A small random HF model in bf16 (Llama: GQA, untied; Qwen2: q/k/v biases, tied embeddings)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        initializer_range=0.1,
        max_position_embeddings=1024,
    )
    if family == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
        model = transformers.Qwen2ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_dir(request, tmp_path_factory) -> Path:
    return build_hf(tmp_path_factory.mktemp(request.param) / request.param, request.param)


def test_hf_megatron_hf_round_trip_is_bit_exact(hf_dir):
    from safetensors.torch import load_file

    from vime_core.trainer.megatron_backend import MegatronTrainer

    trainer = MegatronTrainer(trainer_config(lr=1e-3), hf_dir)
    original = load_file(str(hf_dir / "model.safetensors"))
    if trainer.arch.tie_word_embeddings:
        original.pop("lm_head.weight", None)
    exported = dict(trainer.named_hf_tensors())
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        e = exported[name]
        assert e.dtype == t.dtype == torch.bfloat16 and e.shape == t.shape, name
        assert torch.equal(e.view(torch.uint8), t.view(torch.uint8)), name


def test_logits_match_hugging_face_within_bf16_tolerance(hf_dir):
    from transformers import AutoModelForCausalLM

    from vime_core.algorithms.logprobs import token_log_probs
    from vime_core.trainer.megatron_backend import MegatronTrainer

    trainer = MegatronTrainer(trainer_config(lr=1e-3), hf_dir)
    ids = torch.randint(0, 1000, (2, 256), generator=torch.Generator().manual_seed(3))
    meg = token_log_probs(trainer.model(input_ids=ids).logits, ids)
    with torch.no_grad():
        hf32 = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).cuda().eval()
        ref = token_log_probs(hf32(input_ids=ids.cuda()).logits.float().cpu(), ids)
        hf16 = hf32.to(torch.bfloat16)
        hf_bf16 = token_log_probs(hf16(input_ids=ids.cuda()).logits.float().cpu(), ids)
    meg_err, hf_err = (meg - ref).abs().max().item(), (hf_bf16 - ref).abs().max().item()
    print(
        f"\n{hf_dir.name}: max |logprob - fp32 HF|: megatron bf16 {meg_err:.4f}, HF bf16 {hf_err:.4f}; "
        f"mean {(meg - ref).abs().mean().item():.5f} vs {(hf_bf16 - ref).abs().mean().item():.5f}"
    )
    assert meg_err < max(3 * hf_err, 0.05)


class TestMegatronTrainerContract(TrainerBackendContract):
    @pytest.fixture(scope="class")
    def model_dir(self, tmp_path_factory) -> Path:
        return build_hf(tmp_path_factory.mktemp("contract") / "llama", "llama")

    @pytest.fixture
    def trainer(self, model_dir):
        from vime_core.plugins.manager import get_plugins

        return get_plugins().resolve("trainer", "megatron")(trainer_config(lr=1e-3), model_dir)


def _optimizer_state(trainer) -> dict[tuple, torch.Tensor]:
    """Every tensor of the inner optimizers: fp32 main-parameter shards and their Adam moments (copies)."""
    from vime_core.trainer.megatron_backend import inner_optimizers

    out = {}
    for i, opt in enumerate(inner_optimizers(trainer.optimizer)):
        for j, group in enumerate(opt.param_groups):
            for k, p in enumerate(group["params"]):
                out[(i, j, k, "param")] = p.detach().clone()
                for key, v in opt.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        out[(i, j, k, key)] = v.detach().clone()
    return out


def test_checkpoint_after_steps_restores_the_optimizer(tmp_path):
    """Save after two steps, step on, load: weights, fp32 main parameters, Adam moments and step counts come back
    bit-exactly (the distributed optimizer's parameter-state file included)."""
    from vime_core.trainer.megatron_backend import MegatronTrainer

    model_dir = build_hf(tmp_path / "llama", "llama", seed=1)
    trainer = MegatronTrainer(trainer_config(lr=1e-3), model_dir)
    for adv in (1.0, -0.5):
        trainer.train_step(TrainerBackendContract.make_batch(1000, adv))
    saved_state = _optimizer_state(trainer)
    saved_weights = {n: t.clone() for n, t in trainer.named_hf_tensors()}
    assert any(k[3] == "exp_avg" for k in saved_state)
    trainer.save_checkpoint(tmp_path / "ck")
    trainer.train_step(TrainerBackendContract.make_batch(1000, 1.0))
    assert any(not torch.equal(v, saved_state[k]) for k, v in _optimizer_state(trainer).items())
    trainer.load_checkpoint(tmp_path / "ck")
    loaded = _optimizer_state(trainer)
    assert sorted(loaded) == sorted(saved_state)
    bad = [k for k, v in loaded.items() if not torch.equal(v, saved_state[k])]
    assert not bad, f"{len(bad)} optimizer tensors differ after load, e.g. {bad[:3]}"
    assert all(torch.equal(t, saved_weights[n]) for n, t in trainer.named_hf_tensors())
    assert trainer.steps_done == 2
    trainer.train_step(TrainerBackendContract.make_batch(1000, 1.0))  # and it trains on from there

"""The megatron backend's packed micro-batches (``--qkv-format thd``) and float32 LM head on a real GPU: packed
log-probs, entropies and a training step against the right-padded ones, and the float32 logits against Hugging Face
in float32.
The index math and per-sample attention/RoPE are checked exactly on the CPU (tests/unit/test_megatron_packing.py).
Marked ``gpu``; skipped without CUDA or megatron-core.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vime_core.testing.trainer_args import trainer_config
from vime_core.types import RolloutBatch, Sample, Status

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("megatron.core")

from tests.gpu.test_megatron_backend import build_hf  # noqa: E402


def _samples(shapes, vocab=1000, seed=0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for prompt_len, resp_len in shapes:
        s = Sample(tokens=torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), status=Status.COMPLETED)
        resp = torch.randint(0, vocab, (resp_len,), generator=g).tolist()
        s.append_response_tokens(resp, trainable=True, log_probs=[-1.0] * resp_len, weight_version=0)
        out.append(s)
    return out


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from vime_core.trainer.megatron_backend import MegatronTrainer

    hf = build_hf(tmp_path_factory.mktemp("llama") / "llama", "llama")
    return MegatronTrainer(trainer_config(lr=1e-4, micro_batch_size=8), hf)


def _layout(trainer, fmt: str) -> None:
    trainer.megatron_config = dataclasses.replace(trainer.megatron_config, qkv_format=fmt)


@torch.no_grad()
def test_packed_log_probs_equal_padded(trainer):
    samples = _samples([(37, 90), (5, 3), (120, 41), (64, 1), (9, 200), (33, 33)])
    _layout(trainer, "bshd")
    pad_lp, pad_ent = trainer.sample_log_probs(samples, with_entropy=True)
    _layout(trainer, "thd")
    pack_lp, pack_ent = trainer.sample_log_probs(samples, with_entropy=True)
    diffs = [(a - b).abs().max().item() for a, b in zip(pad_lp, pack_lp, strict=True)]
    ent_diffs = [(a - b).abs().max().item() for a, b in zip(pad_ent, pack_ent, strict=True)]
    mean = torch.cat([(a - b).abs() for a, b in zip(pad_lp, pack_lp, strict=True)]).mean().item()
    print(f"\npacked vs padded: max |Δlogp| per sample {diffs}, mean {mean:.2e}; entropy {ent_diffs}")
    assert [len(x) for x in pack_lp] == [s.response_length for s in samples]
    assert max(diffs) < 0.05 and mean < 5e-3 and max(ent_diffs) < 0.05  # bf16 kernels of other shapes, no more
    one = samples[2:3]  # one sample: the same computation in both layouts
    _layout(trainer, "bshd")
    alone = trainer.sample_log_probs(one)[0][0]
    _layout(trainer, "thd")
    assert torch.equal(trainer.sample_log_probs(one)[0][0], alone)


def test_a_packed_training_step_matches_the_padded_one(trainer, tmp_path_factory):
    from vime_core.trainer.megatron_backend import MegatronTrainer

    samples = _samples([(40, 60), (12, 100), (80, 20), (7, 7)], seed=1)
    advs = [[1.0 if i % 2 else -1.0] * s.response_length for i, s in enumerate(samples)]
    results = {}
    for fmt in ("bshd", "thd"):
        t = MegatronTrainer(trainer_config(lr=1e-4, micro_batch_size=2, qkv_format=fmt), trainer.model_path)
        m = t.train_step(RolloutBatch(samples=samples, advantages=advs))
        results[fmt] = (m["train/pg_loss"], m["train/grad_norm"], t.sample_log_probs(samples)[0])
        print(f"\n{fmt}: pg_loss {m['train/pg_loss']:.6f}, grad_norm {m['train/grad_norm']:.6f}")
    (l0, g0, lp0), (l1, g1, lp1) = results["bshd"], results["thd"]
    assert abs(l0 - l1) < 1e-3 and abs(g0 - g1) / g0 < 2e-2
    assert max((a - b).abs().max().item() for a, b in zip(lp0, lp1, strict=True)) < 0.05


@torch.no_grad()
def test_fp32_lm_head_is_closer_to_float32_hugging_face(trainer):
    """With float32 logits the megatron bf16 model is closer to the float32 HF model than with bf16 logits."""
    from transformers import AutoModelForCausalLM

    from vime_core.algorithms.logprobs import token_log_probs

    ids = torch.randint(0, 1000, (2, 256), generator=torch.Generator().manual_seed(3))
    assert getattr(trainer.gpt.output_layer, "vime_fp32_logits", False)
    fp32_head = token_log_probs(trainer.model(input_ids=ids).logits, ids)
    hf32 = AutoModelForCausalLM.from_pretrained(str(trainer.model_path), dtype=torch.float32).cuda().eval()
    ref = token_log_probs(hf32(input_ids=ids.cuda()).logits.float().cpu(), ids)
    err = (fp32_head - ref).abs().mean().item()
    bf16_logits = trainer.model(input_ids=ids).logits.to(torch.bfloat16).float()  # the same logits rounded to bf16
    err_bf16 = (token_log_probs(bf16_logits, ids) - ref).abs().mean().item()
    print(f"\nmean |logp - fp32 HF|: float32 logits {err:.5f}, rounded to bf16 {err_bf16:.5f}")
    assert err < err_bf16

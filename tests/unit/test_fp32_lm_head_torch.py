"""``--fp32-lm-head`` on the torch trainer (:func:`vime_core.trainer.fp32_head.install_fp32_lm_head`): a bf16 model's
log-probs come from float32 logits — exactly ``log_softmax(fp32_logits(hidden, W))`` of the same hidden states, as
the engine computes them — in the policy and the KL reference; a float32 model is left as it was, bit for bit; and a
train step still updates the tied head/embedding weight.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.samples import random_samples, small_rl_batch
from vime_core.algorithms.logprobs import fp32_logits
from vime_core.testing.trainer_args import trainer_config
from vime_core.trainer.packing import packed_batch, packed_hidden_states
from vime_core.trainer.torch_backend import TorchTrainer, response_log_probs

pytestmark = pytest.mark.unit


def _trainer(model_dir, dtype: str, fp32_head: bool, **flags) -> TorchTrainer:
    return TorchTrainer(trainer_config(train_dtype=dtype, fp32_lm_head=fp32_head, **flags), model_dir)


def _from_hidden(model: torch.nn.Module, samples, round_to_bf16: bool) -> list[torch.Tensor]:
    """The response log-probs of ``samples`` from the trainer's own packed hidden states, the head applied here."""
    packed = packed_batch(samples, torch.device("cpu"))
    hidden = packed_hidden_states(model.base_model, packed).index_select(0, packed.predict_index)
    weight = model.get_output_embeddings().weight
    logits = (hidden @ weight.t()).float() if round_to_bf16 else fp32_logits(hidden, weight)
    lp = torch.log_softmax(logits, dim=-1).gather(-1, packed.targets[:, None])[:, 0]
    return packed.split(lp)


@torch.no_grad()
def test_a_bf16_policy_scores_with_float32_logits_and_the_flag_off_rounds_them(tiny_model_dir):
    samples = random_samples()
    on = _trainer(tiny_model_dir, "bfloat16", True)
    assert on.fp32_lm_head and on.model.get_output_embeddings().weight.dtype == torch.bfloat16
    got = response_log_probs(on.model, samples, on.device)[0]
    for g, want in zip(got, _from_hidden(on.model, samples, round_to_bf16=False), strict=True):
        assert g.dtype == torch.float32 and torch.equal(g, want)

    off = _trainer(tiny_model_dir, "bfloat16", False)
    assert not off.fp32_lm_head
    rounded = response_log_probs(off.model, samples, off.device)[0]
    for r, want in zip(rounded, _from_hidden(off.model, samples, round_to_bf16=True), strict=True):
        assert torch.equal(r, want)
    # the two differ by the bf16 rounding of the logits, and only by that
    diff = torch.cat([g - r for g, r in zip(got, rounded, strict=True)]).abs()
    assert 0 < diff.max() < 0.2


@torch.no_grad()
def test_a_float32_model_is_left_as_it_was(tiny_model_dir):
    samples = random_samples()
    on, off = _trainer(tiny_model_dir, "float32", True), _trainer(tiny_model_dir, "float32", False)
    assert not on.fp32_lm_head and not hasattr(on.model.get_output_embeddings(), "vime_fp32_logits")
    for a, b in zip(
        response_log_probs(on.model, samples, on.device)[0],
        response_log_probs(off.model, samples, off.device)[0],
        strict=True,
    ):
        assert torch.equal(a, b)


def test_the_kl_reference_has_float32_logits_too_and_a_step_trains_the_tied_head(tiny_model_dir):
    trainer = _trainer(tiny_model_dir, "bfloat16", True, use_kl_loss=True, kl_loss_coef=0.1, lr=1e-3)
    ref_head = trainer.ref_model.model.get_output_embeddings()
    assert getattr(ref_head, "vime_fp32_logits", False) and trainer.model.config.tie_word_embeddings
    samples = random_samples()
    with torch.no_grad():  # before any step the reference is the policy: the same float32-logit log-probs
        for a, b in zip(
            response_log_probs(trainer.model, samples, trainer.device)[0],
            response_log_probs(trainer.ref_model.model, samples, trainer.device)[0],
            strict=True,
        ):
            assert torch.equal(a, b)
    head = trainer.model.get_output_embeddings().weight
    assert head is trainer.model.get_input_embeddings().weight  # still tied
    before = head.detach().clone()
    metrics = trainer.train_step(small_rl_batch())
    assert torch.isfinite(torch.tensor(metrics["train/grad_norm"])) and metrics["train/grad_norm"] > 0
    assert not torch.equal(head.detach(), before)  # the head's (the embedding's) gradient flowed through FP32Logits

"""The torch backend's packed micro-batches (one padding-free row, per-sample attention, LM head only on response
positions) give the left-padded path's log-probs, entropies, values and gradients: a wrong segment bound or
position id would silently train on wrong log-probs."""

import pytest
import torch

from vime_core.testing.trainer_args import trainer_config
from vime_core.trainer.packing import PACKED_ATTENTION, packed_batch
from vime_core.trainer.torch_backend import TorchTrainer, response_log_probs
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit

# (prompt length, response length): different lengths, a one-token prompt, a one-token and an empty response
SHAPES = ((3, 7), (11, 2), (1, 5), (6, 1), (9, 0), (4, 12))


def _samples(shapes=SHAPES, seed=3) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for prompt_len, resp_len in shapes:
        s = Sample(tokens=torch.randint(0, 4096, (prompt_len,), generator=g).tolist(), status=Status.COMPLETED)
        resp = torch.randint(0, 4096, (resp_len,), generator=g).tolist()
        s.append_response_tokens(resp, trainable=True, log_probs=[0.0] * resp_len, weight_version=0)
        out.append(s)
    return out


def test_packed_batch_exact_layout():
    a = Sample(tokens=[5, 6, 7, 8], response_length=2)
    b = Sample(tokens=[9, 10], response_length=1)
    c = Sample(tokens=[11, 12, 13], response_length=0)
    batch = packed_batch([a, b, c])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2]]
    assert batch.cu_seq_lens.tolist() == [0, 4, 6, 9] and batch.cu_seq_lens.dtype == torch.int32
    assert (batch.max_len, batch.total) == (4, 9)
    # positions predicting 7, 8 (sample a) and 10 (sample b); none for c
    assert batch.predict_index.tolist() == [1, 2, 4]
    assert batch.targets.tolist() == [7, 8, 10]
    assert [t.tolist() for t in batch.split(torch.tensor([1.0, 2.0, 3.0]))] == [[1.0, 2.0], [3.0], []]
    kw = batch.attention_kwargs()
    assert (kw["max_length_q"], kw["cu_seq_lens_k"].tolist()) == (4, [0, 4, 6, 9])


def test_packed_batch_refuses_a_response_without_prompt():
    with pytest.raises(ValueError, match="at least one prompt token"):
        packed_batch([Sample(tokens=[1, 2], response_length=2)])


def _log_probs(trainer, samples, packing, entropy_grad=True):
    trainer.model.zero_grad(set_to_none=True)
    lps, ents = response_log_probs(
        trainer.model, samples, trainer.device, with_entropy=True, entropy_grad=entropy_grad, packing=packing
    )
    # a loss through every log-prob and entropy (the entropies of the response positions)
    loss = sum((lp * torch.arange(1, len(lp) + 1)).sum() + 0.3 * e.sum() for lp, e in zip(lps, ents, strict=True))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return [lp.detach() for lp in lps], [e.detach() for e in ents], grads


def test_packed_log_probs_entropies_and_gradients_equal_left_padded(tiny_model_dir):
    trainer = TorchTrainer(trainer_config(), tiny_model_dir)
    assert trainer.model.config._attn_implementation == PACKED_ATTENTION
    samples = _samples()
    lp_pad, ent_pad, g_pad = _log_probs(trainer, samples, packing=False)
    lp_pack, ent_pack, g_pack = _log_probs(trainer, samples, packing=True)
    for s, a, b, ea, eb in zip(samples, lp_pad, lp_pack, ent_pad, ent_pack, strict=True):
        assert a.shape == b.shape == ea.shape == eb.shape == (s.response_length,)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        torch.testing.assert_close(eb, ea, atol=1e-5, rtol=0)
    assert g_pad.keys() == g_pack.keys() and len(g_pad) == len(list(trainer.model.parameters()))
    for name, grad in g_pad.items():
        # fp32 sums in another order differ by a few ulps of the tensor's largest entry (the embedding gradient's is
        # ~66, its ulp 7.6e-6; 1.4e-5 apart seen on an AMD EPYC), so the bound is 1e-6 of that entry, at least 1e-5
        atol = max(1e-5, 1e-6 * grad.abs().max().item())
        torch.testing.assert_close(g_pack[name], grad, atol=atol, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_packed_log_probs_equal_unpadded_single_sequence_forwards(tiny_model_dir):
    """Against the plainest reference: each sample alone through the model, full logits, no mask."""
    from vime_core.algorithms.logprobs import token_log_probs_and_entropy

    trainer = TorchTrainer(trainer_config(), tiny_model_dir)
    samples = _samples()
    with torch.no_grad():
        lps, ents = trainer.policy_log_probs(samples, True)
        for s, lp, ent in zip(samples, lps, ents, strict=True):
            ids = torch.tensor([s.tokens])
            ref_lp, ref_ent = token_log_probs_and_entropy(trainer.model(input_ids=ids).logits, ids)
            torch.testing.assert_close(lp, ref_lp[0, s.prompt_length - 1 :], atol=1e-5, rtol=0)
            torch.testing.assert_close(ent, ref_ent[0, s.prompt_length - 1 :], atol=1e-5, rtol=0)


def test_entropy_keeps_a_graph_only_with_an_entropy_term(tiny_model_dir):
    samples = _samples(((3, 4), (5, 2)))
    plain = TorchTrainer(trainer_config(), tiny_model_dir)
    lps, ents = plain.policy_log_probs(samples, True)
    assert all(lp.requires_grad for lp in lps) and not any(e.requires_grad for e in ents)
    bonus = TorchTrainer(trainer_config(entropy_coef=0.01), tiny_model_dir)
    lps2, ents2 = bonus.policy_log_probs(samples, True)
    assert all(e.requires_grad for e in ents2)
    for a, b in zip(ents, ents2, strict=True):  # same weights (seed 0), same values
        torch.testing.assert_close(a, b.detach(), atol=0, rtol=0)


def test_packed_forward_with_gradient_checkpointing_equals_without(tiny_model_dir):
    """Checkpointing recomputes every layer in the backward pass: the recomputation must attend per sample too."""
    samples = _samples()
    plain = TorchTrainer(trainer_config(), tiny_model_dir)
    ckpt = TorchTrainer(trainer_config(gradient_checkpointing=True), tiny_model_dir)
    lp_a, _, g_a = _log_probs(plain, samples, packing=True)
    lp_b, _, g_b = _log_probs(ckpt, samples, packing=True)
    for a, b in zip(lp_a, lp_b, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    for name, grad in g_a.items():
        torch.testing.assert_close(g_b[name], grad, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_train_step_packed_equals_left_padded(tiny_model_dir):
    """One whole RL step (several micro-batches) from the same weights: the same loss metrics and gradient norm
    either way (the updated weights are not compared: Adam's first step is ``lr·sign(g)``, noise where ``g`` ~ 0)."""
    from vime_core.types import RolloutBatch

    samples = [s for s in _samples() if s.response_length > 0]
    advantages = [[1.0 if i % 2 else -1.0] * s.response_length for i, s in enumerate(samples)]
    results = []
    for packing in (False, True):
        trainer = TorchTrainer(trainer_config(micro_batch_size=2, lr=1e-3), tiny_model_dir)
        assert trainer.optimizer.param_groups[0]["fused"] is True
        trainer.use_packing(packing)
        metrics = trainer.train_step(RolloutBatch(samples=samples, advantages=advantages))
        results.append(metrics)
    m_pad, m_pack = results
    for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/train_rollout_logprob_abs_diff"):
        assert m_pack[key] == pytest.approx(m_pad[key], abs=1e-5), key
    assert m_pack["train/grad_norm"] == pytest.approx(m_pad["train/grad_norm"], rel=1e-4)


def test_packed_critic_values_equal_left_padded(tiny_model_dir):
    from vime_core.trainer.critic import ValueModel

    torch.manual_seed(0)
    critic = ValueModel.from_pretrained(tiny_model_dir)
    samples = [s for s in _samples() if s.response_length > 0]  # the left-padded values need a response
    with torch.no_grad():
        padded = critic.response_values(samples, torch.device("cpu"), packing=False)
        packed = critic.response_values(samples, torch.device("cpu"), packing=True)
    for s, a, b in zip(samples, padded, packed, strict=True):
        assert b.shape == (s.response_length,)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    empty = critic.response_values(_samples(((4, 0), (2, 3))), torch.device("cpu"))
    assert [v.shape[0] for v in empty] == [0, 3]


def test_a_model_that_scales_its_logits_takes_the_left_padded_path(tiny_model_dir):
    """packed log-probs apply lm_head themselves, so a model whose config scales or soft-caps the logits is not
    packable (the trainer and reference model fall back to left-padded batches) and a forced packed call raises."""
    from transformers import AutoModelForCausalLM

    from vime_core.trainer.torch_backend import packable

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    assert packable(model) is True
    model.config.logit_scale = 2.0
    assert packable(model) is False
    with pytest.raises(ValueError, match="logit_scale=2.0 is not supported"):
        response_log_probs(model, _samples(), torch.device("cpu"), packing=True)

"""The torch trainer's batched, left-padded log-probs equal an unpadded per-sample forward (a padding or
position-id bug would silently train on wrong log-probs)."""

import random

import numpy as np
import pytest
import torch

from vime_core.algorithms.logprobs import sequence_log_probs
from vime_core.testing.trainer_args import trainer_config
from vime_core.trainer.padding import left_padded_batch, response_slices
from vime_core.trainer.torch_backend import TorchTrainer
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit


def test_batched_response_log_probs_match_unpadded_forward(tiny_model_dir):
    trainer = TorchTrainer(trainer_config(), tiny_model_dir)
    g = torch.Generator().manual_seed(3)
    samples = []
    for prompt_len, resp_len in ((3, 7), (11, 2), (6, 5)):
        s = Sample(tokens=torch.randint(0, 4096, (prompt_len,), generator=g).tolist(), status=Status.COMPLETED)
        s.append_response_tokens(
            torch.randint(0, 4096, (resp_len,), generator=g).tolist(),
            trainable=True,
            log_probs=[0.0] * resp_len,
            weight_version=0,
        )
        samples.append(s)
    batched = trainer.policy_log_probs(samples, False)[0]
    for s, lp in zip(samples, batched, strict=True):
        ref = sequence_log_probs(trainer.model, s.tokens, s.prompt_length)
        assert lp.shape == (s.response_length,)
        torch.testing.assert_close(lp.detach(), ref, atol=1e-5, rtol=0)


def test_left_padded_batch_exact_layout():
    """The batch both the policy's log-probs and the critic's values are computed on: ids right-aligned, position
    ids counting from each sample's first real token, ``keep`` = longest response + 1."""
    a = Sample(tokens=[5, 6, 7, 8], response_length=2)
    b = Sample(tokens=[9, 10], response_length=1)
    batch = left_padded_batch([a, b])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [0, 0, 9, 10]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3], [0, 0, 0, 1]]
    assert (batch.keep, batch.seq_len) == (3, 4)
    x = torch.arange(6).reshape(2, 3)
    assert [t.tolist() for t in response_slices(x, [a, b])] == [[1, 2], [5]]


def test_fused_adamw_step_equals_the_foreach_step(tiny_model_dir):
    """The trainer's AdamW runs torch's fused kernel; from the same gradients it makes the foreach implementation's
    update (within float32 rounding), weight decay included."""
    import copy

    trainer = TorchTrainer(trainer_config(lr=1e-3, weight_decay=0.1), tiny_model_dir)
    assert trainer.optimizer.param_groups[0]["fused"] is True
    other = copy.deepcopy(trainer.model)
    g = torch.Generator().manual_seed(0)
    group = trainer.optimizer.param_groups[0]
    opt = torch.optim.AdamW(
        other.parameters(), lr=1e-3, betas=group["betas"], eps=group["eps"], weight_decay=0.1, foreach=True
    )
    for step in range(3):
        for p, q in zip(trainer.model.parameters(), other.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=g) * (step + 1)
            q.grad = p.grad.clone()
        trainer.optimizer.step()
        opt.step()
    for (name, p), q in zip(trainer.model.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-7, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_a_checkpoint_restores_the_python_numpy_and_torch_rng_exactly(tiny_model_dir, tmp_path):
    """save → draw → load → draw: the second draws are the uninterrupted run's, bit for bit, for Python's random,
    numpy's global generator and torch's CPU generator (CUDA's too where there is a GPU); a checkpoint written
    before the Python/numpy state was saved (torch's CPU state alone) still restores torch's."""
    trainer = TorchTrainer(trainer_config(), tiny_model_dir)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    trainer.save_checkpoint(tmp_path / "ckpt")
    uninterrupted = _draws()
    cuda = torch.rand(4, device="cuda").tolist() if torch.cuda.is_available() else None
    assert uninterrupted == (
        random.Random(1).random(),
        float(np.random.RandomState(2).rand()),
        torch.rand(3, generator=torch.Generator().manual_seed(3)).tolist(),
    )
    _draws()  # the generators move on
    trainer.load_checkpoint(tmp_path / "ckpt")
    assert _draws() == uninterrupted
    if cuda is not None:
        assert torch.rand(4, device="cuda").tolist() == cuda
    state = torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=False)
    expected_keys = ["numpy", "python", "torch"] + (["cuda"] if cuda is not None else [])
    assert sorted(state["rng"]) == sorted(expected_keys)
    torch.manual_seed(3)
    old = {"steps_done": 0, "rng": torch.get_rng_state()}  # the earlier format
    torch.save(old, tmp_path / "ckpt" / "trainer_state.pt")
    torch.rand(5)
    trainer.load_checkpoint(tmp_path / "ckpt")
    assert torch.rand(3).tolist() == uninterrupted[2]

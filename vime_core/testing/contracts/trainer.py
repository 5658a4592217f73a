"""Contract of trainer backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vime_core.testing.contracts.base import _Contract
from vime_core.types import RolloutBatch, Sample, Status


class TrainerBackendContract(_Contract):
    """Contract of ``vime_register_trainer_backends`` providers.

    Fixture to supply: ``trainer`` — a backend instance on a small model, built with ``lr`` large enough that
    one step visibly changes log-probs, ``global_batch_size=None`` and ``weight_decay=0``. Also ``tmp_path``.
    """

    @staticmethod
    def make_batch(vocab: int, advantage: float) -> RolloutBatch:
        g = torch.Generator().manual_seed(1)
        samples, advs = [], []
        for i in range(2):
            prompt = torch.randint(0, vocab, (5,), generator=g).tolist()
            s = Sample(group_index=0, index=i, tokens=prompt, status=Status.COMPLETED, reward=1.0)
            resp = torch.randint(0, vocab, (4,), generator=g).tolist()
            s.append_response_tokens(resp, trainable=True, log_probs=[-1.0] * 4, weight_version=0)
            samples.append(s)
            advs.append([advantage] * 4)
        return RolloutBatch(samples=samples, advantages=advs)

    def _vocab(self, trainer: Any) -> int:
        return int(dict(trainer.named_hf_tensors())["model.embed_tokens.weight"].shape[0])

    def _lp(self, trainer: Any, batch: RolloutBatch) -> float:
        from vime_core.algorithms.logprobs import token_log_probs

        tot = 0.0
        for s in batch.samples:
            ids = torch.tensor([s.tokens])
            with torch.no_grad():
                lp = token_log_probs(trainer.model(input_ids=ids).logits, ids)[0, s.prompt_length - 1 :]
            tot += float(lp.sum())
        return tot

    def test_hf_tensor_names(self, trainer: Any) -> None:
        names = [n for n, _ in trainer.named_hf_tensors()]
        assert "model.embed_tokens.weight" in names and len(names) == len(set(names))

    def test_zero_advantage_changes_nothing(self, trainer: Any) -> None:
        before = {n: t.clone() for n, t in trainer.named_hf_tensors()}
        trainer.train_step(self.make_batch(self._vocab(trainer), 0.0))
        after = dict(trainer.named_hf_tensors())
        assert all(torch.equal(before[n], after[n]) for n in before)

    def test_positive_advantage_raises_log_probs(self, trainer: Any) -> None:
        batch = self.make_batch(self._vocab(trainer), 1.0)
        before = self._lp(trainer, batch)
        metrics = trainer.train_step(batch)
        assert self._lp(trainer, batch) > before
        assert "train/pg_loss" in metrics and "train/grad_norm" in metrics

    def test_checkpoint_round_trip(self, trainer: Any, tmp_path: Path) -> None:
        trainer.save_checkpoint(tmp_path / "ck")
        saved = {n: t.clone() for n, t in trainer.named_hf_tensors()}
        trainer.train_step(self.make_batch(self._vocab(trainer), 1.0))
        trainer.load_checkpoint(tmp_path / "ck")
        now = dict(trainer.named_hf_tensors())
        assert all(torch.equal(saved[n], now[n]) for n in saved)

"""The contract-test kit: pytest base classes every plugin (ours and third parties') runs against itself.

Usage (in a plugin's ``tests/``)::

    from vime_core.testing import RewardFunctionContract

    class TestMyReward(RewardFunctionContract):
        @pytest.fixture
        def reward_fn(self):
            return my_reward

        @pytest.fixture
        def cases(self):
            return [(Sample(response="42", label="42"), 1.0), (Sample(response="7", label="42"), 0.0)]

Rules:

* A subclass supplies the fixtures a contract documents; it may declare ``capabilities`` (a set of strings) that
  turn inapplicable tests into **skips with a reason** — never silent drops.
* A subclass must not override or delete a contract test; to opt out it marks an override
  ``@pytest.mark.xfail(reason=...)``. ``test_no_overrides`` enforces this (langchain-tests' rule).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from vime_core.types import RolloutBatch, Sample, Status

VALID_STATUSES = {Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED}


class _Contract:
    """Common machinery: capability skips and the no-override guard."""

    capabilities: ClassVar[set[str]] = set()

    def require(self, capability: str) -> None:
        """Skip (with the reason printed) unless the subclass declared ``capability``."""
        if capability not in self.capabilities:
            pytest.skip(f"{type(self).__name__} does not declare capability {capability!r}")

    def test_no_overrides(self) -> None:
        """Contract tests may be overridden only when marked ``xfail(reason=...)``."""
        base = next(c for c in type(self).__mro__ if c.__module__ == __name__ and c is not _Contract)
        for name, member in inspect.getmembers(base, inspect.isfunction):
            if not name.startswith("test_"):
                continue
            impl = getattr(type(self), name)
            if impl is not member:
                marks = [m for m in getattr(impl, "pytestmark", []) if m.name == "xfail" and m.kwargs.get("reason")]
                assert marks, f"{type(self).__name__}.{name} overrides a contract test without xfail(reason=...)"


# ---------------------------------------------------------------------------------------------------------------
class RewardFunctionContract(_Contract):
    """Contract of ``vime_register_reward_functions`` providers.

    Fixtures to supply: ``reward_fn`` (the async function) and ``cases``: a list of ``(Sample, expected)`` with
    exact expected values (float, or dict for dict rewards). Optional fixture ``reward_args`` (a Namespace).
    """

    @pytest.fixture
    def reward_args(self) -> argparse.Namespace:
        return argparse.Namespace()

    def test_is_async_with_args_sample(self, reward_fn: Any) -> None:
        assert inspect.iscoroutinefunction(reward_fn), "a reward function must be `async def reward(args, sample)`"
        params = list(inspect.signature(reward_fn).parameters)
        assert params[:2] == ["args", "sample"], f"parameters must start with (args, sample), got {params}"

    def test_exact_values(self, reward_fn: Any, cases: list[tuple[Sample, Any]], reward_args) -> None:
        assert cases, "supply at least one (sample, expected) case"
        for sample, expected in cases:
            got = asyncio.run(reward_fn(reward_args, sample))
            assert isinstance(got, (float, int, dict)), f"reward must be a float or dict, got {type(got).__name__}"
            assert got == pytest.approx(expected), f"{sample.response!r}: expected {expected}, got {got}"


# ---------------------------------------------------------------------------------------------------------------
class WeightSyncContract(_Contract):
    """Contract of ``vime_register_weight_sync_strategies`` providers.

    Fixture to supply: ``strategy`` (an instance ready to :meth:`push`/:meth:`read`). Capability
    ``"cleanup"``: :meth:`cleanup` removes what an update left behind.
    """

    @staticmethod
    def reference_tensors() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return {
            "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=g).to(torch.float16),
            "model.norm.weight": torch.tensor([1.0, -0.0, float("inf"), 1e-38] * 8),
            "buffer.int": torch.arange(10, dtype=torch.int64),
        }

    def test_round_trip_is_bit_exact(self, strategy: Any) -> None:
        sent = self.reference_tensors()
        update = strategy.push(iter(sent.items()), 1)
        got = strategy.read(update)
        assert sorted(got) == sorted(sent)
        for name, t in sent.items():
            r = got[name]
            assert r.dtype == t.dtype and r.shape == t.shape, name
            assert torch.equal(r.view(torch.uint8), t.contiguous().view(torch.uint8)), f"{name} differs bitwise"

    def test_version_bytes_seconds(self, strategy: Any) -> None:
        sent = self.reference_tensors()
        update = strategy.push(iter(sent.items()), 7)
        assert update.version == 7
        assert update.num_bytes >= sum(t.numel() * t.element_size() for t in sent.values()) or update.num_bytes > 0
        assert update.seconds >= 0.0

    def test_cleanup(self, strategy: Any) -> None:
        self.require("cleanup")
        update = strategy.push(iter(self.reference_tensors().items()), 2)
        strategy.cleanup(update)
        with pytest.raises(Exception):  # noqa: B017 - any error: the update is gone
            strategy.read(update)


# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
class GenerateFunctionContract(_Contract):
    """Contract of ``vime_register_generate_functions`` providers (needs a running rollout context).

    Fixtures to supply: ``generate_fn``, ``generate_args`` (a Namespace with what the function reads),
    ``prompt_sample`` (a fresh :class:`Sample`) and ``rollout_context`` (an installed
    :class:`vime_core.rollout.context.RolloutContext`, e.g. a real router client + tokenizer).
    """

    def _run(self, generate_fn, generate_args, sample, params) -> list[Sample]:
        out = asyncio.run(generate_fn(generate_args, sample, params))
        return out if isinstance(out, list) else [out]

    def test_signature(self, generate_fn: Any) -> None:
        assert inspect.iscoroutinefunction(generate_fn)
        assert list(inspect.signature(generate_fn).parameters)[:3] == ["args", "sample", "sampling_params"]

    def test_sample_bookkeeping(self, generate_fn, generate_args, prompt_sample, rollout_context) -> None:
        params = {"temperature": 1.0, "max_tokens": 8}
        for s in self._run(generate_fn, generate_args, prompt_sample, params):
            s.validate()
            assert s.status in VALID_STATUSES
            assert len(s.loss_mask) == s.response_length == len(s.rollout_log_probs) == len(s.weight_versions)
            assert 1 <= s.response_length <= 8 or s.status in (Status.ABORTED, Status.FAILED)
            assert all(lp <= 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m)
            assert all(v == rollout_context.weight_version for v, m in zip(s.weight_versions, s.loss_mask) if m)

    def test_tokens_are_prompt_plus_response(self, generate_fn, generate_args, prompt_sample, rollout_context):
        from vime_core.rollout.generate import encode_prompt

        prompt_ids = encode_prompt(rollout_context.tokenizer, prompt_sample.prompt,
                                   getattr(generate_args, "apply_chat_template", True))
        for s in self._run(generate_fn, generate_args, prompt_sample, {"temperature": 1.0, "max_tokens": 4}):
            assert s.tokens[: s.prompt_length] == prompt_ids

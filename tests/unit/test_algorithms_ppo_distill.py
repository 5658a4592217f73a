"""PPO with a critic and on-policy distillation: exact values of the estimators and of the batch-level GAE step, the
critic's value positions, that its loss falls on a fixed batch, and that a checkpoint restores it."""

import pytest
import torch

from tests.support.samples import random_samples
from vime_core.algorithms.batch import build_batch, gae_advantages
from vime_core.algorithms.distill import distill_advantages
from vime_core.algorithms.options import check_algorithm_config
from vime_core.builtins import advantages as est
from vime_core.cli.arguments import ArgumentError, parse_run_args
from vime_core.config.context import PluginContext
from vime_core.plugins.manager import get_plugins
from vime_core.testing.plugin_context import plugin_context, run_config
from vime_core.testing.trainer_args import trainer_config
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit

BASE = ["--model", "m", "--prompt-data", "d.jsonl"]


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def _algo(**kw):
    return run_config(**kw).algorithm


def _sample(reward, mask, *, rollout=None, teacher=None, index=0, prompt=(1, 2)):
    s = Sample(index=index, tokens=list(prompt), status=Status.COMPLETED, reward=reward)
    n = len(mask)
    s.append_response_tokens(
        [5 + i for i in range(n)], trainable=True, log_probs=rollout or [-0.1] * n, weight_version=0
    )
    s.loss_mask = list(mask)
    s.teacher_log_probs = teacher
    return s


# ---------------------------------------------------------------------------------------------------- flags
def test_flags_and_their_errors():
    args = parse_run_args(
        BASE + ["--advantage-estimator", "ppo", "--critic-lr", "1e-5", "--num-critic-only-steps", "2"]
    )
    assert (args.critic_lr, args.num_critic_only_steps, args.critic_load) == (1e-5, 2, None)
    with pytest.raises(ArgumentError, match="--critic-lr has no effect without --advantage-estimator ppo"):
        parse_run_args(BASE + ["--critic-lr", "1e-5"])
    with pytest.raises(ValueError, match="--critic-load has no effect without --advantage-estimator ppo"):
        check_algorithm_config(_algo(critic_load="x"))
    with pytest.raises(ValueError, match="--num-critic-only-steps must be >= 0"):
        check_algorithm_config(_algo(advantage_estimator="ppo", num_critic_only_steps=-1))
    with pytest.raises(ArgumentError, match="on_policy_distill needs --distill-teacher PATH"):
        parse_run_args(BASE + ["--advantage-estimator", "on_policy_distill"])
    args = parse_run_args(BASE + ["--advantage-estimator", "on_policy_distill", "--distill-teacher", "t"])
    assert (args.distill_teacher, args.distill_coef, args.distill_num_engines) == ("t", 1.0, 1)
    # KL reward shaping is allowed for ppo (it shapes the per-token rewards before GAE)
    check_algorithm_config(_algo(advantage_estimator="ppo", kl_coef=0.1))
    assert get_plugins().resolve("advantage", "ppo") is est.ppo
    assert get_plugins().resolve("advantage", "on_policy_distill") is est.on_policy_distill


# ---------------------------------------------------------------------------------------------------- PPO
def test_ppo_estimator_gives_raw_reward_on_the_last_trained_token():
    group = [_sample(2.0, [1, 1, 0]), _sample(-1.0, [0, 1, 1, 0, 0]), _sample(5.0, [0, 0])]
    assert est.ppo(plugin_context(advantage_estimator="ppo"), group) == [
        [0.0, 2.0, 0.0],
        [0.0, 0.0, -1.0, 0.0, 0.0],
        [0.0, 0.0],
    ]
    with pytest.raises(ValueError, match="has no reward"):
        est.ppo(plugin_context(), [_sample(None, [1])])


def test_gae_advantages_hand_computed_with_masks_kl_and_whitening():
    # sample A: mask [1, 0, 1], rewards [0, 0, 1], V = [0.5, 9.0, 0.7], γ = 0.9, λ = 0.8 (the masked token is skipped)
    #   A2 = 1 - 0.7 = 0.3; A0 = (0.9·0.7 - 0.5) + 0.72·0.3 = 0.346; R = A + V = [0.846, 0, 1.0]
    # sample B: mask [1, 1], rewards [0, -1], V = [0.2, -0.4]
    #   A1 = -1 + 0.4 = -0.6; A0 = (0.9·-0.4 - 0.2) + 0.72·-0.6 = -0.56 - 0.432 = -0.992; R = [-0.792, -1.0]
    samples = [_sample(1.0, [1, 0, 1]), _sample(-1.0, [1, 1])]
    rewards = [_t([0.0, 0.0, 1.0]), _t([0.0, -1.0])]
    values = [_t([0.5, 9.0, 0.7]), _t([0.2, -0.4])]
    algo = _algo(advantage_estimator="ppo", gamma=0.9, lambd=0.8)
    adv, ret, m = gae_advantages(algo, samples, rewards, values)
    assert adv[0].tolist() == pytest.approx([0.346, 0.0, 0.3], abs=1e-6)
    assert adv[1].tolist() == pytest.approx([-0.992, -0.6], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([0.846, 0.0, 1.0], abs=1e-6)
    assert ret[1].tolist() == pytest.approx([-0.792, -1.0], abs=1e-6)
    assert m["adv/mean"] == pytest.approx((0.346 + 0.3 - 0.992 - 0.6) / 4, abs=1e-6)
    assert m["critic/values_mean"] == pytest.approx((0.5 + 0.7 + 0.2 - 0.4) / 4, abs=1e-6)  # masked 9.0 left out
    # KL shaping: r_t - β·KL_t per token before GAE. β = 0.5, KL_B = [0.2, 0.4] → rewards_B = [-0.1, -1.2]
    #   A1 = -1.2 + 0.4 = -0.8; A0 = (-0.1 - 0.36 - 0.2) + 0.72·-0.8 = -0.66 - 0.576 = -1.236
    kl = [_t([0.0, 123.0, 0.0]), _t([0.2, 0.4])]  # the masked token's KL never matters
    adv, _, m = gae_advantages(
        _algo(advantage_estimator="ppo", gamma=0.9, lambd=0.8, kl_coef=0.5), samples, rewards, values, kl=kl
    )
    assert adv[1].tolist() == pytest.approx([-1.236, -0.8], abs=1e-6)
    assert adv[0].tolist() == pytest.approx([0.346, 0.0, 0.3], abs=1e-6)
    assert m["adv/kl_shaping_mean"] == pytest.approx(0.5 * 0.6 / 4, abs=1e-6)
    with pytest.raises(ValueError, match="--kl-coef is non-zero but no per-token KL"):
        gae_advantages(_algo(advantage_estimator="ppo", kl_coef=0.5), samples, rewards, values)
    # --normalize-advantages whitens over the trained tokens; returns stay unwhitened
    adv, ret, _ = gae_advantages(
        _algo(advantage_estimator="ppo", gamma=0.9, lambd=0.8, normalize_advantages=True), samples, rewards, values
    )
    picked = torch.tensor([0.346, 0.3, -0.992, -0.6], dtype=torch.float64)
    expected = ((picked - picked.mean()) / torch.sqrt(picked.var(unbiased=True) + 1e-8)).tolist()
    assert [adv[0][0], adv[0][2], adv[1][0], adv[1][1]] == pytest.approx(expected, abs=1e-6) and adv[0][1] == 0.0
    assert ret[1].tolist() == pytest.approx([-0.792, -1.0], abs=1e-6)


def test_all_masked_response_gives_zeros_not_nan():
    s = _sample(1.0, [0, 0])
    adv, ret, _ = gae_advantages(_algo(advantage_estimator="ppo"), [s], [_t([0.0, 0.0])], [_t([float("nan")] * 2)])
    assert adv[0].tolist() == [0.0, 0.0] and ret[0].tolist() == [0.0, 0.0]


# ---------------------------------------------------------------------------------------------------- distillation
def test_distill_advantages_hand_computed():
    # teacher - student per trained token, times λ; masked tokens 0 whatever they hold
    assert distill_advantages([-1.0, -2.0, float("nan"), -0.5], [-1.5, -1.0, -3.0, -0.5], [1, 1, 0, 1]) == [
        0.5,
        -1.0,
        0.0,
        0.0,
    ]
    assert distill_advantages([-1.0, -2.0], [-1.5, -1.0], [1, 1], coef=0.5) == [0.25, -0.5]
    with pytest.raises(ValueError, match="2 teacher log-probs, 3 student log-probs, 3 mask entries"):
        distill_advantages([-1.0, -2.0], [-1.0, -1.0, -1.0], [1, 1, 1])
    with pytest.raises(ValueError, match="non-finite log-prob at token 1"):
        distill_advantages([-1.0, float("-inf")], [-1.0, -1.0], [1, 1])


def test_on_policy_distill_estimator_and_grpo_combination():
    a = _sample(1.0, [1, 1, 0], rollout=[-0.5, -2.0, 0.0], teacher=[-0.25, -1.0, -7.0], index=0)
    b = _sample(0.0, [1, 1, 1], rollout=[-1.0, -1.0, -1.0], teacher=[-1.0, -3.0, -0.5], index=1)
    ctx = plugin_context(advantage_estimator="on_policy_distill", distill_teacher="t", distill_coef=2.0)
    batch = build_batch(ctx, [[a, b]], est.on_policy_distill)
    assert batch.advantages == [[0.5, 2.0, 0.0], [0.0, -4.0, 1.0]]
    # mean over trained tokens of logπ_s - logπ_T: (-0.25 - 1.0 + 0 + 2.0 - 0.5) / 5
    assert batch.metrics["rollout/distill_reverse_kl"] == pytest.approx(0.25 / 5)
    # GRPO + distillation: the GRPO advantage (±1/√2 for rewards 1, 0) plus λ·(teacher - student) per token
    ctx = plugin_context(advantage_estimator="grpo", distill_teacher="t", distill_coef=1.0)
    batch = build_batch(ctx, [[a, b]], est.grpo)
    g = 0.5 / (0.7071067811865476 + 1e-6)
    assert batch.advantages[0] == pytest.approx([g + 0.25, g + 1.0, g])
    assert batch.advantages[1] == pytest.approx([-g, -g - 2.0, -g + 0.5])
    # a teacher run whose sample was not scored fails naming the flag
    a.teacher_log_probs = None
    with pytest.raises(ValueError, match="has no teacher_log_probs.*--distill-teacher"):
        build_batch(ctx, [[a, b]], est.grpo)


def test_teacher_log_probs_round_trip_and_validation():
    s = _sample(1.0, [1, 1], teacher=[-0.1, -0.2])
    assert Sample.from_dict(s.to_dict()).teacher_log_probs == [-0.1, -0.2]
    s.teacher_log_probs = [-0.1]
    with pytest.raises(ValueError, match="len\\(teacher_log_probs\\)=1 != response_length=2"):
        s.validate()


# ---------------------------------------------------------------------------------------------------- critic


def test_critic_values_batched_equal_unpadded_forward(tiny_model_dir):
    from vime_core.trainer.critic import Critic

    cfg = trainer_config(advantage_estimator="ppo")
    critic = Critic(
        cfg.trainer,
        cfg.algorithm,
        tiny_model_dir,
        torch.device("cpu"),
        torch.float32,
    )
    samples = random_samples()
    batched = critic.model.response_values(samples, torch.device("cpu"))
    with torch.no_grad():
        for s, v in zip(samples, batched, strict=True):
            hidden = critic.model.backbone(input_ids=torch.tensor([s.tokens])).last_hidden_state[0]
            # V_t comes from the state one position before response token t
            ref = critic.model.value_head(hidden[s.prompt_length - 1 : len(s.tokens) - 1]).squeeze(-1)
            assert v.shape == (s.response_length,)
            torch.testing.assert_close(v.detach(), ref, atol=1e-5, rtol=0)


def test_critic_loss_decreases_on_a_fixed_batch_and_checkpoint_restores_it(tiny_model_dir, tmp_path):
    from vime_core.trainer.torch_backend import TorchTrainer

    # γ = λ = 1: the value targets are the Monte-Carlo returns, fixed whatever the critic predicts
    flags = dict(
        advantage_estimator="ppo", critic_lr=3e-3, num_critic_only_steps=100, gamma=1.0, lambd=1.0, value_clip=10.0
    )
    cfg = trainer_config(**flags)
    trainer = TorchTrainer(cfg, tiny_model_dir)
    policy_before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    batch = build_batch(PluginContext(cfg), [random_samples()], est.ppo)
    losses = []
    for _ in range(6):
        m = trainer.train_step(batch)
        losses.append(m["train/value_loss"])
        assert m["train/critic_only"] == 1.0 and "train/pg_loss" not in m
    assert losses[-1] < 0.25 * losses[0], losses
    # critic-only steps leave the policy untouched
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in policy_before.items())

    trainer.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "critic" / "value_head.safetensors").is_file()
    fresh = TorchTrainer(cfg, tiny_model_dir)
    fresh.load_checkpoint(tmp_path / "ckpt")
    for (k, v), (k2, v2) in zip(
        trainer.critic.model.state_dict().items(), fresh.critic.model.state_dict().items(), strict=True
    ):
        assert k == k2 and torch.equal(v, v2), k
    assert (
        fresh.critic.optimizer.state_dict()["state"][0]["step"]
        == trainer.critic.optimizer.state_dict()["state"][0]["step"]
    )
    # the restored critic continues exactly where the saved one stops
    assert fresh.train_step(batch)["train/value_loss"] == pytest.approx(
        trainer.train_step(batch)["train/value_loss"], abs=1e-6
    )
    # --critic-load of a saved critic directory loads its value head too
    loaded = TorchTrainer(trainer_config(**flags, critic_load=str(tmp_path / "ckpt" / "critic")), tiny_model_dir)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "ckpt" / "critic" / "value_head.safetensors"))
    assert torch.equal(loaded.critic.model.value_head.weight.detach(), saved["weight"])


def test_ppo_updates_policy_with_gae_advantages(tiny_model_dir):
    from vime_core.trainer.torch_backend import TorchTrainer

    cfg = trainer_config(advantage_estimator="ppo", gamma=1.0, lambd=0.95)
    trainer = TorchTrainer(cfg, tiny_model_dir)
    samples = random_samples()
    values = trainer.critic.values(samples, 8)
    batch = build_batch(PluginContext(cfg), [samples], est.ppo)
    expected, _, _ = gae_advantages(
        trainer.algorithm_config, samples, [_t(a) for a in batch.advantages], [values[id(s)] for s in samples]
    )
    m = trainer.train_step(batch)
    assert m["train/critic_only"] == 0.0 and "train/pg_loss" in m and "train/value_loss" in m
    picked = torch.cat(expected)[torch.cat([_t(s.loss_mask) for s in samples]).bool()].double()
    assert m["train/adv/mean"] == pytest.approx(float(picked.mean()), abs=1e-6)

"""Exact, hand-computed values for the algorithm menu: estimators, GAE, value loss, KL, loss terms, IS, drift."""

import math

import pytest
import torch

from vime_core.algorithms.advantages import discounted_returns, masked_whiten, outcome_returns, rloo_advantages
from vime_core.algorithms.batch import build_batch, postprocess_advantages
from vime_core.algorithms.filters import check_reward_nonzero_std
from vime_core.algorithms.gae import gae, value_loss
from vime_core.algorithms.kl import approx_kl
from vime_core.algorithms.logprobs import token_log_probs_and_entropy
from vime_core.algorithms.mismatch import LogprobDriftError, check_logprob_drift, importance_weights
from vime_core.algorithms.options import check_algorithm_config
from vime_core.algorithms.policy_loss import policy_loss, policy_loss_kwargs
from vime_core.builtins import advantages as est
from vime_core.cli.arguments import ArgumentError, default_args, parse_run_args
from vime_core.config import AlgorithmConfig
from vime_core.testing.plugin_context import plugin_context
from vime_core.testing.trainer_args import trainer_config
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit

BASE = ["--model", "m", "--prompt-data", "d.jsonl"]


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def _ns(**kw):
    return plugin_context(**kw)


def _algo(**kw):
    return AlgorithmConfig.from_args(default_args(**kw))


def _sample(reward, mask=(1, 1), episode_id=None, status=Status.COMPLETED, index=0):
    s = Sample(index=index, tokens=[1, 2], status=status, reward=reward, episode_id=episode_id)
    s.append_response_tokens([5] * len(mask), trainable=True, log_probs=[-0.1] * len(mask), weight_version=0)
    s.loss_mask = list(mask)
    return s


# ---------------------------------------------------------------------------------------------------- options
def test_only_one_kl_may_be_non_zero():
    argv = BASE + ["--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.1", "--use-kl-loss"]
    with pytest.raises(
        ArgumentError,
        match=r"--kl-coef 0.1 \(KL as reward shaping\) and --use-kl-loss --kl-loss-coef "
        r"0.01 \(KL as a loss term\) are both non-zero; use only one",
    ):
        parse_run_args(argv + ["--kl-loss-coef", "0.01"])
    # KL loss at coefficient 0 is a metric only, so it may sit next to reward shaping
    assert parse_run_args(argv).kl_coef == 0.1


def test_kl_and_is_flag_errors_name_the_flags():
    with pytest.raises(ValueError, match="--kl-loss-coef 0.1 has no effect without --use-kl-loss"):
        check_algorithm_config(_algo(kl_loss_coef=0.1))
    with pytest.raises(ValueError, match="--advantage-estimator grpo does not have .* use --use-kl-loss"):
        check_algorithm_config(_algo(kl_coef=0.1))
    with pytest.raises(ValueError, match="--use-tis .* and --use-mis .* exclude each other"):
        check_algorithm_config(_algo(use_tis=True, use_mis=True))
    with pytest.raises(ValueError, match="--eps-clip-c must be > 1"):
        check_algorithm_config(_algo(eps_clip_c=1.0))
    with pytest.raises(ValueError, match="--critic-lr has no effect without --advantage-estimator ppo"):
        check_algorithm_config(_algo(critic_lr=1e-5))
    with pytest.raises(ArgumentError, match="need 0 <= --tis-clip-low < --tis-clip, got 2.0 and 2.0"):
        parse_run_args(BASE + ["--tis-clip-low", "2"])


def test_policy_loss_kwargs_from_flags():
    kw = policy_loss_kwargs(_algo(advantage_estimator="gspo", use_mis=True, use_kl_loss=True, kl_loss_coef=0.5))
    assert (kw["ratio_type"], kw["importance_sampling"], kw["kl_loss_coef"]) == ("sequence", "mis", 0.5)
    # the flags' defaults give plain PPO-clip
    kw = policy_loss_kwargs(_algo(eps_clip=0.1))
    assert kw["eps_clip"] == 0.1 and kw["ratio_type"] == "token" and kw["importance_sampling"] is None


# ------------------------------------------------------------------------------------------------- estimators
def test_estimators_are_registered():
    from vime_core.plugins.manager import Plugins

    names = Plugins().load().registries["advantage"].names()
    assert {"grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"} <= set(names)


def test_rloo_hand_computed():
    # k = 4, sum = 1.5: A_i = r_i - (1.5 - r_i) / 3
    assert rloo_advantages([1.0, 0.0, 0.0, 0.5]) == pytest.approx([1 - 0.5 / 3, -0.5, -0.5, 0.5 - 1 / 3], abs=1e-15)
    group = [_sample(1.0), _sample(0.0), _sample(0.0), _sample(0.5)]
    assert est.rloo(_ns(), group)[0] == pytest.approx([5 / 6, 5 / 6])
    assert est.rloo(_ns(), group)[3] == pytest.approx([1 / 6, 1 / 6])


@pytest.mark.parametrize("name", ["grpo", "gspo", "rloo", "reinforce_plus_plus_baseline"])
def test_baseline_estimators_all_equal_and_group_of_one_are_exact_zeros(name):
    fn = getattr(est, name)
    assert fn(_ns(), [_sample(0.7), _sample(0.7), _sample(0.7)]) == [[0.0, 0.0]] * 3
    assert fn(_ns(), [_sample(1.0, mask=(1, 1, 1))]) == [[0.0, 0.0, 0.0]]


@pytest.mark.parametrize("name", ["grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_estimators_refuse_nan_reward(name):
    with pytest.raises(ValueError, match=r"has no reward \(got nan\)"):
        getattr(est, name)(_ns(), [_sample(1.0), _sample(float("nan"))])


def test_rloo_pure_function_edge_cases():
    assert rloo_advantages([2.0]) == [0.0]
    with pytest.raises(ValueError, match="non-finite"):
        rloo_advantages([1.0, float("inf")])
    with pytest.raises(ValueError, match="at least one"):
        rloo_advantages([])


def test_fan_out_counts_each_rollout_once():
    # slime PR #2300's example: rollout "a" (reward 1) fans out into 3 samples, rollout "b" (reward 0) into 1.
    # Dr.GRPO over the two rollouts: mean 0.5 → [0.5, 0.5, 0.5, -0.5] (not a baseline of 0.75).
    group = [
        _sample(1.0, episode_id="a"),
        _sample(1.0, episode_id="a"),
        _sample(1.0, episode_id="a"),
        _sample(0.0, episode_id="b"),
    ]
    adv = est.grpo(_ns(disable_grpo_std_normalization=True), group)
    assert [a[0] for a in adv] == [0.5, 0.5, 0.5, -0.5]
    std = math.sqrt(0.5)  # unbiased std of [1, 0]
    assert est.grpo(_ns(), group)[0][0] == pytest.approx(0.5 / (std + 1e-6), rel=1e-12)
    assert [a[0] for a in est.rloo(_ns(), group)] == [1.0, 1.0, 1.0, -1.0]
    with pytest.raises(ValueError, match="episode 'a': its segments have different rewards 1.0 and 0.0"):
        est.grpo(_ns(), [_sample(1.0, episode_id="a"), _sample(0.0, episode_id="a")])


def test_reinforce_plus_plus_discounted_outcome_return():
    # mask [1, 1, 0, 1], reward 2, γ = 0.5; steps are trained tokens: G3 = 2, G1 = 0.5·2 = 1, G0 = 0.5·1 = 0.5
    assert outcome_returns(2.0, [1, 1, 0, 1], 0.5) == [0.5, 1.0, 0.0, 2.0]
    group = [_sample(2.0, mask=(1, 1, 0, 1)), _sample(-1.0, mask=(0, 0))]
    assert est.reinforce_plus_plus(_ns(gamma=0.5), group) == [[0.5, 1.0, 0.0, 2.0], [0.0, 0.0]]
    assert est.reinforce_plus_plus(_ns(), [_sample(1.0, mask=(1, 0, 1))]) == [[1.0, 0.0, 1.0]]  # γ = 1


def test_reinforce_plus_plus_baseline_group_part():
    # rewards [3, 1] → mean 2 → [1, -1]; γ = 0.5 over masks [1, 1, 1] and [1, 0]
    group = [_sample(3.0, mask=(1, 1, 1)), _sample(1.0, mask=(1, 0))]
    assert est.reinforce_plus_plus_baseline(_ns(gamma=0.5), group) == [[0.25, 0.5, 1.0], [-1.0, 0.0]]


def test_discounted_returns_skip_masked_tokens():
    # KL penalties -β·KL with β = 0.1, KL = [0.2, -0.4, 5.0 (masked), 1.0], γ = 0.5:
    # G3 = -0.1, G1 = 0.04 + 0.5·(-0.1) = -0.01, G0 = -0.02 + 0.5·(-0.01) = -0.025
    assert discounted_returns([-0.02, 0.04, -0.5, -0.1], [1, 1, 0, 1], 0.5) == pytest.approx(
        [-0.025, -0.01, 0.0, -0.1], abs=1e-15
    )
    with pytest.raises(ValueError, match="3 token rewards but 2 mask entries"):
        discounted_returns([0.0, 0.0, 0.0], [1, 1], 1.0)


def test_batch_whitening_hand_computed():
    # trained values [0.5, 1.0, 2.0, -1.0]: mean 0.625, unbiased var 4.6875 / 3 = 1.5625, std 1.25
    out = masked_whiten([_t([0.5, 1.0, 9.0, 2.0]), _t([-1.0])], [_t([1, 1, 0, 1]), _t([1])])
    assert out[0].tolist() == pytest.approx([-0.1, 0.3, 0.0, 1.1], abs=1e-7)
    assert out[1].tolist() == pytest.approx([-1.3], abs=1e-7)


def test_batch_whitening_degenerate_batches_are_zeros_not_nan():
    assert masked_whiten([_t([3.0, float("nan")])], [_t([0, 0])])[0].tolist() == [0.0, 0.0]  # all masked
    assert masked_whiten([_t([0.7, 0.7]), _t([0.7])], [_t([1, 1]), _t([1])])[1].tolist() == [0.0]  # all equal
    assert masked_whiten([_t([5.0])], [_t([1])])[0].tolist() == [0.0]  # one token
    assert masked_whiten([], []) == []


def test_postprocess_whitens_reinforce_plus_plus_over_the_batch():
    samples = [_sample(2.0, mask=(1, 1, 0, 1)), _sample(-1.0, mask=(1,))]
    advs, metrics = postprocess_advantages(
        _algo(advantage_estimator="reinforce_plus_plus"), samples, [_t([0.5, 1.0, 0.0, 2.0]), _t([-1.0])]
    )
    assert advs[0].tolist() == pytest.approx([-0.1, 0.3, 0.0, 1.1], abs=1e-7)
    assert advs[1].tolist() == pytest.approx([-1.3], abs=1e-7)
    assert metrics["adv/mean"] == pytest.approx(0.0, abs=1e-7)
    # grpo is left alone unless --normalize-advantages
    same, _ = postprocess_advantages(_algo(), samples, [_t([0.5, 1.0, 0.0, 2.0]), _t([-1.0])])
    assert same[0].tolist() == [0.5, 1.0, 0.0, 2.0]
    normed, _ = postprocess_advantages(
        _algo(normalize_advantages=True), samples, [_t([0.5, 1.0, 0.0, 2.0]), _t([-1.0])]
    )
    assert normed[1].tolist() == pytest.approx([-1.3], abs=1e-7)


def test_postprocess_kl_reward_shaping():
    # β = 0.5, γ = 1: KL [0.2, 0.4, 0.4] → penalties [-0.1, -0.2, -0.2] → returns [-0.5, -0.4, -0.2]
    samples = [_sample(1.0, mask=(1, 1, 1)), _sample(0.0, mask=(1, 1))]
    ns = _algo(advantage_estimator="my_estimator", kl_coef=0.5)  # not whitened, so the shaping shows alone
    advs, metrics = postprocess_advantages(
        ns, samples, [_t([1.0, 1.0, 1.0]), _t([-1.0, -1.0])], kl=[_t([0.2, 0.4, 0.4]), _t([0.0, 0.0])]
    )
    assert advs[0].tolist() == pytest.approx([0.5, 0.6, 0.8], abs=1e-7)
    assert advs[1].tolist() == [-1.0, -1.0]
    assert metrics["adv/kl_shaping_mean"] == pytest.approx(0.5 * 1.0 / 5)
    with pytest.raises(ValueError, match="no per-token KL"):
        postprocess_advantages(ns, samples, [_t([1.0, 1.0, 1.0]), _t([-1.0, -1.0])])


def test_build_batch_with_reinforce_plus_plus_all_masked_member_no_nan():
    g = [_sample(1.0, mask=(1, 1)), _sample(1.0, mask=(0, 0))]  # the second is not trainable (no trained token)
    batch = build_batch(
        _ns(advantage_estimator="reinforce_plus_plus"),
        [g],
        est.reinforce_plus_plus,
    )
    assert batch.advantages == [[1.0, 1.0]]
    advs, _ = postprocess_advantages(
        _algo(advantage_estimator="reinforce_plus_plus"), batch.samples, [_t(a) for a in batch.advantages]
    )
    assert advs[0].tolist() == [0.0, 0.0]  # all-equal values whiten to 0, not NaN


# ------------------------------------------------------------------------------------------------- filters
def test_check_reward_nonzero_std():
    ctx = plugin_context()
    assert check_reward_nonzero_std(ctx, [_sample(1.0), _sample(0.0)]) is True
    assert check_reward_nonzero_std(ctx, [_sample(1.0), _sample(1.0)]) is False
    assert check_reward_nonzero_std(ctx, [_sample(1.0)]) is False
    # a failed member is excluded, not scored 0
    assert check_reward_nonzero_std(ctx, [_sample(1.0), _sample(None, status=Status.FAILED), _sample(1.0)]) is False
    with pytest.raises(ValueError, match="has no reward"):
        check_reward_nonzero_std(ctx, [_sample(1.0), _sample(float("nan"))])


# ------------------------------------------------------------------------------------------------- GAE / critic
def test_gae_three_steps():
    # r = [0, 0, 1], V = [0.5, 0.6, 0.7], γ = 0.9, λ = 0.8 (γλ = 0.72)
    # δ2 = 1 - 0.7 = 0.3                      A2 = 0.3
    # δ1 = 0.9·0.7 - 0.6 = 0.03                A1 = 0.03 + 0.72·0.3 = 0.246
    # δ0 = 0.9·0.6 - 0.5 = 0.04                A0 = 0.04 + 0.72·0.246 = 0.21712
    adv, ret = gae([0.0, 0.0, 1.0], [0.5, 0.6, 0.7], gamma=0.9, lambd=0.8)
    assert adv == pytest.approx([0.21712, 0.246, 0.3], abs=1e-12)
    assert ret == pytest.approx([0.71712, 0.846, 1.0], abs=1e-12)
    # γ = λ = 1: A_t = sum of rewards - V_t (Monte Carlo)
    adv, ret = gae([0.0, 0.0, 1.0], [0.5, 0.6, 0.7], gamma=1.0, lambd=1.0)
    assert adv == pytest.approx([0.5, 0.4, 0.3], abs=1e-12) and ret == pytest.approx([1.0, 1.0, 1.0], abs=1e-12)


def test_gae_skips_masked_tokens():
    # middle token masked: step 0's next value is V2 = 0.7: δ0 = 0.9·0.7 - 0.5 = 0.13, A0 = 0.13 + 0.72·0.3 = 0.346
    adv, ret = gae([0.0, 123.0, 1.0], [0.5, 9.0, 0.7], gamma=0.9, lambd=0.8, mask=[1, 0, 1])
    assert adv == pytest.approx([0.346, 0.0, 0.3], abs=1e-12)
    assert ret == pytest.approx([0.846, 0.0, 1.0], abs=1e-12)


def test_value_loss_clipping_hand_computed():
    # token 0: V-Vold = 0.5 → Vclip = 0.7: max((0.7-2)², (1-2)²) = 1.69 (clipped, no gradient)
    # token 1: V-Vold = -0.5 → Vclip = 0.3: max(0.09, 0) = 0.09 (clipped, no gradient)
    # token 2: inside the clip: (0.6-1)² = 0.16, gradient 2·(0.6-1) = -0.8
    v = _t([1.0, 0.0, 0.6]).requires_grad_()
    v_masked = _t([float("nan")]).requires_grad_()
    out = value_loss(
        [v, v_masked],
        [_t([0.5, 0.5, 0.5]), _t([0.0])],
        [_t([2.0, 0.0, 1.0]), _t([1.0])],
        [_t([1, 1, 1]), _t([0])],
        value_clip=0.2,
    )
    assert float(out.loss.detach()) == pytest.approx((1.69 + 0.09 + 0.16) / 3, abs=1e-6)
    assert out.metrics["value_clipfrac"] == pytest.approx(2 / 3)
    out.loss.backward()
    assert v.grad.tolist() == pytest.approx([0.0, 0.0, -0.8 / 3], abs=1e-6)
    assert v_masked.grad.tolist() == [0.0]


# ------------------------------------------------------------------------------------------------- KL
LP, REF = [-1.0, -2.0, -3.0], [-1.5, -1.0, 2.0]  # log ratio logp - ref = [0.5, -1, -5]


@pytest.mark.parametrize(
    "kl_type, expected",
    [
        ("k1", [0.5, -1.0, -5.0]),
        ("k2", [0.125, 0.5, 12.5]),
        # exp(ref - logp) - 1 - (ref - logp) with ref - logp = [-0.5, 1, 5]
        ("k3", [0.1065306597126334, 0.7182818284590451, 142.4131591025766]),
        ("low_var_kl", [0.1065306597126334, 0.7182818284590451, 10.0]),
    ],
)
def test_kl_estimators(kl_type, expected):
    assert approx_kl(_t(LP), _t(REF), kl_type).tolist() == pytest.approx(expected, rel=1e-6)


def test_kl_unknown_type():
    with pytest.raises(ValueError, match="unknown KL type 'k4'; known: k1, k2, k3, low_var_kl"):
        approx_kl(_t(LP), _t(REF), "k4")


def test_kl_loss_term_value_and_gradient():
    # adv 0 → pg 0; k1 mean over 2 tokens = (0.5 - 1) / 2 = -0.25; loss = 0.1·(-0.25); d/dlogp = 0.1 / 2
    lp = _t([-1.0, -2.0]).requires_grad_()
    out = policy_loss(
        [lp],
        [_t([-1.0, -2.0])],
        [_t([0.0, 0.0])],
        [_t([1, 1])],
        ref_log_probs=[_t([-1.5, -1.0])],
        kl_loss_coef=0.1,
        kl_loss_type="k1",
    )
    assert float(out.loss.detach()) == pytest.approx(-0.025, abs=1e-7)
    assert out.metrics["kl_loss"] == pytest.approx(-0.25)
    out.loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.05, 0.05], abs=1e-7)
    # coefficient 0: logged, no gradient
    lp0 = _t([-1.0, -2.0]).requires_grad_()
    out0 = policy_loss([lp0], [_t([-1.0, -2.0])], [_t([0.0, 0.0])], [_t([1, 1])], ref_log_probs=[_t([-1.5, -1.0])])
    assert out0.metrics["kl_loss"] == pytest.approx(-0.25) and float(out0.loss.detach()) == 0.0


# ------------------------------------------------------------------------------------------------- loss terms
def test_dual_clip_hand_computed():
    # eps 0.2, c = 3. token 0: A=-1, ρ=5: max(5, 1.2) = 5 → min(5, 3) = 3 (dual clip, no gradient)
    # token 1: A=-1, ρ=2: max(2, 1.2) = 2 < 3 (gradient ρ = 2). token 2: A=+1, ρ=5: max(-5, -1.2) = -1.2 (clipped)
    old = _t([0.0, 0.0, 0.0])
    lp = _t([math.log(5), math.log(2), math.log(5)]).requires_grad_()
    out = policy_loss(
        [lp], [old], [_t([-1.0, -1.0, 1.0])], [_t([1, 1, 1])], eps_clip=0.2, eps_clip_c=3.0, per_token=True
    )
    assert float(out.loss.detach()) == pytest.approx((3.0 + 2.0 - 1.2) / 3, abs=1e-6)
    assert out.metrics["pg_clipfrac"] == pytest.approx(1 / 3)
    assert out.metrics["pg_dual_clipfrac"] == pytest.approx(1 / 3)
    out.loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.0, 2 / 3, 0.0], abs=1e-6)
    # without dual clip token 0 would cost 5
    plain = policy_loss([lp.detach()], [old], [_t([-1.0, -1.0, 1.0])], [_t([1, 1, 1])], per_token=True)
    assert float(plain.loss) == pytest.approx((5.0 + 2.0 - 1.2) / 3, abs=1e-6)
    with pytest.raises(ValueError, match="must be > 1"):
        policy_loss([lp.detach()], [old], [_t([-1.0, -1.0, 1.0])], [_t([1, 1, 1])], eps_clip_c=0.9)


def test_entropy_bonus_per_sample_and_per_token():
    # adv 0 → pg 0. Entropies [0.5, 1.5] and [2.0]: per-sample mean (1.0 + 2.0) / 2 = 1.5, per-token 4 / 3
    ents = [_t([0.5, 1.5]).requires_grad_(), _t([2.0]).requires_grad_()]
    args = dict(
        log_probs=[_t([-1.0, -1.0]), _t([-1.0])],
        old_log_probs=[_t([-1.0, -1.0]), _t([-1.0])],
        advantages=[_t([0.0, 0.0]), _t([0.0])],
        loss_masks=[_t([1, 1]), _t([1])],
        entropy_coef=0.1,
    )
    out = policy_loss(**args, entropies=ents)
    assert float(out.loss.detach()) == pytest.approx(-0.15, abs=1e-7)
    assert out.metrics["entropy_loss"] == pytest.approx(1.5)
    out.loss.backward()
    assert ents[0].grad.tolist() == pytest.approx([-0.025, -0.025]) and ents[1].grad.tolist() == pytest.approx([-0.05])
    tok = policy_loss(**args, entropies=[e.detach() for e in ents], per_token=True)
    assert float(tok.loss) == pytest.approx(-0.1 * 4 / 3, abs=1e-7)


def test_token_entropy_from_logits():
    # position 0: logits [0, 0] → p = [0.5, 0.5], H = ln 2; position 1: [ln 3, 0] → p = [0.75, 0.25]
    logits = _t([[[0.0, 0.0], [math.log(3), 0.0], [0.0, -1e4]]]).requires_grad_()
    lp, ent = token_log_probs_and_entropy(logits, torch.tensor([[0, 1, 0]]))
    assert lp.tolist()[0] == pytest.approx([math.log(0.5), math.log(0.75)], abs=1e-6)
    assert ent.tolist()[0] == pytest.approx([math.log(2), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))], abs=1e-6)
    # a distribution with an underflowing probability has entropy 0 and a finite gradient
    logits2 = _t([[[0.0, -1e4], [0.0, 0.0]]]).requires_grad_()
    _, ent2 = token_log_probs_and_entropy(logits2, torch.tensor([[1, 0]]))
    assert ent2.tolist() == [[0.0]]
    ent2.sum().backward()
    assert torch.isfinite(logits2.grad).all()


def test_per_sample_vs_per_token_aggregation():
    # ratio 1: token losses -A. sample A: [-2] (1 token), sample B: [-1, -1, -1]
    args = dict(
        log_probs=[_t([-1.0]), _t([-1.0] * 3)],
        old_log_probs=[_t([-1.0]), _t([-1.0] * 3)],
        advantages=[_t([2.0]), _t([1.0] * 3)],
        loss_masks=[_t([1]), _t([1, 1, 1])],
    )
    assert float(policy_loss(**args).loss) == pytest.approx((-2.0 - 1.0) / 2)
    assert float(policy_loss(**args, per_token=True).loss) == pytest.approx(-5.0 / 4)


def test_gspo_sequence_ratio():
    # log ratios [ln 2, 0] → sequence ratio s = exp(ln 2 / 2) = √2; A = 1, band [0.5, 1.5] (no clip)
    old = _t([0.0, 0.0])
    lp = _t([math.log(2), 0.0]).requires_grad_()
    out = policy_loss([lp], [old], [_t([1.0, 1.0])], [_t([1, 1])], eps_clip=0.5, ratio_type="sequence")
    assert float(out.loss.detach()) == pytest.approx(-math.sqrt(2), abs=1e-6)
    out.loss.backward()
    assert lp.grad.tolist() == pytest.approx([-math.sqrt(2) / 2] * 2, abs=1e-6)  # d(-s)/dlogp_t = -s / |y|
    # token ratios instead: max(-2, -1.5) = -1.5 and -1 → -1.25
    tok = policy_loss([lp.detach()], [old], [_t([1.0, 1.0])], [_t([1, 1])], eps_clip=0.5)
    assert float(tok.loss) == pytest.approx(-1.25, abs=1e-6)
    # eps 0.2: √2 > 1.2 → every token clipped at -1.2
    clipped = policy_loss([lp.detach()], [old], [_t([1.0, 1.0])], [_t([1, 1])], ratio_type="sequence")
    assert float(clipped.loss) == pytest.approx(-1.2, abs=1e-6) and clipped.metrics["pg_clipfrac"] == 1.0
    # a masked token does not enter the sequence ratio: mean over [ln 2] only → s = 2
    masked = policy_loss(
        [_t([math.log(2), 7.0])], [old], [_t([1.0, 1.0])], [_t([1, 0])], eps_clip=5.0, ratio_type="sequence"
    )
    assert float(masked.loss) == pytest.approx(-2.0, abs=1e-6)


def _is_case(mode, low, high):
    # ratio 1 (logp = old = 0), A = 1; engine log-probs chosen so that w = exp(0 - rollout) = [0.5, 1.5, 4]
    lp = _t([0.0, 0.0, 0.0]).requires_grad_()
    rollout = _t([math.log(2), -math.log(1.5), -math.log(4)])
    out = policy_loss(
        [lp],
        [_t([0.0, 0.0, 0.0])],
        [_t([1.0, 1.0, 1.0])],
        [_t([1, 1, 1])],
        rollout_log_probs=[rollout],
        importance_sampling=mode,
        is_low=low,
        is_high=high,
        per_token=True,
    )
    out.loss.backward()
    return out, lp.grad.tolist()


def test_tis_weight_and_clipfrac():
    out, grad = _is_case("tis", 0.0, 2.0)  # weights [0.5, 1.5, 2]
    assert float(out.loss.detach()) == pytest.approx(-(0.5 + 1.5 + 2.0) / 3, abs=1e-6)
    assert out.metrics["tis"] == pytest.approx((0.5 + 1.5 + 4.0) / 3, abs=1e-6)
    assert out.metrics["tis_clipfrac"] == pytest.approx(1 / 3)
    assert grad == pytest.approx([-0.5 / 3, -1.5 / 3, -2.0 / 3], abs=1e-6)
    assert out.metrics["train_rollout_logprob_abs_diff"] == pytest.approx(
        (math.log(2) + math.log(1.5) + math.log(4)) / 3, abs=1e-6
    )
    assert importance_weights(_t([0.5, 1.5, 4.0]), "tis", 0.0, 2.0).tolist() == [0.5, 1.5, 2.0]


def test_mis_masks_tokens_outside_the_band():
    out, grad = _is_case("mis", 0.6, 2.0)  # weights [0 (0.5 < 0.6), 1.5, 0 (4 > 2)]; denominators unchanged
    assert float(out.loss.detach()) == pytest.approx(-1.5 / 3, abs=1e-6)
    assert out.metrics["tis_clipfrac"] == pytest.approx(2 / 3)
    assert grad == pytest.approx([0.0, -0.5, 0.0], abs=1e-6)
    assert importance_weights(_t([0.5, 1.5, 4.0, float("nan")]), "mis", 0.6, 2.0).tolist() == [0.0, 1.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="needs rollout_log_probs"):
        policy_loss([_t([0.0])], [_t([0.0])], [_t([1.0])], [_t([1])], importance_sampling="mis")


def test_loss_is_never_nan():
    # masked garbage (NaN/inf log-probs), an all-masked sample, and an extreme ratio on a trained token
    lp = [_t([float("nan"), 0.0]).requires_grad_(), _t([float("inf")]).requires_grad_(), _t([60.0]).requires_grad_()]
    out = policy_loss(
        lp,
        [_t([0.0, 0.0]), _t([0.0]), _t([0.0])],
        [_t([1.0, 1.0]), _t([1.0]), _t([-1.0])],
        [_t([0, 1]), _t([0]), _t([1])],
        rollout_log_probs=[_t([0.0, 0.0]), _t([0.0]), _t([0.0])],
        entropies=[_t([float("nan"), 1.0]), _t([float("nan")]), _t([1.0])],
        entropy_coef=0.01,
        ref_log_probs=[_t([0.0, 0.0]), _t([0.0]), _t([0.0])],
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
        importance_sampling="tis",
    )
    assert math.isfinite(float(out.loss.detach()))
    assert all(math.isfinite(v) for v in out.metrics.values())
    out.loss.backward()
    assert all(torch.isfinite(t.grad).all() for t in lp)
    empty = policy_loss([_t([0.0])], [_t([0.0])], [_t([1.0])], [_t([0])])
    assert float(empty.loss) == 0.0


# ------------------------------------------------------------------------------------------------- drift budget
def test_drift_budget_hand_computed():
    # |Δ| on trained tokens: 0.1, 0.5, 0 → mean 0.2 (the masked token's 10.0 is ignored)
    train = [_t([-1.0, -2.0]), _t([-0.5, 0.0])]
    engine = [_t([-1.1, -2.5]), _t([-0.5, -10.0])]
    masks = [_t([1, 1]), _t([1, 0])]
    assert check_logprob_drift(train, engine, masks, bound=0.25) == pytest.approx(0.2, abs=1e-7)
    assert check_logprob_drift(train, engine, masks, bound=None) == pytest.approx(0.2, abs=1e-7)
    with pytest.raises(LogprobDriftError) as info:
        check_logprob_drift(train, engine, masks, bound=0.1, step=7)
    msg = str(info.value)
    assert "at train step 7" in msg and "= 0.2 nats per token over 3 trained tokens" in msg
    assert "--max-train-rollout-logprob-diff 0.1" in msg and "stale weights" in msg and "dtype mismatch" in msg
    assert info.value.value == pytest.approx(0.2) and info.value.bound == 0.1
    with pytest.raises(LogprobDriftError, match="= nan nats"):
        check_logprob_drift([_t([float("nan")])], [_t([0.0])], [_t([1])], bound=1.0)


# ------------------------------------------------------------------------------------------------- torch trainer
def _batch(trainer, advantage=1.0):
    from vime_core.testing import TrainerBackendContract

    vocab = int(dict(trainer.named_hf_tensors())["model.embed_tokens.weight"].shape[0])
    return TrainerBackendContract.make_batch(vocab, advantage)


def test_torch_trainer_drift_budget_stops_before_any_update(tiny_model_dir):
    from vime_core.trainer.torch_backend import TorchTrainer

    trainer = TorchTrainer(trainer_config(max_train_rollout_logprob_diff=0.01), tiny_model_dir)
    before = {n: t.clone() for n, t in trainer.named_hf_tensors()}
    with pytest.raises(LogprobDriftError, match="exceeds the bound --max-train-rollout-logprob-diff 0.01"):
        trainer.train_step(_batch(trainer))  # the batch's engine log-probs are all -1.0: far from the model's
    assert all(torch.equal(before[n], t) for n, t in trainer.named_hf_tensors())


def test_torch_trainer_kl_loss_with_reference_model(tiny_model_dir):
    from vime_core.trainer.torch_backend import TorchTrainer

    cfg = trainer_config(
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
        entropy_coef=0.01,
        use_tis=True,
        global_batch_size=1,
    )
    trainer = TorchTrainer(cfg, tiny_model_dir)
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.model.parameters())
    batch = _batch(trainer)
    m1 = trainer.train_step(batch)
    # the policy is the reference at the start: KL ~ 0 in the first optimizer step; the second mini-batch has moved
    assert m1["train/kl_loss"] >= 0.0 and math.isfinite(m1["train/loss"])
    assert {"train/entropy_loss", "train/tis", "train/tis_clipfrac"} <= set(m1)
    m2 = trainer.train_step(batch)
    assert m2["train/kl_loss"] > 0.0


def test_batched_entropies_match_an_unpadded_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from vime_core.trainer.torch_backend import response_log_probs

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    samples = []
    for prompt, resp in (([1, 2, 3], [4, 5, 6, 7]), ([8, 9, 10, 11, 12, 13], [14, 15])):
        s = Sample(tokens=list(prompt), status=Status.COMPLETED)
        s.append_response_tokens(resp, trainable=True, log_probs=[0.0] * len(resp), weight_version=0)
        samples.append(s)
    with torch.no_grad():
        lps, ents = response_log_probs(model, samples, torch.device("cpu"), with_entropy=True)
        for s, lp, ent in zip(samples, lps, ents, strict=True):
            ids = torch.tensor([s.tokens])
            ref_lp, ref_ent = token_log_probs_and_entropy(model(input_ids=ids).logits, ids)
            torch.testing.assert_close(lp, ref_lp[0, s.prompt_length - 1 :], atol=1e-5, rtol=0)
            torch.testing.assert_close(ent, ref_ent[0, s.prompt_length - 1 :], atol=1e-5, rtol=0)


def test_vocab_parallel_entropy_equals_softmax_entropy_with_padded_columns():
    """The megatron backend's entropy (one TP rank here) ignores ``-inf`` padding columns; value and gradient equal
    the plain softmax entropy's."""
    from vime_core.trainer.megatron_backend import vocab_parallel_entropy

    g = torch.Generator().manual_seed(0)
    real = torch.randn(3, 5, 15, generator=g, dtype=torch.float64) * 3
    padded = torch.cat([real, torch.full((3, 5, 2), float("-inf"), dtype=torch.float64)], -1).requires_grad_(True)
    ent = vocab_parallel_entropy(padded)
    ref_in = real.clone().requires_grad_(True)
    ref = torch.distributions.Categorical(logits=ref_in).entropy()
    torch.testing.assert_close(ent, ref, atol=1e-12, rtol=0)
    ent.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(padded.grad[..., :15], ref_in.grad, atol=1e-12, rtol=0)
    assert torch.equal(padded.grad[..., 15:], torch.zeros(3, 5, 2, dtype=torch.float64))

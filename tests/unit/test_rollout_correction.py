"""Rollout correction against hand-computed weights and masks: IS at token/sequence/geometric level in truncate,
clip and mask mode, rejection sampling, the veto, batch normalisation, the mismatch metrics, the flag checks and the
decoupled PPO loss (docs/algorithms.md, "Rollout correction")."""

from __future__ import annotations

import math

import pytest
import torch

from vime_core.algorithms.options import check_algorithm_config
from vime_core.algorithms.policy_loss import PolicyLossOptions, policy_loss
from vime_core.algorithms.rollout_correction import (
    CorrectionSettings,
    level_log_ratio,
    mismatch_metrics,
    rollout_correction,
)
from vime_core.cli.arguments import default_args
from vime_core.config import AlgorithmConfig

pytestmark = pytest.mark.unit

LN = math.log


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


# Two rows. Token ratios old/rollout: row 0 [0.5, 1.5, 4] (product 3, geometric mean 3^(1/3)); row 1 [1, 0.8]
# (product 0.8, geometric mean sqrt(0.8)) and a masked pad whose old log-prob is -50 (ratio e^-49.7: it must reach
# no sum, mean, rejection or veto).
ROLLOUT = _t([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.3]])
OLD = ROLLOUT + _t([[LN(0.5), LN(1.5), LN(4.0)], [0.0, LN(0.8), 0.0]])
OLD[1, 2] = -50.0
MASK = _t([[1, 1, 1], [1, 1, 0]])
GEO0, GEO1 = 3.0 ** (1 / 3), 0.8**0.5


def _run(**kw):
    return rollout_correction(OLD, ROLLOUT, MASK, CorrectionSettings(**kw))


def _close(tensor, expected):
    torch.testing.assert_close(tensor, _t(expected), atol=1e-5, rtol=0)


def test_level_log_ratios():
    r = OLD - ROLLOUT
    _close(level_log_ratio(r, MASK, "token"), [[LN(0.5), LN(1.5), LN(4.0)], [0.0, LN(0.8), 0.0]])
    _close(level_log_ratio(r, MASK, "sequence"), [[LN(3.0)] * 3, [LN(0.8), LN(0.8), 0.0]])
    _close(level_log_ratio(r, MASK, "geometric"), [[LN(3.0) / 3] * 3, [LN(0.8) / 2, LN(0.8) / 2, 0.0]])
    with pytest.raises(ValueError, match="unknown rollout-correction level 'row'; known: token, sequence, geometric"):
        level_log_ratio(r, MASK, "row")


# (mode, level, low, high) → weights, mask, mode metrics (token fractions over the 5 trained tokens)
IS_CASES = [
    ("truncate", "token", 0.0, 2.0, [[0.5, 1.5, 2.0], [1.0, 0.8, 0.0]], [[1, 1, 1], [1, 1, 0]],
     {"tis_truncate_fraction": 0.2}),
    ("clip", "token", 0.6, 2.0, [[0.6, 1.5, 2.0], [1.0, 0.8, 0.0]], [[1, 1, 1], [1, 1, 0]],
     {"tis_clip_fraction_low": 0.2, "tis_clip_fraction_high": 0.2}),
    ("mask", "token", 0.6, 2.0, [[0.5, 1.5, 4.0], [1.0, 0.8, 0.0]], [[0, 1, 0], [1, 1, 0]],
     {"tis_mask_fraction_low": 0.2, "tis_mask_fraction_high": 0.2}),
    ("truncate", "sequence", 0.0, 2.0, [[2.0] * 3, [0.8, 0.8, 0.0]], [[1, 1, 1], [1, 1, 0]],
     {"tis_truncate_fraction": 0.6}),
    ("clip", "sequence", 0.9, 2.0, [[2.0] * 3, [0.9, 0.9, 0.0]], [[1, 1, 1], [1, 1, 0]],
     {"tis_clip_fraction_low": 0.4, "tis_clip_fraction_high": 0.6}),
    ("mask", "sequence", 0.9, 2.0, [[3.0] * 3, [0.8, 0.8, 0.0]], [[0, 0, 0], [0, 0, 0]],
     {"tis_mask_fraction_low": 0.4, "tis_mask_fraction_high": 0.6}),
    ("truncate", "geometric", 0.0, 1.2, [[1.2] * 3, [GEO1, GEO1, 0.0]], [[1, 1, 1], [1, 1, 0]],
     {"tis_truncate_fraction": 0.6}),
    ("clip", "geometric", 0.9, 1.2, [[1.2] * 3, [0.9, 0.9, 0.0]], [[1, 1, 1], [1, 1, 0]],
     {"tis_clip_fraction_low": 0.4, "tis_clip_fraction_high": 0.6}),
    ("mask", "geometric", 0.9, 1.5, [[GEO0] * 3, [GEO1, GEO1, 0.0]], [[1, 1, 1], [0, 0, 0]],
     {"tis_mask_fraction_low": 0.4, "tis_mask_fraction_high": 0.0}),
]  # fmt: skip


@pytest.mark.parametrize(("mode", "level", "low", "high", "weights", "mask", "fractions"), IS_CASES)
def test_is_weights_every_mode_and_level(mode, level, low, high, weights, mask, fractions):
    out = _run(tis_mode=mode, tis_level=level, tis_low=low, tis_high=high)
    _close(out.weights, weights)
    assert out.mask.tolist() == mask
    raw_mean = {"token": (0.5 + 1.5 + 4 + 1 + 0.8) / 5, "sequence": (3 * 3 + 0.8 * 2) / 5}
    raw_mean["geometric"] = (3 * GEO0 + 2 * GEO1) / 5
    assert out.metrics["tis"] == pytest.approx(raw_mean[level], abs=1e-5)
    for k, v in fractions.items():
        assert out.metrics[k] == pytest.approx(v, abs=1e-6), k
    kept = [(w, m) for wr, mr in zip(weights, mask, strict=True) for w, m in zip(wr, mr, strict=True) if m]
    assert out.metrics["tis_weight_mean"] == pytest.approx(sum(w for w, _ in kept) / max(len(kept), 1), abs=1e-5)
    rejected = 5 - sum(map(sum, mask))
    assert out.metrics["rejected_fraction"] == pytest.approx(rejected / 5)


def test_rejection_sampling_at_each_level():
    token = _run(rs_level="token", rs_low=0.6, rs_high=2.0)
    assert token.mask.tolist() == [[0, 1, 0], [1, 1, 0]]
    assert token.weights.tolist() == [[1, 1, 1], [1, 1, 0]]  # no IS: weight 1 on trained tokens
    assert (token.metrics["rs_mask_fraction_low"], token.metrics["rs_mask_fraction_high"]) == pytest.approx((0.2, 0.2))
    sequence = _run(rs_level="sequence", rs_low=0.9, rs_high=2.5)  # 3 > 2.5 and 0.8 < 0.9: both rows rejected
    assert sequence.mask.tolist() == [[0, 0, 0], [0, 0, 0]]
    assert sequence.metrics["rs_mask_fraction_low"] == pytest.approx(0.4)
    assert sequence.metrics["rs_mask_fraction_high"] == pytest.approx(0.6)
    assert sequence.metrics["rejected_fraction"] == 1.0
    geometric = _run(rs_level="geometric", rs_low=0.9, rs_high=1.5)  # 1.442 kept, 0.894 rejected
    assert geometric.mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    assert geometric.metrics["rejected_fraction"] == pytest.approx(0.4)
    # IS and RS together: truncated weights, the RS band's mask
    both = _run(tis_mode="truncate", tis_high=2.0, rs_level="token", rs_low=0.6, rs_high=2.0)
    _close(both.weights, [[0.5, 1.5, 2.0], [1.0, 0.8, 0.0]])
    assert both.mask.tolist() == [[0, 1, 0], [1, 1, 0]]
    assert both.metrics["tis_weight_mean"] == pytest.approx((1.5 + 1.0 + 0.8) / 3, abs=1e-6)


def test_veto_rejects_whole_rows_and_ignores_masked_tokens():
    out = _run(veto_threshold=0.6)  # row 0 has a token ratio 0.5 < 0.6; row 1's e^-49.7 is masked
    assert out.mask.tolist() == [[0, 0, 0], [1, 1, 0]]
    assert out.metrics["rs_catastrophic_token_fraction"] == pytest.approx(0.2)
    assert out.metrics["rs_catastrophic_seq_fraction"] == 0.5
    assert _run(veto_threshold=1e-4).mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    combined = _run(tis_mode="truncate", tis_high=2.0, veto_threshold=0.9)  # 0.5 < 0.9 and 0.8 < 0.9: both rows
    assert combined.mask.tolist() == [[0, 0, 0], [0, 0, 0]]
    _close(combined.weights, [[0.5, 1.5, 2.0], [1.0, 0.8, 0.0]])


def test_batch_normalisation():
    token = _run(tis_mode="truncate", tis_high=2.0, batch_normalize=True)  # mean of [.5, 1.5, 2, 1, .8] = 1.16
    _close(token.weights, [[0.5 / 1.16, 1.5 / 1.16, 2.0 / 1.16], [1.0 / 1.16, 0.8 / 1.16, 0.0]])
    assert token.metrics["tis_batch_norm_factor"] == pytest.approx(1.16, abs=1e-6)
    # sequence level: one weight per row (2 and 0.8), mean 1.4, whatever the rows' lengths
    seq = _run(tis_mode="truncate", tis_level="sequence", tis_high=2.0, batch_normalize=True)
    _close(seq.weights, [[2.0 / 1.4] * 3, [0.8 / 1.4, 0.8 / 1.4, 0.0]])
    assert seq.metrics["tis_batch_norm_factor"] == pytest.approx(1.4, abs=1e-6)
    # the step's normalizer (computed over the whole batch) replaces this batch's
    given = rollout_correction(OLD, ROLLOUT, MASK, CorrectionSettings(tis_mode="truncate", batch_normalize=True), 2.0)
    _close(given.weights, [[0.25, 0.75, 1.0], [0.5, 0.4, 0.0]])


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match=r"one shape; got old \(2, 3\), rollout \(2, 2\), mask \(2, 3\)"):
        rollout_correction(OLD, ROLLOUT[:, :2], MASK, CorrectionSettings(tis_mode="truncate"))


def test_mismatch_metrics_hand_computed():
    train = _t([[-1.0, -2.0], [-0.5, 9.0]])
    rollout = _t([[-1.5, -1.0], [-0.5, -9.0]])
    mask = _t([[1, 1], [1, 0]])
    m = mismatch_metrics(train, rollout, mask)
    # rows: train means -1.5, -0.5; rollout means -1.25, -0.5; per-token r = train - rollout = 0.5, -1, 0
    expected = {
        "training_log_ppl": 1.0,
        "training_ppl": (math.exp(1.5) + math.exp(0.5)) / 2,
        "rollout_log_ppl": 0.875,
        "rollout_ppl": (math.exp(1.25) + math.exp(0.5)) / 2,
        "kl": 0.5 / 3,
        "k3_kl": (math.exp(0.5) - 1.5 + math.exp(-1.0)) / 3,
        "log_ppl_diff": 0.125,
        "log_ppl_abs_diff": 0.125,
        "ppl_ratio": (math.exp(0.25) + 1.0) / 2,
        "logprob_abs_diff": 0.5,
    }
    assert list(m) == list(expected)
    for k, v in expected.items():
        assert m[k] == pytest.approx(v, abs=1e-6), k
    assert set(mismatch_metrics(train, rollout, torch.zeros_like(mask)).values()) == {0.0}


# ------------------------------------------------------------------------------------------- decoupled PPO loss
def _decoupled(**kw):
    # A = 1; the current policy equals the old one except token 0 of sample 1 (ratio 1.5, clipped to 1.2)
    old = [OLD[0].clone(), OLD[1, :2].clone()]
    lp = [old[0].clone().requires_grad_(), (old[1] + _t([LN(1.5), 0.0])).requires_grad_()]
    out = policy_loss(
        lp,
        old,
        [_t([1.0, 1.0, 1.0]), _t([1.0, 1.0])],
        [_t([1, 1, 1]), _t([1, 1])],
        PolicyLossOptions(**kw),
        rollout_log_probs=[ROLLOUT[0], ROLLOUT[1, :2]],
        train_old_log_probs=old,
    )
    out.loss.backward()
    return out, [t.grad.tolist() for t in lp]


def test_decoupled_ppo_loss_hand_computed():
    # per-token PPO terms -[1, 1, 1] and -[1.2 (clipped), 1]; IS weights (truncate, 2) [.5, 1.5, 2] and [1, .8];
    # token RS [0.6, 2] keeps tokens 1 of sample 0 and both of sample 1
    opts = {"importance_sampling": "tis", "is_high": 2.0, "rs_level": "token", "rs_low": 0.6, "rs_high": 2.0}
    out, grad = _decoupled(**opts)
    assert float(out.loss.detach()) == pytest.approx((-1.5 + -(1.2 + 0.8) / 2) / 2, abs=1e-6)  # -1.25
    assert grad[0] == pytest.approx([0.0, -1.5 / 2, 0.0], abs=1e-6)  # rejected tokens get no gradient
    assert grad[1] == pytest.approx([0.0, -0.8 / 4], abs=1e-6)  # token 0 is clipped
    assert out.metrics["rejected_fraction"] == pytest.approx(0.4)
    assert out.metrics["pg_clipfrac"] == pytest.approx(1 / 3)  # over the 3 accepted tokens
    # token-mean: accepted terms over all 5 trained tokens (slime's per-token denominator)
    per_token, _ = _decoupled(per_token=True, **opts)
    assert float(per_token.loss.detach()) == pytest.approx(-(1.5 + 1.2 + 0.8) / 5, abs=1e-6)
    # the veto drops sample 0 whole; it still counts as a sample of the batch
    vetoed, _ = _decoupled(importance_sampling="tis", is_high=2.0, rs_veto_threshold=0.6)
    assert float(vetoed.loss.detach()) == pytest.approx((0.0 + -(1.2 + 0.8) / 2) / 2, abs=1e-6)
    # geometric IS (weights 1.2 and sqrt(0.8) after truncation at 1.2), no rejection
    geo, _ = _decoupled(importance_sampling="tis", tis_level="geometric", is_high=1.2)
    assert float(geo.loss.detach()) == pytest.approx((-1.2 + -(1.2 + 1.0) * GEO1 / 2) / 2, abs=1e-5)


def test_options_from_flags():
    cfg = AlgorithmConfig.from_args(
        default_args(
            use_rollout_correction=True, use_tis=True, tis_mode="clip", tis_level="geometric", tis_clip_low=0.5,
            tis_batch_normalize=True, use_rs=True, rs_level="sequence", rs_upper_bound=4.0, rs_veto_threshold=1e-4,
        )
    )  # fmt: skip
    check_algorithm_config(cfg)
    o = PolicyLossOptions.from_config(cfg)
    got = (o.importance_sampling, o.tis_mode, o.tis_level, o.is_low, o.is_high, o.tis_batch_normalize)
    assert got == ("tis", "clip", "geometric", 0.5, 2.0, True)
    assert (o.rs_level, o.rs_low, o.rs_high, o.rs_veto_threshold) == ("sequence", 0.25, 4.0, 1e-4)
    plain = PolicyLossOptions.from_config(AlgorithmConfig.from_args(default_args(use_tis=True)))
    assert (plain.tis_mode, plain.tis_level, plain.rs_level, plain.rs_veto_threshold) == (
        "truncate",
        "token",
        None,
        None,
    )


FLAG_ERRORS = [
    ({"tis_mode": "clip"}, "--tis-mode has no effect without --use-tis"),
    ({"use_mis": True, "tis_level": "sequence"}, "--tis-level has no effect without --use-tis"),
    ({"tis_batch_normalize": True}, "--tis-batch-normalize has no effect without --use-tis"),
    (
        {"use_tis": True, "use_mis": True},
        "--use-tis (IS weights) and --use-mis (token-level IcePop masking) exclude each other; "
        "--use-tis --tis-mode mask is the masked variant of --use-tis",
    ),
    (
        {"use_tis": True, "tis_clip_low": 0.5},
        "--tis-clip-low 0.5 has no effect with --tis-mode truncate (the default: min(w, --tis-clip)); "
        "use --tis-mode clip to clamp w to [--tis-clip-low, --tis-clip]",
    ),
    (
        {"use_tis": True, "tis_mode": "clip", "tis_clip_low": 3.0},
        "need 0 <= --tis-clip-low < --tis-clip, got 3.0 and 2.0",
    ),
    (
        {"use_rs": True},
        "--use-rs needs --rs-upper-bound (and optionally --rs-lower-bound, default 1 / upper): the band of the ratio "
        "old/rollout whose tokens are kept",
    ),
    (
        {"use_rs": True, "rs_lower_bound": 2.0, "rs_upper_bound": 2.0},
        "need 0 <= --rs-lower-bound < --rs-upper-bound, got 2.0 and 2.0",
    ),
    ({"rs_upper_bound": 2.0}, "--rs-upper-bound has no effect without --use-rs"),
    ({"rs_level": "token"}, "--rs-level has no effect without --use-rs"),
    ({"rs_veto_threshold": 0.0}, "--rs-veto-threshold must be in (0, 1] (a ratio old/rollout), got 0.0"),
    (
        {"use_rollout_correction": True},
        "--use-rollout-correction selects no correction: add --use-tis, --use-rs or --rs-veto-threshold",
    ),
    (
        {"use_rollout_correction": True, "use_tis": True, "use_rollout_logprobs": True},
        "--use-rollout-correction (decoupled PPO: the ratio against the trainer's recomputed old policy) contradicts "
        "--use-rollout-logprobs (bypass: the ratio against the engine's log-probs); use one",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), FLAG_ERRORS)
def test_flag_checks_exact_messages(flags, message):
    with pytest.raises(ValueError) as info:
        check_algorithm_config(AlgorithmConfig.from_args(default_args(**flags)))
    assert str(info.value) == message


# ------------------------------------------------------------------------------------------ through the RL step
def _step(tiny_model_dir, **flags):
    """One torch-backend train step on two samples whose engine log-probs are the trainer's minus ln 2 on the 6 tokens
    of sample 0 (ratio old/rollout 2) and equal on the 3 of sample 1 (ratio 1); A = 1."""
    from vime_core.testing.trainer_args import trainer_config
    from vime_core.trainer.torch_backend import TorchTrainer
    from vime_core.types import RolloutBatch, Sample, Status

    trainer = TorchTrainer(trainer_config(**flags), tiny_model_dir)
    vocab = int(dict(trainer.named_hf_tensors())["model.embed_tokens.weight"].shape[0])
    g = torch.Generator().manual_seed(5)
    samples = []
    for i, (p, r) in enumerate(((4, 6), (8, 3))):
        s = Sample(index=i, tokens=torch.randint(0, vocab, (p,), generator=g).tolist(), status=Status.COMPLETED)
        s.append_response_tokens(
            torch.randint(0, vocab, (r,), generator=g).tolist(), trainable=True, log_probs=[0.0] * r, weight_version=0
        )
        samples.append(s)
    with torch.no_grad():
        old = trainer.policy_log_probs(samples, False)[0]
    for s, lp, d in zip(samples, old, (LN(2.0), 0.0), strict=True):
        s.rollout_log_probs = (lp - d).tolist()
    return trainer.train_step(RolloutBatch(samples=samples, advantages=[[1.0] * s.response_length for s in samples]))


def test_rl_step_mismatch_metrics_and_step_wide_batch_normalisation(tiny_model_dir):
    plain = _step(tiny_model_dir)
    logged = _step(tiny_model_dir, get_mismatch_metrics=True)
    assert logged["train/loss"] == plain["train/loss"]  # metrics only
    assert not any(k.startswith("train/mismatch/") for k in plain)
    expected = {
        "logprob_abs_diff": 6 * LN(2.0) / 9,
        "kl": -6 * LN(2.0) / 9,
        "k3_kl": 6 * (2.0 - LN(2.0) - 1.0) / 9,
        "log_ppl_diff": -LN(2.0) / 2,
        "log_ppl_abs_diff": LN(2.0) / 2,
        "ppl_ratio": (0.5 + 1.0) / 2,
    }
    for k, v in expected.items():
        assert logged[f"train/mismatch/{k}"] == pytest.approx(v, abs=1e-5), k
    gap = logged["train/mismatch/rollout_log_ppl"] - logged["train/mismatch/training_log_ppl"]
    assert gap == pytest.approx(LN(2.0) / 2, abs=1e-5)  # the engine gave lower log-probs: a higher log-ppl
    # weights [2] * 6 and [1] * 3, normalised by their mean over the whole step (15 / 9), although each sample is a
    # micro-batch of its own: per-sample means of -w are -1.2 and -0.6
    norm = _step(tiny_model_dir, use_tis=True, tis_batch_normalize=True, micro_batch_size=1)
    assert norm["train/pg_loss"] == pytest.approx(-0.9, abs=1e-5)
    assert norm["train/tis_batch_norm_factor"] == pytest.approx(15 / 9, abs=1e-5)

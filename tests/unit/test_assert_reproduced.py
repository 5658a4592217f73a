"""`tests.integration.helpers.assert_reproduced`, the comparison of two seeded runs' metrics, on the step-3 records of
the stop-36 suite run where the uninterrupted and the resumed run of test_resume_kill.py's sync case differed by
float rounding only."""

from __future__ import annotations

import pytest

from tests.integration.helpers import assert_reproduced

pytestmark = pytest.mark.unit

#: step 3 of the uninterrupted run and of the resumed one (values as logged; the other 33 keys were equal)
WANT = {
    "step": 3,
    "rollout/reward_mean": 0.0078125,
    "train/entropy_loss": 8.001165390014648,
    "train/train_rollout_logprob_abs_diff": 3.178914388020833e-07,
    "train/grad_norm": 2.6187970638275146,
    "weight_sync/bytes": 899582.0,
    "weight_sync/version": 4.0,
    "perf/step_seconds": 1.9,
}
GOT = dict(
    WANT,
    **{
        "train/entropy_loss": 8.001161575317383,
        "train/train_rollout_logprob_abs_diff": 2.632538477579753e-07,
        "train/grad_norm": 2.6186492443084717,
        "weight_sync/bytes": 899691.0,
        "perf/step_seconds": 2.4,
    },
)


def test_float_rounding_of_the_trainer_passes():
    assert_reproduced(GOT, WANT)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("train/grad_norm", 2.6187970638275146 * 1.01),  # 1%: a wrong checkpoint moves it 10-40%
        ("rollout/reward_mean", 0.0078126),  # rewards exactly
        ("weight_sync/version", 3.0),  # versions exactly
    ],
)
def test_a_real_difference_is_named(key, value):
    with pytest.raises(AssertionError, match=key):
        assert_reproduced(dict(GOT, **{key: value}), WANT)


def test_a_missing_key_is_named():
    with pytest.raises(AssertionError, match="train/grad_norm"):
        assert_reproduced({k: v for k, v in GOT.items() if k != "train/grad_norm"}, WANT)

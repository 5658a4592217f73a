import asyncio

from vime_reward_digits.hooks import digit_fraction

from vime_core.types import Sample


def test_digit_fraction_exact():
    assert asyncio.run(digit_fraction(None, Sample(response="12 ab"))) == 0.5
    assert asyncio.run(digit_fraction(None, Sample(response="  "))) == 0.0

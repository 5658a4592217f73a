"""Hook implementations of vime-reward-digits."""

from __future__ import annotations

from vime_core import hookimpl


async def digit_fraction(ctx, sample) -> float:
    """Fraction of the response's non-space characters that are ASCII digits, in [0, 1] (0.0 for an empty response).

    A toy reward with variance even on a random model, used by vime's end-to-end tests.
    """
    chars = [c for c in sample.response if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c in "0123456789" for c in chars) / len(chars)


@hookimpl
def vime_register_reward_functions(register):
    register("digit_fraction", digit_fraction)

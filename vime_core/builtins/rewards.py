"""Built-in reward functions."""

from vime_core.hookspecs import hookimpl


@hookimpl
def vime_register_reward_functions(register):
    from vime_core.rewards.reasoning_gym import reasoning_gym_reward
    from vime_core.rewards.simple import exact_match

    register("reasoning_gym", reasoning_gym_reward)
    register("exact_match", exact_match)

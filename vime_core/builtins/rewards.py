"""Built-in reward functions (per sample) and group reward functions (see docs/rewards.md)."""

from vime_core.plugins.hookspecs import hookimpl
from vime_core.rewards.dapo import dapo_math
from vime_core.rewards.group import rank_reward
from vime_core.rewards.math_answer import math_reward
from vime_core.rewards.reasoning_gym import reasoning_gym_reward
from vime_core.rewards.remote import remote_reward
from vime_core.rewards.simple import exact_match, f1


@hookimpl
def vime_register_reward_functions(register):
    register("reasoning_gym", reasoning_gym_reward)
    register("exact_match", exact_match)
    register("f1", f1)
    register("math", math_reward)
    register("dapo_math", dapo_math)
    register("remote", remote_reward)


@hookimpl
def vime_register_group_reward_functions(register):
    register("rank", rank_reward)

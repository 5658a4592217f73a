"""Built-in advantage estimators."""

from vime_core.algorithms.advantages import broadcast_to_tokens, grpo_advantages
from vime_core.hookspecs import hookimpl


def grpo(args, group):
    """GRPO: group-normalised outcome advantage broadcast to every response token (Dr.GRPO with
    ``--disable-grpo-std-normalization``)."""
    rewards = [s.reward_value(args.reward_key) for s in group]
    adv = grpo_advantages(rewards, normalize_std=not args.disable_grpo_std_normalization)
    return [broadcast_to_tokens(a, s.response_length) for a, s in zip(adv, group)]


@hookimpl
def vime_register_advantage_estimators(register):
    register("grpo", grpo)

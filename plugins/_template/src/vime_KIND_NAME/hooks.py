"""Hook implementations of vime-KIND-NAME. Keep this module import-light: vime imports it at start-up.

Replace the example reward with what your plugin provides; the other registration hooks are
``vime_register_generate_functions``, ``vime_register_sandbox_backends``, ``vime_register_agent_harnesses``,
``vime_register_weight_sync_strategies``, ``vime_register_trainer_backends``, ``vime_register_advantage_estimators``
(see docs/hooks.md). Plugin flags go under the plugin's prefix through ``vime_add_arguments``.
"""

from __future__ import annotations

from vime_core import hookimpl


async def NAME_reward(ctx, sample) -> float:
    """Example reward: 1.0 if the response contains the label, else 0.0.

    :raises ValueError: if the sample has no label.
    """
    if sample.label is None:
        raise ValueError("NAME_reward needs a label (--label-key)")
    return float(str(sample.label) in sample.response)


@hookimpl
def vime_register_reward_functions(register):
    register("NAME", NAME_reward)


@hookimpl
def vime_add_arguments(parser):
    group = parser.add_argument_group("vime-KIND-NAME")
    group.add_argument("--KIND-NAME-example", type=int, default=0, help="an example plugin flag")

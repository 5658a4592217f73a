"""Hook implementations of vime-KIND-NAME. Keep this module import-light: vime imports it at start-up.

Replace the example reward with what your plugin provides; the other registration hooks are
``vime_register_generate_functions``, ``vime_register_sandbox_backends``, ``vime_register_agent_harnesses``,
``vime_register_weight_sync_strategies``, ``vime_register_trainer_backends``, ``vime_register_advantage_estimators``
(see docs/hooks.md). The plugin's flags are the fields of one frozen ``PluginConfig`` dataclass under the
plugin's prefix, registered through ``vime_register_flags``; read them back from the context, ``ctx.plugin(Flags)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from vime_core import hookimpl
from vime_core.config import PluginConfig, flag


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


@dataclass(frozen=True, kw_only=True)
class Flags(PluginConfig):
    """The ``--KIND-NAME-*`` flags (one declaration each: type, default, help)."""

    PREFIX = "KIND-NAME"
    TITLE = "vime-KIND-NAME"

    KIND_NAME_example: int = flag(type=int, default=0, help="an example plugin flag")


@hookimpl
def vime_register_flags(register):
    register(Flags.PREFIX, Flags)

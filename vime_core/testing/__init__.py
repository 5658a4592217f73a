"""Test helpers shared by vime and its plugins: the contract kit, the tiny model builder and
``trainer_args`` (the namespace a trainer backend reads).

Install with ``pip install vime[testing]``; the kit is also a pytest plugin (entry point ``pytest11: vime``).
"""

from vime_core.testing.contracts import (
    AgentHarnessContract,
    GenerateFunctionContract,
    GroupRewardFunctionContract,
    PluginArgumentsContract,
    PluginFlagsContract,
    RewardFunctionContract,
    SandboxBackendContract,
    TrainerBackendContract,
    WeightSyncContract,
    flags_parser,
)
from vime_core.testing.trainer_args import trainer_args

__all__ = [
    "AgentHarnessContract",
    "GenerateFunctionContract",
    "GroupRewardFunctionContract",
    "PluginArgumentsContract",
    "PluginFlagsContract",
    "RewardFunctionContract",
    "SandboxBackendContract",
    "TrainerBackendContract",
    "WeightSyncContract",
    "flags_parser",
    "trainer_args",
]

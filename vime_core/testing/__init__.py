"""Test helpers shared by vime and its plugins: the contract kit and the tiny model builder.

Install with ``pip install vime[testing]``; the kit is also a pytest plugin (entry point ``pytest11: vime``).
"""

from vime_core.testing.contracts import (
    AgentHarnessContract,
    GenerateFunctionContract,
    RewardFunctionContract,
    SandboxBackendContract,
    TrainerBackendContract,
    WeightSyncContract,
)

__all__ = [
    "AgentHarnessContract",
    "GenerateFunctionContract",
    "RewardFunctionContract",
    "SandboxBackendContract",
    "TrainerBackendContract",
    "WeightSyncContract",
]

"""The contract-test kit: pytest base classes every plugin (ours and third parties') runs against itself.

A plugin's test subclasses the contract of its kind (e.g. ``class TestMyReward(RewardFunctionContract)``) and
supplies the fixtures the contract documents; declared ``capabilities`` turn inapplicable tests into skips with a
reason, and a contract test may not be overridden except as ``@pytest.mark.xfail(reason=...)``
(``test_no_overrides``). Usage: docs/plugins.md.
"""

from vime_core.testing.contracts.agent import AgentHarnessContract
from vime_core.testing.contracts.arguments import PluginArgumentsContract, PluginFlagsContract, flags_parser
from vime_core.testing.contracts.generate import GenerateFunctionContract
from vime_core.testing.contracts.reward import GroupRewardFunctionContract, RewardFunctionContract
from vime_core.testing.contracts.sandbox import SandboxBackendContract
from vime_core.testing.contracts.trainer import TrainerBackendContract
from vime_core.testing.contracts.weight_sync import WeightSyncContract

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
]

"""The contract-test kit: pytest base classes every plugin (ours and third parties') runs against itself.

Usage (in a plugin's ``tests/``)::

    from vime_core.testing import RewardFunctionContract

    class TestMyReward(RewardFunctionContract):
        @pytest.fixture
        def reward_fn(self):
            return my_reward

        @pytest.fixture
        def cases(self):
            return [(Sample(response="42", label="42"), 1.0), (Sample(response="7", label="42"), 0.0)]

Rules:

* A subclass supplies the fixtures a contract documents; it may declare ``capabilities`` (a set of strings) that
  turn inapplicable tests into **skips with a reason** — never silent drops.
* A subclass must not override or delete a contract test; to opt out it marks an override
  ``@pytest.mark.xfail(reason=...)``. ``test_no_overrides`` enforces this (langchain-tests' rule).
"""

from vime_core.testing.contracts.agent import AgentHarnessContract
from vime_core.testing.contracts.arguments import PluginArgumentsContract
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
    "RewardFunctionContract",
    "SandboxBackendContract",
    "TrainerBackendContract",
    "WeightSyncContract",
]

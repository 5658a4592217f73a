"""vime's reward contract kit against ``tests``, with a real ``local`` sandbox: exact rewards for a correct, a
wrong, a partial and a test-tampering solution."""

from __future__ import annotations

import pytest
from reward_tests_cases import HACK, PARTIAL, task_sample

from vime_core.plugins.manager import get_plugins
from vime_core.testing import RewardFunctionContract
from vime_core.testing.plugin_context import plugin_context

pytestmark = pytest.mark.contract


def test_plugin_is_discovered():
    rows = {r["name"]: r for r in get_plugins().describe()}
    assert rows["reward-tests"]["distribution"] == "vime-reward-tests"
    assert rows["reward-tests"]["provides"] == {"reward": ["tests"], "flags": ["reward-tests"]}


class TestTestsReward(RewardFunctionContract):
    @pytest.fixture
    def reward_fn(self):
        return get_plugins().resolve("reward", "tests")

    @pytest.fixture
    def reward_ctx(self):
        return plugin_context(sandbox="local", reward_tests_mode="fraction", reward_tests_timeout=60.0)

    @pytest.fixture
    def cases(self):
        return [
            (task_sample({"solution.py": "def add(a, b):\n    return a + b\n"}), 1.0),
            (task_sample({"solution.py": "def add(a, b):\n    return -1\n"}), 0.0),
            (task_sample({"solution.py": PARTIAL}), 2 / 3),
            (task_sample(HACK), 1 / 3),  # add() == 0 passes test_zero only: the planted files changed nothing
            (task_sample(None), 0.0),  # no agent result: the untouched stub
        ]

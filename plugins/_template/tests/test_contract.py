"""Run vime's contract kit against this plugin, and check it is discovered through its entry point."""

import pytest

from vime_core.plugins.manager import get_plugins
from vime_core.testing import PluginFlagsContract, RewardFunctionContract
from vime_core.types import Sample

pytestmark = pytest.mark.contract


def test_plugin_is_discovered():
    rows = {r["name"]: r for r in get_plugins().describe()}
    assert rows["KIND-NAME"]["distribution"] == "vime-KIND-NAME"
    assert rows["KIND-NAME"]["provides"] == {"reward": ["NAME"], "flags": ["KIND-NAME"]}


class TestReward(RewardFunctionContract):
    @pytest.fixture
    def reward_fn(self):
        return get_plugins().resolve("reward", "NAME")

    @pytest.fixture
    def cases(self):
        return [(Sample(response="it is 42", label="42"), 1.0), (Sample(response="it is 41", label="42"), 0.0)]


class TestFlags(PluginFlagsContract):
    @pytest.fixture
    def flags_class(self):
        from vime_KIND_NAME.hooks import Flags

        return Flags

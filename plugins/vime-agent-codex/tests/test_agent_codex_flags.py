"""The contract kit's flag checks on this plugin's flag class (registered, every flag has help, defaults parse)."""

import pytest

from vime_core.testing import PluginFlagsContract

pytestmark = pytest.mark.contract


class TestFlags(PluginFlagsContract):
    @pytest.fixture
    def flags_class(self):
        from vime_agent_codex.harness import CodexFlags

        return CodexFlags
